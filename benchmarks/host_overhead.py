"""leangraph's own host time per training step, on any machine (the CPU will do): the bench's
launch-bound step (rank 0 of PP4/VP2, 2 chunks x 4 blocks, 8 microbatches) with every graph
replay made a no-op, so what is left is Python and autograd around the replays.

For each leangraph method it prints the best of 15 rounds of 20 steps (ms per step), and a floor:
the same step through one trivial autograd node per layer (a function that returns a fresh
tensor and passes the gradient back), which is what any per-layer graph costs at least. The
difference, over the step's 64 forward and 64 backward replays, is what one replay costs
beyond that. On a GPU the step is bound by this host time (docs/benchmarks.md), so a change
here shows in the launch-bound bench; the blocks are tiny (hidden 32) so that the floor's own
tensor work is negligible. Host timings move with whatever else the machine runs: compare
methods within one run, and runs only where their floors agree.
Usage: PYTHONPATH=src python3 benchmarks/host_overhead.py [cpu|cuda]
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable

import torch

from leangraph.cli.bench import LEANGRAPH_METHODS, BenchConfig, BenchWorkload, capture_method
from leangraph.cli.workloads import BlockShape

ROUNDS = 15
STEPS = 20


class _Passthrough(torch.autograd.Function):
    """One autograd node that does nothing: a fresh output, the gradient handed back."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


def best_ms(step: Callable[[], object], sync: Callable[[], None]) -> float:
    """Best of :data:`ROUNDS` rounds of :data:`STEPS` steps, ms per step."""
    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(ROUNDS):
        sync()
        start = time.perf_counter()
        for _ in range(STEPS):
            step()
        sync()
        best = min(best, (time.perf_counter() - start) / STEPS * 1e3)
    return best


def main(argv: list[str]) -> None:
    device = argv[0] if argv else "cpu"
    shape = BlockShape(hidden=32, heads=2, sequence=8)
    config = BenchConfig(num_microbatches=8, shape=shape, device=device, methods=("eager",))
    work = BenchWorkload(config)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    blocks = work.copy_blocks()
    floor = best_ms(lambda: work.train_step(lambda c, m, l: _Passthrough.apply, blocks), sync)
    replays = 2 * work.layout.num_graphs
    print(f"{replays} replays a step; floor (one trivial autograd node per layer) {floor:.2f} ms")
    for name in LEANGRAPH_METHODS:
        captured = capture_method(work, name)
        assert captured.graphed is not None and captured.lookup is not None
        for graphed in captured.graphed:
            record = graphed._record  # a probe reads the private pair: replays do nothing
            assert record is not None
            record.pair.replay_forward = _nothing  # type: ignore[method-assign]
            record.pair.replay_backward = _nothing  # type: ignore[method-assign]
        ms = best_ms(functools.partial(work.train_step, captured.lookup, captured.blocks), sync)
        extra = (ms - floor) / replays * 1e3
        print(f"{name:<26} {ms:6.2f} ms a step, {extra:5.1f} µs a replay above the floor")
        captured.release()


def _nothing() -> None:
    pass


if __name__ == "__main__":
    main(sys.argv[1:])
