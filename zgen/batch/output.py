"""The results file of a batch job: appended as records finish, durable, and resumable.

Each record is one JSON line. Lines are written whole (one ``write`` per group of records), then
flushed and ``fsync``-ed before the job counts them as done, so a crash (``kill -9``, power loss on a
file system that honours ``fsync``) loses at most the records not yet synced and leaves at most a torn
last line. :meth:`ResultsFile.open` cuts a torn last line off and returns the keys (custom_ids) already
there: running the same job again skips them, so the file ends with every request exactly once.

Writes go through a :class:`RecordWriter` thread, so syncing never stalls the device. An exclusive
``flock`` on the file keeps a second job from writing to it at the same time.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Self, cast

from zgen.batch.format import RecordKey, record_key
from zgen.errors import InputError


@dataclass
class Existing:
    """What an output file held when the job started."""

    keys: set[RecordKey] = field(default_factory=lambda: set[RecordKey]())
    failed: int = 0  # records with an error
    repaired_bytes: int = 0  # a torn last line cut off


class ResultsFile:
    """An output JSONL file opened for appending records (see the module docstring)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._file: IO[bytes] | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def open(self) -> Existing:
        """Lock the file (creating it), cut a torn last line, and read the keys of its records."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+b")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise InputError(f"another batch job is writing {self.path}; wait for it or choose another output") from None
        try:
            handle.seek(0)
            data = handle.read()
            whole = data.rfind(b"\n") + 1  # bytes up to the last complete line
            existing = Existing(repaired_bytes=len(data) - whole)
            if existing.repaired_bytes:
                handle.truncate(whole)
                os.fsync(handle.fileno())
            for number, line in enumerate(data[:whole].splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record: object = json.loads(line)
                except ValueError:
                    record = None
                key = record_key(cast(Mapping[str, object], record)) if isinstance(record, dict) else None
                if key is None:
                    raise InputError(
                        f"line {number} of {self.path} is not a batch result record; is this the output of another "
                        "program? Choose a new output file"
                    )
                existing.keys.add(key)
                existing.failed += cast(dict[str, object], record).get("error") is not None
        except BaseException:
            handle.close()
            raise
        self._file = handle
        return existing

    def append(self, records: list[dict[str, object]]) -> None:
        """Write ``records`` as whole lines and sync them to disk."""
        assert self._file is not None, "open the results file first"
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()  # releases the lock
            self._file = None


class RecordWriter:
    """Appends records on a thread of its own, in the order given; ``on_written(records)`` runs after
    each sync. :meth:`close` waits for every record to be written (and re-raises a write error)."""

    def __init__(self, results: ResultsFile, on_written: Callable[[list[dict[str, object]]], None]) -> None:
        self._results = results
        self._on_written = on_written
        self._queue: queue.Queue[dict[str, object] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="zgen-batch-writer", daemon=True)
        self._thread.start()

    def put(self, record: dict[str, object]) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(record)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        done = False
        while not done:
            records: list[dict[str, object]] = []
            item = self._queue.get()
            while True:  # everything already queued goes in one write and one sync
                if item is None:
                    done = True
                    break
                records.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if records and self._error is None:
                try:
                    self._results.append(records)
                    self._on_written(records)
                except BaseException as err:  # a full disk: the job stops and says so
                    self._error = err
