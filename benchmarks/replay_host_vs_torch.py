"""The replay microbenchmark's host-time comparison without a GPU: one forward and one backward
replay of a block, graphed by ``torch.cuda.make_graphed_callables`` and by leangraph as
``leangraph bench --replay-micro`` graphs them, with every graph launch made a no-op.

torch's function runs its own Python and autograd path (its CUDA pieces, the graphs, streams
and the pool handle, are stand-ins: capture runs the work, replay runs nothing); leangraph's
runs on the CPU backend with replays stubbed out. What is left on each side is the host
work around the launches, the figure that decides ``leangraph / torch`` in the GPU
microbenchmark, where the launches themselves cost both sides alike. The CPU has no launch
cost, so its ratio is larger than the GPU's: read the difference in µs, which tracks the
GPU host's (scaled by the two CPUs' speeds).
Usage: PYTHONPATH=src python3 benchmarks/replay_host_vs_torch.py
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.cuda.graphs

import leangraph
from leangraph.cli.workloads import BlockShape, make_blocks, sample_hidden

ROUNDS = 7
REPLAYS = 3000
SHAPE = BlockShape(hidden=64, heads=4, sequence=16)  # the bench's block, small


class _NoGraph:
    """Stands for ``torch.cuda.CUDAGraph``: capture records nothing, replay runs nothing."""

    def capture_begin(self, *args: Any, **kwargs: Any) -> None:
        pass

    def capture_end(self) -> None:
        pass

    def replay(self) -> None:
        pass

    def pool(self) -> None:
        return None


@contextlib.contextmanager
def _no_capture(*args: Any, **kwargs: Any) -> Iterator[None]:
    yield


def _stub_cuda() -> None:
    """torch's make_graphed_callables with its CUDA calls made stand-ins (CPU tensors)."""
    for module in (torch.cuda, torch.cuda.graphs):
        module.CUDAGraph = _NoGraph  # type: ignore[attr-defined, misc]
        module.graph = _no_capture  # type: ignore[attr-defined, assignment]
        module.graph_pool_handle = lambda: None  # type: ignore[attr-defined]
    torch.cuda.Stream = lambda *args, **kwargs: None  # type: ignore[assignment, misc]
    torch.cuda.stream = lambda stream: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args: None  # type: ignore[assignment]


def _layers() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    block = make_blocks(1, SHAPE, "cpu")[0]
    sample = sample_hidden(SHAPE, "cpu")
    ours = leangraph.make_graphed_callables(
        (copy.deepcopy(block),), ((sample.detach().clone().requires_grad_(),),),
        order=[1, -1], num_layers_per_chunk=1,
    )  # fmt: skip
    record = ours[0]._record  # a probe reads the private pair: replays do nothing
    assert record is not None
    record.pair.replay_forward = _nothing  # type: ignore[method-assign]
    record.pair.replay_backward = _nothing  # type: ignore[method-assign]
    theirs = torch.cuda.make_graphed_callables((copy.deepcopy(block),), ((sample,),))
    return {"torch": theirs[0], "leangraph": ours[0]}


def _time(layer: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """The median over rounds of µs per forward and backward replay."""
    x = sample_hidden(SHAPE, "cpu")
    grad = sample_hidden(SHAPE, "cpu", requires_grad=False)
    for _ in range(REPLAYS // 10):
        layer(x).backward(grad)
    rounds = []
    for _ in range(ROUNDS):
        start = time.perf_counter_ns()
        for _ in range(REPLAYS):
            layer(x).backward(grad)
        rounds.append((time.perf_counter_ns() - start) / REPLAYS / 1e3)
    return statistics.median(rounds)


def _nothing() -> None:
    pass


def main(argv: list[str]) -> None:
    _stub_cuda()
    layers = _layers()
    times = {name: _time(layer) for name, layer in layers.items()}
    print(f"torch {torch.__version__}, {REPLAYS} replays x {ROUNDS} rounds")
    for name, value in times.items():
        print(f"{name:10s} {value:6.1f} µs per forward and backward replay")
    print(f"leangraph - torch: {times['leangraph'] - times['torch']:+.1f} µs "
          f"({times['leangraph'] / times['torch']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
