"""The zero-bubble weight step (``leangraph.runtime.weight``): ``backward_dw()`` replays the
weight-gradient graph and accumulates into ``.grad`` as autograd would (a fresh tensor while
None, else added in place); misuse raises (CPU backend)."""

from __future__ import annotations

import copy

import pytest
import torch
from models import Block, TwoOutputs

import leangraph


def _zb_graphs():
    """One layer, one microbatch: forward, input-gradient backward, weight step."""
    torch.manual_seed(0)
    layers = (Block(8),)
    samples = ((torch.randn(4, 8, requires_grad=True),),)
    return layers, leangraph.make_graphed_callables(layers, samples, order=[1, -1, -1.5])


def test_input_grads_come_before_the_weight_step():
    layers, graphed = _zb_graphs()
    x = torch.randn(4, 8, requires_grad=True)
    out = graphed[0](x)  # chunk 1, microbatch 0
    out.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is None for p in layers[0].parameters())
    graphed[0].backward_dw()
    assert all(p.grad is not None for p in layers[0].parameters())
    reference = Block(8)
    reference.load_state_dict(layers[0].state_dict())
    y = x.detach().clone().requires_grad_()
    reference(y).square().sum().backward()
    assert torch.equal(x.grad, y.grad)
    for p, q in zip(layers[0].parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_backward_dw_misuse_raises():
    _, graphed = _zb_graphs()
    with pytest.raises(RuntimeError, match=r"graph \(chunk 1, microbatch 0, layer 0\): "
                                           r"backward_dw\(\) called with no backward awaiting"):
        graphed[0].backward_dw()
    x = torch.randn(4, 8, requires_grad=True)
    graphed[0](x).sum().backward()
    with pytest.raises(RuntimeError, match="forward replayed while the weight step of replay 1"):
        graphed[0](x)
    graphed[0].backward_dw()
    graphed[0](x).sum().backward()
    graphed[0].reset()
    with pytest.raises(leangraph.GraphResetError, match="cannot run its weight step"):
        graphed[0].backward_dw()
    assert graphed[0].is_reset and graphed[0].static_tensors() == []


def test_backward_dw_needs_a_split_order():
    torch.manual_seed(0)
    graphed = leangraph.make_graphed_callables(
        (Block(8),), ((torch.randn(4, 8, requires_grad=True),),), order=[1, -1])
    with pytest.raises(RuntimeError, match=r"backward_dw\(\) needs an order with -\(c \+ 0.5\)"):
        graphed[0].backward_dw()


class Scale(torch.nn.Module):
    """No parameters: a split backward with nothing for the weight step to do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_split_backward_without_parameters_or_input_grads():
    torch.manual_seed(0)
    layers = (Scale(), Block(8))
    samples = ((torch.randn(4, 8, requires_grad=True),), (torch.randn(4, 8),))
    # Chunk 1 has no parameters (nothing for its weight step); chunk 2's input does not
    # require grad (nothing for its input-gradient step).
    graphed = leangraph.make_graphed_callables(layers, samples, order=[1, 2, -2, -1, -2.5, -1.5])
    x, y = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    scaled = graphed[0](x)
    out = graphed[1](y)
    out.square().sum().backward()
    scaled.sum().backward()
    assert torch.equal(x.grad, torch.full((4, 8), 2.0))
    assert all(p.grad is None for p in layers[1].parameters())
    graphed[1].backward_dw()
    graphed[0].backward_dw()
    reference = Block(8)
    reference.load_state_dict(layers[1].state_dict())
    reference(y).square().sum().backward()
    for p, q in zip(layers[1].parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def _one_layer(**kwargs):
    """One Block, two microbatches, each weight step right after its backward; and an eager twin."""
    torch.manual_seed(0)
    layer = Block(8)
    twin = Block(8)
    twin.load_state_dict(layer.state_dict())
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(2))
    graphed = leangraph.make_graphed_callables(
        (layer,), samples, order=[1, -1, -1.5, 1, -1, -1.5], **kwargs
    )
    return layer, twin, graphed


def _step(graph, layer_input):
    graph(layer_input).square().sum().backward()
    graph.backward_dw()


def test_a_grad_that_is_none_becomes_a_fresh_tensor():
    layer, twin, graphed = _one_layer()
    x = torch.randn(4, 8, requires_grad=True)
    _step(graphed[0], x)
    twin(x.detach()).square().sum().backward()
    first = [(p.grad, p.grad.clone()) for p in layer.parameters()]
    for p, q in zip(layer.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
        p.grad = None
    _step(graphed[0], torch.randn(4, 8, requires_grad=True))  # the same weight graph again
    for (grad, value), p in zip(first, layer.parameters()):
        assert torch.equal(grad, value), "a .grad aliased the weight graph's gradient buffer"
        assert p.grad is not grad


def test_an_existing_grad_is_added_to_in_place():
    layer, twin, graphed = _one_layer()
    for p, q in zip(layer.parameters(), twin.parameters()):
        p.grad, q.grad = torch.full_like(p, 0.5), torch.full_like(q, 0.5)
    held = [p.grad for p in layer.parameters()]
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(2)]
    for graph, x in zip(graphed, xs):  # both microbatches' weight steps add to it
        _step(graph, x)
        twin(x.detach()).square().sum().backward()
    for p, q, grad in zip(layer.parameters(), twin.parameters(), held):
        assert p.grad is grad
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("keep", ["tensor-hook", "accumulator-hook", "accumulator-prehook"])
def test_gradients_a_hook_keeps_at_the_weight_step_are_eagers_after_later_replays(keep):
    """The weight step hands autograd tensors over its gradient buffers where ``.grad``
    exists. A tensor hook on a parameter sees what is handed and may keep it: a copy. One a
    hook on an accumulator kept is moved onto a copy once the step's pass ends. Each keeps
    eager's values after the later weight steps write the buffers again (before, every
    kept gradient was the last step's)."""
    layer, twin, graphed = _one_layer()
    kept: dict[str, dict[tuple[int, int], torch.Tensor]] = {"graphed": {}, "eager": {}}
    nodes = []  # kept alive, as DDP keeps them: else the hooks are lost with them
    step = [0]
    for key, module in (("graphed", layer), ("eager", twin)):
        for index, p in enumerate(module.parameters()):
            p.grad = torch.zeros_like(p)

            def store(seen, key=key, index=index):
                kept[key][step[0], index] = seen

            if keep == "tensor-hook":
                p.register_hook(store)
                continue
            node = p.view_as(p).grad_fn.next_functions[0][0]
            nodes.append(node)
            if keep == "accumulator-hook":
                node.register_hook(lambda _, seen, store=store: store(seen[0]))
            else:
                node.register_prehook(lambda seen, store=store: store(seen[0]))
    for step[0] in range(4):
        x = torch.randn(4, 8, requires_grad=True)
        _step(graphed[step[0] % 2], x)
        twin(x.detach()).square().sum().backward()
    assert kept["graphed"].keys() == kept["eager"].keys() and len(kept["eager"]) == 4 * 6
    for where, want in kept["eager"].items():
        assert torch.equal(kept["graphed"][where], want), where
    for p, q in zip(layer.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_weight_step_runs_once_per_backward():
    _, _, graphed = _one_layer()
    graphed[0](torch.randn(4, 8, requires_grad=True)).sum().backward()
    graphed[0].backward_dw()
    with pytest.raises(RuntimeError, match=r"graph \(chunk 1, microbatch 0, layer 0\): "
                                           r"backward_dw\(\) called with no backward awaiting"):
        graphed[0].backward_dw()


@pytest.mark.parametrize("fuse", [False, True], ids=["autograd", "fused"])
def test_l3_a_split_backward_runs_once_per_forward_replay_even_when_retained(fuse):
    # Eager's two backwards through one forward add two weight gradients; a split backward's
    # weight step replays one, so the second backward (or one after the weight step) would
    # lose its weight gradients: refused, also with retain_graph_in_backward=True.
    torch.manual_seed(0)
    layers = (Block(8),)
    (graph,) = leangraph.make_graphed_callables(
        layers, ((torch.randn(4, 8, requires_grad=True),),), order=[1, -1, -1.5],
        retain_graph_in_backward=True, fuse_grad_accumulation=fuse)
    reference = copy.deepcopy(layers[0])
    x = torch.randn(4, 8)
    loss = graph(x.clone().requires_grad_()).square().sum()
    loss.backward(retain_graph=True)
    for weight_step_first in (False, True):
        if weight_step_first:
            graph.backward_dw()
        with pytest.raises(RuntimeError, match=(
                r"graph \(chunk 1, microbatch 0, layer 0\): second backward through forward "
                r"replay 1: .*weight step \(backward_dw\(\)\)")):
            loss.backward(retain_graph=True)
    reference(x).square().sum().backward()
    for p, q in zip(layers[0].parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)  # one backward's, as eager's one backward
    y = graph(torch.randn(4, 8, requires_grad=True))  # the next pass replays as usual
    y.sum().backward()
    graph.backward_dw()
    leangraph.reset_all((graph,))


def test_a_weight_step_is_due_per_graph():
    # Both microbatches in flight, weight steps last: microbatch 1's replay is free while
    # microbatch 0's weight step is pending; microbatch 0's own next replay is not.
    torch.manual_seed(0)
    layer = Block(8)
    twin = Block(8)
    twin.load_state_dict(layer.state_dict())
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(2))
    graphed = leangraph.make_graphed_callables(
        (layer,), samples, order=[1, 1, -1, -1, -1.5, -1.5]
    )
    x0, x1 = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    out0, out1 = graphed[0](x0), graphed[1](x1)
    out0.square().sum().backward()
    out1.square().sum().backward()
    with pytest.raises(RuntimeError, match="forward replayed while the weight step of replay 1"):
        graphed[0](x0)
    graphed[0].backward_dw()
    graphed[1].backward_dw()
    for x in (x0, x1):
        twin(x.detach()).square().sum().backward()
    for p, q in zip(layer.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("fuse", [False, True], ids=["autograd", "fused"])
def test_the_weight_step_leaves_what_only_an_output_without_gradient_reaches_without_one(fuse):
    """As eager's weight step: ``head`` gets no gradient (None, not zeros) when the loss
    leaves ``head(y)`` out, so an optimizer skips it."""
    torch.manual_seed(0)
    eager = TwoOutputs()
    module = copy.deepcopy(eager)
    graphed = leangraph.make_graphed_callables(
        (module,), tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(2)),
        order=[1, 1, -1, -1.5, -1, -1.5], fuse_grad_accumulation=fuse)
    inputs = [torch.randn(4, 8) for _ in range(2)]
    outputs = [graphed[m](x) for m, x in enumerate(inputs)]
    for m, (y, h) in enumerate(outputs):
        (y.sum() + (h.sum() if m == 1 else 0)).backward()
        graphed[m].backward_dw()
        y, h = eager(inputs[m])
        (y.sum() + (h.sum() if m == 1 else 0)).backward()
        for (name, a), b in zip(module.named_parameters(), eager.parameters()):
            assert (a.grad is None) == (b.grad is None), (m, name)
            assert b.grad is None or torch.equal(a.grad, b.grad), (m, name)
    assert module.head.weight.grad is not None  # microbatch 1's loss used the head
    leangraph.reset_all(graphed)
