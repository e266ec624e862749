"""The memory recorder (``leangraph.build.recorder``): an observer of warm-up and capture that
keeps one timeline point per step of the first warm-up pass and of capture, and the phases'
times (allocator figures are CUDA's: test_cuda.py)."""

from __future__ import annotations

import time

import torch

from leangraph.build.recorder import MemoryRecorder
from leangraph.plan import build_unordered_plan
from leangraph.progress import ProgressEvent


def test_later_warmup_passes_add_no_points_and_cpu_figures_are_absent():
    plan = build_unordered_plan(1)
    forward, backward = plan.warmup
    recorder = MemoryRecorder(torch.device("cpu"), None)
    for iteration in (0, 1):
        for done, step in enumerate((forward, backward), 2 * iteration + 1):
            recorder(ProgressEvent("warm-up", done, 6, step, "callable 0 (f)", iteration,
                                   pass_done=done - 2 * iteration, pass_total=2))
    recorder.end_warmup()
    for done, step in enumerate(plan.capture, 5):
        recorder(ProgressEvent("capture", done, 6, step, "callable 0 (f)", pass_done=done - 4,
                               pass_total=2))
    record = recorder.finish()
    assert [(p.phase, p.step, p.allocated_bytes) for p in record.timeline] == [
        ("warm-up", "F c1 m0 l0", None), ("warm-up", "B c1 m0 l0", None),
        ("capture", "F c1 m0 l0", None), ("capture", "B c1 m0 l0", None)]
    assert {p.label for p in record.timeline} == {"callable 0 (f)"}
    assert record.device == "cpu" and record.pool is None
    assert (record.baseline_bytes, record.warmup_peak_bytes, record.capture_peak_bytes) == (
        None, None, None)


def test_each_phase_is_timed_from_its_start():
    began = time.perf_counter()
    recorder = MemoryRecorder(torch.device("cpu"), None)
    time.sleep(0.05)
    recorder.end_warmup()
    time.sleep(0.03)
    record = recorder.finish()
    total = time.perf_counter() - began
    assert record.warmup_seconds >= 0.05 and record.capture_seconds >= 0.03
    assert record.warmup_seconds + record.capture_seconds <= total  # the phases do not overlap
