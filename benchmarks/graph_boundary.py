"""What a CUDA graph boundary costs the GPU (GPU only): the same blocks' forwards replayed as
one graph per block, back to back, against one graph holding them all.

For the bench's compute-bound block (hidden 1024, sequence 2048) and its launch-bound block
(hidden 256, sequence 128), bf16: 8 blocks chained (each reads the previous one's output
buffer), captured once as 8 graphs and once as a single graph of the same kernels. Each round
replays both 50 times, synchronised, timed by CUDA events; rounds alternate the two, and the
medians of 9 rounds are printed: GPU µs per pass, and the difference per boundary (the
per-block pass has 7 more). The host launches a graph in a few µs, far ahead of the GPU's
work per block, so the difference is the GPU's own, the idle time between one graph's last
kernel and the next graph's first. A per-layer training step has two such boundaries per
layer and microbatch (its forward and its backward graph): 256 on the bench's 16-microbatch
step.

Then the same for training, through leangraph (``fuse_grad_accumulation=True,
accumulator_hooks=False``), compute-bound block only (there the host stays ahead): the 8
blocks as one pipeline chunk of 8 graphed layers (chained: no copies between them) against the
8 blocks as one graphed ``nn.Sequential``; 20 forward+backward steps per round, GPU time by
CUDA events, 9 alternating rounds, medians. Per boundary is the difference over 14 (7 more
forward and 7 more backward graphs).
Usage: PYTHONPATH=src python3 benchmarks/graph_boundary.py
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

import leangraph
from leangraph.cli.workloads import BlockShape, make_blocks

BLOCKS = 8
REPLAYS = 50
ROUNDS = 9
SHAPES = {
    "compute-bound block": BlockShape(hidden=1024, heads=16, sequence=2048, dtype=torch.bfloat16),
    "launch-bound block": BlockShape(hidden=256, heads=4, sequence=128, dtype=torch.bfloat16),
}


def capture(body: Callable[[], torch.Tensor], pool: Any) -> torch.cuda.CUDAGraph:
    """``body`` recorded into a new graph in ``pool`` (warmed up on the capture stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph


def gpu_ms(replay: Callable[[], None], times: int = REPLAYS) -> float:
    """GPU ms of ``times`` calls of ``replay``, from a synchronised start."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(times):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def measure(shape: BlockShape) -> tuple[float, float]:
    """Median GPU µs per pass of the per-block graphs and of the single graph."""
    blocks = make_blocks(BLOCKS, shape, "cuda")
    x = torch.randn(
        shape.micro_batch, shape.sequence, shape.hidden, device="cuda", dtype=shape.dtype
    )
    pool = torch.cuda.graph_pool_handle()
    with torch.no_grad():
        buffers = [x]
        per_block = []
        for block in blocks:
            out: list[torch.Tensor] = []
            per_block.append(capture(functools.partial(_keep, out, block, buffers[-1]), pool))
            buffers.append(out[-1])
        whole = capture(functools.partial(_chain, blocks, x), pool)

    def replay_per_block() -> None:
        for graph in per_block:
            graph.replay()

    passes: dict[str, list[float]] = {"per-block": [], "single": []}
    replays = {"per-block": replay_per_block, "single": whole.replay}
    for replay in replays.values():  # untimed: clocks up, lazy state
        gpu_ms(replay)
    for _ in range(ROUNDS):
        for name, replay in replays.items():
            passes[name].append(gpu_ms(replay) * 1e3 / REPLAYS)
    return statistics.median(passes["per-block"]), statistics.median(passes["single"])


def measure_training(shape: BlockShape, steps: int = 20) -> tuple[float, float]:
    """Median GPU µs per training step (forward and backward) of the blocks graphed as 8
    chained layers, and as one callable of all 8."""
    options: dict[str, Any] = {"fuse_grad_accumulation": True, "accumulator_hooks": False}

    def sample() -> torch.Tensor:
        size = (shape.micro_batch, shape.sequence, shape.hidden)
        return torch.randn(size, device="cuda", dtype=shape.dtype, requires_grad=True)

    layers = leangraph.make_graphed_callables(
        tuple(make_blocks(BLOCKS, shape, "cuda")),
        tuple((sample(),) for _ in range(BLOCKS)),
        order=[1, -1],
        num_layers_per_chunk=[BLOCKS],
        **options,
    )
    whole = leangraph.make_graphed_callables(
        torch.nn.Sequential(*make_blocks(BLOCKS, shape, "cuda")), (sample(),), **options
    )
    x, seed = sample(), torch.randn(shape.micro_batch, shape.sequence, shape.hidden, device="cuda")
    seed = seed.to(shape.dtype)

    def train(callables: Sequence[Callable[[torch.Tensor], torch.Tensor]]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(steps):
                hidden = x
                for layer in callables:
                    hidden = layer(hidden)
                hidden.backward(seed)

        return run

    runs = {"per-layer": train(layers), "single": train([whole])}
    for run in runs.values():
        gpu_ms(run, 1)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            times[name].append(gpu_ms(run, 1) * 1e3 / steps)
    leangraph.reset_all(layers)
    leangraph.reset_all(whole)
    return statistics.median(times["per-layer"]), statistics.median(times["single"])


def _keep(out: list[torch.Tensor], block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``block(x)``, also appended to ``out`` (the last call's is the captured output)."""
    out.append(block(x))
    return out[-1]


def _chain(blocks: Sequence[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    """The blocks applied in turn to ``x``."""
    for block in blocks:
        x = block(x)
    return x


def main() -> None:
    print(f"{BLOCKS} chained block forwards, {REPLAYS} passes per round, {ROUNDS} rounds, medians")
    for name, shape in SHAPES.items():
        per_block, single = measure(shape)
        boundary = (per_block - single) / (BLOCKS - 1)
        print(
            f"{name:<20} {BLOCKS} graphs {per_block:8.1f} µs/pass   1 graph {single:8.1f} µs/pass"
            f"   {boundary:5.2f} µs per boundary ({per_block / single:.3f}x)"
        )
    name, shape = next(iter(SHAPES.items()))
    per_layer, single = measure_training(shape)
    boundary = (per_layer - single) / (2 * (BLOCKS - 1))
    print(
        f"training, {name}: {BLOCKS} layers {per_layer:8.1f} µs/step   1 callable {single:8.1f} "
        f"µs/step   {boundary:5.2f} µs per boundary ({per_layer / single:.3f}x)"
    )


if __name__ == "__main__":
    main()
