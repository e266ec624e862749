"""Gradient routing (``leangraph.runtime.grads``): what a backward replay hands autograd. Every
gradient autograd stores (a leaf input's ``.grad``, a parameter's ``.grad`` while None) is a
fresh tensor; a parameter gradient another graph of the same backward pass still adds to is a
copy; the rest are tensors over the static buffers, which earlier nodes consume at once, and
any kept past that (a hook's, ``torch.autograd.grad``'s) is moved onto a copy before a replay
writes over it (CPU backend)."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from helpers import one_graph, three_graphs
from models import Block, ThreeOutputs, assert_histories_equal, train_both

import leangraph
from leangraph.runtime.grads import NO_LEAVES, GradRouting, copies
from leangraph.runtime.pending import PendingBackwards

ORDER = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]


def _grads(modules):
    return [p.grad.clone() for m in modules for p in m.parameters()]


@pytest.mark.parametrize("overlap", [False, True], ids=["default", "overlap"])
def test_several_microbatches_in_one_backward_pass_accumulate_exactly(overlap):
    """GPipe with the microbatches' losses summed: one backward pass reaches a layer's
    parameters through every microbatch's graph, so autograd waits for all of them before
    accumulating, and a shared gradient buffer must not be overwritten meanwhile (also with
    the additions on a side stream, ``overlap_grad_accumulation``)."""
    torch.manual_seed(0)
    layers = tuple(Block(8) for _ in range(2))
    reference = copy.deepcopy(layers)
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(6))
    # One backward pass over the summed losses runs the microbatches' backwards newest
    # first (autograd runs the latest-made node first): the order must say so, with steps
    # that name their microbatch.
    forward, backward = leangraph.StepKind.FORWARD, leangraph.StepKind.BACKWARD
    order = [leangraph.Step(forward, 1, m) for m in range(3)]
    order += [leangraph.Step(backward, 1, m) for m in reversed(range(3))]
    graphed = leangraph.make_graphed_callables(
        layers, samples, order=order, num_layers_per_chunk=2, overlap_grad_accumulation=overlap
    )
    for _ in range(3):
        xs = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
        loss = sum((m + 1) * graphed[2 * m + 1](graphed[2 * m](x)).square().sum()
                   for m, x in enumerate(xs))
        loss.backward()
        sum((m + 1) * reference[1](reference[0](x.detach())).square().sum()
            for m, x in enumerate(xs)).backward()
        assert all(torch.equal(a, b) for a, b in zip(_grads(layers), _grads(reference)))


@pytest.mark.parametrize("overlap", [False, True], ids=["default", "overlap"])
def test_weights_tied_between_graphed_modules_accumulate_exactly(overlap):
    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    second.weight = first.weight
    ref_first, ref_second = copy.deepcopy((first, second))
    assert ref_second.weight is ref_first.weight
    graphed = leangraph.make_graphed_callables(
        (first, second), tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(2)),
        overlap_grad_accumulation=overlap,
    )
    for _ in range(3):
        x = torch.randn(4, 8, requires_grad=True)
        graphed[1](graphed[0](x)).square().sum().backward()
        ref_second(ref_first(x.detach())).square().sum().backward()
        assert torch.equal(first.weight.grad, ref_first.weight.grad)
        assert torch.equal(second.bias.grad, ref_second.bias.grad)


def test_one_microbatch_per_backward_pass_hands_autograd_the_buffers(monkeypatch):
    """The usual pipeline step differentiates one microbatch at a time: no other graph of a
    layer runs in that backward pass, so its parameter gradients need no copy."""
    seen: list[bool] = []
    original = PendingBackwards.reached_now

    def record(self, graphs):
        seen.append(original(self, graphs))
        return seen[-1]

    monkeypatch.setattr(PendingBackwards, "reached_now", record)
    history, _ = train_both(ORDER, [2, 2], width=8, microbatches=3, steps=2)
    assert_histories_equal(history, exact=True)
    assert seen and not any(seen)


def test_returned_parameter_grads_do_not_alias_static_buffers():
    # A .grad aliasing the backward graph's gradient buffer would be overwritten by the next
    # replay and then have that view added to itself: twice eager's gradient.
    reference, graphed = one_graph()
    for step in range(3):
        x = torch.randn(2, 4, requires_grad=True)
        graphed[0](x).sum().backward()
        reference[0](x.detach()).sum().backward()
        for param, ref in zip(graphed[0].parameters(), reference[0].parameters()):
            assert torch.equal(param.grad, ref.grad), step
            param.grad.zero_()  # zero_grad(set_to_none=False)
            ref.grad.zero_()


def test_leaf_input_grads_are_fresh_tensors():
    reference, graphed = one_graph()
    x1, x2 = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    graphed[0](x1).square().sum().backward()
    first = x1.grad.clone()
    graphed[0](x2).square().sum().backward()  # overwrites the graph's gradient buffers
    assert torch.equal(x1.grad, first)
    y = x1.detach().clone().requires_grad_()
    reference[0](y).square().sum().backward()
    assert torch.equal(x1.grad, y.grad)


def test_a_parameter_grad_set_to_none_gets_a_fresh_tensor_each_time():
    reference, graphed = one_graph()
    layer, twin = graphed[0], reference[0]
    kept = []
    for _ in range(2):
        x = torch.randn(2, 4, requires_grad=True)
        layer(x).square().sum().backward()
        twin(x.detach()).square().sum().backward()
        kept.append([(p.grad, p.grad.clone()) for p in layer.parameters()])
        for p, q in zip(layer.parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad)
            p.grad = q.grad = None  # zero_grad(set_to_none=True)
    for grad, value in kept[0]:  # the first step's gradients survived the second replay
        assert torch.equal(grad, value)
    assert all(a is not b for (a, _), (b, _) in zip(*kept))


def test_an_existing_parameter_grad_is_added_to_in_place():
    reference, graphed = one_graph()
    layer, twin = graphed[0], reference[0]
    for p, q in zip(layer.parameters(), twin.parameters()):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    held = [p.grad for p in layer.parameters()]
    x = torch.randn(2, 4, requires_grad=True)
    layer(x).square().sum().backward()
    twin(x.detach()).square().sum().backward()
    for p, q, grad in zip(layer.parameters(), twin.parameters(), held):
        assert p.grad is grad and torch.equal(p.grad, q.grad)


def test_gradients_reaching_earlier_graphs_are_exact():
    # Through three graphed callables in a row: each backward's input gradient is the next
    # (earlier) backward's incoming gradient.
    reference, graphed = three_graphs()
    x = torch.randn(2, 4, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    graphed[2](graphed[1](graphed[0](x))).square().sum().backward()
    reference[2](reference[1](reference[0](y))).square().sum().backward()
    assert torch.equal(x.grad, y.grad)
    for graphed_layer, twin in zip(graphed, reference):
        for p, q in zip(graphed_layer.parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad)


def test_copies_are_fresh_and_bit_exact():
    special = torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -3.5])
    tensors = [special, special.flip(0) * 2, torch.arange(4.0)]
    for batch in ([tensors[0]], tensors):  # one tensor, and several at once
        result = copies(batch)
        assert len(result) == len(batch)
        for copy_, original in zip(result, batch):
            assert copy_.data_ptr() != original.data_ptr()
            assert torch.equal(copy_.view(torch.int32), original.view(torch.int32))


def test_a_gradient_autograd_adds_at_once_is_a_static_buffer_and_one_flowing_on_a_copy():
    """Without buffer sharing each graph keeps its gradient buffers (``static_tensors()``), so
    where a gradient handed to autograd points says whether it is the buffer or a copy. A
    parameter's, once its ``.grad`` exists, is the buffer tensor itself (autograd adds it in
    at once and never adds into a tensor it does not hold alone). An input's that flows on
    into eager code is a copy: that code may keep it (next test)."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    graphed = leangraph.make_graphed_callables(
        (first, second), ((torch.randn(2, 4, requires_grad=True),),) * 2, share_buffers=False
    )
    buffers = [{t.data_ptr() for t in m.forward.static_tensors()} for m in graphed]
    # What autograd accumulates into first.weight, and what flows from graph 1 into graph 0.
    accumulate = first.weight.view_as(first.weight).grad_fn.next_functions[0][0]
    accumulated: list[int] = []
    accumulate.register_prehook(lambda grads: accumulated.append(grads[0].data_ptr()))
    for step in range(2):  # .grad None (autograd stores it: a copy), then set (added: the buffer)
        flowing: list[torch.Tensor] = []
        x = torch.randn(2, 4, requires_grad=True)
        hidden = graphed[0](x)
        hidden.register_hook(flowing.append)
        graphed[1](hidden).sum().backward()
        assert flowing and flowing[0].data_ptr() not in buffers[1]
        assert x.grad.data_ptr() not in buffers[0]  # a leaf's .grad: a copy
        assert (accumulated[step] in buffers[0]) == (step == 1), step


def _kept_input_grads(layer_of, keep):
    """Two microbatches through a graphed (or eager) layer whose input is a non-leaf, each
    input gradient kept by ``keep(hidden, loss)``, then an unrelated third backward."""
    torch.manual_seed(1)
    source = torch.randn(2, 4, requires_grad=True)
    prefix = torch.nn.Parameter(torch.randn(8))  # reaches the layer through a view
    kept = []
    for microbatch in range(3):
        hidden = source * (microbatch + 1) + prefix.view(2, 4)
        loss = layer_of()(hidden).square().sum()
        if microbatch < 2:
            kept.append(keep(hidden, loss))
        else:
            loss.backward()
    return kept, prefix.grad


@pytest.mark.parametrize("share_buffers", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_input_gradients_kept_outside_the_graphs_are_eagers(share_buffers, device):
    """A non-leaf input's gradient may be kept by the code it flows to: returned by
    ``torch.autograd.grad``, stored by a tensor hook, or taken (a view of it) by
    ``AccumulateGrad`` as the ``.grad`` of a parameter that reaches the layer through
    ``view``. Each must keep eager's values after later replays overwrite the buffers."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4).to(device)
    eager = copy.deepcopy(layer)
    with torch.device(device):
        graphed = leangraph.make_graphed_callables(
            layer, (torch.randn(2, 4, requires_grad=True),), share_buffers=share_buffers)

    def by_hook(hidden, loss):
        stored = []
        hidden.register_hook(stored.append)
        loss.backward()
        return stored[0]

    def by_grad(hidden, loss):
        return torch.autograd.grad(loss, hidden)[0]

    for keep in (by_hook, by_grad):
        with torch.device(device):
            got, got_prefix = _kept_input_grads(lambda: graphed, keep)
            want, want_prefix = _kept_input_grads(lambda: eager, keep)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), keep.__name__
        assert torch.equal(got_prefix, want_prefix), keep.__name__
    leangraph.reset_all(graphed)


def _kept_param_grads(model, keep, device):
    """Three steps through ``model`` (two blocks) with every ``.grad`` set, so the graphs
    lend their parameter gradients; ``keep`` stores the gradients Python is handed, by
    (step, parameter): returned by ``torch.autograd.grad``, or seen by a hook on each
    accumulator (in whatever order autograd runs them)."""
    kept, nodes = {}, []  # the nodes kept alive, as DDP keeps them: else hooks are lost
    step = 0

    def store(index, seen):
        kept[step, index] = seen[0]

    for index, p in enumerate(model.parameters()):
        p.grad = torch.zeros_like(p)
        if not keep.startswith("autograd.grad"):
            node = p.view_as(p).grad_fn.next_functions[0][0]
            nodes.append(node)
            if keep == "accumulator-hook":
                node.register_hook(lambda _, seen, i=index: store(i, seen))
            else:
                node.register_prehook(lambda seen, i=index: store(i, seen))
    torch.manual_seed(1)
    for step in range(3):
        x = torch.randn(2, 8, device=device, requires_grad=True)
        loss = model(x).square().sum() * (step + 1)
        if keep.startswith("autograd.grad"):
            grads = torch.autograd.grad(loss, list(model.parameters()))
            if keep == "autograd.grad-detached":  # other tensors over the memory returned
                grads = [g.detach() for g in grads]
            kept.update({(step, i): g for i, g in enumerate(grads)})
        else:
            loss.backward()
    return kept, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "keep", ["autograd.grad", "autograd.grad-detached", "accumulator-hook", "accumulator-prehook"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_parameter_gradients_python_keeps_are_eagers_after_later_replays(keep, device):
    """A lent parameter gradient (``.grad`` exists: autograd adds it in place) that Python
    keeps shares autograd's count of C++ references with the routing's: a hook on the
    accumulator may store it, and its count of Python references shows that.
    ``torch.autograd.grad`` returns it (no accumulator runs), and the caller may keep
    another tensor over its memory (``.detach()``), which no count of it shows: the replay
    sees the pass runs no accumulator and hands copies. Each keeps eager's values after the
    next replays write over the buffers (before, every step's kept gradients were the last
    step's)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(8), Block(8)).to(device)
    eager = copy.deepcopy(model)
    with torch.device(device):
        leangraph.make_graphed_callables(
            tuple(model), tuple((torch.randn(2, 8, requires_grad=True),) for _ in model))
    got, got_grads = _kept_param_grads(model, keep, device)
    want, want_grads = _kept_param_grads(eager, keep, device)
    assert got.keys() == want.keys() and len(got) == 3 * len(got_grads)
    for key in want:
        _assert_as_eager(got[key], want[key], device, key)
    for a, b in zip(got_grads, want_grads):
        _assert_as_eager(a, b, device)
    leangraph.reset_all(tuple(model))


@pytest.mark.parametrize("branch", ["none", "also-in-the-loss", "a-hook-replaces-it"])
def test_a_chained_layer_reads_the_next_layers_input_gradient_as_its_seed(branch):
    """Within a chunk, layer 0's seed is layer 1's input-gradient buffer: the gradient
    autograd hands layer 0's backward is that buffer itself (no copy). Where the output feeds
    something else too, autograd sums the gradients first (a new tensor, or that buffer
    updated in place), and a tensor hook may hand on another tensor; layer 0's backward
    copies what it gets then, and training stays eager's: bitwise, except where the output
    also feeds the loss. There eager's autograd adds that gradient to each of the contributions
    the layer's own uses of its input make, one at a time, while the graph has summed those
    already (as any per-layer graph does, torch's too): the same sum in another order."""
    torch.manual_seed(0)
    eager = [Block(8), Block(8)]
    layers = copy.deepcopy(eager)
    graphed = leangraph.make_graphed_callables(
        tuple(layers), ((torch.randn(4, 8, requires_grad=True),),) * 2, order=[1, -1],
        num_layers_per_chunk=2)
    flowing: list[int] = []  # where each gradient the hook sees lies (keeping none of them)
    same = torch.testing.assert_close if branch == "also-in-the-loss" else _bitwise
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        losses = []
        for lookup, is_graphed in ((eager, False), (graphed, True)):
            inp = x.clone().requires_grad_()
            hidden = lookup[0](inp)
            if is_graphed:
                hidden.register_hook(lambda grad: flowing.append(grad.data_ptr()))
            if branch == "a-hook-replaces-it":
                hidden.register_hook(lambda grad: grad.mul(2.0))
            out = lookup[1](hidden).square().sum()
            if branch == "also-in-the-loss":
                out = out + hidden.pow(3).sum()
            out.backward()
            losses.append((out.detach(), inp.grad))
        (eager_loss, eager_grad), (graphed_loss, graphed_grad) = losses
        assert torch.equal(eager_loss, graphed_loss)
        same(eager_grad, graphed_grad)
    for a, b in zip([p for m in eager for p in m.parameters()],
                    [p for m in layers for p in m.parameters()]):
        same(a.grad, b.grad)
    if branch == "none":
        seed = graphed[1]._record.static_grads[0]  # layer 1's input-gradient buffer
        assert flowing and all(pointer == seed.data_ptr() for pointer in flowing)
        assert graphed[0]._record.static_grad_outputs[0].data_ptr() == seed.data_ptr()
    leangraph.reset_all(graphed)


def _chained_input_grads_kept(first, second, keep, microbatches):
    """The gradients ``keep(hidden, x, loss)`` kept of the tensor between two chained layers,
    one per microbatch (``first[m]``, ``second[m]``: microbatch m's layers), read after every
    microbatch's backward ran: forwards of all, then backwards oldest first; and the inputs'."""
    gen = torch.Generator().manual_seed(3)
    device = torch.get_default_device()
    inputs = [
        torch.randn(4, 8, generator=gen, device="cpu").to(device).requires_grad_()
        for _ in range(microbatches)
    ]
    hidden, outputs = [], []
    for m, x in enumerate(inputs):
        hidden.append(first[m](x))
        outputs.append(second[m](hidden[-1]))
    kept = [
        keep(h, x, (out * (m + 1)).square().sum())
        for m, (x, h, out) in enumerate(zip(inputs, hidden, outputs))
    ]
    return kept, inputs


def _kept_by_hook(hidden, x, loss):
    stored = []
    hidden.register_hook(stored.append)
    loss.backward()
    return stored[0]


def _kept_by_grad(hidden, x, loss):
    # With respect to x too: a pass without the earlier layer's backward is out of the order.
    return torch.autograd.grad(loss, (hidden, x))[0]


@pytest.mark.parametrize(
    "keep", [_kept_by_hook, _kept_by_grad], ids=["tensor-hook", "autograd.grad"]
)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_gradient_kept_between_chained_layers_keeps_eagers_values(keep, device):
    """Between chained layers the gradient is lent uncopied as the previous layer's seed. A
    tensor hook on the tensor between them may store it, or ``torch.autograd.grad`` return
    it; the next microbatch's backward replays reuse that buffer, and what was kept must
    still hold eager's values then (it is moved onto a copy first), as the inputs' gradients
    must."""
    torch.manual_seed(0)
    microbatches = 3
    with torch.device(device):
        eager = [Block(8), Block(8)]
        layers = copy.deepcopy(eager)
        samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(2 * microbatches))
    graphed = leangraph.make_graphed_callables(
        tuple(layers), samples, order=[1] * microbatches + [-1] * microbatches,
        num_layers_per_chunk=2)  # fmt: skip
    with torch.device(device):
        want, want_inputs = _chained_input_grads_kept(
            [eager[0]] * microbatches, [eager[1]] * microbatches, keep, microbatches)
        got, got_inputs = _chained_input_grads_kept(
            graphed[0::2], graphed[1::2], keep, microbatches)
    for m, (a, b) in enumerate(zip(want, got)):
        _assert_as_eager(b, a, device, m)
    for m, (a, b) in enumerate(zip(want_inputs, got_inputs)):
        assert (a.grad is None) == (b.grad is None), m
        if a.grad is not None:
            _assert_as_eager(b.grad, a.grad, device, m)
    leangraph.reset_all(graphed)


class _TwoHeads(torch.nn.Module):
    """``(body(x), side(z))``: a loss on ``side`` alone leaves ``x`` and what feeds it out."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.side = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, z: torch.Tensor):
        return self.body(x), self.side(z)


@pytest.mark.parametrize("options", [{}, {"fuse_grad_accumulation": True}, {"order": [1, -1]}],
                         ids=["default", "fused", "ordered"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_layer_whose_only_output_gets_no_gradient_leaves_its_parameters_none(options, device):
    """Layer 1 hands layer 0's output no gradient (the loss uses only its ``side``): eager never
    reaches layer 0, so its ``.grad`` and the input's stay None and its hooks stay quiet.
    Autograd materialized zeros for layer 0's single output, whose replay then trained on
    them: zeros as ``.grad``, which weight decay or momentum would step on."""
    torch.manual_seed(0)
    eager = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), _TwoHeads()]
    layers = [copy.deepcopy(m).to(device) for m in eager]
    eager = [m.to(device) for m in eager]
    if "order" in options:
        options = {**options, "num_layers_per_chunk": 2}
    with torch.device(device):
        samples = ((torch.randn(4, 8, requires_grad=True),),
                   (torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)))
        graphed = leangraph.make_graphed_callables(tuple(layers), samples, **options)
    fired = []
    for p in layers[0].parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    for _ in range(2):
        x, z = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
        for first, second in ((eager[0], eager[1]), graphed):
            inp = x.clone().requires_grad_()
            _, side = second(first(inp), z.clone().requires_grad_())
            side.square().sum().backward()
            assert inp.grad is None
    assert fired == []
    for a, b in zip(layers[0].parameters(), eager[0].parameters()):
        assert a.grad is None and b.grad is None
    for a, b in zip(layers[1].side.parameters(), eager[1].side.parameters()):
        _assert_as_eager(a.grad, b.grad, device)
    leangraph.reset_all(graphed)


def _assert_as_eager(got: torch.Tensor, want: torch.Tensor, device: str, step: int = 0) -> None:
    """Bitwise on the CPU; on CUDA within float32 tolerance, as cuBLAS may choose other
    kernels for tiny matmuls under capture."""
    if device == "cpu":
        assert torch.equal(got, want), step
    else:
        torch.testing.assert_close(got, want, msg=f"step {step}")


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b), f"max diff {(a - b).abs().max()}"


# --------------------------------------------------------------------------------------------
# A non-leaf input that several graphs of one backward pass take: its node waits for all of
# their gradients, so none may be a buffer another replay of the pass overwrites first.
# --------------------------------------------------------------------------------------------


class _WithMemory(torch.nn.Module):
    """A layer with a second input every layer takes (a cross-attention memory, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) + memory)


def _source_grads(run, source: torch.Tensor, callables) -> torch.Tensor:
    source.grad = None
    run(callables)
    assert source.grad is not None
    return source.grad.clone()


@pytest.mark.parametrize("share_buffers", [True, False])
def test_two_drop_in_callables_taking_one_non_leaf_input_get_eager_gradients(share_buffers):
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    eager = (copy.deepcopy(first), copy.deepcopy(second))
    graphed = leangraph.make_graphed_callables(
        (first, second), ((torch.randn(3, 4, requires_grad=True),),) * 2,
        share_buffers=share_buffers)
    source = torch.randn(3, 4, requires_grad=True)

    def run(fns):
        hidden = source * 1.5  # not a leaf: its node gets both graphs' gradients
        (fns[0](hidden).sum() + 2 * fns[1](hidden).sum()).backward()

    assert torch.equal(_source_grads(run, source, graphed), _source_grads(run, source, eager))


def test_every_layer_taking_one_non_leaf_memory_in_1f1b_gets_eager_gradients():
    from leangraph.schedules import one_f_one_b

    torch.manual_seed(0)
    layers = (_WithMemory(), _WithMemory())
    eager = copy.deepcopy(layers)
    samples = tuple((torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True))
                    for _ in range(2 * 2))
    graphed = leangraph.make_graphed_callables(layers, samples, order=one_f_one_b(1, 0, 2),
                                               num_layers_per_chunk=2)
    source = torch.randn(4, 4, requires_grad=True)

    def run(layer_of):
        for microbatch in range(2):
            memory = source * (microbatch + 1)
            hidden = torch.randn(4, 4, generator=torch.Generator().manual_seed(microbatch))
            for layer in range(2):
                hidden = layer_of(microbatch, layer)(hidden, memory)
            hidden.sum().backward()

    graphed_grad = _source_grads(run, source, lambda m, l: graphed[m * 2 + l])
    assert torch.equal(graphed_grad, _source_grads(run, source, lambda m, l: eager[l]))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(
        (p for m in layers for p in m.parameters()), (p for m in eager for p in m.parameters())))


def test_gpipe_microbatches_taking_one_non_leaf_input_get_eager_gradients():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    eager = copy.deepcopy(layer)
    forward, backward = leangraph.StepKind.FORWARD, leangraph.StepKind.BACKWARD
    order = [leangraph.Step(forward, 1, m) for m in range(3)] + [
        leangraph.Step(backward, 1, m) for m in reversed(range(3))]
    graphed = leangraph.make_graphed_callables(
        (layer,), tuple((torch.randn(4, 4, requires_grad=True),) for _ in range(3)), order=order)
    source = torch.randn(4, 4, requires_grad=True)

    def run(layer_of):
        hidden = source * 1.0
        sum((m + 1) * layer_of(m)(hidden).sum() for m in range(3)).backward()

    assert torch.equal(_source_grads(run, source, lambda m: graphed[m]),
                       _source_grads(run, source, lambda m: eager))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("used", [(0,), (1,), (0, 2), (0, 1, 2)], ids=str)
def test_outputs_without_a_gradient_leave_what_only_they_reach_without_one(used, device):
    """Eager's backward gives no gradient (None, not zeros) to parameters and inputs that
    only outputs outside the loss reach: an optimizer skips them (AdamW's decay included)."""
    torch.manual_seed(0)
    module = ThreeOutputs().to(device)
    eager = copy.deepcopy(module)
    graphed = leangraph.make_graphed_callables(
        module, tuple(torch.randn(3, 4, device=device, requires_grad=True) for _ in range(2)))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (module, eager)]
    for step in range(3):
        x, z = (torch.randn(3, 4, device=device, requires_grad=True) for _ in range(2))
        xe, ze = (t.detach().clone().requires_grad_() for t in (x, z))
        for fn, inputs, optimizer in ((graphed, (x, z), optimizers[0]),
                                      (eager, (xe, ze), optimizers[1])):
            optimizer.zero_grad(set_to_none=True)
            outputs = fn(*inputs)
            sum(outputs[i].square().sum() for i in used).backward()
            optimizer.step()
        for (name, a), b in zip(module.named_parameters(), eager.parameters()):
            assert (a.grad is None) == (b.grad is None), (step, name)
            assert torch.equal(a, b), (step, name)
        assert (z.grad is None) == (ze.grad is None) and (x.grad is None) == (xe.grad is None)
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("tied", [False, True], ids=["same-layers", "tied-weight"])
def test_a_parameter_two_calls_train_in_one_backward_pass_gets_eagers_gradient(tied):
    """The same layers graphed by two calls (two sample shapes), or a weight tied between the
    layers of two calls, differentiated in one backward pass with `.grad` already there:
    autograd waits for the second call's gradient before it adds the first's, and the first
    call's next backward replay reuses the pool memory of that buffer meanwhile. The first
    call's graphs cannot know the second's peers, so such a parameter's gradient is handed as
    a copy: bitwise eager's, where the buffer was overwritten."""
    torch.manual_seed(0)
    first = [Block(8) for _ in range(2)]
    second = [Block(8) for _ in range(2)] if tied else first
    if tied:
        second[1].up.weight = first[1].up.weight
    eager_first = copy.deepcopy(first)
    eager_second = copy.deepcopy(second) if tied else eager_first
    if tied:
        eager_second[1].up.weight = eager_first[1].up.weight

    def samples(rows):
        return tuple((torch.randn(rows, 8, requires_grad=True),) for _ in range(2))

    graphs_a = leangraph.make_graphed_callables(tuple(first), samples(4), order=[1, -1],
                                                num_layers_per_chunk=2)
    graphs_b = leangraph.make_graphed_callables(tuple(second), samples(2), order=[1, -1],
                                                num_layers_per_chunk=2)
    modules = {id(m): m for m in (*first, *second, *eager_first, *eager_second)}
    for module in modules.values():
        for p in module.parameters():
            p.grad = torch.zeros_like(p)  # added into at once, unless autograd must wait
    for _ in range(2):
        xa, xb = torch.randn(4, 8), torch.randn(2, 8)
        (graphs_a[1](graphs_a[0](xa)).square().sum()
         + graphs_b[1](graphs_b[0](xb)).square().sum()).backward()
        (eager_first[1](eager_first[0](xa)).square().sum()
         + eager_second[1](eager_second[0](xb)).square().sum()).backward()
    got = [p.grad for m in (*first, *second) for p in m.parameters()]
    want = [p.grad for m in (*eager_first, *eager_second) for p in m.parameters()]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    leangraph.reset_all(graphs_a)
    leangraph.reset_all(graphs_b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("mode", [{}, {"overlap_grad_accumulation": True}],
                         ids=["default", "overlap"])
def test_a_tensor_hook_added_after_capture_keeps_eager_gradients_not_the_buffer(mode, device):
    """A parameter's ``register_hook`` hook sees the gradient autograd is handed; one that
    keeps it (gradient logging, say) holds eager's fresh gradient. Handed the static buffer
    (the parameter's ``.grad`` exists) it would hold memory the next replay overwrites."""
    torch.manual_seed(0)
    layer = Block(8).to(device)
    eager = copy.deepcopy(layer)
    graphed = leangraph.make_graphed_callables(
        layer, (torch.randn(4, 8, device=device, requires_grad=True),), **mode)
    kept: dict[str, list[torch.Tensor]] = {"graphed": [], "eager": []}
    for key, module in (("graphed", layer), ("eager", eager)):
        module.up.weight.register_hook(kept[key].append)
    for _ in range(3):
        x = torch.randn(4, 8, device=device)
        graphed(x).sum().backward()
        eager(x).sum().backward()
    assert len(kept["graphed"]) == len(kept["eager"]) == 3
    for step, (got, want) in enumerate(zip(kept["graphed"], kept["eager"])):
        _assert_as_eager(got, want, device, step)
    assert kept["graphed"][1].data_ptr() != kept["graphed"][2].data_ptr()


class _TiedToAnEagerUseBefore(torch.nn.Module):
    """Three layers, the last one's weight read eagerly before the first (an eager module
    tied to a graphed one): a backward pass reaches ``last.weight`` through the last graph
    first and through the eager use last, after the other graphs replayed."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.middle, self.last = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.last.weight.t()
        return self.last(torch.tanh(self.middle(torch.tanh(self.first(h)))))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("mode", [{}, {"overlap_grad_accumulation": True}],
                         ids=["default", "overlap"])
def test_a_weight_also_used_eagerly_earlier_in_the_pass_gets_eagers_gradient(mode, device):
    """Autograd adds the last graph's gradient of ``last.weight`` only once the eager use's
    arrives, after the two other graphs replayed; their gradient buffers share memory with
    the last one's (same shapes), so the gradient it waits with was overwritten (``.grad``
    off by the middle layer's weight gradient from the second step on). The next replay now
    moves a lent gradient autograd has not added onto a copy first."""
    torch.manual_seed(0)
    model = _TiedToAnEagerUseBefore().to(device)
    eager = copy.deepcopy(model)
    layers = (model.first, model.middle, model.last)
    leangraph.make_graphed_callables(
        layers, tuple((torch.randn(4, 16, device=device, requires_grad=True),) for _ in layers),
        **mode)
    for step in range(4):
        x = torch.randn(4, 16, device=device)
        for net in (model, eager):
            net(x).square().sum().backward()
        for (name, got), want in zip(model.named_parameters(), eager.parameters()):
            assert torch.equal(got.grad, want.grad), (step, name)
        if step == 1:
            model.zero_grad(set_to_none=False)
            eager.zero_grad(set_to_none=False)
    leangraph.reset_all(layers)


def test_passes_of_autograd_grad_between_backwards_leave_the_lent_gradients_alone(monkeypatch):
    """``torch.autograd.grad`` with respect to the input runs no accumulator: the parameter
    gradients the replays lent are dropped unread, so the next replay finds ``.grad``
    unmoved but nothing holding them, and copies nothing; the backwards still train as
    eager's."""
    moved: list[int] = []
    original = GradRouting._settle

    def settle(self, positions):
        before = self._grads
        original(self, positions)
        moved.extend(i for i in positions if self._grads[i] is not before[i])

    monkeypatch.setattr(GradRouting, "_settle", settle)
    torch.manual_seed(0)
    layers = tuple(torch.nn.Linear(8, 8) for _ in range(2))
    eager = copy.deepcopy(layers)
    leangraph.make_graphed_callables(layers, tuple((torch.randn(2, 8, requires_grad=True),)
                                                   for _ in layers))
    for step in range(3):
        x = torch.randn(2, 8)
        for first, second in (layers, eager):
            inputs = x.clone().requires_grad_()
            second(first(inputs)).square().sum().backward()
            inputs = x.clone().requires_grad_()
            torch.autograd.grad(second(first(inputs)).sum(), inputs)
        for a, b in zip((p for m in layers for p in m.parameters()),
                        (p for m in eager for p in m.parameters())):
            assert torch.equal(a.grad, b.grad), step
    assert moved == []
    leangraph.reset_all(layers)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_in_an_order_a_weight_also_used_eagerly_earlier_gets_eagers_gradient(device):
    """The same in a pipeline order (two microbatches of three chained layers, one backward
    pass per microbatch): ``last.weight`` read eagerly before the chunk's first layer. Wrong
    from the first step before (the chunk's graphs share the gradient buffers)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16).to(device) for _ in range(3)]
    eager = copy.deepcopy(layers)
    graphed = leangraph.make_graphed_callables(
        tuple(layers),
        tuple((torch.randn(4, 16, device=device, requires_grad=True),) for _ in range(6)),
        order=[1, 1, -1, -1],
    )

    def loss(chain, last_weight, x):
        h = x @ last_weight.t()
        for layer in chain:
            h = layer(h)
        return torch.tanh(h).square().sum()

    for step in range(3):
        xs = [torch.randn(4, 16, device=device) for _ in range(2)]
        losses = [loss(graphed[3 * m:3 * m + 3], layers[2].weight, xs[m]) for m in range(2)]
        for each in losses:
            each.backward()
        for x in xs:
            loss(eager, eager[2].weight, x).backward()
        for got, want in zip(layers, eager):
            assert torch.equal(got.weight.grad, want.weight.grad), step
            assert torch.equal(got.bias.grad, want.bias.grad), step
    leangraph.reset_all(graphed)


# --------------------------------------------------------------------------------------------
# A leaf input whose .grad exists: autograd adds its gradient in place and keeps nothing, so
# the replay lends it (a tensor over the buffer) instead of copying, as a parameter's.
# --------------------------------------------------------------------------------------------


def _handed_input_grads(monkeypatch) -> list[tuple[int, int]]:
    """Per backward replay, where input 0's gradient handed to autograd points and the id of
    the tensor handed: not the tensor itself, which a reference kept here would have moved
    onto a copy (what Python keeps of a lent gradient is)."""
    handed: list[tuple[int, int]] = []
    original = GradRouting.hand

    def hand(self, reached, accumulating=NO_LEAVES, **options):
        result = original(self, reached, accumulating, **options)
        handed.append((result[0].data_ptr(), id(result[0])))
        return result

    monkeypatch.setattr(GradRouting, "hand", hand)
    return handed


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_leaf_inputs_gradient_is_lent_where_its_grad_exists_and_copied_where_not(
        monkeypatch, device):
    handed = _handed_input_grads(monkeypatch)
    torch.manual_seed(0)
    layer = Block(8).to(device)
    eager = copy.deepcopy(layer)
    graphed = leangraph.make_graphed_callables(
        layer, (torch.randn(4, 8, device=device, requires_grad=True),))
    buffer = graphed.forward._record.static_grads[0]
    x = torch.randn(4, 8, device=device, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    for _ in range(3):  # .grad None first: copied (autograd keeps it); then lent, added into
        graphed(x).square().sum().backward()
        eager(y).square().sum().backward()
        _assert_as_eager(x.grad, y.grad, device)
    assert [pointer == buffer.data_ptr() for pointer, _ in handed] == [False, True, True]
    assert all(tensor != id(buffer) for _, tensor in handed)  # a tensor over it, never it
    x.grad = None
    graphed(x).square().sum().backward()
    assert handed[-1][0] != buffer.data_ptr()
    leangraph.reset_all([graphed])


def test_a_leaf_input_lent_its_gradient_is_not_kept_alive_by_the_routing(monkeypatch):
    handed = _handed_input_grads(monkeypatch)
    _, graphed = one_graph()
    x = torch.randn(2, 4, requires_grad=True)
    x.grad = torch.zeros_like(x)
    graphed[0](x).sum().backward()
    assert handed[-1][0] == graphed[0].forward._record.static_grads[0].data_ptr()
    gone = weakref.ref(x)
    del x
    assert gone() is None  # until the next replay settles what was lent, only weakly held
    graphed[0](torch.randn(2, 4, requires_grad=True)).sum().backward()  # settles nothing


@pytest.mark.parametrize("keep", ["autograd.grad", "tensor-hook", "non-leaf"])
def test_an_input_gradient_kept_beyond_the_pass_is_a_copy_though_grad_exists(keep):
    """``torch.autograd.grad`` returns a leaf's gradient (its accumulator does not run); a
    tensor hook sees it and may store it; a non-leaf's goes to its node, not an accumulator:
    each keeps eager's values after the next replays overwrite the buffer."""
    reference, graphed = one_graph()
    kept: dict[str, list[torch.Tensor]] = {"graphed": [], "eager": []}
    for key, layer in (("graphed", graphed[0]), ("eager", reference[0])):
        torch.manual_seed(1)
        x = torch.randn(2, 4, requires_grad=True)
        x.grad = torch.zeros_like(x)
        if keep == "tensor-hook":
            x.register_hook(kept[key].append)
        for step in range(3):
            inp = x * 1.0 if keep == "non-leaf" else x
            if keep == "non-leaf":
                inp.register_hook(kept[key].append)
            loss = layer(inp).square().sum() * (step + 1)
            if keep == "autograd.grad":
                kept[key].append(torch.autograd.grad(loss, x)[0])
            else:
                loss.backward()
    assert len(kept["graphed"]) == 3
    for got, want in zip(kept["graphed"], kept["eager"]):
        assert torch.equal(got, want)


class _InputAlsoUsedEagerlyEarlier(torch.nn.Module):
    """Three layers of one shape; the input goes to the first eagerly (``2 * x``) and to the
    last: a backward pass hands ``x`` the last graph's gradient first, and its accumulator
    waits for the eager use's, which comes after the two other graphs replayed."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.middle, self.last = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.middle(torch.tanh(self.first(2 * x))))
        return self.last(x) * hidden


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_lent_input_gradient_autograd_waits_with_is_moved_before_the_next_replay(device):
    """The last graph's input gradient, lent (``x.grad`` exists), sits in autograd's buffer
    for ``x`` while the middle and first graphs replay, over memory that may share the
    last's buffer: the next replay moves it onto a copy first, so ``x.grad`` is eager's."""
    torch.manual_seed(0)
    model = _InputAlsoUsedEagerlyEarlier().to(device)
    eager = copy.deepcopy(model)
    layers = (model.first, model.middle, model.last)
    leangraph.make_graphed_callables(
        layers, tuple((torch.randn(4, 16, device=device, requires_grad=True),) for _ in layers))
    x = torch.randn(4, 16, device=device, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    for step in range(4):
        model(x).square().sum().backward()
        eager(y).square().sum().backward()
        _assert_as_eager(x.grad, y.grad, device, step)
    leangraph.reset_all(layers)
