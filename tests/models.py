"""Small models and drivers shared by the tests."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
from torch.distributed import pipelining

import leangraph
from leangraph.cli.local_pipeline import run_order
from leangraph.order import Layout

_ZERO_BUBBLE_NAMES = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")

# This torch's zero-bubble schedule classes, as test parameters; one skipped parameter where it
# has none.
TORCH_ZERO_BUBBLE_SCHEDULES = [
    getattr(pipelining, name) for name in _ZERO_BUBBLE_NAMES if hasattr(pipelining, name)
] or [
    pytest.param(None, id="none", marks=pytest.mark.skip(
        reason=f"this torch has no zero-bubble schedule class ({', '.join(_ZERO_BUBBLE_NAMES)})"))
]


class Block(torch.nn.Module):
    """A residual MLP block: deterministic, cheap, with parameters in every path."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TwoOutputs(torch.nn.Module):
    """``(y, head(y))``: a loss may leave ``head(y)`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        y = self.body(x)
        return y, self.head(y)


class ThreeOutputs(torch.nn.Module):
    """``(y, head(y), side(z))``: a loss may use only some of them. ``head`` only the second
    output reaches, ``side`` only the third, ``body`` the first two."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 4)
        self.side = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, z: torch.Tensor):
        y = self.body(x)
        return y, self.head(y), self.side(z)


def make_layers(count: int, width: int, device: str = "cpu", seed: int = 0) -> list[Block]:
    torch.manual_seed(seed)
    return [Block(width).to(device) for _ in range(count)]


def mse(target: Sequence[torch.Tensor]):
    return lambda out, m: torch.nn.functional.mse_loss(out, target[m])


def train_both(order, layers_per_chunk, width, microbatches, steps, device="cpu", seed=0,
               set_to_none=True, hook_logs=None, **capture_options):
    """Train eager and graphed copies of the same layers in ``order``; return both histories.

    ``set_to_none`` is ``zero_grad``'s argument (a bool, or a function of the step); with
    ``hook_logs`` (a dict), each copy's post-accumulate-grad hooks append ``(layer, name)``
    to ``hook_logs["eager"]`` / ``hook_logs["graphed"]`` as they fire, one list per step.
    ``capture_options`` go to ``make_graphed_callables``."""
    count = sum(layers_per_chunk)
    eager = make_layers(count, width, device, seed)
    graphed_layers = copy.deepcopy(eager)
    gen = torch.Generator().manual_seed(seed + 1)
    data = [torch.randn(microbatches, 4, width, generator=gen).to(device) for _ in range(steps)]
    target = [torch.randn(4, width, generator=gen).to(device) for _ in range(microbatches)]
    layout = Layout(tuple(layers_per_chunk), microbatches)
    samples = tuple((torch.randn(4, width, device=device, requires_grad=True),)
                    for _ in range(layout.num_graphs))
    graphed = leangraph.make_graphed_callables(
        tuple(graphed_layers), samples, order=order, num_layers_per_chunk=list(layers_per_chunk),
        **capture_options)

    def eager_layer(c, m, l):
        return eager[layout.callable_index(c, l)]

    def graph_layer(c, m, l):
        return graphed[layout.graph_index(c, m, l)]

    history = {"eager": [], "graphed": []}
    for name, lookup, params in (("eager", eager_layer, eager),
                                 ("graphed", graph_layer, graphed_layers)):
        optim = torch.optim.SGD([p for layer in params for p in layer.parameters()], lr=0.05)
        if hook_logs is not None:
            log = hook_logs.setdefault(name, [])
            for index, layer in enumerate(params):
                for pname, p in layer.named_parameters():
                    p.register_post_accumulate_grad_hook(
                        lambda _, key=(index, pname), log=log: log[-1].append(key))
        for step in range(steps):
            optim.zero_grad(set_to_none=set_to_none(step) if callable(set_to_none)
                            else set_to_none)
            if hook_logs is not None:
                hook_logs[name].append([])
            result = run_order(order, layers_per_chunk, lookup, list(data[step]), mse(target))
            grads = [p.grad.clone() for layer in params for p in layer.parameters()]
            optim.step()
            history[name].append((result, grads, [p.detach().clone() for layer in params
                                                  for p in layer.parameters()]))
    return history, graphed


def assert_histories_equal(history, exact=True):
    for step, (eager, graphed) in enumerate(zip(history["eager"], history["graphed"])):
        (er, eg, ep), (gr, gg, gp) = eager, graphed
        pairs = (list(zip(er.losses, gr.losses)) + list(zip(er.input_grads, gr.input_grads))
                 + list(zip(eg, gg)) + list(zip(ep, gp)))
        for a, b in pairs:
            if exact:
                assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max()}"
            else:
                torch.testing.assert_close(a, b)


def replay_step(graphed, order, layers_per_chunk, inputs):
    """One training step of ``graphed`` in ``order`` (the order it was captured in, which
    replays must follow), chunk ``c + 1`` consuming chunk ``c``'s output; returns the step's
    losses and the gradients of ``inputs`` (one per microbatch)."""
    layout = Layout(tuple(layers_per_chunk), len(inputs))

    def layer(chunk: int, microbatch: int, index: int):
        return graphed[layout.graph_index(chunk, microbatch, index)]

    return run_order(order, layers_per_chunk, layer, inputs, lambda out, m: out.float().sum())


def backward_through_stacks(stacks: Sequence[Sequence[torch.nn.Module]], x: torch.Tensor) -> None:
    """One step of each stack (graphed or eager) of layers on ``x``: tanh after each layer,
    the squares' sum as the loss, its backward; and every layer of the first stack has the
    ``.grad`` of the same layer of each other stack, bitwise."""
    for stack in stacks:
        h = x
        for layer in stack:
            h = torch.tanh(layer(h))
        h.square().sum().backward()
    for layers in zip(*stacks):
        for params in zip(*(layer.parameters() for layer in layers)):
            assert all(torch.equal(params[0].grad, p.grad) for p in params[1:]), layers[0]
