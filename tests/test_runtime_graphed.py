"""One graphed callable (``leangraph.runtime.graphed``): replay, the module drop-in and its eager
fallback, reset, and the lifecycle rules (docs/errors.md, R9, R10, R26, L1-L6) (CPU backend)."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import re
import weakref

import pytest
import torch
from helpers import blocks, graphed_blocks, raises, sample, three_graphs
from models import Block

import leangraph
from leangraph import GraphResetError

mgc = leangraph.make_graphed_callables


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
    order = dict(order=[1, -1, 1, -1], num_layers_per_chunk=3) if ordered else {}
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


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"order": [1, -1, 1, -1], "num_layers_per_chunk": 2},
        {"order": [1, 2, -2, -1, -2.5, -1.5]},
        {"fuse_grad_accumulation": True},
        {"fuse_grad_accumulation": True, "accumulator_hooks": "python"},
        {"fuse_grad_accumulation": True, "accumulator_hooks": False},
        {"overlap_grad_accumulation": True},
        {"debug_outputs": True},
    ],
    ids=[
        "unordered",
        "ordered",
        "weight-steps",
        "fused",
        "fused-python",
        "fused-nohooks",
        "overlap",
        "debug",
    ],
)
def test_dropping_every_reference_without_reset_frees_by_reference_counting_alone(options):
    """No reset at all: once the caller drops the result, its modules and the set after a
    training step, everything (static buffers, the set, callables, modules, parameters) goes
    by reference counting, with the cycle collector off."""
    layers = tuple(Block(4) for _ in range(2))
    if options.get("accumulator_hooks") == "python":
        for param in (p for layer in layers for p in layer.parameters()):
            param.register_post_accumulate_grad_hook(lambda _: None)
    microbatches = 2 if options.get("num_layers_per_chunk") else 1
    samples = tuple((sample(),) for _ in range(2 * microbatches))
    gc.collect()
    gc.disable()
    try:
        graphed = mgc(layers, samples, **options)
        members = [m.forward if isinstance(m, torch.nn.Module) else m for m in graphed]
        alive = [weakref.ref(t) for m in members for t in m.static_tensors()]
        alive += [weakref.ref(members[0].graphed_set), weakref.ref(layers[0].up.weight)]
        alive += [weakref.ref(m) for m in (*members, *layers)]
        graphed[1](graphed[0](sample())).sum().backward()
        if "-2.5" in str(options.get("order")):
            members[1].backward_dw()
            members[0].backward_dw()
        del graphed, members, layers, samples
        assert [ref() is None for ref in alive] == [True] * len(alive)
    finally:
        gc.enable()


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


class Gates(torch.nn.Module):
    """Two parameters of one shape: a gradient routed to the wrong one would not be noticed."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(4))
        self.b = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + x * x * self.b


def test_r10_a_parameter_frozen_at_capture_must_stay_frozen():
    gates = Gates()
    gates.a.requires_grad_(False)
    graphed = mgc(gates, (sample(),))
    gates.a.requires_grad_(True)
    with raises(
        ValueError,
        "callable 0 (Gates) parameter 'a' must have requires_grad=False as at capture",
        "got requires_grad=True",
    ):
        graphed(sample())
    gates.a.requires_grad_(False)
    graphed(sample()).sum().backward()
    assert gates.a.grad is None and gates.b.grad is not None


def test_a_parameter_frozen_after_capture_gets_no_gradient_and_the_others_theirs():
    torch.manual_seed(0)
    gates = Gates()
    eager = copy.deepcopy(gates)
    graphed = mgc(gates, (sample(),))
    for module in (gates, eager):
        module.a.requires_grad_(False)
    x = sample()
    graphed(x).sum().backward()
    eager(x).sum().backward()
    assert gates.a.grad is None
    torch.testing.assert_close(gates.b.grad, eager.b.grad, rtol=0, atol=0)


class FlagSwitch(torch.nn.Module):
    """Branches on its weight's requires_grad, as Megatron-core's linear layers do (another
    autograd function for a frozen weight, which leaves the bias without a gradient too)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.bias = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight.detach(), self.bias.detach())


def test_r26_a_parameter_whose_requires_grad_the_forward_reads_must_not_be_frozen():
    torch.manual_seed(0)
    switch = FlagSwitch()
    eager = copy.deepcopy(switch)
    graphed = mgc(switch, (sample(),))
    switch.weight.requires_grad_(False)
    with raises(
        RuntimeError,
        "callable 0 (FlagSwitch) parameter 'weight' must require grad as at capture, got "
        "requires_grad=False",
        "its forward reads the parameter's requires_grad",
        "another path",
        "capture again after freezing it",
    ):
        graphed(sample())
    # The bias, whose flag the forward does not read, may be frozen: eager's path is the same.
    switch.weight.requires_grad_(True)
    for module in (switch, eager):
        module.bias.requires_grad_(False)
    x = sample()
    x_ref = x.detach().clone().requires_grad_()
    out, ref = graphed(x), eager(x_ref)
    out.sum().backward()
    ref.sum().backward()
    assert torch.equal(out, ref) and torch.equal(x.grad, x_ref.grad)
    assert switch.bias.grad is None and torch.equal(switch.weight.grad, eager.weight.grad)


def test_r26_reads_under_an_order_are_refused_per_graph():
    torch.manual_seed(0)
    layers = (FlagSwitch(), FlagSwitch())
    graphed = mgc(layers, ((sample(),), (sample(),)), order=[1, -1], num_layers_per_chunk=2)
    layers[1].weight.requires_grad_(False)
    hidden = graphed[0](sample())  # layer 0's flag is as at capture
    with raises(RuntimeError, "graph (chunk 1, microbatch 0, layer 1) parameter 'weight'"):
        graphed[1](hidden)


@pytest.mark.parametrize("make, frozen", [
    (lambda: torch.nn.Linear(4, 4), "weight"),
    (lambda: Block(4), "up.weight"),
    (lambda: Block(4), "norm.bias"),
])
def test_freezing_a_parameter_of_plain_torch_layers_after_capture_trains_like_eager(make, frozen):
    """torch's own layers do not read their parameters' requires_grad in Python: freezing one
    after capture is allowed, and the others' gradients are eager's, bitwise."""
    torch.manual_seed(0)
    module = make()
    eager = copy.deepcopy(module)
    graphed = mgc(module, (sample(),))
    for m in (module, eager):
        m.get_parameter(frozen).requires_grad_(False)
    for _ in range(2):
        x = sample()
        x_ref = x.detach().clone().requires_grad_()
        out, ref = graphed(x), eager(x_ref)
        out.square().sum().backward()
        ref.square().sum().backward()
        assert torch.equal(out, ref) and torch.equal(x.grad, x_ref.grad)
    for (name, p), q in zip(module.named_parameters(), eager.parameters()):
        if name == frozen:
            assert p.grad is None and q.grad is None
        else:
            assert torch.equal(p.grad, q.grad), name


def test_r9_chained_input_must_be_the_previous_layers_output():
    layers = blocks(2)
    graphed = mgc(layers, ((sample(),), (sample(),)), order=[1, -1], num_layers_per_chunk=2)
    hidden = graphed[0](sample())
    with raises(
        ValueError,
        "graph (chunk 1, microbatch 0, layer 1) input 0 is the output buffer "
        "of graph (chunk 1, microbatch 0, layer 0)",
        "pass that graph's output itself, got another tensor",
        "share_buffers=False",
    ):
        graphed[1](hidden.detach().clone().requires_grad_())
    graphed[1](hidden).sum().backward()  # the output itself is fine
    graphed[0].reset()  # nothing can feed layer 1 now: the message says to reset it too
    with raises(ValueError, "once that graph is reset, reset this one too"):
        graphed[1](sample())
    free = mgc(
        blocks(2),
        ((sample(),), (sample(),)),
        order=[1, -1],
        num_layers_per_chunk=2,
        share_buffers=False,
    )
    free[0](sample())  # its output dropped: no backward comes, and the order passes it over
    free[1](sample()).sum().backward()  # without sharing, anything matching goes


def _weighted(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ torch.arange(9.0).view(3, 3) + b * 3


@pytest.mark.parametrize("requires_grad", [False, True])
def test_arguments_in_the_memory_of_the_samples_replay_as_eager_reads_them(requires_grad):
    """With share_buffers=False the samples are the static inputs, so the caller holds
    them: arguments in their memory (the samples swapped, a transposed or shifted view of
    one) must be read before any copy writes over them, as eager reads its arguments."""
    base = torch.randn(4, 3)
    s0, s1 = base[:3].clone(), torch.randn(3, 3)
    samples = (s0.requires_grad_(requires_grad), s1.requires_grad_(requires_grad))
    graphed = mgc(_weighted, samples, share_buffers=False)
    calls = [
        lambda: (s1, s0),  # swapped: the first copy would write over the second argument
        lambda: (s0.t(), s1),  # a transposed view of its own static input
        lambda: (s0, s1.t()),
        lambda: (s1, s1),
    ]
    for arguments in calls:
        args = arguments()
        expected = _weighted(*(a.detach().clone() for a in args))
        out = graphed(*args)
        assert torch.equal(out, expected)
        if requires_grad:
            out.sum().backward()
    window = torch.randn(5, 3)
    shifted = mgc(_weighted, (window[:3], window[2:].clone()), share_buffers=False)
    expected = _weighted(window[1:4].clone(), window[2:].clone())
    assert torch.equal(shifted(window[1:4], window[2:]), expected)  # overlaps the sample


def test_l1_calling_a_reset_callable():
    graphed = graphed_blocks()
    graphed[1].forward.reset()
    with raises(GraphResetError, "callable 1 (Block): cannot call", "was reset"):
        graphed[1](sample())
    graphed[1].eval()  # a reset module does not fall back to eager either
    with raises(GraphResetError, "callable 1 (Block): cannot call"):
        graphed[1](sample())
    leangraph.reset_all(graphed)
    with raises(GraphResetError, "callable 0 (Block): cannot call"):
        graphed[0](sample())
    assert issubclass(GraphResetError, RuntimeError)


def test_l2_backward_through_a_reset_callable():
    graphed = graphed_blocks()
    out = graphed[2](graphed[1](graphed[0](sample())))
    graphed[1].forward.reset()
    with raises(GraphResetError, "callable 1 (Block): cannot run a backward", "was reset"):
        out.sum().backward()


def test_l2_resetting_the_first_callable_mid_pass_leaves_the_others_training_like_eager():
    """Callable 0 reset while the backward of 1 and 2, which chains from its output, is
    pending: the backward raises naming callable 0, 1 and 2 got eager's gradients on the way
    (as when any autograd node raises), and their next passes train exactly like eager."""
    torch.manual_seed(0)
    reference, graphed = three_graphs()
    x = torch.randn(2, 4, requires_grad=True)
    out = graphed[2](graphed[1](graphed[0](x)))
    graphed[0].forward.reset()
    with raises(GraphResetError, "callable 0 (Block): cannot run a backward"):
        out.sum().backward()
    assert x.grad is None and all(p.grad is None for p in graphed[0].parameters())
    hidden = reference[0](x.detach()).detach().requires_grad_()
    reference[2](reference[1](hidden)).sum().backward()
    for _ in range(3):
        for module, twin in zip(graphed[1:], reference[1:]):
            for p, q in zip(module.parameters(), twin.parameters()):
                assert torch.equal(p.grad, q.grad)
                with torch.no_grad():
                    p.sub_(0.1 * p.grad)
                    q.sub_(0.1 * q.grad)
                p.grad = q.grad = None
        x = torch.randn(2, 4, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        graphed[2](graphed[1](x)).square().sum().backward()
        reference[2](reference[1](x_ref)).square().sum().backward()
        assert torch.equal(x.grad, x_ref.grad)


def test_l3_second_backward_through_one_forward_replay():
    graphed = graphed_blocks(1)[0]
    loss = graphed(sample()).sum()
    loss.backward(retain_graph=True)
    with raises(
        RuntimeError,
        "callable 0 (Block): second backward through forward replay",
        "runs once, even where eager's would run again (backward(retain_graph=True) asks "
        "that of autograd, not of the graph)",
        "retain_graph_in_backward=True",
    ):
        loss.backward()


def test_l3_retain_graph_in_backward_allows_it():
    layers = blocks(1)
    reference = copy.deepcopy(layers[0])
    graphed = mgc(layers, ((sample(),),), retain_graph_in_backward=True)[0]
    x = sample()
    x_ref = x.detach().clone().requires_grad_()
    loss, loss_ref = graphed(x).sum(), reference(x_ref).sum()
    for _ in range(2):
        loss.backward(retain_graph=True)
        loss_ref.backward(retain_graph=True)
    assert torch.equal(x.grad, x_ref.grad)


def test_l3_a_second_backward_pass_through_several_retained_graphs_is_refused_saying_why():
    """retain_graph_in_backward lets a backward repeat right after itself only: a second pass
    through a chain replays the last layer's backward after the first layer's, whose capture
    may reuse the activations the last one reads. The refusal says so, and a fresh forward
    pass trains as eager's."""
    layers = blocks(3)
    reference = copy.deepcopy(layers)
    graphed = mgc(layers, tuple((sample(),) for _ in layers), retain_graph_in_backward=True)
    x = sample()
    loss = graphed[2](graphed[1](graphed[0](x))).sum()
    loss.backward(retain_graph=True)
    with raises(
        RuntimeError,
        "callable 2 (Block): backward replayed out of capture order",
        "retain_graph_in_backward lets a backward replay again only right after itself",
        "replay their forwards again",
    ):
        loss.backward()
    x_ref = x.detach().clone().requires_grad_()
    reference[2](reference[1](reference[0](x_ref))).sum().backward()
    x.grad = None
    graphed[2](graphed[1](graphed[0](x))).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    for module, twin in zip(layers, reference):
        for p, q in zip(module.parameters(), twin.parameters()):
            assert torch.equal(p.grad, 2 * q.grad)  # the first pass's and this one's


def test_l4_replay_while_outputs_await_backward():
    graphed = graphed_blocks(1)[0]
    first = graphed(sample())
    with raises(RuntimeError, "callable 0 (Block)", "still await their backward"):
        graphed(sample())
    first.sum().backward()  # the refused replay changed nothing: the first backward still works
    second = graphed(sample())  # after the backward, a replay is fine
    del second
    graphed(sample())  # and so it is once the outputs are gone


def test_l4_outputs_that_do_not_require_grad_are_exempt():
    graphed = graphed_blocks(1)[0]
    with torch.no_grad():
        first = graphed(sample())
        second = graphed(sample())
    assert not first.requires_grad and not second.requires_grad
    frozen = mgc(Block(4).requires_grad_(False), (sample(requires_grad=False),))
    first = frozen(sample(requires_grad=False))
    second = frozen(sample(requires_grad=False))
    del first, second


def test_l4_forward_while_only_a_derived_tensor_awaits_backward():
    graphed = graphed_blocks(1)[0]
    loss1 = graphed(sample()).sum()  # the output is gone; its autograd graph is not
    with raises(
        RuntimeError,
        "callable 0 (Block): forward replayed while the outputs of its "
        "previous replay (1) still await their backward",
    ):
        graphed(sample())
    loss1.backward()


def test_l5_backward_after_a_newer_replay():
    # Only reachable when retain_graph_in_backward lets replays overlap a pending backward.
    graphed = graphed_blocks(1, retain_graph_in_backward=True)[0]
    loss1 = graphed(sample()).sum()
    loss2 = graphed(sample()).sum()
    with raises(
        RuntimeError,
        "callable 0 (Block): backward of forward replay 1 requested",
        "replayed again since (replay 2)",
    ):
        loss1.backward()
    loss2.backward()


def test_l6_graphed_callables_cannot_be_copied_or_pickled():
    graphed = graphed_blocks(2)
    with raises(TypeError, "callable 1 (Block): a graphed callable cannot be copied or pickled"):
        copy.deepcopy(graphed[1])
    with raises(TypeError, "callable 0 (Block): a graphed callable cannot be copied or pickled"):
        pickle.dumps(graphed[0].forward)


def test_l6_a_shallow_copy_of_a_graphed_module_is_refused_too():
    """copy.copy would share the graphed forward with a copy whose training mode the graphs
    never see: the copy's eval() would still replay the training graph."""
    graphed = graphed_blocks(1)[0]
    for copied in (graphed, graphed.forward):
        with raises(TypeError, "callable 0 (Block): a graphed callable cannot be copied",
                    "copy the module before graphing it"):
            copy.copy(copied)
    eager = Block(4)
    assert copy.copy(eager).forward.__func__ is Block.forward  # an eager module copies as usual


def test_l6_a_model_holding_graphed_layers_is_saved_by_its_state_dict():
    model = torch.nn.Sequential(*graphed_blocks(2))
    with raises(TypeError, "callable 0 (Block): a graphed callable cannot be copied",
                "by its state_dict()"):
        torch.save(model, io.BytesIO())
    saved = io.BytesIO()
    torch.save(model.state_dict(), saved)
    torch.manual_seed(1)
    eager = torch.nn.Sequential(*(Block(4) for _ in range(2)))
    model.load_state_dict(eager.state_dict())  # copied in place: the graphs read the new values
    x = sample()
    x_eager = x.detach().clone().requires_grad_()
    model(x).sum().backward()
    eager(x_eager).sum().backward()
    assert torch.equal(x.grad, x_eager.grad)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad)
    saved.seek(0)
    eager.load_state_dict(torch.load(saved))  # what was saved loads into an eager model
    assert torch.equal(eager[0].up.weight, graphed_blocks(2)[0].up.weight)


def test_r20_a_backward_with_create_graph_gives_eagers_gradients_and_refuses_a_second_order():
    """A graph's backward is no differentiable function: with ``create_graph=True`` its
    gradients are eager's, and differentiating them again raises, naming the callable (R20;
    the usual backward, grad mode off, skips that wrapping)."""
    torch.manual_seed(0)
    eager = Block(8)
    module = copy.deepcopy(eager)
    graphed = mgc(module, (torch.randn(4, 8, requires_grad=True),))
    x = torch.randn(4, 8, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(graphed(x).square().sum(), x, create_graph=True)
    (expected,) = torch.autograd.grad(eager(x_eager).square().sum(), x_eager)
    assert torch.equal(grad, expected)
    with raises(RuntimeError, "callable 0 (Block): cannot differentiate its backward (a "
                "second-order gradient)", "differentiate the eager callable instead"):
        grad.sum().backward()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fused", [False, True], ids=["autograd", "fused"])
def test_r19_a_graph_captured_under_no_grad_replays_forward_only(fused, device):
    """Under no_grad the graphs get no backward (inference graphs): a module whose parameters
    require grad, on a sample that requires grad, replays exactly under no_grad; with grad
    mode on, where eager's outputs would require grad, the replay refuses naming itself."""
    from models import Block

    torch.manual_seed(0)
    eager = Block(8).to(device)
    module = copy.deepcopy(eager)
    with torch.no_grad():
        graphed = leangraph.make_graphed_callables(
            module, (torch.randn(4, 8, device=device, requires_grad=True),),
            fuse_grad_accumulation=fused)
    x = torch.randn(4, 8, device=device)
    with torch.no_grad():
        assert torch.equal(graphed(x), eager(x))
    with raises(RuntimeError, "callable 0 (Block) was captured under torch.no_grad(), so it has "
                "forward graphs only", "capture it with grad enabled"):
        graphed(x)
    with torch.inference_mode():
        assert torch.equal(graphed(x), eager(x))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_r24_an_output_the_backward_reads_modified_in_place_is_refused(device):
    """tanh's backward reads its output: eager refuses the backward once the output was
    modified in place, and so does the replay (its backward graph would read the new values).
    An output no backward reads (a linear layer's) may change, as in eager."""
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).to(device)
    eager = copy.deepcopy(layer)
    graphed = leangraph.make_graphed_callables(
        layer, (torch.randn(2, 4, device=device, requires_grad=True),))
    x = torch.randn(2, 4, device=device, requires_grad=True)
    out = eager(x)
    out.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    out = graphed(x)
    out.add_(1)
    with pytest.raises(RuntimeError, match=r"callable 0 \(Sequential\): output 0 was modified "
                       r"in place after its forward replay \(version \d+, now \d+\), but the "
                       r"backward reads it .* Clone the output before modifying it"):
        out.sum().backward()
    leangraph.reset_all(graphed)
    linear = torch.nn.Linear(4, 4).to(device)
    eager = copy.deepcopy(linear)
    graphed = leangraph.make_graphed_callables(
        linear, (torch.randn(2, 4, device=device, requires_grad=True),))
    for module in (linear, eager):
        out = module(x)
        out.mul_(2)
        out.sum().backward()
    assert torch.equal(linear.weight.grad, eager.weight.grad)
    leangraph.reset_all(graphed)


def _view_first(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x * 2
    return y[0], y  # the view before its base


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_an_output_viewing_a_later_output_comes_back_as_its_view(device):
    """``return y[0], y``: the first output is a view of the second. A replay returns it as a
    view of the second's replayed tensor, so a write into one shows in the other and the
    backward follows it, as eager's does (before, only a view of an *earlier* output was
    linked: the CPU backend returned it in a buffer of its own, CUDA shared the memory but
    not the autograd link, and either way the gradient missed the write)."""
    graphed = leangraph.make_graphed_callables(
        _view_first, (torch.randn(3, 4, device=device, requires_grad=True),))
    for step in range(2):
        x = torch.randn(3, 4, device=device, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        results = []
        for run, inp in ((graphed, x), (_view_first, x_eager)):
            row, whole = run(inp)
            row.mul_(10)
            results.append(whole.detach().clone())
            (whole ** 2).sum().backward()
        assert torch.equal(results[0], results[1]), step
        assert torch.equal(x.grad, x_eager.grad), step
    leangraph.reset_all(graphed)


def _refused_as_eager(backward, eager: bool, ours: str) -> None:
    """``backward()`` raises: autograd's refusal where ``eager``, else the replay's ``ours``."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation" if eager else ours):
        backward()


def _input_as_is(x: torch.Tensor, w: torch.Tensor):
    return x * w, x


def _view_of_input(x: torch.Tensor, w: torch.Tensor):
    return x * w, x[1:]


def _mask_as_is(x: torch.Tensor, mask: torch.Tensor):
    return x * mask, mask


def _max_indices(x: torch.Tensor, w: torch.Tensor):
    return tuple(x.mul(w).max(-1))


# Beside its result, each returns an input (or a view of one) or an output needing no
# gradient that its backward reads: ``x * w`` saves ``x`` for ``w``'s gradient, ``x * mask``
# saves ``mask`` (which needs none) for ``x``'s, ``max`` its indices.
RETURNS_AN_INPUT = {
    "input": _input_as_is,
    "view": _view_of_input,
    "no-grad input": _mask_as_is,
    "indices": _max_indices,
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("form", ["input", "view", "no-grad input", "indices"])
@pytest.mark.parametrize("ordered", [False, True], ids=["drop-in", "ordered"])
def test_r24_an_input_returned_and_modified_in_place_is_refused(device, form, ordered):
    """An output in an input's memory, or needing no gradient, that the backward reads: eager
    refuses the backward once it was modified in place. So does the replay: on CUDA that
    output is the graph's static input itself, so its backward graph would read the new
    values (before, the replay let it pass). The refused backward has not run: once the
    outputs are dropped, the graph trains like eager."""
    fn = RETURNS_AN_INPUT[form]
    w_sample = torch.randn(2, 4, device=device, requires_grad=form != "no-grad input")
    options = {"order": [1, -1]} if ordered else {}
    graphed = leangraph.make_graphed_callables(
        fn, (torch.randn(2, 4, device=device, requires_grad=True), w_sample), **options
    )
    label = (
        "graph (chunk 1, microbatch 0, layer 0)" if ordered else f"callable 0 ({fn.__qualname__})"
    )
    x = torch.randn(2, 4, device=device, requires_grad=True)
    w = w_sample.detach().clone().requires_grad_(w_sample.requires_grad)
    for run in (fn, graphed):
        y, aside = run(x * 1, w)  # x * 1: eager may write into a non-leaf
        aside.add_(1)
        _refused_as_eager(y.sum().backward, run is fn, rf"{re.escape(label)}: output 1 was "
                          r"modified in place after its forward replay \(version \d+, now "
                          r"\d+\), but the backward reads it")
        del y, aside
    x_eager = x.detach().clone().requires_grad_()
    w_eager = w.detach().clone().requires_grad_(w.requires_grad)
    y, _ = graphed(x, w)
    y.square().sum().backward()
    y_eager, _ = fn(x_eager, w_eager)
    y_eager.square().sum().backward()
    assert torch.equal(x.grad, x_eager.grad)
    if w.requires_grad:
        assert torch.equal(w.grad, w_eager.grad)
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("order", [None, [1, -1], [1, 1, -1, -1]],
                         ids=["drop-in", "ordered", "two microbatches"])
def test_a_data_write_into_an_output_the_backward_reads_reaches_it_as_in_eager(device, order):
    """``out.data.mul_(k)`` bumps no version, so neither eager nor R24 refuses it, and eager's
    tanh backward reads the new values. On CUDA the static output is the memory the backward
    graph reads; the CPU backend reads it from the static buffer too (it read its own copy of
    the forward's result before), so both train like eager."""
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).to(device)
    eager = copy.deepcopy(layer)
    microbatches = 1 if order is None else order.count(1)
    samples = tuple(
        (torch.randn(2, 4, device=device, requires_grad=True),) for _ in range(microbatches))
    if microbatches == 1:
        graphed = leangraph.make_graphed_callables(
            layer, samples[0], **({} if order is None else {"order": order}))
        per_microbatch = [graphed]
    else:  # one graph per microbatch, called in the order's turn
        graphed = leangraph.make_graphed_callables((layer,), samples, order=order)
        per_microbatch = list(graphed)
    inputs = [torch.randn(2, 4, device=device) for _ in range(microbatches)]
    for modules in ([eager] * microbatches, per_microbatch):
        for step in range(2):  # the second step's replay overwrites the first's buffers
            outs = [module(x) for module, x in zip(modules, inputs)]
            for k, out in enumerate(outs):
                out.data.mul_(0.5 + k + step)
            for out in outs:
                out.square().sum().backward()
    for name, param in layer.named_parameters():
        assert torch.equal(param.grad, eager.get_parameter(name).grad), name
    leangraph.reset_all(graphed)


def test_r24_an_input_returned_that_no_backward_reads_may_change_as_in_eager():
    def fn(x: torch.Tensor, w: torch.Tensor):
        return x + w, x  # the sum's backward reads neither

    w = torch.randn(4, requires_grad=True)
    graphed = leangraph.make_graphed_callables(fn, (torch.randn(2, 4, requires_grad=True), w))
    grads = []
    for run in (fn, graphed):
        y, same = run(torch.randn(2, 4, generator=torch.Generator().manual_seed(0)) * 1, w)
        same.mul_(3)
        (y * 2).sum().backward()
        grads.append(w.grad.clone())
        w.grad = None
    assert torch.equal(grads[0], grads[1])
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_r24_a_chained_input_the_backward_reads_modified_in_place_is_refused(device):
    """Within a chunk, layer 1's static input is layer 0's output buffer itself, which the
    caller holds, and layer 1's backward reads it (its norm saves it): eager refuses the
    backward once it was modified in place, and so does the replay, naming the input
    (before, the backward graph read the new values). The refused backward has not run:
    once the outputs are dropped, the layers train like eager. An argument a replay copies
    is not the graph's memory: modified after the forward, it leaves the gradient as at
    the forward."""
    torch.manual_seed(0)
    eager = [Block(4).to(device), Block(4).to(device)]
    layers = copy.deepcopy(eager)
    graphed = leangraph.make_graphed_callables(
        tuple(layers), ((torch.randn(2, 4, device=device, requires_grad=True),),) * 2,
        order=[1, -1], num_layers_per_chunk=2)
    x = torch.randn(2, 4, device=device, requires_grad=True)
    for run in (eager, graphed):
        hidden = run[0](x)
        out = run[1](hidden)
        with torch.no_grad():
            hidden.add_(1)
        _refused_as_eager(out.sum().backward, run is eager, r"graph \(chunk 1, microbatch 0, "
                          r"layer 1\): input 0 \(the output buffer of graph \(chunk 1, "
                          r"microbatch 0, layer 0\)\) was modified in place after the forward "
                          r"replay \(version \d+, now \d+\), but the backward reads it")
        del hidden, out
    for module in (*eager, *layers):
        module.zero_grad()  # eager's refused backward may have reached some parameters
    want = x.detach().clone().requires_grad_()
    got = x.detach().clone().requires_grad_()
    eager[1](eager[0](want)).square().sum().backward()
    graphed_out = graphed[1](graphed[0](got))
    with torch.no_grad():
        got.mul_(3)  # copied into layer 0's static input: the gradient is the forward's
    graphed_out.square().sum().backward()
    same = torch.testing.assert_close if device == "cuda" else _bitwise  # cuBLAS may differ
    same(got.grad, want.grad)
    for a, b in zip(layers, eager):
        for p, q in zip(a.parameters(), b.parameters()):
            same(p.grad, q.grad)
    leangraph.reset_all(graphed)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b), f"max diff {(a - b).abs().max()}"


def _linear_tanh(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).to(device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("ordered", [False, True], ids=["drop-in", "ordered"])
def test_r28_an_optimizer_step_before_the_backward_is_refused(device, ordered):
    """A linear layer's backward reads its weight (for the input's gradient): eager refuses
    the backward once an optimizer step changed it in place after the forward. The backward
    graph would read the new weight (before, the replay computed with it silently), so the
    replay refuses too, naming the parameter; the refused backward has not run, and once
    the outputs are dropped the graph trains like eager."""
    module = _linear_tanh(device)
    eager = copy.deepcopy(module)
    options = {"order": [1, -1]} if ordered else {}
    result = leangraph.make_graphed_callables(
        module, (torch.randn(2, 4, device=device, requires_grad=True),), **options
    )
    graphed = result if ordered else module
    label = "graph (chunk 1, microbatch 0, layer 0)" if ordered else "callable 0 (Sequential)"
    x = torch.randn(2, 4, device=device, requires_grad=True)
    for run, params in ((eager, eager.parameters()), (graphed, module.parameters())):
        optim = torch.optim.SGD(list(params), lr=0.1)
        y = run(x)
        y.square().sum().backward()  # a first step, so that the optimizer has gradients
        y = run(x)
        optim.step()
        expected = (
            "modified by an inplace operation"
            if run is eager
            else rf"{re.escape(label)} parameter '0.weight' was modified in place after the "
            r"forward replay \(version \d+, now \d+\), but the backward reads it .* Run "
            r"the backward before the optimizer step"
        )
        with pytest.raises(RuntimeError, match=expected):
            y.square().sum().backward()
        del y
        optim.zero_grad()
    for run in (eager, graphed):
        run(x).square().sum().backward()
    for p, q in zip(module.parameters(), eager.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
    leangraph.reset_all(result)


def _flat_linear() -> torch.nn.Linear:
    """A linear layer whose weight and bias are views of one flat buffer (as Megatron-core
    lays out parameters), each with a version counter of its own."""
    module = torch.nn.Linear(4, 4)
    flat = torch.cat([module.weight.detach().reshape(-1), module.bias.detach()])
    module.weight.data = flat[:16].view(4, 4)
    module.bias.data = flat[16:]
    return module


@pytest.mark.parametrize("flat", [False, True], ids=["own-storage", "one-flat-buffer"])
def test_r28_a_parameter_no_backward_reads_may_change_as_in_eager(flat):
    """A linear layer's backward does not read its bias: changing it between the forward
    and the backward is eager's business, and the replay's gradients stay eager's, also
    where the bias shares one buffer with the weight the backward reads."""
    module = _flat_linear() if flat else torch.nn.Linear(4, 4)
    eager = torch.nn.Linear(4, 4)
    eager.load_state_dict(module.state_dict())
    graphed = leangraph.make_graphed_callables(module, (torch.randn(2, 4, requires_grad=True),))
    x = torch.randn(2, 4, requires_grad=True)
    for run in (eager, graphed):
        y = run(x)
        with torch.no_grad():
            run.bias.add_(1)
        y.square().sum().backward()
    for p, q in zip(module.parameters(), eager.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
    leangraph.reset_all(graphed)


class _ScaledNorm(torch.nn.Module):
    """A linear layer times a gain buffer (which the backward reads), then batch norm
    (whose running statistics its backward reads too, and every forward updates)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("gain", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x) * self.gain)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_r28_a_buffer_the_backward_reads_modified_in_place_is_refused(device):
    """The backward reads the gain buffer: eager refuses the backward once it was written in
    place after the forward, and so does the replay, naming it (before, the backward graph
    read the new gain). Batch norm's running statistics, which its backward reads as well,
    change at every forward without a new version: two microbatches in flight train like
    eager, statistics included."""
    torch.manual_seed(0)
    module = _ScaledNorm().to(device)
    eager = copy.deepcopy(module)
    samples = tuple((torch.randn(8, 4, device=device, requires_grad=True),) for _ in range(2))
    graphed = leangraph.make_graphed_callables((module,), samples, order=[1, 1, -1, -1])
    xs = [torch.randn(8, 4, device=device, requires_grad=True) for _ in range(2)]
    for _ in range(2):  # two steps
        outs = [graphed[0](xs[0]), graphed[1](xs[1])]
        eager_outs = [eager(x) for x in xs]
        for out, eager_out in zip(outs, eager_outs):
            out.square().sum().backward()
            eager_out.square().sum().backward()
    same = torch.testing.assert_close if device == "cuda" else _bitwise
    for a, b in zip(module.state_dict().values(), eager.state_dict().values()):
        same(a, b)
    for p, q in zip(module.parameters(), eager.parameters()):
        same(p.grad, q.grad)
    for run in (eager, graphed[0]):
        y = run(xs[0])
        with torch.no_grad():
            (eager if run is eager else module).gain.mul_(3)
        _refused_as_eager(y.sum().backward, run is eager, r"graph \(chunk 1, microbatch 0, "
                          r"layer 0\): buffer 'gain' was modified in place after the forward "
                          r"replay \(version \d+, now \d+\), but the backward reads")
        del y
    leangraph.reset_all(graphed)

