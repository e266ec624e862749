"""Pipeline orders as a property (hypothesis, CPU backend): random Megatron orders (1F1B or
interleaved 1F1B, any rank), layers per chunk, microbatches and options, with code that keeps
gradients the replays hand on (a tensor hook storing every gradient between two layers of a
chunk, the gradients a chunk's input receives), two training steps through the graphed layers
and through eager copies of them, an SGD step and ``zero_grad`` (to None or to zeros) after
each.

Invariants: every gradient kept, read after both steps (when later replays have reused the
graph memory it came from), each parameter's ``.grad`` after each step, each chunk input's
gradient and the parameters at the end are eager's, bitwise.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leangraph
from leangraph.schedules import interleaved_1f1b, one_f_one_b

WIDTH = 6
Lookup = Callable[[int, int, int], Any]


def _layers(seed: int, chunks: int, per_chunk: int) -> list[list[torch.nn.Module]]:
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        return [
            [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
             for _ in range(per_chunk)]
            for _ in range(chunks)
        ]  # fmt: skip


def _train(
    order: list[int], lookup: Lookup, layers: list[list[torch.nn.Module]], microbatches: int,
    hook: bool, to_none: bool,
) -> tuple[list[torch.Tensor], ...]:  # fmt: skip
    """Two steps of ``order`` (chunk ``c``'s layer ``l`` for microbatch ``m``:
    ``lookup(c, m, l)``, which trains ``layers``), each followed by an SGD step and
    ``zero_grad(set_to_none=to_none)``; the gradients kept between layers, the chunk inputs'
    gradients, the parameters' after each step, and the parameters."""
    chunks, per_chunk = len(layers), len(layers[0])
    params = [p for chunk in layers for layer in chunk for p in layer.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    generator = torch.Generator().manual_seed(1)
    kept: list[torch.Tensor] = []
    received: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for _ in range(2):
        samples = [torch.randn(2, WIDTH, generator=generator) for _ in range(microbatches)]
        started, finished = [0] * chunks, [0] * chunks
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        for entry in order:
            c = abs(entry) - 1
            if entry > 0:
                m, started[c] = started[c], started[c] + 1
                source = samples[m] if c == 0 else outputs[(c - 1, m)].detach()
                hidden = inputs[(c, m)] = source.clone().requires_grad_()
                for layer in range(per_chunk):
                    hidden = lookup(c, m, layer)(hidden)
                    if hook and layer < per_chunk - 1:
                        hidden.register_hook(kept.append)
                outputs[(c, m)] = hidden
            else:
                m, finished[c] = finished[c], finished[c] + 1
                if c == chunks - 1:
                    outputs[(c, m)].square().sum().backward()
                else:
                    outputs[(c, m)].backward(inputs[(c + 1, m)].grad)
        received += [inputs[key].grad for key in sorted(inputs)]
        grads += [p.grad.clone() for p in params]
        optimizer.step()
        optimizer.zero_grad(set_to_none=to_none)
    return kept, received, grads, [p.detach() for p in params]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pp_size=st.sampled_from([2, 4]),
    vp_size=st.sampled_from([1, 2]),
    rounds=st.sampled_from([1, 2]),
    rank_seed=st.integers(0, 3),
    per_chunk=st.sampled_from([1, 2, 3]),
    options=st.sampled_from([
        {}, {"fuse_grad_accumulation": True}, {"share_buffers": False},
        {"fuse_grad_accumulation": True, "accumulator_hooks": "python"},
        {"overlap_grad_accumulation": True},
    ]),
    hook=st.booleans(),
    to_none=st.booleans(),
)
def test_random_pipeline_orders_train_and_hand_on_gradients_as_eager(
    pp_size: int, vp_size: int, rounds: int, rank_seed: int, per_chunk: int,
    options: dict[str, Any], hook: bool, to_none: bool,
) -> None:  # fmt: skip
    microbatches, rank = pp_size * rounds, rank_seed % pp_size
    order = (
        interleaved_1f1b(pp_size, vp_size, rank, microbatches)
        if vp_size > 1
        else one_f_one_b(pp_size, rank, microbatches)
    )
    eager = _layers(0, vp_size, per_chunk)
    layers = copy.deepcopy(eager)
    flat = tuple(layer for chunk in layers for layer in chunk)
    graphs = vp_size * microbatches * per_chunk
    samples = tuple((torch.randn(2, WIDTH, requires_grad=True),) for _ in range(graphs))
    graphed = leangraph.make_graphed_callables(
        flat, samples, order=order, num_layers_per_chunk=per_chunk, **options
    )
    want = _train(order, lambda c, m, l: eager[c][l], eager, microbatches, hook, to_none)
    got = _train(order, lambda c, m, l: graphed[(c * microbatches + m) * per_chunk + l],
                 layers, microbatches, hook, to_none)  # fmt: skip
    for name, wanted, gotten in zip(("kept", "received", "grads", "params"), want, got):
        assert len(wanted) == len(gotten), name
        for index, (a, b) in enumerate(zip(wanted, gotten)):
            assert torch.equal(a, b), (name, index)
    leangraph.reset_all(graphed)
