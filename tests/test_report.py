"""Progress events, the memory report and its plot (CPU backend; figures need CUDA)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from models import Block

import leangraph

ORDER = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]


def _capture(**kwargs):
    torch.manual_seed(0)
    layers = tuple(Block(8) for _ in range(4))
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(12))
    return leangraph.make_graphed_callables(layers, samples, order=ORDER, num_warmup_iters=2,
                                            **kwargs)


def test_progress_reports_every_warmup_and_capture_step_in_order():
    events: list[leangraph.ProgressEvent] = []
    _capture(progress=events.append)
    steps = 2 * 12  # 12 order entries x 2 layers
    warm = 2 * 4  # microbatch 0's 4 entries: every microbatch's sample has one layout
    assert [e.done for e in events] == list(range(1, 2 * warm + steps + 1))
    assert {e.total for e in events} == {2 * warm + steps}
    assert [e.pass_done for e in events] == [*range(1, warm + 1)] * 2 + [*range(1, steps + 1)]
    assert [e.pass_total for e in events] == [warm] * 2 * warm + [steps] * steps
    assert [e.phase for e in events] == ["warm-up"] * 2 * warm + ["capture"] * steps
    assert [str(e.step) for e in events[:warm]] == [
        "F c1 m0 l0", "F c1 m0 l1", "F c2 m0 l0", "F c2 m0 l1",
        "B c2 m0 l1", "B c2 m0 l0", "B c1 m0 l1", "B c1 m0 l0",
    ]
    assert events[0].label == "graph (chunk 1, microbatch 0, layer 0)"
    assert str(events[-1].step) == "B c1 m2 l0"
    assert [e.iteration for e in events] == [0] * warm + [1] * warm + [0] * steps


def test_memory_report_lists_every_callable_and_counts_shared_buffers_once():
    graphed = _capture()
    report = leangraph.memory_report(graphed)
    assert len(report.callables) == 12 and report.record.device == "cpu"
    assert report.pool_reserved_bytes is None and report.record.warmup_peak_bytes is None
    # The first warm-up pass (microbatch 0 of each layer) and the capture pass; the second
    # warm-up pass repeats the first.
    assert [p.phase for p in report.timeline] == ["warm-up"] * 8 + ["capture"] * 24
    assert 0 < report.static_bytes <= sum(c.static_bytes for c in report.callables)
    assert "graphs: 12 on cpu" in report.describe()
    leangraph.reset_all(graphed)
    assert all(c.is_reset for c in leangraph.memory_report(graphed).callables)


def _as_measured(report: leangraph.MemoryReport) -> leangraph.MemoryReport:
    """``report`` given the byte figures a CUDA call measures (plausible, made up)."""
    mib = 1024 * 1024
    points = tuple(replace(p, allocated_bytes=(100 + 10 * (i % 5)) * mib)
                   for i, p in enumerate(report.timeline))
    record = replace(report.record, device="cuda:0", baseline_bytes=100 * mib,
                     warmup_peak_bytes=150 * mib, capture_peak_bytes=160 * mib)
    return replace(report, record=record, timeline=points)


def test_plot_memory_writes_a_png_with_references_and_notes(tmp_path):
    report = _as_measured(leangraph.memory_report(_capture()))
    extra = [leangraph.report.TimelinePoint("replay", "F c1 m0 l0", "x", 120 * 1024 * 1024)]
    path = leangraph.plot_memory(report.with_points(extra), tmp_path / "timeline.png",
                                 title="t", references={"eager step peak": 170 * 1024 * 1024},
                                 phase_notes={"replay": "first step"})
    assert path == tmp_path / "timeline.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_memory_refuses_a_report_that_measured_nothing(tmp_path):
    report = leangraph.memory_report(_capture())  # the CPU backend measures no bytes
    with pytest.raises(ValueError, match="call on cpu measured no memory"):
        leangraph.plot_memory(report, tmp_path / "timeline.png")
    with pytest.raises(ValueError, match="no timeline to plot"):
        leangraph.plot_memory(replace(_as_measured(report), timeline=()), tmp_path / "t.png")
    assert not any(tmp_path.iterdir())
