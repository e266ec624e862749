"""The memory recorder: what warm-up and capture allocate, sampled step by step.

A :class:`MemoryRecorder` observes warm-up and capture like a progress callback. It samples the
allocator's allocated bytes after every step of the first warm-up pass and of the capture pass
(later warm-up passes repeat the first), and reads the allocator's peak per phase (it resets
the allocator's peak counter at each phase start, so a caller's own ``max_memory_allocated``
restarts there). On the CPU it records times only.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..progress import ProgressEvent
from ..report import CaptureRecord, TimelinePoint

__all__ = ["MemoryRecorder"]


class MemoryRecorder:
    """Observer of warm-up and capture that builds a :class:`CaptureRecord`."""

    def __init__(self, device: torch.device, pool: Any) -> None:
        self._device = device
        self._pool = pool
        self._cuda = device.type == "cuda"
        # An index, not a device: the allocator's statistics are read after every step.
        self._index = 0
        if self._cuda:
            self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._points: list[TimelinePoint] = []
        self._baseline = self._allocated()
        self._warmup_peak: int | None = None
        self._started = time.perf_counter()
        self._warmup_seconds = 0.0
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def _allocated(self) -> int | None:
        if not self._cuda:
            return None
        # memory_allocated() flattens the allocator's whole statistics dict in Python, about
        # a third of a millisecond; once per step that was a visible share of capture time.
        stats = torch.cuda.memory_stats_as_nested_dict(self._index)
        return int(stats["allocated_bytes"]["all"]["current"])

    def __call__(self, event: ProgressEvent) -> None:
        # Later warm-up passes run the same steps on the same sizes, so they would repeat the
        # first pass's points (their peak is in the record all the same). Each sample costs
        # tens of microseconds; over every pass they were a visible share of capture time.
        if event.iteration > 0:
            return
        self._points.append(
            TimelinePoint(event.phase, str(event.step), event.label, self._allocated())
        )

    def end_warmup(self) -> None:
        """Close the warm-up phase (read its peak, restart the counter for capture)."""
        if self._cuda:
            torch.cuda.synchronize(self._device)
            self._warmup_peak = torch.cuda.max_memory_allocated(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
        now = time.perf_counter()
        self._warmup_seconds, self._started = now - self._started, now

    def finish(self) -> CaptureRecord:
        """Close the capture phase and return the record."""
        capture_peak = None
        if self._cuda:
            torch.cuda.synchronize(self._device)
            capture_peak = torch.cuda.max_memory_allocated(self._device)
        return CaptureRecord(
            device=str(self._device),
            pool=self._pool,
            baseline_bytes=self._baseline,
            warmup_peak_bytes=self._warmup_peak,
            capture_peak_bytes=capture_peak,
            warmup_seconds=self._warmup_seconds,
            capture_seconds=time.perf_counter() - self._started,
            timeline=tuple(self._points),
        )
