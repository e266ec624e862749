"""``overlap_grad_accumulation=True`` (CPU backend): each graphed callable holds its
parameters' accumulator nodes, made under a side stream (there is none on the CPU), so training
is eager's bitwise and every hook fires as without the option; misuse is refused before
warm-up. (``test_runtime_grads.py`` runs its several-microbatch and tied-weight cases with
the option too.) ``test_cuda_overlap.py`` runs it on a GPU, where the additions move to that stream."""

from __future__ import annotations

import pytest
import torch
from helpers import one_graph, raises
from models import Block, assert_histories_equal, backward_through_stacks, train_both
from test_runtime_accumulation import ZB

import leangraph
from leangraph import GraphResetError

ORDER = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]


def _by_step(logs):
    return [sorted(step) for step in logs]


def _layers(logs):
    """Per step, the layer of each hook in firing order."""
    return [[layer for layer, _ in step] for step in logs]


@pytest.mark.parametrize("set_to_none", [True, False, lambda step: step % 2 == 0],
                         ids=["none", "zeros", "alternating"])
def test_an_interleaved_order_trains_bitwise_as_eager_with_the_same_hooks(set_to_none):
    logs: dict[str, list] = {}
    history, graphed = train_both(ORDER, [2, 2], width=8, microbatches=3, steps=3,
                                  set_to_none=set_to_none, hook_logs=logs,
                                  overlap_grad_accumulation=True)
    assert_histories_equal(history, exact=True)
    # Once per parameter per microbatch, as eager, a layer's right after its backward (as
    # without the option, within a layer in the order autograd picks among equals).
    assert _by_step(logs["graphed"]) == _by_step(logs["eager"])
    assert _layers(logs["graphed"]) == _layers(logs["eager"])
    assert all(len(step) == 4 * 6 * 3 for step in logs["eager"])
    leangraph.reset_all(graphed)


def test_a_drop_in_module_accumulates_bitwise_over_replays_and_steps():
    torch.manual_seed(0)
    (eager,), (graphed,) = one_graph(overlap_grad_accumulation=True)
    module = graphed
    for step in range(3):
        for _ in range(3):
            x = torch.randn(2, 4, requires_grad=True)
            y = x.detach().clone().requires_grad_()
            graphed(x).square().sum().backward()
            eager(y).square().sum().backward()
            assert torch.equal(x.grad, y.grad)
        for a, b in zip(module.parameters(), eager.parameters()):
            assert torch.equal(a.grad, b.grad), step
        module.zero_grad(set_to_none=step % 2 == 0)
        eager.zero_grad(set_to_none=step % 2 == 0)


def test_without_grad_mode_a_replay_runs_as_eager_and_a_frozen_parameter_gets_none():
    torch.manual_seed(0)
    (eager,), (graphed,) = one_graph(overlap_grad_accumulation=True)
    module = graphed
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(graphed(x), eager(x))
    module.norm.weight.requires_grad_(False)
    eager.norm.weight.requires_grad_(False)
    graphed(x).sum().backward()
    eager(x).sum().backward()
    assert module.norm.weight.grad is None and eager.norm.weight.grad is None
    for a, b in zip(module.parameters(), eager.parameters()):
        if b.grad is not None:
            assert torch.equal(a.grad, b.grad)


def test_a_reset_between_the_replay_and_its_backward_is_refused():
    module = Block(8)
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), overlap_grad_accumulation=True)
    out = graphed(torch.randn(4, 8, requires_grad=True))
    module.forward.reset()
    with raises(GraphResetError, "this graphed callable was reset"):
        out.sum().backward()


def test_v25_misuse_is_refused_before_warm_up():
    module = Block(8)
    sample = (torch.randn(4, 8, requires_grad=True),)
    with raises(ValueError, "overlap_grad_accumulation=True", "fuse_grad_accumulation=True",
                "choose one"):
        leangraph.make_graphed_callables(module, sample, overlap_grad_accumulation=True,
                                         fuse_grad_accumulation=True)
    with raises(TypeError, "overlap_grad_accumulation must be a bool, got str 'yes'"):
        leangraph.make_graphed_callables(module, sample, overlap_grad_accumulation="yes")
    layers = tuple(Block(8) for _ in range(2))
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(4))
    with raises(ValueError, "needs an order without weight steps"):
        leangraph.make_graphed_callables(layers, samples, order=ZB, num_layers_per_chunk=1,
                                         overlap_grad_accumulation=True)
    assert "forward" not in module.__dict__  # nothing was graphed


def test_the_callables_hold_their_parameters_accumulators_until_reset():
    module = Block(8)
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), overlap_grad_accumulation=True)

    def node(param):
        return param.view_as(param).grad_fn.next_functions[0][0]

    def tagged():  # a node's metadata lives as long as the node
        return [bool(node(p).metadata.get("seen")) for p in module.parameters()]

    for p in module.parameters():
        node(p).metadata["seen"] = True  # the test keeps no reference
    assert all(tagged())  # the graphed callable holds them (eager's would be gone)
    graphed(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert all(tagged())  # a replay's backward ran through the same nodes
    module.forward.reset()
    assert not any(tagged())  # released: each parameter's node is made anew


def _param_grad_storages(layer) -> set[int]:
    """Where the backward graph of a graphed layer writes its parameters' gradients."""
    record = layer.forward._record
    trained = len(list(layer.parameters()))
    return {g.untyped_storage().data_ptr() for g in record.static_grads[-trained:]}


@pytest.mark.parametrize("overlap", [False, True])
def test_the_next_backward_graph_never_writes_the_parameter_gradients_still_being_added(overlap):
    """Equal layers sharing buffers write their parameter gradients into the same blocks; with
    the additions on a side stream the next backward graph (replayed while they may still
    read) gets other blocks, the one after reuses them: two sets, whatever the depth."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(6)]
    samples = tuple((torch.randn(2, 8, requires_grad=True),) for _ in layers)
    leangraph.make_graphed_callables(tuple(layers), samples, overlap_grad_accumulation=overlap)
    backward_order = [_param_grad_storages(layer) for layer in reversed(layers)]
    if overlap:
        for this, after in zip(backward_order, backward_order[1:]):
            assert not this & after
        assert len(set().union(*backward_order)) == 2 * len(backward_order[0])
    else:  # the default's additions run between the graphs: one set serves all
        assert len(set().union(*backward_order)) == len(backward_order[0])
    eager = [torch.nn.Linear(8, 8) for _ in layers]
    for a, b in zip(eager, layers):
        a.load_state_dict(b.state_dict())
    for _ in range(2):
        backward_through_stacks((layers, eager), torch.randn(2, 8))
    leangraph.reset_all(layers)


def test_a_backward_after_another_than_its_capture_predecessor_waits_for_all_additions():
    """The fence's order (CUDA waits on it; the decision itself is plain bookkeeping): a
    backward replayed right after the one captured before it waits only for what came before
    that one; after any other (a step passed over, a repeat) it must wait for everything."""
    from leangraph.runtime.overlap import BackwardNeighbours

    neighbours = BackwardNeighbours([3, 2, 1, 0])
    seen = []
    for graph in [3, 2, 1, 0, 3, 2, 0, 0, 3, 1]:
        seen.append(neighbours.follows_its_predecessor(graph))
        neighbours.ran(graph)
    assert seen == [True, True, True, True, True, True, False, False, True, False]
