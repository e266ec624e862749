"""Where one graphed layer's replay spends host time (GPU only): the pieces, timed apart.

On one launch-bound block (hidden 256, 4 heads, sequence 128, bf16) it times, in µs of host
time per call (median of 7 rounds of 300 calls, synchronising only around each round):

- a one-element kernel launch, and ``CUDAGraph.replay()`` of the block's forward and backward
  graphs captured by hand (the floor of any per-layer method);
- an empty ``autograd.Function`` forward + ``backward()`` on the block's input, alone and with
  the block's parameters passed through it (autograd's engine and its gradient
  accumulation into ``.grad``);
- the whole replay (forward + backward) of torch's graphed block and leangraph's, unfused and
  fused, as ``leangraph bench --replay-micro`` times it;

then a cProfile of 300 replays of each method, by own time.
Usage: PYTHONPATH=src python3 benchmarks/replay_anatomy.py
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _cprofile import print_profile

from leangraph.cli.replay_micro import REPLAY_METHODS, graphed_layer
from leangraph.cli.workloads import BlockShape, make_blocks, sample_hidden

SHAPE = BlockShape(hidden=256, heads=4, sequence=128, dtype=torch.bfloat16)
CALLS = 300


def host_us(call: Callable[[], object], calls: int = CALLS, rounds: int = 7) -> float:
    """Median over rounds of the host µs per ``call()``."""
    call()
    figures = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for _ in range(calls):
            call()
        figures.append((time.perf_counter_ns() - start) / calls / 1e3)
        torch.cuda.synchronize()
    return statistics.median(figures)


class _Pass(torch.autograd.Function):
    """Identity on the first tensor; hands the others a zero-free gradient of their own."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.grads = tuple(torch.ones_like(p) for p in params)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (grad, *ctx.grads)


def raw_graphs(block: torch.nn.Module) -> tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]:
    """The block's forward graph and its backward graph (``autograd.grad``), by hand."""
    params = list(block.parameters())
    x = sample_hidden(SHAPE, "cuda")
    gy = torch.randn_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            torch.autograd.grad(block(x), [x, *params], gy)
    torch.cuda.current_stream().wait_stream(stream)
    forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(forward):
        y = block(x)
    with torch.cuda.graph(backward, pool=forward.pool()):
        torch.autograd.grad(y, [x, *params], gy)
    return forward, backward


def _replay(
    layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor
) -> None:
    layer(x).backward(grad)


def main() -> None:
    print("torch", torch.__version__, torch.cuda.get_device_name())
    block = make_blocks(1, SHAPE, "cuda")[0]
    params = list(block.parameters())
    tiny = torch.zeros(1, device="cuda")
    print(f"kernel launch (add_ on 1 element)     {host_us(lambda: tiny.add_(1)):7.1f} µs")
    forward, backward = raw_graphs(copy.deepcopy(block))
    print(f"CUDAGraph.replay, forward              {host_us(forward.replay):7.1f} µs")
    print(f"CUDAGraph.replay, backward             {host_us(backward.replay):7.1f} µs")
    x = sample_hidden(SHAPE, "cuda")
    grad = torch.randn_like(x)
    print(
        "empty Function fwd+bwd, input only     "
        f"{host_us(lambda: _Pass.apply(x).backward(grad)):7.1f} µs"
    )
    plist = [p.detach().clone().requires_grad_() for p in params]
    print(
        f"empty Function fwd+bwd, +{len(plist)} params     "
        f"{host_us(lambda: _Pass.apply(x, *plist).backward(grad)):7.1f} µs"
    )
    layers = {}
    for method in REPLAY_METHODS:
        layers[method] = graphed_layer(method, copy.deepcopy(block), sample_hidden(SHAPE, "cuda"))
    inputs = {m: sample_hidden(SHAPE, "cuda") for m in REPLAY_METHODS}
    for method, layer in layers.items():
        xm = inputs[method]
        forward_only = host_us(lambda: layer(xm).backward(grad))  # noqa: B023
        print(f"{method:<16} replay fwd+bwd        {forward_only:7.1f} µs")
    for method, layer in layers.items():
        replay = functools.partial(_replay, layer, inputs[method], grad)
        print_profile(f"{method}, {CALLS} replays", replay, CALLS, 22)


if __name__ == "__main__":
    main()
