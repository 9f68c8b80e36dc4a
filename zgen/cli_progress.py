"""What the ``zgen`` command shows on stderr while it works: each long phase (resolve the model, load or
convert its weights, compile, prefill) as a line with a spinner or a bar and, once done, its time.

Silent with ``--quiet`` or ``--json`` and when stderr is not a terminal; rich decides what a terminal
is, so ``TTY_COMPATIBLE=1`` (or ``FORCE_COLOR``) forces the display and ``TTY_COMPATIBLE=0`` hides it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from types import TracebackType
from typing import Self

import jax.monitoring
from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
)
from rich.table import Column
from rich.text import Text

# jax's monitoring events (jax/_src/dispatch.py) that end the two halves of a compilation: tracing a
# function, then XLA compiling it. Named here by value: jax has no public constants for them.
_TRACED = "/jax/core/compile/jaxpr_trace_duration"
_COMPILED = "/jax/core/compile/backend_compile_duration"


def stderr_console() -> Console:
    return Console(stderr=True)


class Phases:
    """The long phases of one command, each a line on stderr (see the module docstring).

    Use it as a context manager around the phases; nothing may write to stdout inside it. A chat turn's
    wait is ``transient``: its line goes away once the reply starts.
    """

    def __init__(self, console: Console, *, enabled: bool, transient: bool = False) -> None:
        self.enabled = enabled and console.is_terminal
        self._progress = Progress(
            SpinnerColumn(finished_text="[green]✓[/]"),
            TextColumn("{task.description}", table_column=Column(ratio=1, overflow="fold")),
            _OnlyMeasured(BarColumn(bar_width=24)),
            _OnlyMeasured(DownloadColumn()),
            _Seconds(),
            console=console,
            transient=transient,
            redirect_stdout=False,  # stdout is the command's output, never the display's
            disable=not self.enabled,
            expand=True,
        )

    @classmethod
    def on_stderr(cls, *, enabled: bool, transient: bool = False) -> Phases:
        return cls(stderr_console(), enabled=enabled, transient=transient)

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.stop()

    def note(self, text: str) -> None:
        """A line of information between the phases (what was resolved, which defaults apply)."""
        if self.enabled:
            self._progress.console.print(Text(text, style="dim"))

    @contextmanager
    def phase(self, description: str) -> Generator[Phase]:
        """A phase running for the body of the ``with``; its line shows ✓ and the time when the body
        ends, and disappears if the body raises (the command reports the error)."""
        phase = Phase(self._progress, self._progress.add_task(description, total=None))
        try:
            yield phase
        except BaseException:
            self._progress.update(phase.task, visible=False)
            raise
        phase.finish()


class Phase:
    """One phase's line: a spinner with a description, or a bar once sizes are known."""

    def __init__(self, progress: Progress, task: TaskID) -> None:
        self._progress = progress
        self.task = task
        self._total = 1  # a spinner-only phase is one step, done when it finishes
        self._start = time.monotonic()

    def describe(self, description: str) -> None:
        self._progress.update(self.task, description=description)

    def measure(self, done: int, total: int) -> None:
        """Show a bar of ``done`` out of ``total`` bytes (the shape of ``load_model``'s ``progress``)."""
        self._total = total
        self._progress.update(self.task, completed=done, total=total, measured=True)

    def finish(self) -> None:
        seconds = time.monotonic() - self._start
        self._progress.update(self.task, completed=self._total, total=self._total, seconds=seconds)


class _OnlyMeasured(ProgressColumn):
    """``column`` for phases that measure their work (a bar, sizes); nothing for spinner-only ones."""

    def __init__(self, column: ProgressColumn) -> None:
        super().__init__()
        self.column = column

    def render(self, task: Task) -> RenderableType:
        return self.column.render(task) if task.fields.get("measured") else Text("")


class _Seconds(ProgressColumn):
    """Seconds a phase has run, or took once finished (rich's elapsed column stops when a bar fills,
    before the work after it is done)."""

    def render(self, task: Task) -> RenderableType:
        seconds = task.fields.get("seconds", task.elapsed or 0.0)
        return Text(f"{seconds:.1f} s", style="progress.elapsed")


class CompileClock:
    """XLA compilations while it is open (jax's monitoring events): how many, their seconds, and a
    callback told ``True`` when one starts (a trace ended) and ``False`` when it is done."""

    def __init__(self, on_compiling: Callable[[bool], None] | None = None) -> None:
        self.on_compiling = on_compiling
        self.seconds = 0.0
        self.count = 0

    def _listen(self, event: str, duration_secs: float, **_: str | int) -> None:
        if event == _COMPILED:
            self.seconds += duration_secs
            self.count += 1
        if self.on_compiling is not None and event in (_TRACED, _COMPILED):
            self.on_compiling(event == _TRACED)

    def __enter__(self) -> Self:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)
