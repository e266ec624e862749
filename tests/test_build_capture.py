"""Capture (``leangraph.build.capture``): graphs are recorded in exactly the plan's capture
sequence, each on the static buffers the buffer plan gives it, chained layers reading the
previous layer's output buffer itself (CPU backend, observed from inside the callables and
through ``GraphedCallable.static_tensors()``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers import raises
from models import Block

import leangraph
from leangraph._call import validate_call
from leangraph.buffers import BufferKey, plan_buffers
from leangraph.schedules import interleaved_1f1b

mgc = leangraph.make_graphed_callables


class _Logged(torch.autograd.Function):
    """Identity whose backward logs ``B<tag>``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: list[str], tag: int) -> torch.Tensor:
        ctx.log, ctx.tag = log, tag
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.log.append(f"B{ctx.tag}")
        return grad, None, None


class Tagged(torch.nn.Module):
    """``x * w``, logging ``F<tag>`` at its forward and ``B<tag>`` at its backward, where the
    tag is the input's row count less one: graph ``g``'s sample has ``g + 1`` rows, and capture
    runs each graph on static inputs of its sample's shape (a shape, not a value: capture
    cannot read tensor values on the host, W8)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log
        self.weight = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tag = x.shape[0] - 1
        self.log.append(f"F{tag}")
        return _Logged.apply(x * self.weight, self.log, tag)


def _capture_log(count: int, graphs: int, **kwargs: Any) -> list[str]:
    """The callables' log with ``| <step>`` after every step, warm-up skipped."""
    log: list[str] = []
    samples = tuple((torch.ones(g + 1, 3, requires_grad=True),) for g in range(graphs))
    mgc(tuple(Tagged(log) for _ in range(count)), samples, num_warmup_iters=0,
        progress=lambda event: log.append(f"| {event.step}"), **kwargs)
    return log


def _interleaved(calls: list[str], steps: list[str]) -> list[str]:
    return [entry for pair in zip(calls, steps) for entry in pair]


@pytest.mark.parametrize("share_buffers", [True, False])
def test_ordered_capture_records_the_plans_sequence(share_buffers):
    # Chunk 1 has layers 0 and 1, chunk 2 one layer; two microbatches. Graphs: chunk 1's
    # (m0 l0, m0 l1, m1 l0, m1 l1) = 0..3, chunk 2's (m0, m1) = 4, 5.
    log = _capture_log(3, 6, order=[1, 2, 1, -2, -1, 2, -2, -1], num_layers_per_chunk=[2, 1],
                       share_buffers=share_buffers)
    calls = ["F0", "F1", "F4", "F2", "F3", "B4", "B1", "B0", "F5", "B5", "B3", "B2"]
    steps = ["F c1 m0 l0", "F c1 m0 l1", "F c2 m0 l0", "F c1 m1 l0", "F c1 m1 l1",
             "B c2 m0 l0", "B c1 m0 l1", "B c1 m0 l0", "F c2 m1 l0", "B c2 m1 l0",
             "B c1 m1 l1", "B c1 m1 l0"]
    expected = _interleaved(calls, [f"| {s}" for s in steps])
    assert log[-len(expected):] == expected
    assert not any(e.startswith("|") for e in log[: -len(expected)])  # capture is the one pass


def test_unordered_capture_records_forwards_then_backwards_in_reverse():
    log = _capture_log(3, 3)
    calls = ["F0", "F1", "F2", "B2", "B1", "B0"]
    steps = ["F c1 m0 l0", "F c1 m0 l1", "F c1 m0 l2", "B c1 m0 l2", "B c1 m0 l1", "B c1 m0 l0"]
    expected = _interleaved(calls, [f"| {s}" for s in steps])
    assert log[-len(expected):] == expected


def test_weight_steps_are_recorded_where_the_order_puts_them():
    log = _capture_log(2, 2, order=[1, 2, -2, -1, -2.5, -1.5])
    # The weight step differentiates the same forward again (its parameters this time).
    calls = ["F0", "F1", "B1", "B0", "B1", "B0"]
    steps = ["F c1 m0 l0", "F c2 m0 l0", "B c2 m0 l0", "B c1 m0 l0", "W c2 m0 l0", "W c1 m0 l0"]
    expected = _interleaved(calls, [f"| {s}" for s in steps])
    assert log[-len(expected):] == expected


# ------------------------------------------------------------------------- static buffers


def _roles(graph: leangraph.GraphedCallable) -> tuple[set[int], set[int]]:
    """Data pointers of a graph's static inputs (they require grad, as the samples do) and of
    its gradient seeds (which never do)."""
    tensors = graph.static_tensors()
    return ({t.data_ptr() for t in tensors if t.requires_grad},
            {t.data_ptr() for t in tensors if not t.requires_grad})


def _one_layer(order, **kwargs):
    torch.manual_seed(0)
    samples = tuple((torch.randn(2, 4, requires_grad=True),) for _ in range(2))
    return samples, mgc((Block(4),), samples, order=order, **kwargs)


def test_one_microbatch_at_a_time_shares_the_input_slot_and_the_seed():
    samples, graphed = _one_layer([1, -1, 1, -1])
    (inputs0, seeds0), (inputs1, seeds1) = _roles(graphed[0]), _roles(graphed[1])
    assert len(inputs0) == len(seeds0) == 1
    assert inputs0 == inputs1 and seeds0 == seeds1
    # The samples are not the static inputs: they may be freed after the call.
    assert not {s.data_ptr() for (s,) in samples} & inputs0


def test_microbatches_in_flight_get_input_slots_of_their_own():
    _, graphed = _one_layer([1, 1, -1, -1])
    (inputs0, seeds0), (inputs1, seeds1) = _roles(graphed[0]), _roles(graphed[1])
    assert inputs0.isdisjoint(inputs1)
    assert seeds0 == seeds1  # a seed is read only during its backward


def test_without_sharing_the_samples_are_the_static_inputs():
    samples, graphed = _one_layer([1, -1, 1, -1], share_buffers=False)
    (inputs0, seeds0), (inputs1, seeds1) = _roles(graphed[0]), _roles(graphed[1])
    assert inputs0 == {samples[0][0].data_ptr()} and inputs1 == {samples[1][0].data_ptr()}
    assert seeds0.isdisjoint(seeds1)


def test_graphs_share_an_input_buffer_exactly_where_the_buffer_plan_says():
    order = interleaved_1f1b(2, 2, 0, 6)
    torch.manual_seed(0)
    layers = tuple(Block(4) for _ in range(2))
    samples = tuple((torch.randn(2, 4, requires_grad=True),) for _ in range(12))
    graphed = mgc(layers, samples, order=order)
    call = validate_call(layers, samples, None, order, None)
    keys = [[BufferKey.of(s)] for (s,) in samples]
    plan = plan_buffers(call.plan, keys, keys, chainable=call.chainable())
    inputs = [_roles(g)[0] for g in graphed]
    assert all(len(i) == 1 for i in inputs)
    pairs = [(a, b) for a in range(12) for b in range(a + 1, 12)]
    shared = {(a, b) for a, b in pairs if inputs[a] == inputs[b]}
    assert shared == {(a, b) for a, b in pairs if plan.inputs[a] == plan.inputs[b]}
    assert 0 < len(shared) < len(pairs)


# ------------------------------------------------------------------------- chained inputs


def _chain(widths_ok: bool = True):
    """Two chunks: three chained layers, then one; one microbatch."""
    torch.manual_seed(0)
    layers = tuple(Block(4) for _ in range(4))
    samples = [(torch.randn(2, 4, requires_grad=True),) for _ in range(4)]
    if not widths_ok:  # layer 2's sample differs from layer 1's output: it gets a slot
        samples[2] = (torch.randn(2, 4),)
    return mgc(layers, tuple(samples), order=[1, 2, -2, -1], num_layers_per_chunk=[3, 1])


def test_chained_layers_read_the_previous_output_buffer_and_own_no_input():
    graphed = _chain()
    inputs = [_roles(g)[0] for g in graphed]
    assert len(inputs[0]) == 1 and inputs[1] == set() and inputs[2] == set()
    assert len(inputs[3]) == 1  # a chunk's first layer is never chained
    hidden = graphed[1](graphed[0](torch.randn(2, 4, requires_grad=True)))
    with raises(ValueError, "graph (chunk 1, microbatch 0, layer 2) input 0 is the output buffer "
                            "of graph (chunk 1, microbatch 0, layer 1)"):
        graphed[2](hidden.detach().clone().requires_grad_())
    graphed[3](graphed[2](hidden)).sum().backward()  # the next chunk takes any tensor


def test_a_layer_whose_input_differs_from_the_previous_output_is_not_chained():
    graphed = _chain(widths_ok=False)
    assert _roles(graphed[1])[0] == set()
    owned = graphed[2].static_tensors()
    assert len(owned) == 2  # its own input (no grad, like its sample) and its seed
    hidden = graphed[1](graphed[0](torch.randn(2, 4, requires_grad=True)))
    graphed[3](graphed[2](hidden.detach())).sum().backward()  # any tensor of its key goes


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_chain_of_layers_whose_outputs_the_backward_saves_captures_and_trains(device):
    """Layers ending in a ReLU, chained (each takes the previous one's output buffer as its
    static input): the ReLU saves its output for the backward. Capture put the next layer's
    sample into that buffer with a versioned copy, so the previous layer's backward capture
    raised 'modified by an inplace operation' on CUDA."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).to(device)
              for _ in range(3)]
    eager = copy.deepcopy(layers)
    samples = tuple((torch.randn(4, 8, device=device, requires_grad=True),) for _ in range(6))
    order = [1, 1, -1, -1]  # one chunk of 3 layers, 2 microbatches
    graphed = leangraph.make_graphed_callables(tuple(layers), samples, order=order,
                                               num_layers_per_chunk=3)
    optimizers = [torch.optim.SGD([p for m in ms for p in m.parameters()], lr=0.1)
                  for ms in (layers, eager)]
    for step in range(3):
        for run, optimizer in ((lambda m, l: graphed[m * 3 + l], optimizers[0]),
                               (lambda m, l: eager[l], optimizers[1])):
            optimizer.zero_grad()
            torch.manual_seed(step)
            outs = []
            for microbatch in range(2):
                hidden = torch.randn(4, 8, device=device, requires_grad=True)
                for layer in range(3):
                    hidden = run(microbatch, layer)(hidden)
                outs.append(hidden)
            for out in outs:
                out.square().sum().backward()
            optimizer.step()
        for a, b in zip((p for m in layers for p in m.parameters()),
                        (p for m in eager for p in m.parameters())):
            assert torch.equal(a, b), step
    leangraph.reset_all(graphed)
