"""Where capture time goes, phase by phase (GPU only): torch's and leangraph's
``make_graphed_callables`` on the benchmark workloads, timed with wall clocks around
``CUDAGraph.capture_begin``/``capture_end`` (no profiler, which distorts short calls).

For each method and round it prints: *before capture* (from the call to the first
``capture_begin``: argument handling, leangraph's memory check, warm-up), *capture* (first
``capture_begin`` to the end of the call), of which *in capture_end* (graph instantiation), and
the number of graphs, and how many segments the allocator took from the device (cudaMalloc)
before the first capture. Usage: PYTHONPATH=src python3 benchmarks/capture_phases.py
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from leangraph.cli.bench import LAUNCH_BOUND, BenchConfig, BenchWorkload, capture_method

WORKLOADS = {"16 microbatches": BenchConfig(num_microbatches=16), "launch-bound": LAUNCH_BOUND}


def _segments() -> int:
    return int(torch.cuda.memory_stats().get("segment.all.allocated", 0))


class Clock:
    """Wraps CUDAGraph.capture_begin/capture_end to timestamp them."""

    def __init__(self) -> None:
        self.first_begin: float | None = None
        self.segments_before: int | None = None  # cudaMalloc calls before the first capture
        self.in_end = 0.0
        self.graphs = 0
        begin, end = torch.cuda.CUDAGraph.capture_begin, torch.cuda.CUDAGraph.capture_end
        clock = self

        def timed_begin(graph, *args, **kwargs):
            if clock.first_begin is None:
                clock.first_begin = time.perf_counter()
                clock.segments_before = _segments()
            clock.graphs += 1
            return begin(graph, *args, **kwargs)

        def timed_end(graph):
            start = time.perf_counter()
            try:
                return end(graph)
            finally:
                clock.in_end += time.perf_counter() - start

        torch.cuda.CUDAGraph.capture_begin = timed_begin
        torch.cuda.CUDAGraph.capture_end = timed_end
        self._restore = (begin, end)

    def close(self) -> None:
        torch.cuda.CUDAGraph.capture_begin, torch.cuda.CUDAGraph.capture_end = self._restore


def call(method: str, work: BenchWorkload) -> tuple[float, float, float, int, int]:
    """One ``make_graphed_callables`` call of ``method`` (the bench's capture, on a fresh copy
    of the workload's blocks): before capture, capture, in capture_end, graphs, cudaMalloc."""
    torch.cuda.synchronize()
    if method == "leangraph, cache pre-filled":
        # One segment as large as warm-up's peak, freed into the cache: warm-up then splits
        # its blocks from it instead of asking the device for each.
        del_me = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
        del del_me
    blocks = copy.deepcopy(work.blocks)  # outside the clock, as in the bench
    clock = Clock()
    segments = _segments()
    start = time.perf_counter()
    try:
        captured = capture_method(work, "torch" if method == "torch" else "leangraph", blocks)
        torch.cuda.synchronize()
        end = time.perf_counter()
    finally:
        clock.close()
    if clock.first_begin is None or clock.segments_before is None:
        raise RuntimeError(f"{method}: make_graphed_callables captured no graph")
    captured.release()
    del captured, blocks
    torch.cuda.empty_cache()
    mallocs = clock.segments_before - segments
    return clock.first_begin - start, end - clock.first_begin, clock.in_end, clock.graphs, mallocs


def main() -> None:
    for name, config in WORKLOADS.items():
        work = BenchWorkload(config)
        call("torch", work)  # untimed: per-process set-up
        call("leangraph", work)
        methods = ["torch", "leangraph", "leangraph, cache pre-filled"]
        rows: dict[str, list[tuple[float, float, float, int, int]]] = {m: [] for m in methods}
        for round_index in range(4):
            for method in methods[round_index % 3 :] + methods[: round_index % 3]:
                rows[method].append(call(method, work))
        print(f"== {name} (4 rounds, medians, seconds)")
        for method, values in rows.items():
            before, capture, in_end, graphs, mallocs = (statistics.median(v) for v in zip(*values))
            print(
                f"{method:<28} before capture {before:.3f}  capture {capture:.3f}  "
                f"in capture_end {in_end:.3f}  graphs {graphs:.0f}  "
                f"cudaMalloc before capture {mallocs:.0f}"
            )
        del work


if __name__ == "__main__":
    main()
