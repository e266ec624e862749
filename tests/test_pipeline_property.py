"""Pipeline orders as a property (hypothesis, CPU backend): random Megatron orders (1F1B or
interleaved 1F1B, any rank), layers per chunk, microbatches and options, with code that keeps
gradients the replays hand on (a tensor hook storing every gradient between two layers of a
chunk, the gradients a chunk's input receives), two training steps through the graphed layers
and through eager copies of them, an SGD step and ``zero_grad`` (to None or to zeros) after
each. The second property runs the orders torch.distributed.pipelining's schedule classes
give one rank (the zero-bubble ones' weight steps, ``backward_dw()``, included), with tensor
and post-accumulate-grad hooks on the parameters; the third, layers of two streams and a
shared mask, with dropout.

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
from models import Block
from torch.distributed import pipelining

import leangraph
from leangraph.cli.local_pipeline import run_order
from leangraph.order import Layout
from leangraph.schedules import from_pipelining, interleaved_1f1b, one_f_one_b

WIDTH = 6
Lookup = Callable[[int, int, int], Any]


def _assert_bitwise(what: Any, wanted: list[torch.Tensor], gotten: list[torch.Tensor]) -> None:
    """As many tensors in ``gotten`` as in ``wanted``, each equal to its own, bitwise."""
    assert len(wanted) == len(gotten), what
    for index, (a, b) in enumerate(zip(wanted, gotten)):
        assert torch.equal(a, b), (what, index)


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
        _assert_bitwise(name, wanted, gotten)
    leangraph.reset_all(graphed)


# torch.distributed.pipelining's schedule classes this torch has, the zero-bubble ones (their
# orders split backwards into input-gradient steps and weight steps, backward_dw()) included.
_PIPELINING_SCHEDULES = tuple(
    getattr(pipelining, name)
    for name in ("Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B",
                 "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
    if hasattr(pipelining, name)
)  # fmt: skip


def _train_schedule(
    order: list[Any], per_chunk: list[int], lookup: Lookup, layers: list[torch.nn.Module],
    data: list[torch.Tensor], targets: list[torch.Tensor], tensor_hooks: bool, to_none: bool,
) -> tuple[list[Any], ...]:  # fmt: skip
    """Two steps of ``order`` through ``lookup`` (run_order's driver, which calls
    ``backward_dw()`` at weight steps), each followed by an SGD step and ``zero_grad``; every
    other parameter with a tensor hook keeping the gradient it sees (where ``tensor_hooks``),
    every parameter with a post-accumulate-grad hook counting its calls. Returns, per step,
    the losses, the chunk-1 inputs' gradients, the parameters' gradients and the hook counts;
    the kept gradients by parameter; and the final parameters."""
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05)
    kept: list[list[torch.Tensor]] = [[] for _ in params]
    calls = [0] * len(params)
    handles = []
    for index, param in enumerate(params):
        if tensor_hooks and index % 2 == 0:
            handles.append(param.register_hook(kept[index].append))
        handles.append(param.register_post_accumulate_grad_hook(
            lambda _, index=index: calls.__setitem__(index, calls[index] + 1)))  # fmt: skip
    steps: list[Any] = []

    def loss(out: torch.Tensor, m: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, targets[m])

    for step in range(2):
        result = run_order(order, per_chunk, lookup, list(data[step]), loss)
        steps.append((result.losses, result.input_grads, [p.grad.clone() for p in params],
                      list(calls)))  # fmt: skip
        optimizer.step()
        optimizer.zero_grad(set_to_none=to_none)
    for handle in handles:
        handle.remove()
    return steps, kept, [p.detach() for p in params]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schedule=st.sampled_from(_PIPELINING_SCHEDULES),
    pp_size=st.sampled_from([2, 4]),
    rounds=st.sampled_from([1, 2]),
    rank_seed=st.integers(0, 3),
    layers_seed=st.integers(0, 8),
    options=st.sampled_from([
        {}, {"fuse_grad_accumulation": True}, {"share_buffers": False},
        {"fuse_grad_accumulation": True, "accumulator_hooks": "python"},
        {"retain_graph_in_backward": True},
    ]),
    tensor_hooks=st.booleans(),
    to_none=st.booleans(),
)
def test_torch_pipelining_schedules_train_as_eager(
    schedule: type, pp_size: int, rounds: int, rank_seed: int, layers_seed: int,
    options: dict[str, Any], tensor_hooks: bool, to_none: bool,
) -> None:  # fmt: skip
    """The orders torch's schedule classes run on one rank (weight steps of the zero-bubble
    ones included), graphed layer by layer, train as eager bitwise: losses, input and
    parameter gradients, gradients a parameter's tensor hook keeps, the post-accumulate-grad
    hooks' counts per parameter (once per parameter per backward; their order within a layer
    is autograd's, concepts.md), parameters."""
    stages = 1 if schedule.__name__ in ("Schedule1F1B", "ScheduleGPipe") else 2
    microbatches = pp_size * rounds * (2 if schedule.__name__ == "ScheduleDualPipeV" else 1)
    order = from_pipelining(schedule, pp_size, microbatches, rank_seed % pp_size, stages)
    split = any(entry != int(entry) for entry in order)
    # Weight steps need one layer per chunk; other orders get 1-3 per chunk.
    per_chunk = [1 if split else 1 + (layers_seed + c) % 3 for c in range(stages)]
    tensor_hooks = tensor_hooks and not options.get("fuse_grad_accumulation")  # refused there
    layout = Layout(tuple(per_chunk), microbatches)
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(layers_seed)
        eager = [Block(WIDTH) for _ in range(sum(per_chunk))]
        samples = tuple((torch.randn(4, WIDTH, requires_grad=True),)
                        for _ in range(layout.num_graphs))  # fmt: skip
        data = [torch.randn(microbatches, 4, WIDTH) for _ in range(2)]
        targets = [torch.randn(4, WIDTH) for _ in range(microbatches)]
    layers = copy.deepcopy(eager)
    graphed = leangraph.make_graphed_callables(
        tuple(layers), samples, order=order, num_layers_per_chunk=per_chunk, **options
    )
    want = _train_schedule(order, per_chunk, lambda c, m, l: eager[layout.callable_index(c, l)],
                           eager, data, targets, tensor_hooks, to_none)  # fmt: skip
    got = _train_schedule(order, per_chunk, lambda c, m, l: graphed[layout.graph_index(c, m, l)],
                          layers, data, targets, tensor_hooks, to_none)  # fmt: skip
    (want_steps, want_kept, want_params), (got_steps, got_kept, got_params) = want, got
    for step, (wanted, gotten) in enumerate(zip(want_steps, got_steps)):
        for name, a, b in zip(("losses", "input grads", "grads"), wanted, gotten):
            _assert_bitwise((step, name), a, b)
        assert wanted[3] == gotten[3], (step, "post-accumulate-grad hook calls")
    for index, (a, b) in enumerate(zip(want_kept, got_kept)):
        _assert_bitwise(("kept", index), a, b)
    _assert_bitwise("params", want_params, got_params)
    leangraph.reset_all(graphed)


class _TwoStreams(torch.nn.Module):
    """A layer of two streams (hidden, residual) and a mask that every layer reads: ``kind``
    0 mixes both, 1 passes the residual through as an output itself, 2 draws dropout masks."""

    def __init__(self, kind: int) -> None:
        super().__init__()
        self.kind = kind
        self.mix = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.tanh(self.mix(hidden)) * mask
        if self.kind == 0:
            return z + residual, residual + self.out(z)
        if self.kind == 1:
            return self.out(z), residual
        dropped = torch.nn.functional.dropout(residual, 0.5)
        return torch.nn.functional.dropout(z, 0.3) + residual, self.out(dropped)


def _train_streams(
    order: list[int], per_chunk: int, lookup: Lookup, layers: list[torch.nn.Module],
    data: list[list[tuple[torch.Tensor, torch.Tensor]]], mask: torch.Tensor, to_none: bool,
) -> tuple[Any, ...]:  # fmt: skip
    """Two steps of ``order`` through two-stream layers (a chunk's backward hands both of its
    outputs their gradients), from the same generator state; every stream between two layers
    of a chunk has a tensor hook keeping its gradient (by step, chunk, microbatch, layer and
    stream: two streams' hooks may fire in either order). Returns the kept gradients, per
    step the chunk inputs' and parameters' gradients, and the parameters."""
    chunks = len(layers) // per_chunk
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    kept: dict[tuple[int, ...], torch.Tensor] = {}
    steps: list[Any] = []
    torch.manual_seed(7)  # the dropout masks: eager's and the replays' draw the same ones
    for step in range(2):
        started, finished = [0] * chunks, [0] * chunks
        inputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        for entry in order:
            c = abs(entry) - 1
            if entry > 0:
                m, started[c] = started[c], started[c] + 1
                source = data[step][m] if c == 0 else outputs[(c - 1, m)]
                streams = inputs[(c, m)] = tuple(t.detach().clone().requires_grad_()
                                                 for t in source)  # fmt: skip
                for layer in range(per_chunk):
                    streams = lookup(c, m, layer)(*streams, mask)
                    for index, tensor in enumerate(streams if layer < per_chunk - 1 else ()):
                        key = (step, c, m, layer, index)
                        tensor.register_hook(lambda g, key=key: kept.__setitem__(key, g))
                outputs[(c, m)] = streams
            else:
                m, finished[c] = finished[c], finished[c] + 1
                hidden, residual = outputs.pop((c, m))
                if c == chunks - 1:
                    (hidden.square().sum() + (residual * hidden).sum()).backward()
                else:
                    grads = [t.grad for t in inputs[(c + 1, m)]]
                    torch.autograd.backward([hidden, residual], grads)
        steps.append(([t.grad for key in sorted(inputs) for t in inputs[key]],
                      [p.grad.clone() for p in params]))  # fmt: skip
        optimizer.step()
        optimizer.zero_grad(set_to_none=to_none)
    return kept, steps, [p.detach() for p in params]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pp_size=st.sampled_from([2, 4]),
    vp_size=st.sampled_from([1, 2]),
    rank_seed=st.integers(0, 3),
    per_chunk=st.sampled_from([1, 2, 3]),
    kinds_seed=st.integers(0, 80),
    options=st.sampled_from([
        {}, {"fuse_grad_accumulation": True}, {"share_buffers": False},
        {"overlap_grad_accumulation": True}, {"retain_graph_in_backward": True},
    ]),
    to_none=st.booleans(),
)
def test_two_stream_layers_with_a_shared_mask_and_dropout_train_as_eager(
    pp_size: int, vp_size: int, rank_seed: int, per_chunk: int, kinds_seed: int,
    options: dict[str, Any], to_none: bool,
) -> None:  # fmt: skip
    """A chunk's layers of two inputs and two outputs (one of them, for some layers, an
    input passed through; a layer of several outputs feeds the next through its static
    inputs, copied, not chained), a mask every graph reads, dropout: the gradients kept
    between layers, the chunk inputs' and parameters' gradients and the parameters are
    eager's, bitwise."""
    microbatches, rank = pp_size, rank_seed % pp_size
    order = (
        interleaved_1f1b(pp_size, vp_size, rank, microbatches)
        if vp_size > 1
        else one_f_one_b(pp_size, rank, microbatches)
    )
    kinds = [(kinds_seed // 3**i) % 3 for i in range(vp_size * per_chunk)]
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(kinds_seed)
        eager = [_TwoStreams(kind) for kind in kinds]
        mask = (torch.rand(2, WIDTH) > 0.3).float()
        samples = tuple(
            (torch.randn(2, WIDTH, requires_grad=True), torch.randn(2, WIDTH, requires_grad=True),
             mask)
            for _ in range(vp_size * microbatches * per_chunk)
        )  # fmt: skip
        data = [[(torch.randn(2, WIDTH), torch.randn(2, WIDTH)) for _ in range(microbatches)]
                for _ in range(2)]  # fmt: skip
    layers = copy.deepcopy(eager)
    graphed = leangraph.make_graphed_callables(
        tuple(layers), samples, order=order, num_layers_per_chunk=per_chunk, **options
    )
    want = _train_streams(order, per_chunk, lambda c, m, l: eager[c * per_chunk + l], eager,
                          data, mask, to_none)  # fmt: skip
    got = _train_streams(
        order, per_chunk, lambda c, m, l: graphed[(c * microbatches + m) * per_chunk + l],
        layers, data, mask, to_none,
    )  # fmt: skip
    (want_kept, want_steps, want_params), (got_kept, got_steps, got_params) = want, got
    assert want_kept.keys() == got_kept.keys()
    for key, gradient in want_kept.items():
        assert torch.equal(gradient, got_kept[key]), ("kept", key)
    for step, (wanted, gotten) in enumerate(zip(want_steps, got_steps)):
        for name, a, b in zip(("input grads", "grads"), wanted, gotten):
            _assert_bitwise((step, name), a, b)
    _assert_bitwise("params", want_params, got_params)
    leangraph.reset_all(graphed)
