"""The progress bar of a batch job on stderr: requests done, output tokens/s, time left.

Shown only on a terminal (rich decides, as for the CLI's phases: ``TTY_COMPATIBLE=1`` forces it) and
never when ``enabled`` is false (``--quiet``).
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Self

from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from zgen.cli_progress import stderr_console


class _TokensPerSecond(ProgressColumn):
    def render(self, task: Task) -> Text:
        tokens = int(task.fields.get("tokens", 0))
        started = float(task.fields.get("started", time.monotonic()))
        seconds = max(time.monotonic() - started, 1e-9)
        return Text(f"{tokens / seconds:,.0f} tok/s", style="progress.data.speed")


class _Failed(ProgressColumn):
    def render(self, task: Task) -> Text:
        failed = int(task.fields.get("failed", 0))
        return Text(f"{failed} failed" if failed else "", style="red")


class JobProgress:
    """A bar over the requests this run computes; :meth:`advance` after each synced group of records."""

    def __init__(self, total: int, *, enabled: bool, description: str = "Generating") -> None:
        console = stderr_console()
        self.enabled = enabled and console.is_terminal
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=32),
            MofNCompleteColumn(),
            _TokensPerSecond(),
            _Failed(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            redirect_stdout=False,
            disable=not self.enabled,
        )
        self._task = self._progress.add_task(description, total=total, tokens=0, failed=0, started=time.monotonic())
        self._tokens = 0
        self._failed = 0

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._progress.stop()

    def advance(self, requests: int, tokens: int, failed: int) -> None:
        self._tokens += tokens
        self._failed += failed
        self._progress.update(self._task, advance=requests, tokens=self._tokens, failed=self._failed)
