"""Where capture time goes, phase by phase (GPU only): torch's and leangraph's
``make_graphed_callables`` on the benchmark workloads, timed with wall clocks around
``CUDAGraph.capture_begin``/``capture_end`` (no profiler, which distorts short calls).

For each method and round it prints: *before capture* (from the call to the first
``capture_begin``: argument handling, leangraph's memory check, warm-up), *capture* (first
``capture_begin`` to the end of the call), of which *in capture_end* (graph instantiation), and
the number of graphs, and how many segments the allocator took from the device (cudaMalloc)
before the first capture. Usage: PYTHONPATH=src python3 scripts/capture_phases.py
"""

from __future__ import annotations

import statistics
import time

import torch

import leangraph
from leangraph.schedules import interleaved_1f1b
from leangraph.workloads import BlockShape, make_blocks, sample_hidden

WORKLOADS = {
    "16 microbatches": (BlockShape(hidden=1024, heads=16, sequence=2048, dtype=torch.bfloat16), 16),
    "launch-bound": (BlockShape(hidden=256, heads=4, sequence=128, dtype=torch.bfloat16), 8),
}


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


def graph_blocks(
    method: str, blocks: list[torch.nn.Module], shape: BlockShape, microbatches: int,
    **options: object,
) -> object:
    """Graph the 2 chunks x 4 blocks of rank 0 of PP4/VP2 with torch (one wrapper module per
    graph over the shared blocks: torch graphs each module once) or with leangraph."""
    graphs = 8 * microbatches
    if method == "torch":
        wrappers = tuple(
            torch.nn.Sequential(blocks[(g // (4 * microbatches)) * 4 + g % 4])
            for g in range(graphs)
        )
        return torch.cuda.make_graphed_callables(
            wrappers, tuple((sample_hidden(shape, "cuda"),) for _ in wrappers)
        )
    sample = sample_hidden(shape, "cuda")
    return leangraph.make_graphed_callables(
        tuple(blocks), tuple((sample,) for _ in range(graphs)),
        order=interleaved_1f1b(4, 2, 0, microbatches), num_layers_per_chunk=4, **options,
    )


def call(
    method: str, shape: BlockShape, microbatches: int
) -> tuple[float, float, float, int, int]:
    blocks = make_blocks(8, shape, "cuda")
    torch.cuda.synchronize()
    if method == "leangraph, cache pre-filled":
        # One segment as large as warm-up's peak, freed into the cache: warm-up then splits
        # its blocks from it instead of asking the device for each.
        del_me = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
        del del_me
    clock = Clock()
    segments = _segments()
    start = time.perf_counter()
    try:
        result = graph_blocks("torch" if method == "torch" else "leangraph", blocks, shape,
                              microbatches)
        torch.cuda.synchronize()
        end = time.perf_counter()
    finally:
        clock.close()
    assert clock.first_begin is not None and clock.segments_before is not None
    if method != "torch":
        leangraph.reset_all(result)
    del result
    torch.cuda.empty_cache()
    mallocs = clock.segments_before - segments
    return clock.first_begin - start, end - clock.first_begin, clock.in_end, clock.graphs, mallocs


if __name__ == "__main__":
    for name, (shape, microbatches) in WORKLOADS.items():
        call("torch", shape, microbatches)  # untimed: per-process set-up
        call("leangraph", shape, microbatches)
        methods = ["torch", "leangraph", "leangraph, cache pre-filled"]
        rows: dict[str, list[tuple[float, float, float, int, int]]] = {m: [] for m in methods}
        for round_index in range(4):
            for method in methods[round_index % 3 :] + methods[: round_index % 3]:
                rows[method].append(call(method, shape, microbatches))
        print(f"== {name} (4 rounds, medians, seconds)")
        for method, values in rows.items():
            before, capture, in_end, graphs, mallocs = (
                statistics.median(v) for v in zip(*values)
            )
            print(f"{method:<28} before capture {before:.3f}  capture {capture:.3f}  "
                  f"in capture_end {in_end:.3f}  graphs {graphs:.0f}  "
                  f"cudaMalloc before capture {mallocs:.0f}")
