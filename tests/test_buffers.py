"""Schedule-driven buffer reuse: the buffer plan and its effect (CPU backend)."""

from __future__ import annotations

import copy

import pytest
import torch
from models import Block, assert_histories_equal, train_both

import leangraph
from leangraph.buffers import BufferKey, Chained, plan_buffers
from leangraph.order import parse_order
from leangraph.plan import build_plan
from leangraph.schedules import interleaved_1f1b

KEY = BufferKey((4, 8), torch.float32, torch.device("cpu"), True)


def _buffer_plan(order, layers_per_chunk, chain=True):
    layout, steps = parse_order(order, num_callables=sum(layers_per_chunk),
                                num_samples=sum(layers_per_chunk) * order.count(1),
                                num_layers_per_chunk=list(layers_per_chunk))
    plan = build_plan(layout, steps)
    n = layout.num_graphs
    return plan, plan_buffers(plan, [[KEY]] * n, [[KEY]] * n, chainable=[chain] * n)


def _overlaps(a, b):
    return not (a[1] < b[0] or b[1] < a[0])


@pytest.mark.parametrize("microbatches", [4, 8, 16])
def test_no_two_overlapping_lifetimes_share_a_slot(microbatches):
    order = interleaved_1f1b(4, 2, 0, microbatches)
    _, buffers = _buffer_plan(order, (2, 2), chain=False)
    for slot in range(len(buffers.slot_keys)):
        users = buffers.slot_users(slot)
        for i, a in enumerate(users):
            for b in users[i + 1:]:
                assert not _overlaps(buffers.lifetimes[a], buffers.lifetimes[b]), (slot, a, b)


def test_buffer_count_is_flat_in_microbatches_for_the_interleaved_order():
    counts = []
    for microbatches in (8, 16, 32, 64):
        plan, buffers = _buffer_plan(interleaved_1f1b(4, 2, 0, microbatches), (2, 2))
        counts.append((len(buffers.slot_keys), len(buffers.seed_keys)))
        # Only layer 0 of each chunk needs a slot; layer 1 is chained to layer 0's output.
        assert all(isinstance(buffers.inputs[g][0], Chained) == (plan.layout.graph_id(g).layer > 0)
                   for g in range(plan.layout.num_graphs))
    assert counts == [counts[0]] * 4
    # In flight at most: the slots equal the plan's peak of live chunk inputs.
    assert counts[0] == (plan.max_live(plan.capture) // 2, 1)


def test_without_sharing_every_graph_gets_its_own_buffers():
    layout, steps = parse_order([1, -1, 1, -1], num_callables=1, num_samples=2)
    plan = build_plan(layout, steps)
    shared = plan_buffers(plan, [[KEY]] * 2, [[KEY]] * 2, chainable=[True] * 2)
    private = plan_buffers(plan, [[KEY]] * 2, [[KEY]] * 2, chainable=[True] * 2, share=False)
    assert shared.inputs == ((0,), (0,)) and len(shared.seed_keys) == 1
    assert private.inputs == ((0,), (1,)) and len(private.seed_keys) == 2


def test_shared_buffers_keep_training_exact_for_a_long_interleaved_order():
    order = interleaved_1f1b(2, 2, 0, 8)
    history, graphed = train_both(order, [2, 2], width=8, microbatches=8, steps=2)
    assert_histories_equal(history, exact=True)
    # Layer 0 of each chunk and microbatch takes an input slot (layer 1 is chained to its
    # output): the 16 such graphs share far fewer slots than there are graphs.
    first_layers = [g for g in graphed if g.graph_id.layer == 0]
    # Their static tensors are input slots (which require grad, as the samples do) and
    # gradient seeds (which never do).
    slots = {t.data_ptr() for g in first_layers for t in g.static_tensors() if t.requires_grad}
    assert len(first_layers) == 16 and 0 < len(slots) <= 8, len(slots)


def test_outputs_are_valid_until_backward_without_debug_mode():
    torch.manual_seed(0)
    layers = tuple(Block(8) for _ in range(2))
    reference = copy.deepcopy(layers)
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(4))
    graphed = leangraph.make_graphed_callables(layers, samples, order=[1, -1, 1, -1])
    x0, x1 = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    first = graphed[1](graphed[0](x0))
    # Valid until its backward: the output is microbatch 0's own result.
    assert torch.equal(first, reference[1](reference[0](x0)))
    first.sum().backward()
    second = graphed[3](graphed[2](x1))
    assert torch.equal(second, reference[1](reference[0](x1)))
    second.sum().backward()
    # Microbatch 1's graphs were given microbatch 0's released buffers (on the CPU backend's
    # emulated pool, as on CUDA's): the old output's memory now holds their results.
    assert not torch.equal(first, reference[1](reference[0](x0)))




@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_chain_after_a_frozen_layer_trains_like_eager(microbatches):
    # Layer 0 trains nothing and its input needs no gradient, so its output needs none: the
    # chained input of layer 1 must not require grad either (it did, and the backward replay
    # handed autograd an input gradient where the first parameter's belonged).
    torch.manual_seed(0)
    layers = (Block(8), Block(8))
    layers[0].requires_grad_(False)
    reference = copy.deepcopy(layers)
    order = [1] * microbatches + [-1] * microbatches
    samples = tuple((torch.randn(4, 8),) for _ in range(2 * microbatches))
    graphed = leangraph.make_graphed_callables(layers, samples, order=order,
                                               num_layers_per_chunk=2)
    inputs = [torch.randn(4, 8) for _ in range(microbatches)]
    for run, pick in ((graphed, lambda m, l: graphed[2 * m + l]),
                      (reference, lambda m, l: reference[l])):
        outputs = [pick(m, 1)(pick(m, 0)(x)) for m, x in enumerate(inputs)]
        for output in outputs:
            output.square().sum().backward()
    assert all(p.grad is None for p in layers[0].parameters())
    for got, want in zip(layers[1].parameters(), reference[1].parameters()):
        assert torch.equal(got.grad, want.grad)


def test_a_dense_non_contiguous_sample_keeps_its_layout_in_the_static_input():
    """A transposed sample: kernels chosen for its layout may round differently from a
    contiguous copy's, so the static input keeps it and the replay equals eager bitwise."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 5)
    eager = copy.deepcopy(layer)
    graphed = leangraph.make_graphed_callables(layer, (torch.randn(8, 6).t().requires_grad_(),))
    (static,) = graphed.forward.static_tensors()[:1]
    assert static.stride() == (1, 6)
    x = torch.randn(8, 6).t().requires_grad_()
    x_eager = x.detach().clone().t().t().requires_grad_()  # the same layout, its own leaf
    assert x_eager.stride() == x.stride()
    out, want = graphed(x), eager(x_eager)
    assert torch.equal(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    assert torch.equal(layer.weight.grad, eager.weight.grad) and torch.equal(x.grad, x_eager.grad)


class _SeenGradLayout(torch.autograd.Function):
    """Identity that notes the layout of the gradient its backward receives."""

    seen: list[tuple[int, ...]] = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _SeenGradLayout.seen.append(tuple(grad.stride()))
        return grad


class _TransposedOut(torch.nn.Module):
    """Returns a transposed (dense, non-contiguous) output, as LAPACK's results are."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x):
        return _SeenGradLayout.apply(self.linear(x).t())


def test_a_transposed_output_gets_its_gradient_seed_in_its_layout():
    """The seed a backward graph reads the output gradient from has the output's layout, as
    eager's backward reads it (torch's tool allocates it with ``empty_like``): a contiguous
    seed would run the layer's backward kernels on another layout than eager's."""
    torch.manual_seed(0)
    layer = _TransposedOut()
    eager = copy.deepcopy(layer)
    _SeenGradLayout.seen.clear()
    copy.deepcopy(eager)(torch.randn(4, 6, requires_grad=True)).square().sum().backward()
    assert _SeenGradLayout.seen == [(1, 6)]  # eager's gradient keeps the output's layout
    _SeenGradLayout.seen.clear()
    graphed = leangraph.make_graphed_callables(layer, (torch.randn(4, 6, requires_grad=True),))
    # The backward graph was captured reading the seed: the layout it saw is the seed's.
    assert _SeenGradLayout.seen and set(_SeenGradLayout.seen) == {(1, 6)}, _SeenGradLayout.seen
    for _ in range(2):
        x = torch.randn(4, 6, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        out, want = graphed(x), eager(x_eager)
        assert out.stride() == want.stride() and torch.equal(out, want)
        out.square().sum().backward()
        want.square().sum().backward()
        assert torch.equal(x.grad, x_eager.grad)
    for got, want in zip(layer.parameters(), eager.parameters()):
        assert torch.equal(got.grad, want.grad)


def test_an_expanded_sample_gets_a_contiguous_static_input():
    key = BufferKey.of(torch.randn(1, 4).expand(3, 4), keep_layout=True)
    assert key.stride is None and BufferKey.of(torch.randn(4, 3).t(), keep_layout=True).stride == (1, 3)
