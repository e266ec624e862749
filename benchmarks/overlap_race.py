"""Probe (GPU only): do the side-stream additions of ``overlap_grad_accumulation`` read a
parameter-gradient buffer that a later backward graph writes meanwhile?

With ``share_buffers=True`` a graph's gradient buffers go back to the pool once its backward is
captured, and later captures reuse that memory: in a drop-in stack of equal layers every
backward graph would write its weight gradient into the same memory, while autograd adds the
previous one on the side stream. leangraph orders the two (``runtime/overlap.py``: the next
backward graph gets other blocks, the one after waits for the additions); this probe checks that
nothing still races. Wide layers with few rows make the addition slow and the next write early;
``--hook-sleep`` gives every weight's gradient accumulator a pre-hook (as DDP hooks the
accumulator, not the tensor, which leangraph refuses) that keeps the stream the addition runs on
busy for that many GPU cycles before it adds, which makes the race certain where it exists.
Prints the largest difference from eager's gradients per mode (0 where nothing raced) over a few
steps.

Usage: PYTHONPATH=src python3 benchmarks/overlap_race.py [--width N] [--rows N] [--layers N]
       [--hook-sleep CYCLES]
"""

from __future__ import annotations

import argparse
import copy

import torch

import leangraph


def _busy_prehook(cycles: int):
    def prehook(grad_outputs: tuple[torch.Tensor, ...]) -> None:
        torch.cuda._sleep(cycles)  # on the stream autograd runs the accumulation on

    return prehook


def _grad_accumulator(parameter: torch.Tensor) -> torch.autograd.graph.Node:
    return parameter.view_as(parameter).grad_fn.next_functions[0][0]


def largest_difference(
    mode: str, width: int, layers: int, rows: int, steps: int, hook_sleep: int
) -> float:
    torch.manual_seed(0)
    graphed = [torch.nn.Linear(width, width).cuda() for _ in range(layers)]
    eager = copy.deepcopy(graphed)
    options = {"overlap_grad_accumulation": True} if mode == "overlap" else {}
    samples = tuple((torch.randn(rows, width, device="cuda", requires_grad=True),) for _ in graphed)
    leangraph.make_graphed_callables(tuple(graphed), samples, **options)
    # After capture: an accumulator something holds keeps the stream it was made on, so one
    # taken before would keep overlap's additions off the side stream. Autograd holds an
    # accumulator only weakly: the list keeps the hooked ones alive (overlap's are held).
    accumulators = (
        [_grad_accumulator(layer.weight) for layer in (*graphed, *eager)] if hook_sleep else []
    )
    for accumulator in accumulators:
        accumulator.register_prehook(_busy_prehook(hook_sleep))
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(rows, width, device="cuda")
        for stack in (graphed, eager):
            h = x
            for layer in stack:
                h = torch.tanh(layer(h))
            h.square().sum().backward()
        torch.cuda.synchronize()
        for a, b in zip(graphed, eager):
            worst = max(worst, (a.weight.grad - b.weight.grad).abs().max().item())
    leangraph.reset_all(graphed)
    accumulators.clear()
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hook-sleep", type=int, default=0)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    for mode in ("overlap", "default"):
        worst = largest_difference(
            mode, args.width, args.layers, args.rows, args.steps, args.hook_sleep
        )
        print(
            f"{mode:8s} width {args.width} rows {args.rows} hook sleep {args.hook_sleep}: "
            "max |graphed - eager| "
            f"weight gradient over {args.steps} steps: {worst:.3g}",
            flush=True,
        )


if __name__ == "__main__":
    main()
