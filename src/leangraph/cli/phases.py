"""What the command line is doing, one named phase at a time, with its totals up front.

A command names each phase as it starts (``eager training``, ``memory check``, ``warm-up pass
2 of 3``, ``capture``...) with what it counts, so a display never shows ``0/?`` for work
whose size is known. :class:`PhaseProgress` is also a ``make_graphed_callables(progress=...)``
callback: it turns leangraph's per-step events into the warm-up passes and the capture, each
counted in graph steps (one forward or one backward of one graph).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TextIO

from leangraph.order import StepKind
from leangraph.progress import ProgressEvent

__all__ = [
    "GRAPH_STEPS",
    "Phase",
    "PhaseProgress",
    "line_display",
    "phase_display",
    "progress_bar",
]

GRAPH_STEPS = "graph steps"
"""The unit of warm-up and capture: one forward or one backward of one graph."""

_KIND_NAMES = {
    StepKind.FORWARD: "forward",
    StepKind.BACKWARD: "backward",
    StepKind.WEIGHT: "weight gradient",
}


@dataclass(frozen=True, slots=True)
class Phase:
    """The phase running now: ``done`` of ``total`` ``unit`` (a plural noun; ``total`` None:
    not counted); ``detail`` says what finished last (``backward of graph (chunk 2,
    microbatch 0, ...)``)."""

    name: str
    done: int = 0
    total: int | None = None
    unit: str = ""
    detail: str = ""

    def count(self) -> str:
        """``17/64 graph steps``, or nothing when the phase is not counted."""
        return "" if self.total is None else f"{self.done}/{self.total} {self.units()}".rstrip()

    def size(self) -> str:
        """`` (64 graph steps)``, `` (1 step)``, or nothing when the phase is not counted."""
        return "" if self.total is None else f" ({self.total} {self.units()}".rstrip() + ")"

    def units(self) -> str:
        """``unit`` as ``total`` counts it: given as a plural, one of it is singular."""
        return self.unit[:-1] if self.total == 1 and self.unit.endswith("s") else self.unit


@dataclass(frozen=True, slots=True)
class _CaptureShape:
    """What the next ``make_graphed_callables`` call will run, known before it starts."""

    prefix: str
    warmup_passes: int


class PhaseProgress:
    """Names the phases of a command and counts their work; ``show`` draws every change.

    As a ``progress=`` callback of ``make_graphed_callables`` it shows each event as warm-up
    pass ``k`` of ``n`` or capture, each counted in its own steps (the events carry them),
    once :meth:`expect_capture` has said how many passes the call runs; without that, warm-up
    pass ``k`` and capture.
    """

    def __init__(self, show: Callable[[Phase], None]) -> None:
        self._show = show
        self._phase = Phase("")
        self._capture: _CaptureShape | None = None

    def begin(self, name: str, total: int | None = None, unit: str = "") -> None:
        """Start phase ``name``, counting ``total`` ``unit`` (None: a phase not counted)."""
        self._phase = Phase(name, 0, total, unit)
        self._show(self._phase)

    def advance(self, done: int, detail: str = "") -> None:
        """``done`` units of the current phase have finished."""
        self._phase = replace(self._phase, done=done, detail=detail)
        self._show(self._phase)

    def expect_capture(
        self,
        *,
        warmup_passes: int,
        memory_check: bool,
        prefix: str = "",
        steps_per_pass: int | None = None,
    ) -> None:
        """Announce a ``make_graphed_callables`` call and show its first phase, which runs
        before any event: the probe, with the memory check on CUDA.

        ``steps_per_pass`` is accepted for callers written before the events counted their
        own passes, and ignored with a ``DeprecationWarning``: a warm-up pass runs one graph
        per layer, so its size is not the capture's, and each event now says both.
        """
        if steps_per_pass is not None:
            warnings.warn(
                "expect_capture(steps_per_pass=...) is ignored: progress events carry each "
                "pass's size (pass_total); drop the argument",
                DeprecationWarning,
                stacklevel=2,
            )
        self._capture = _CaptureShape(prefix, warmup_passes)
        check = "memory check" if memory_check else "probe"
        self.begin(f"{prefix}{check} (one forward per layer)")

    def __call__(self, event: ProgressEvent) -> None:
        name = self._name(event)
        if name != self._phase.name:
            self.begin(name, event.pass_total, GRAPH_STEPS)
        self.advance(event.pass_done, f"{_KIND_NAMES[event.step.kind]} of {event.label}")

    def _name(self, event: ProgressEvent) -> str:
        shape = self._capture
        prefix = "" if shape is None else shape.prefix
        if event.phase != "warm-up":
            return f"{prefix}{event.phase}"
        of = "" if shape is None else f" of {shape.warmup_passes}"
        return f"{prefix}warm-up pass {event.iteration + 1}{of}"


def line_display(stream: TextIO) -> Callable[[Phase], None]:
    """A ``show`` for a log: one line per phase as it starts (``progress: capture (64 graph
    steps)``), none per step."""
    last = [""]

    def show(phase: Phase) -> None:
        if phase.name != last[0]:
            last[0] = phase.name
            print(f"progress: {phase.name}{phase.size()}", file=stream, flush=True)

    return show


@contextlib.contextmanager
def _rich_display() -> Iterator[Callable[[Phase], None]]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[count]}"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[detail]}", style="dim"),
        transient=True,
    ) as bar:
        task = bar.add_task("", total=None, count="", detail="")
        shown = [""]

        def show(phase: Phase) -> None:
            count, detail = phase.count(), phase.detail
            if phase.name != shown[0]:  # a new phase: its own clock from zero
                shown[0] = phase.name
                bar.reset(
                    task, total=phase.total, description=phase.name, count=count, detail=detail
                )
            bar.update(task, completed=phase.done, total=phase.total, count=count, detail=detail)

        yield show


def _rich_available() -> bool:
    try:
        import rich.progress  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def phase_display(enabled: bool = True) -> Iterator[PhaseProgress | None]:
    """The command line's progress on stderr: a rich bar on a terminal, else one line per
    phase (a log); None when ``enabled`` is False."""
    if not enabled or sys.stderr is None:  # None: the process started with stderr closed
        yield None
    elif sys.stderr.isatty() and _rich_available():
        with _rich_display() as show:
            yield PhaseProgress(show)
    else:
        yield PhaseProgress(line_display(sys.stderr))


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[PhaseProgress | None]:
    """A rich progress bar over warm-up and capture, to pass as ``progress=``.

    Yields None (no bar) when disabled, when rich is missing or stderr is not a terminal.
    Call :meth:`PhaseProgress.expect_capture` first for per-pass counts.
    """
    if not (enabled and sys.stderr is not None and sys.stderr.isatty() and _rich_available()):
        yield None
        return
    with _rich_display() as show:
        yield PhaseProgress(show)
