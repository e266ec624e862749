"""The bench's training step with each pipeline chunk graphed as one callable, against one
graph per layer and the whole-step graph (GPU only).

A per-layer step pays a graph boundary twice per layer and microbatch (forward and backward
graph): 256 on the 16-microbatch compute-bound step, about 7 µs of GPU time each
(``graph_boundary.py``). Graphing a chunk's 4 blocks as one ``nn.Sequential`` makes a quarter
of the graphs, of the same kernels; the step and its order are the bench's. Three methods, on
copies of the same initial blocks:

* ``per-layer``: ``leangraph-fused`` of the bench, one graph per block;
* ``per-chunk``: ``leangraph.make_graphed_callables`` over one ``nn.Sequential`` per chunk, in
  the same order (one layer per chunk), ``fuse_grad_accumulation=True`` with its accumulator
  hooks, as ``leangraph-fused``;
* ``whole-step``: the bench's limit, the rank's whole step as one CUDA graph.

Each method's losses are checked equal to eager's, and its parameter gradients after one step
compared with eager's (a second eager step's against the first gives the scale). Then
``ROUNDS`` alternating rounds of the three, each ``STEPS`` synchronised steps; medians of the
rounds' median step times, the ratio to whole-step's, and each method's capture time and
warm-up + capture peak above its start.
Usage: PYTHONPATH=src python3 benchmarks/chunk_step.py [16 32 launch]
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace

import torch

import leangraph
from leangraph.cli.bench import (
    FUSED,
    LAUNCH_BOUND,
    BenchConfig,
    BenchWorkload,
    Captured,
    capture_method,
)

ROUNDS = 5
STEPS = 10


def capture_per_chunk(work: BenchWorkload) -> Captured:
    """Each chunk's blocks of a fresh copy graphed as one ``nn.Sequential``, in the order."""
    blocks = work.copy_blocks()
    layout = work.layout
    chunks = tuple(
        torch.nn.Sequential(*(blocks[layout.callable_index(c, l)] for l in range(count)))
        for c, count in enumerate(work.layers_per_chunk, 1)
    )
    per_chunk = leangraph.Layout((1,) * len(chunks), layout.num_microbatches)
    sample = work.sample()
    graphed = leangraph.make_graphed_callables(
        chunks,
        tuple(sample for _ in range(per_chunk.num_graphs)),
        order=work.order,
        num_layers_per_chunk=1,
        num_warmup_iters=work.config.warmup_iters,
        fuse_grad_accumulation=True,
    )

    def lookup(chunk: int, microbatch: int, layer: int):
        if layer:  # the chunk's graph ran its later layers already
            return lambda x: x
        return graphed[per_chunk.graph_index(chunk, microbatch, 0)]

    return Captured(work, blocks, lookup, graphed)


def _grads(blocks: list[torch.nn.Module]) -> list[torch.Tensor]:
    """Every parameter's gradient after a step, copied (graph buffers are rewritten)."""
    return [p.grad.detach().clone() for block in blocks for p in block.parameters()]


def _difference(grads: list[torch.Tensor], eager: list[torch.Tensor]) -> str:
    """``bitwise`` where every gradient equals eager's, else the largest difference relative
    to the largest eager gradient of its parameter (flash attention's backward, for one, is
    not deterministic, so eager's own steps differ from each other)."""
    if all(map(torch.equal, grads, eager)):
        return "bitwise"
    worst = max(
        float((g.float() - e.float()).abs().max() / e.float().abs().max().clamp_min(1e-30))
        for g, e in zip(grads, eager)
    )
    return f"within {worst:.1e} (relative)"


def measured_capture(make) -> tuple[Captured, float, int]:
    """``make()``'s result, its wall time, and its peak allocation above the start."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start_bytes = torch.cuda.memory_allocated()
    start = time.perf_counter()
    captured = make()
    torch.cuda.synchronize()
    return captured, time.perf_counter() - start, torch.cuda.max_memory_allocated() - start_bytes


def step_ms(captured: Captured) -> float:
    """Median of ``STEPS`` synchronised steps, ms."""
    times = []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        captured.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run(name: str, config: BenchConfig) -> None:
    work = BenchWorkload(config)
    eager_blocks = work.copy_blocks()
    eager = work.step(work.eager_lookup(eager_blocks), eager_blocks)
    eager_grads = _grads(eager_blocks)
    work.step(work.eager_lookup(eager_blocks), eager_blocks)  # eager again, the same blocks
    repeated = _difference(_grads(eager_blocks), eager_grads)
    del eager_blocks
    makers = {
        "per-layer": lambda: capture_method(work, FUSED),
        "per-chunk": lambda: capture_per_chunk(work),
        "whole-step": lambda: capture_method(work, "whole-step"),
    }
    methods, capture, same_grads = {}, {}, {"eager again": repeated}
    for method, make in makers.items():
        methods[method], seconds, peak = measured_capture(make)
        capture[method] = (seconds, peak)
        losses = methods[method].step()
        assert losses == eager, (method, losses[:2], eager[:2])
        same_grads[method] = _difference(_grads(methods[method].blocks), eager_grads)
    rounds: dict[str, list[float]] = {method: [] for method in methods}
    for _ in range(ROUNDS):
        for method, captured in methods.items():
            rounds[method].append(step_ms(captured))
    limit = statistics.median(rounds["whole-step"])
    graphs = {"per-layer": 2 * work.layout.num_graphs, "per-chunk": len(work.order)}
    print(f"== {name}: {work.layout.num_microbatches} microbatches, losses equal to eager's")
    print("gradients against eager's: " + ", ".join(f"{m} {d}" for m, d in same_grads.items()))
    print(
        f"{'method':<12}{'graphs':>8}{'step ms':>26}{'x limit':>9}{'capture s':>11}{'peak MiB':>10}"
    )
    for method, times in rounds.items():
        median = statistics.median(times)
        spread = f"{median:.2f} [{min(times):.2f}-{max(times):.2f}]"
        seconds, peak = capture[method]
        print(
            f"{method:<12}{graphs.get(method, 1):>8}{spread:>26}{median / limit:>8.3f}x"
            f"{seconds:>11.2f}{peak / 2**20:>10.0f}"
        )
    for captured in methods.values():
        captured.release()


def main(which: list[str]) -> None:
    workloads = {
        "16": ("compute-bound", BenchConfig(num_microbatches=16)),
        "32": ("compute-bound", BenchConfig(num_microbatches=32)),
        "launch": ("launch-bound", replace(LAUNCH_BOUND, steps=5)),
    }
    for key in which or ["16", "32", "launch"]:
        run(*workloads[key])


if __name__ == "__main__":
    main(sys.argv[1:])
