"""What capture cost: the records of a ``make_graphed_callables`` call's memory, and their plot.

During the call a :class:`~leangraph.build.recorder.MemoryRecorder` fills a
:class:`CaptureRecord`; :func:`leangraph.memory_report` turns it and what the callables hold
now into a :class:`MemoryReport`; :func:`plot_memory` draws the timeline.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "CallableMemory",
    "CaptureRecord",
    "MemoryReport",
    "TimelinePoint",
    "plot_memory",
]

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """Allocated bytes right after one step (``phase``: warm-up, capture or replay)."""

    phase: str
    step: str
    label: str
    allocated_bytes: int


@dataclass(frozen=True, slots=True)
class CaptureRecord:
    """What one ``make_graphed_callables`` call measured; shared by all its callables.

    Byte figures are None on the CPU backend (nothing to measure). Peaks are absolute
    (``torch.cuda.max_memory_allocated`` within the phase), as is ``baseline_bytes`` (allocated
    when the call began).
    """

    device: str
    pool: Any
    baseline_bytes: int | None
    warmup_peak_bytes: int | None
    capture_peak_bytes: int | None
    warmup_seconds: float
    capture_seconds: float
    timeline: tuple[TimelinePoint, ...]


@dataclass(frozen=True, slots=True)
class CallableMemory:
    """Static buffers one callable holds (a buffer shared with others counts for each)."""

    label: str
    static_bytes: int
    is_reset: bool


@dataclass(frozen=True)
class MemoryReport:
    """Memory of one ``make_graphed_callables`` result; bytes are None on the CPU backend.

    ``static_bytes`` counts every buffer the callables hold once; ``pool_*`` are the graph
    pool's segments in the allocator now (blocks the graphs use internally, such as saved
    activations, and released outputs live there).
    """

    record: CaptureRecord
    callables: tuple[CallableMemory, ...]
    static_bytes: int
    pool_reserved_bytes: int | None
    pool_allocated_bytes: int | None
    timeline: tuple[TimelinePoint, ...] = field(default=())

    def with_points(self, points: Iterable[TimelinePoint]) -> MemoryReport:
        """This report with more timeline points (say, a measured replay step) appended."""
        return replace(self, timeline=self.timeline + tuple(points))

    def describe(self) -> str:
        """A short human-readable summary."""
        r = self.record

        def mib(value: int | None) -> str:
            return "n/a" if value is None else f"{value / MIB:.1f} MiB"

        lines = [
            f"graphs: {len(self.callables)} on {r.device}; static buffers {mib(self.static_bytes)}",
            f"graph pool: reserved {mib(self.pool_reserved_bytes)}, "
            f"allocated {mib(self.pool_allocated_bytes)}",
            f"peak allocated: warm-up {mib(r.warmup_peak_bytes)}, capture "
            f"{mib(r.capture_peak_bytes)} (call began at {mib(r.baseline_bytes)})",
            f"time: warm-up {r.warmup_seconds:.2f} s, capture {r.capture_seconds:.2f} s",
        ]
        return "\n".join(lines)


_PHASE_COLOURS = {"warm-up": "#f2c14e", "capture": "#5fad56", "replay": "#4d9de0"}


def _phase_spans(points: Sequence[TimelinePoint]) -> list[tuple[str, int, int]]:
    spans: list[tuple[str, int, int]] = []
    for index, point in enumerate(points):
        if spans and spans[-1][0] == point.phase:
            spans[-1] = (point.phase, spans[-1][1], index)
        else:
            spans.append((point.phase, index, index))
    return spans


def plot_memory(report: MemoryReport, path: str | Path, *, title: str = "") -> Path:
    """Write the allocated-memory timeline as a PNG, phases shaded (needs matplotlib).

    Returns:
        The path written.

    Raises:
        ImportError: when matplotlib is missing (``pip install leangraph[plot]``).
        ValueError: when the report has no timeline (nothing was measured).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report.timeline
    if not points:
        raise ValueError("the report has no timeline to plot")
    fig, ax = plt.subplots(figsize=(10, 4))
    for phase, start, end in _phase_spans(points):
        ax.axvspan(
            start - 0.5,
            end + 0.5,
            color=_PHASE_COLOURS.get(phase, "#cccccc"),
            alpha=0.25,
            label=phase,
        )
    ax.plot(
        range(len(points)), [p.allocated_bytes / MIB for p in points], color="black", linewidth=1
    )
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="upper left")
    ax.set_xlabel("step")
    ax.set_ylabel("allocated (MiB)")
    ax.set_title(title or f"leangraph memory timeline ({report.record.device})")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
