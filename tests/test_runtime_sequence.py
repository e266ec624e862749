"""Replay order (``leangraph.runtime.sequence``): graphs replay in the order they were captured;
a forward or backward out of that order is refused naming the graph and the replay that must
come next, steps that can no longer come are passed over, and a pass abandoned midway may start
over (CPU backend)."""

from __future__ import annotations

import copy

import torch
from helpers import blocks, graphed_blocks, mgc, raises, sample

from leangraph.cli.local_pipeline import run_order
from leangraph.order import Layout


def test_r12_replays_follow_the_capture_order():
    layers = blocks(1)
    graphed = mgc(layers, tuple((sample(),) for _ in range(2)), order=[1, 1, -1, -1])
    with raises(
        RuntimeError,
        "graph (chunk 1, microbatch 1, layer 0): forward replayed out of capture order",
        "the next replay must be the forward of graph (chunk 1, microbatch 0, layer 0)",
    ):
        graphed[1](sample())  # microbatch 1 before microbatch 0
    first, second = graphed[0](sample()), graphed[1](sample())
    with raises(RuntimeError, "graph (chunk 1, microbatch 1, layer 0): backward replayed out of",
                "must be the backward of graph (chunk 1, microbatch 0, layer 0)"):
        second.sum().backward()  # the order runs microbatch 0's backward first
    first.sum().backward()
    second.sum().backward()
    unordered = graphed_blocks(2)
    with raises(RuntimeError, "callable 1 (Block): forward replayed out of capture order",
                "must be the forward of callable 0 (Block)"):
        unordered[1](sample())


def test_r12_steps_that_cannot_come_are_passed_over():
    layers = blocks(1)
    graphed = mgc(layers, tuple((sample(),) for _ in range(2)), order=[1, 1, -1, -1])
    with torch.no_grad():  # no backward can come for either
        graphed[0](sample())
        graphed[1](sample())
    graphed[0](sample())  # outputs dropped: its backward is passed over
    out = graphed[1](sample())
    out.sum().backward()
    graphed[1].reset()  # a reset graph's steps are passed over too
    graphed[0](sample()).sum().backward()
    graphed[0](sample()).sum().backward()


def test_r12_a_pass_abandoned_midway_may_start_over():
    graphed = mgc(blocks(1), tuple((sample(),) for _ in range(2)), order=[1, 1, -1, -1])
    graphed[0](sample())  # the pass is abandoned: output dropped, nothing in flight
    graphed[0](sample())  # so it may start over
    second = graphed[1](sample())  # microbatch 0's output dropped again; 1's is in flight
    with raises(RuntimeError, "graph (chunk 1, microbatch 0, layer 0): forward replayed out of",
                "must be the backward of graph (chunk 1, microbatch 1, layer 0)"):
        graphed[0](sample())
    second.sum().backward()
    graphed[0](sample())  # a new pass: forward, then its output dropped


def test_r12_an_abandoned_zero_bubble_pass_drains_its_due_weight_steps_and_starts_over():
    """``[1, -1, 1, -1, -1.5, -1.5]`` abandoned after microbatch 0's backward: its weight step
    is due, and holds the activations a new forward would overwrite. With nothing else in
    flight it may run now, out of order; then the pass starts over, and the later weight
    step's position is passed over."""
    graphed = mgc(blocks(1), tuple((sample(),) for _ in range(2)), order=[1, -1, 1, -1, -1.5, -1.5])
    graphed[0](sample()).sum().backward()  # then abandoned: microbatch 1 never comes
    with raises(RuntimeError, "forward replayed while the weight step of replay 1 has not run"):
        graphed[0](sample())
    graphed[0].backward_dw()  # drained
    for _ in range(2):  # a whole new pass, twice: the drained step no longer waits anywhere
        graphed[0](sample()).sum().backward()
        graphed[1](sample()).sum().backward()
        graphed[0].backward_dw()
        graphed[1].backward_dw()


def test_r12_a_pass_abandoned_with_a_reset_graphs_weight_step_due_may_start_over():
    """Abandoned after chunk 2's first backward, whose weight step is due: once that graph is
    reset its weight step can no longer come, so a new pass starts over (an eager layer in
    the reset graph's place) instead of waiting for it forever, and trains as eager."""
    order = [1, 2, 1, -2, 2, -1, -2.5, -2, -1.5, -1, -2.5, -1.5]
    layers = blocks(2)
    reference = copy.deepcopy(layers)
    graphed = mgc(layers, tuple((sample(),) for _ in range(4)), order=order)
    layout = Layout((1, 1), 2)
    hidden = graphed[layout.graph_index(1, 0, 0)](sample())
    out = graphed[layout.graph_index(2, 0, 0)](hidden.detach().requires_grad_())
    pending = graphed[layout.graph_index(1, 1, 0)](sample())
    out.sum().backward()  # then abandoned: its weight step is due
    del hidden, out, pending
    graphed[layout.graph_index(2, 0, 0)].reset()
    for layer in layers:
        layer.zero_grad()
    inputs = [sample() for _ in range(2)]

    def lookup(chunk, microbatch, layer):
        if (chunk, microbatch) == (2, 0):
            return layers[1]  # the reset graph's layer, eagerly
        return graphed[layout.graph_index(chunk, microbatch, layer)]

    for _ in range(2):  # a whole new pass, twice
        run_order(order, [1, 1], lookup, inputs, lambda y, m: y.square().sum())
        run_order(order, [1, 1], lambda c, m, l: reference[c - 1], inputs,
                  lambda y, m: y.square().sum())
    for layer, twin in zip(layers, reference):
        for p, q in zip(layer.parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad)


def test_r12_a_weight_step_may_not_run_early_while_another_forward_awaits_its_backward():
    graphed = mgc(blocks(1), tuple((sample(),) for _ in range(2)), order=[1, -1, 1, -1, -1.5, -1.5])
    graphed[0](sample()).sum().backward()
    pending = graphed[1](sample())  # in flight: microbatch 0's weight step must wait its turn
    with raises(RuntimeError, "graph (chunk 1, microbatch 0, layer 0): weight step replayed out "
                "of capture order", "must be the backward of graph (chunk 1, microbatch 1"):
        graphed[0].backward_dw()
    pending.sum().backward()
    graphed[0].backward_dw()
    graphed[1].backward_dw()


def _eager_grads(layer, inputs):
    for x in inputs:
        layer(x).sum().backward()
    return [p.grad for p in layer.parameters()]


def test_r12_a_refused_backward_keeps_its_place_in_the_order():
    """A backward refused by a check of its own (R14 here) has not run: the order still waits
    for it, so the next forward may not overwrite its activations, and once the cause is gone
    the same backward runs and trains as eager's."""
    layers = blocks(1)
    eager = copy.deepcopy(layers[0])
    graphed = mgc(layers, tuple((sample(),) for _ in range(2)), order=[1, -1, 1, -1],
                  fuse_grad_accumulation=True)
    inputs = [sample() for _ in range(2)]
    loss = graphed[0](inputs[0]).sum()
    hook = layers[0].up.weight.register_hook(lambda grad: grad)
    with raises(RuntimeError, "parameter 'up.weight' got a tensor hook"):
        loss.backward()
    with raises(RuntimeError, "graph (chunk 1, microbatch 1, layer 0): forward replayed out of",
                "must be the backward of graph (chunk 1, microbatch 0, layer 0)"):
        graphed[1](inputs[1])
    hook.remove()
    loss.backward()
    graphed[1](inputs[1]).sum().backward()
    for got, want in zip(layers[0].parameters(), _eager_grads(eager, inputs)):
        assert torch.equal(got.grad, want)


def test_r12_a_refused_weight_step_keeps_its_place_in_the_order():
    """A weight step refused by a check of its own (R14 here) has not run: it stays due, and
    runs once the cause is gone; every microbatch's weight gradient is added once, as eager's."""
    layers = blocks(1)
    eager = copy.deepcopy(layers[0])
    graphed = mgc(layers, tuple((sample(),) for _ in range(2)), order=[1, -1, 1, -1, -1.5, -1.5],
                  fuse_grad_accumulation=True)
    inputs = [sample() for _ in range(2)]
    graphed[0](inputs[0]).sum().backward()
    graphed[1](inputs[1]).sum().backward()
    hook = layers[0].up.weight.register_hook(lambda grad: grad)
    with raises(RuntimeError, "parameter 'up.weight' got a tensor hook"):
        graphed[0].backward_dw()
    hook.remove()
    with raises(RuntimeError, "graph (chunk 1, microbatch 1, layer 0): weight step replayed out of",
                "must be the weight step of graph (chunk 1, microbatch 0, layer 0)"):
        graphed[1].backward_dw()
    graphed[0].backward_dw()
    graphed[1].backward_dw()
    for got, want in zip(layers[0].parameters(), _eager_grads(eager, inputs)):
        assert torch.equal(got.grad, want)
    graphed[0](inputs[0]).sum().backward()  # the next pass starts as usual


def test_r12_due_weight_steps_run_in_capture_order_even_when_drained():
    """Weight step 1 was captured after weight step 0 freed its activations, so replayed
    first it could overwrite them (the CPU backend reuses that memory as CUDA's pool does):
    refused, in a full pass and in an abandoned one drained before a new pass; in capture
    order every weight gradient is eager's."""
    layers = blocks(1)
    eager = copy.deepcopy(layers[0])
    order = [1, -1, 1, -1, -1.5, -1.5]
    graphed = mgc(layers, tuple((sample(),) for _ in range(2)), order=order)
    inputs = [sample() for _ in range(2)]
    for _ in range(2):
        graphed[0](inputs[0]).sum().backward()
        graphed[1](inputs[1]).sum().backward()
        with raises(RuntimeError, "graph (chunk 1, microbatch 1, layer 0): weight step replayed "
                    "out of capture order", "must be the weight step of graph (chunk 1, "
                    "microbatch 0, layer 0)"):
            graphed[1].backward_dw()
        graphed[0].backward_dw()
        graphed[1].backward_dw()
    for got, want in zip(layers[0].parameters(), _eager_grads(eager, inputs * 2)):
        assert torch.equal(got.grad, want)
    graphed = mgc(blocks(1), tuple((sample(),) for _ in range(3)),
                  order=[1, -1, 1, -1, 1, -1, -1.5, -1.5, -1.5])
    graphed[0](sample()).sum().backward()
    graphed[1](sample()).sum().backward()  # abandoned: microbatch 2 never comes
    with raises(RuntimeError, "graph (chunk 1, microbatch 1, layer 0): weight step replayed out",
                "must be the forward of graph (chunk 1, microbatch 2, layer 0)"):
        graphed[1].backward_dw()
    graphed[0].backward_dw()  # drained in capture order
    graphed[1].backward_dw()
    graphed[0](sample()).sum().backward()  # a new pass


def test_r12_the_usual_ways_out_of_order_say_what_went_wrong():
    graphed = mgc(blocks(1), tuple((sample(),) for _ in range(2)), order=[1, 1, -1, -1])
    outputs = [graphed[m](sample()) for m in range(2)]
    with raises(RuntimeError, "microbatch 1, layer 0): backward replayed out of capture order",
                "summed losses runs their backwards newest first", "leangraph.order.Step"):
        sum(o.sum() for o in outputs).backward()  # autograd runs microbatch 1's first
    del outputs
    graphed = mgc(blocks(1), tuple((sample(),) for _ in range(3)), order=[1, 1, -1, 1, -1, -1])
    first, second = graphed[0](sample()), graphed[1](sample())  # a step of 2 microbatches
    first.sum().backward()
    with raises(RuntimeError, "graph (chunk 1, microbatch 1, layer 0): backward replayed out",
                "every pass runs every step of the order, for all the microbatches"):
        second.sum().backward()


class ModeScaled(torch.nn.Module):
    """A linear whose output scale depends on the training mode: its eval forward computes
    differently from the training graphs, as a dropout's or batch norm's would (deterministic,
    so the test compares with eager bitwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * (2.0 if self.training else 0.5)


def test_a_module_run_eagerly_in_another_mode_lets_the_others_replay_as_in_eager():
    """A drop-in module put in eval mode (to freeze its dropout, say) runs its eager forward;
    its graphs sit that pass out, and the other modules' replays do not wait for them (they
    were refused as out of capture order). Each step puts another module in eval mode, the
    first, a middle and the last, then none; every output and gradient is eager's."""
    torch.manual_seed(0)
    layers = tuple(ModeScaled() for _ in range(3))
    eager = copy.deepcopy(layers)
    graphed = mgc(layers, tuple((sample(),) for _ in layers))
    optimizers = [
        torch.optim.SGD([p for m in ms for p in m.parameters()], lr=0.1) for ms in (layers, eager)
    ]
    for frozen in (0, 1, 2, None, 1):
        for index, (module, twin) in enumerate(zip(layers, eager)):
            module.train(index != frozen)
            twin.train(index != frozen)
        x = sample()
        x_ref = x.detach().clone().requires_grad_()
        out, ref = x, x_ref
        for module, twin in zip(graphed, eager):
            out, ref = module(out), twin(ref)
            assert torch.equal(out, ref), frozen
        grad = torch.randn_like(out)
        out.backward(grad)
        ref.backward(grad)
        assert torch.equal(x.grad, x_ref.grad), frozen
        for module, twin in zip(layers, eager):
            for p, q in zip(module.parameters(), twin.parameters()):
                assert torch.equal(p.grad, q.grad), frozen
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def test_a_callable_collected_inside_a_replay_check_is_dropped_without_a_deadlock():
    # The garbage collector may free a callable (its __del__ drops its graph) while another
    # callable's replay is inside the sequence's check, on the same thread: an allocation
    # there collected a cycle. Here the check's own `awaits` query stands in for that
    # allocation. The drop must neither block on the held lock nor be lost: graph 1, reset
    # with its backward outstanding, no longer keeps a new pass from starting.
    import threading

    from leangraph.order import StepKind
    from leangraph.runtime.sequence import ReplaySequence

    forward, backward = StepKind.FORWARD, StepKind.BACKWARD
    collected = []

    def awaits(graph):
        if graph == 1 and not collected:
            collected.append(graph)
            sequence.drop(graph)  # what GraphedCallable.__del__ -> _release does
        return True

    steps = [(0, forward), (0, backward), (1, forward), (1, backward)]
    sequence = ReplaySequence(steps, ["g0", "g1"], awaits)
    for graph, kind in steps[:3]:
        sequence.expect(graph, kind)
    errors = []

    def new_pass():
        try:
            sequence.expect(0, forward)
        except Exception as error:  # reported below, on the test's thread
            errors.append(error)

    thread = threading.Thread(target=new_pass, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the drop deadlocked on the sequence's lock"
    assert collected == [1] and errors == []
    sequence.expect(0, backward)  # the new pass goes on; graph 1's steps are passed over
    sequence.expect(0, forward)
