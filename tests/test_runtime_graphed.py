"""Graphed training equals eager autograd; lifecycle; replay argument checks (CPU backend)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import leangraph
from helpers import three_graphs
from models import Block


def test_module_drop_in_matches_eager_and_falls_back_in_eval():
    torch.manual_seed(0)
    block = Block(8)
    reference = copy.deepcopy(block)
    graphed = leangraph.make_graphed_callables(block, (torch.randn(4, 8, requires_grad=True),))
    assert graphed is block and isinstance(block.forward, leangraph.GraphedCallable)
    for _ in range(3):
        x = torch.randn(4, 8, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        out, ref = graphed(x), reference(x_ref)
        out.square().sum().backward()
        ref.square().sum().backward()
        assert torch.equal(out, ref) and torch.equal(x.grad, x_ref.grad)
    for p, q in zip(block.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    block.eval()
    x = torch.randn(2, 3, 8)  # a shape the graph never saw: eval runs eagerly
    assert torch.equal(graphed(x), reference(x))


def test_reset_is_terminal_isolated_and_idempotent():
    torch.manual_seed(0)
    reference, graphed = three_graphs()
    middle = graphed[1].forward
    middle.reset()
    middle.reset()
    assert middle.is_reset and not graphed[0].forward.is_reset
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"callable 1 \(Block\): cannot call: .* was reset"):
        graphed[1](x)
    for index in (0, 2):  # the others keep replaying correctly
        assert torch.equal(graphed[index](x), reference[index](x))
    leangraph.reset_all(graphed)
    leangraph.reset_all(graphed)
    assert all(g.forward.is_reset for g in graphed)


def test_backward_reaching_a_reset_callable_raises():
    _, graphed = three_graphs()
    out = graphed[2](graphed[1](graphed[0](torch.randn(2, 4, requires_grad=True))))
    graphed[1].forward.reset()
    with pytest.raises(RuntimeError, match=r"callable 1 \(Block\): cannot run a backward"):
        out.sum().backward()


def test_graphed_callables_cannot_be_copied():
    _, graphed = three_graphs()
    with pytest.raises(TypeError, match=r"callable 0 \(Block\): a graphed callable cannot be copied"):
        copy.deepcopy(graphed[0])


def test_reset_releases_graph_state():
    _, graphed = three_graphs()
    callable_ = graphed[0].forward
    inputs = [weakref.ref(t) for t in callable_.static_tensors() if t.requires_grad]
    assert inputs and all(ref() is not None for ref in inputs)
    callable_.reset()
    assert callable_.static_tensors() == [] and all(ref() is None for ref in inputs)
    assert leangraph.memory_report(graphed[0]).static_bytes == 0


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("with_hooks", [False, True])
def test_reset_all_frees_modules_by_reference_counting_alone(ordered, with_hooks):
    """No reference cycle outlives reset_all: a module's forward is its graphed callable, so
    anything the callable still held (its function, capture-time hooks, samples) would keep the
    module, its parameters and gradients alive until the cycle collector happened to run."""
    layers = tuple(Block(8) for _ in range(3))
    microbatches = 2 if ordered else 1
    samples = tuple((torch.randn(2, 8, requires_grad=True),) for _ in range(3 * microbatches))
    order = dict(order=[1, 1, -1, -1], num_layers_per_chunk=3) if ordered else {}
    hooks = [{"forward": [lambda *args: None]}] * 3 if with_hooks else None
    alive = [weakref.ref(layer) for layer in layers] + [weakref.ref(layers[0].up.weight)]
    gc.disable()
    try:
        graphed = leangraph.make_graphed_callables(
            layers, samples, capture_time_hooks=hooks, **order
        )
        alive += [weakref.ref(g) for g in graphed]
        graphed[2](graphed[1](graphed[0](samples[0][0]))).sum().backward()
        leangraph.reset_all(graphed)
        del graphed, layers
        assert [ref() is None for ref in alive] == [True] * len(alive)
    finally:
        gc.enable()


def test_replay_while_outputs_await_backward_raises():
    _, graphed = three_graphs()
    x = torch.randn(2, 4, requires_grad=True)
    first = graphed[0](x)
    with pytest.raises(RuntimeError, match=r"callable 0 \(Block\): forward replayed while the "
                                           r"outputs of its previous replay \(1\) still await"):
        graphed[0](x)
    first.sum().backward()
    graphed[0](x).sum().backward()  # fine once the backward ran


def test_replay_while_only_a_derived_tensor_awaits_backward_raises():
    _, graphed = three_graphs()
    x = torch.randn(2, 4, requires_grad=True)
    loss = graphed[0](x).sum()  # the output tensor itself is gone, its autograd node is not
    with pytest.raises(RuntimeError, match="still await their backward"):
        graphed[0](x)
    loss.backward()
    graphed[0](x).sum().backward()


def test_backward_after_a_newer_replay_raises():
    # retain_graph_in_backward allows replays with a backward outstanding; the backward of
    # an older replay still cannot run against the newer replay's activations.
    torch.manual_seed(0)
    graphed = leangraph.make_graphed_callables(
        (Block(4),), ((torch.randn(2, 4, requires_grad=True),),), retain_graph_in_backward=True
    )
    x = torch.randn(2, 4, requires_grad=True)
    loss = graphed[0](x).sum()
    graphed[0](x).sum().backward()
    with pytest.raises(RuntimeError, match="replayed again since"):
        loss.backward()


