"""What capture cost: the records of a ``make_graphed_callables`` call's memory, and their plot.

During the call a :class:`~leangraph.build.recorder.MemoryRecorder` fills a
:class:`CaptureRecord`; :func:`leangraph.memory_report` turns it and what the callables hold
now into a :class:`MemoryReport`; :func:`plot_memory` draws the timeline.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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
    """Allocated bytes right after one step (``phase``: warm-up, capture or replay); None on
    the CPU backend, which measures no memory."""

    phase: str
    step: str
    label: str
    allocated_bytes: int | None


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
_PHASE_NAMES = {"warm-up": "warm-up (first pass)", "capture": "capture", "replay": "replay"}
_PEAK_COLOURS = {"warm-up": "#8a6500", "capture": "#2e6b27", "replay": "#1f4e79"}
_REFERENCE_COLOURS = ("#c0392b", "#7d3c98", "#1f618d", "#7f8c8d")


def _phase_spans(points: Sequence[TimelinePoint]) -> list[tuple[str, int, int]]:
    spans: list[tuple[str, int, int]] = []
    for index, point in enumerate(points):
        if spans and spans[-1][0] == point.phase:
            spans[-1] = (point.phase, spans[-1][1], index)
        else:
            spans.append((point.phase, index, index))
    return spans


def _measured(report: MemoryReport) -> bool:
    """Whether the call measured memory at all (the CPU backend's figures are all None)."""
    r = report.record
    return any(v is not None for v in (r.baseline_bytes, r.warmup_peak_bytes, r.capture_peak_bytes))


def _phase_peaks(report: MemoryReport) -> dict[str, float]:
    """The allocator's peak of each phase the record has one for, in MiB."""
    peaks = {
        "warm-up": report.record.warmup_peak_bytes,
        "capture": report.record.capture_peak_bytes,
    }
    return {phase: value / MIB for phase, value in peaks.items() if value is not None}


def _shade_phases(
    ax: Any,
    spans: list[tuple[str, int, int]],
    top: float,
    peaks: Mapping[str, float],
    notes: Mapping[str, str],
) -> None:
    """Shade each phase and head it, at the top of its span, with its name, its peak and its
    note: labels that sit in no curve's way, so the plot needs no legend over the curve."""
    for phase, start, end in spans:
        ax.axvspan(start - 0.5, end + 0.5, color=_PHASE_COLOURS.get(phase, "#cccccc"), alpha=0.25)
        lines = [_PHASE_NAMES.get(phase, phase)]
        if phase in peaks:
            lines.append(f"peak {peaks[phase]:.0f} MiB (dashed)")
        if phase in notes:
            lines.append(notes[phase])
        # The first phase's header starts at the left edge and the last one's ends at the
        # right edge, so that a narrow phase at either end keeps its header inside the plot.
        if (phase, start, end) == spans[0] and len(spans) > 1:
            x, align, shift = start - 0.5, "left", 3
        elif (phase, start, end) == spans[-1] and len(spans) > 1:
            x, align, shift = end + 0.5, "right", -3
        else:
            x, align, shift = (start + end) / 2, "center", 0
        ax.annotate(
            "\n".join(lines),
            (x, top),
            xytext=(shift, -3),
            textcoords="offset points",
            ha=align,
            va="top",
            fontsize=8,
            color=_PEAK_COLOURS.get(phase, "black"),
        )


def _mark_peaks(ax: Any, spans: list[tuple[str, int, int]], peaks: Mapping[str, float]) -> None:
    """A dashed line over each phase at the allocator's peak there."""
    for phase, start, end in spans:
        if phase in peaks:
            ax.hlines(
                peaks[phase],
                start - 0.5,
                end + 0.5,
                colors=_PEAK_COLOURS.get(phase, "#555555"),
                linestyles="--",
                label=f"{phase} peak (the allocator's, between samples too)",
            )


def _draw_references(ax: Any, references: Mapping[str, float], right: float) -> None:
    """A dotted line across the plot per reference level, labelled at its right end."""
    for index, (label, value) in enumerate(references.items()):
        colour = _REFERENCE_COLOURS[index % len(_REFERENCE_COLOURS)]
        ax.axhline(value, color=colour, linestyle=":", linewidth=1.5, label=label)
        ax.annotate(
            f"{label} {value:.0f} MiB",
            (right, value),
            xytext=(-2, 3),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            color=colour,
        )


def plot_memory(
    report: MemoryReport,
    path: str | Path,
    *,
    title: str = "",
    references: Mapping[str, int] | None = None,
    phase_notes: Mapping[str, str] | None = None,
) -> Path:
    """Write the allocated-memory timeline as a PNG (needs matplotlib).

    The phases (warm-up's first pass, capture, and any points added with
    :meth:`MemoryReport.with_points`, such as a replay) are shaded and named over the plot;
    the allocator's peak of warm-up and of capture is drawn over its phase with its value;
    each of ``references`` is a labelled line across (another method's peak, say).

    Args:
        report: A report of a call that measured memory (CUDA).
        path: The PNG to write.
        title: The plot's title (default: the number of graphs and the device).
        references: Label -> allocated bytes, on the timeline's scale (absolute).
        phase_notes: Phase -> a line printed under the phase's name, saying what its curve
            shows (why it rises, say).

    Returns:
        The path written.

    Raises:
        ImportError: when matplotlib is missing (``pip install leangraph[plot]``).
        ValueError: when the report has no timeline, or measured no memory (a call on the
            CPU backend, whose byte figures are None): there is nothing to draw.
    """
    points = report.timeline
    if not points:
        raise ValueError("the report has no timeline to plot")
    if not _measured(report):
        raise ValueError(
            f"the report of a call on {report.record.device} measured no memory (only the CUDA "
            "backend does): there is no timeline to draw"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [(p.allocated_bytes or 0) / MIB for p in points]  # all measured: _measured
    peaks = _phase_peaks(report)
    levels = {label: value / MIB for label, value in (references or {}).items()}
    # Headroom above the highest line for the phase names and notes at the top.
    top = 1.35 * max([*values, *peaks.values(), *levels.values()])
    spans = _phase_spans(points)
    fig, ax = plt.subplots(figsize=(11, 5))
    _shade_phases(ax, spans, top, peaks, phase_notes or {})
    ax.plot(
        range(len(points)), values, color="black", linewidth=1, label="allocated after each step"
    )
    _mark_peaks(ax, spans, peaks)
    _draw_references(ax, levels, len(points) - 0.5)
    ax.set_xlim(-0.5, len(points) - 0.5)
    ax.set_ylim(0, top)
    ax.set_xlabel("step (a forward or backward of one graph, in the order they ran)")
    ax.set_ylabel("allocated (MiB)")
    ax.set_title(
        title
        or f"leangraph memory timeline: {len(report.callables)} graphs on {report.record.device}"
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, frameon=False, fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
