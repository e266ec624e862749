"""``accumulator_hooks=False`` and ``"python"`` (with ``fuse_grad_accumulation=True``): replays
run no autograd accumulator, so training stays exact. With False no accumulator hook fires and
a post-accumulate-grad hook is refused, before warm-up (V24) or at the next backward (R15);
with ``"python"`` the replays call the hooks registered from Python themselves, and refuse
what they cannot call or order (R17) (CPU backend; the CUDA versions are in
test_cuda_accumulation.py; the hooks' order and Megatron's protocol in
test_runtime_accumulation.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import leangraph
import leangraph.schedules
from helpers import raises
from models import Block, assert_histories_equal, train_both

ZB = [1, 2, 1, -2, 2, -1, -2.5, -2, -1.5, -1, -2.5, -1.5]


def _block_pair(width: int = 8):
    torch.manual_seed(0)
    eager = Block(width)
    return eager, copy.deepcopy(eager)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_interleaved_order_trains_exactly_without_accumulator_hooks(set_to_none):
    order = leangraph.schedules.interleaved_1f1b(
        pp_size=2, vp_size=2, rank=0, num_microbatches=4)
    history, graphed = train_both(order, [2, 2], width=8, microbatches=4, steps=3,
                                  set_to_none=set_to_none, fuse_grad_accumulation=True,
                                  accumulator_hooks=False)
    assert_histories_equal(history, exact=True)
    leangraph.reset_all(graphed)


def test_zero_bubble_weight_steps_train_exactly_without_accumulator_hooks():
    history, graphed = train_both(ZB, [1, 1], width=8, microbatches=2, steps=3,
                                  fuse_grad_accumulation=True, accumulator_hooks=False)
    assert_histories_equal(history, exact=True)
    leangraph.reset_all(graphed)


def _accumulator(param: torch.Tensor):
    return param.view_as(param).grad_fn.next_functions[0][0]


@pytest.mark.parametrize("hooks", [True, "python", False])
def test_accumulator_node_hooks_fire_only_with_accumulator_hooks(hooks):
    """DDP and Megatron hook the accumulator nodes (held, as they hold them), here after
    capture: with the relay, or called by the replay, each fires once per backward; without
    accumulator hooks none does, which is what the option trades."""
    _, module = _block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks)
    fired: list[str] = []
    nodes = []
    for name, p in module.named_parameters():
        node = _accumulator(p)
        node.register_hook(lambda *_, name=name: fired.append(name))
        nodes.append(node)
    for _ in range(2):
        graphed(torch.randn(4, 8)).sum().backward()
    names = [name for name, _ in module.named_parameters()]
    assert sorted(fired) == (sorted(names * 2) if hooks else [])


def test_v24_a_post_accumulate_grad_hook_is_refused_before_warm_up():
    _, module = _block_pair()
    module.up.bias.register_post_accumulate_grad_hook(lambda _: None)
    warmed: list[bool] = []
    with raises(ValueError, "parameter 'up.bias' has a post-accumulate-grad hook, which "
                "accumulator_hooks=False would never run"):
        leangraph.make_graphed_callables(
            module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
            accumulator_hooks=False, pre_warmup_hook=lambda: warmed.append(True))
    assert warmed == []


def test_v24_a_megatron_ddp_parameter_is_refused_before_warm_up():
    """Megatron-core's DDP sets grad_added_to_main_grad on every parameter it manages and
    hooks their accumulators, which no replay runs with accumulator_hooks=False."""
    _, module = _block_pair()
    module.down.weight.grad_added_to_main_grad = False
    warmed: list[bool] = []
    with raises(ValueError, "callable 0 (Block) parameter 'down.weight' is managed by "
                "Megatron-core's DistributedDataParallel (it has grad_added_to_main_grad), "
                "whose gradient-ready hooks are registered on the parameters' accumulators; "
                "accumulator_hooks=False would never run them"):
        leangraph.make_graphed_callables(
            module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
            accumulator_hooks=False, pre_warmup_hook=lambda: warmed.append(True))
    assert warmed == []
    for hooks in (True, "python"):  # either runs Megatron DDP's hooks
        _, module = _block_pair()
        module.down.weight.grad_added_to_main_grad = False
        graphed = leangraph.make_graphed_callables(
            module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
            accumulator_hooks=hooks)
        leangraph.reset_all(graphed)


def test_r15_a_post_accumulate_grad_hook_added_after_capture_is_refused_at_the_backward():
    _, module = _block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=False)
    graphed(torch.randn(4, 8)).sum().backward()
    before = [p.grad.clone() for p in module.parameters()]
    module.down.weight.register_post_accumulate_grad_hook(lambda _: None)
    out = graphed(torch.randn(4, 8)).sum()
    with raises(RuntimeError, "parameter 'down.weight' has a post-accumulate-grad hook"):
        out.backward()
    for p, grad in zip(module.parameters(), before):  # refused before the graph ran
        assert torch.equal(p.grad, grad)


def test_v24_option_misuse_is_refused():
    _, module = _block_pair()
    sample = (torch.randn(4, 8, requires_grad=True),)
    with raises(TypeError, "accumulator_hooks must be True, False or 'python', got int 0"):
        leangraph.make_graphed_callables(module, sample, fuse_grad_accumulation=True,
                                         accumulator_hooks=0)
    with raises(ValueError, "accumulator_hooks must be True, False or 'python', got 'Python'"):
        leangraph.make_graphed_callables(module, sample, fuse_grad_accumulation=True,
                                         accumulator_hooks="Python")
    with raises(ValueError, "accumulator_hooks=False needs fuse_grad_accumulation=True"):
        leangraph.make_graphed_callables(module, sample, accumulator_hooks=False)
    with raises(ValueError, "accumulator_hooks='python' needs fuse_grad_accumulation=True"):
        leangraph.make_graphed_callables(module, sample, accumulator_hooks="python")


@pytest.mark.parametrize("case", ["fused-without-hooks", "split-backward"])
def test_an_input_without_grad_still_trains_the_parameters(case):
    """The parameters are no inputs of the replay's autograd node here; a stand-in makes the
    outputs require grad when no input does, as eager's would."""
    eager, module = _block_pair()
    sample = (torch.randn(4, 8, requires_grad=True),)
    if case == "split-backward":
        graphed = leangraph.make_graphed_callables(
            (module,), (sample,), order=[1, -1, -1.5])[0]
    else:
        graphed = leangraph.make_graphed_callables(
            module, sample, fuse_grad_accumulation=True, accumulator_hooks=False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(4, 8, generator=gen)  # requires no grad
        eager(x).square().sum().backward()
        out = graphed(x)
        assert out.requires_grad
        out.square().sum().backward()
        if case == "split-backward":
            graphed.backward_dw()
    for a, b in zip(eager.parameters(), module.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("hooks", [True, "python", False])
def test_only_the_relay_hands_autograd_the_parameters(hooks):
    """What the modes trade: with the relay the replay's autograd node reaches every
    parameter's accumulator (autograd visits each per backward); otherwise none."""
    _, module = _block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks)
    out = graphed(torch.randn(4, 8, requires_grad=True))
    reached = {id(node) for node, _ in out.grad_fn.next_functions if node is not None}
    accumulators = {id(_accumulator(p)) for p in module.parameters()}
    assert (accumulators <= reached) if hooks is True else not (accumulators & reached)
    out.sum().backward()


def test_python_hooks_get_what_autograd_gives_an_accumulator_without_a_gradient():
    """Pre-hooks, post-accumulate-grad hooks and hooks of each node, in that order, with
    autograd's arguments, grad mode as in the backward (off)."""
    _, module = _block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks="python")
    seen: dict[str, list] = {"relay": [], "python": []}
    p = module.down.bias
    node = _accumulator(p)
    node.register_prehook(lambda grads: seen[mode].append(("pre", grads)))
    p.register_post_accumulate_grad_hook(lambda t: seen[mode].append(("acc", t is p)))
    node.register_hook(lambda grads, inputs: seen[mode].append(
        ("node", grads, inputs, torch.is_grad_enabled())))
    mode = "python"
    graphed(torch.randn(4, 8)).sum().backward()
    mode = "relay"  # what autograd itself gives them (the relay's delivery)
    from leangraph.build.accumulation import fire_relay, hook_relay
    fire_relay(hook_relay([p]))
    assert seen["python"] == seen["relay"] == [
        ("pre", (None,)), ("acc", True), ("node", (), (None,), False)]


def test_r17_a_hook_returning_a_value_is_refused_naming_the_parameter():
    _, module = _block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks="python")
    module.down.bias.register_post_accumulate_grad_hook(lambda t: t)
    with raises(RuntimeError, "parameter 'down.bias': a post-accumulate-grad hook returned a "
                "value", "return None"):
        graphed(torch.randn(4, 8)).sum().backward()


@pytest.mark.parametrize("hooks", [True, "python"])
def test_r17_a_parameter_also_used_outside_the_graph(hooks):
    """A backward pass reaching a parameter both through the graph and eagerly: the relay
    fires its hooks once, after both gradients, as eager does; called by the replay they
    could not be, so that is refused before the graph runs."""
    eager, module = _block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks)
    counts = {"eager": 0, "graphed": 0}
    for name, m in (("eager", eager), ("graphed", module)):
        m.up.weight.register_post_accumulate_grad_hook(
            lambda _, name=name: counts.__setitem__(name, counts[name] + 1))
    x = torch.randn(4, 8)
    eager_loss = eager(x).sum() + eager.up.weight.square().sum()
    loss = graphed(x).sum() + module.up.weight.square().sum()
    eager_loss.backward()
    if hooks == "python":
        with raises(RuntimeError, "parameter 'up.weight': this backward pass reaches its "
                    "gradient outside the graph too", "accumulator_hooks=True"):
            loss.backward()
        # Refused before the graph added its gradient (autograd may have added the eager one).
        grad, weight = module.up.weight.grad, module.up.weight.detach()
        assert grad is None or torch.equal(grad, 2 * weight)
        return
    loss.backward()
    assert counts == {"eager": 1, "graphed": 1}
    for a, b in zip(eager.parameters(), module.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("hooks", [True, "python"], ids=["relay", "python"])
def test_the_accumulators_hooked_through_are_held_until_reset(hooks):
    """The replays keep each parameter's accumulator node (and so the hooks on it) while they
    can replay, and let it go at reset."""
    _, module = _block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks)

    def tagged():  # a node's metadata lives as long as the node
        return [bool(_accumulator(p).metadata.get("seen")) for p in module.parameters()]

    for p in module.parameters():
        _accumulator(p).metadata["seen"] = True  # the test keeps no reference
    graphed(torch.randn(4, 8)).sum().backward()
    assert all(tagged())
    leangraph.reset_all(graphed)
    assert not any(tagged())


def test_in_a_pipeline_order_the_python_hooks_need_no_relay():
    """A layer's graphs, one per microbatch, share its parameters and have their backward
    passes one by one: their replays call the hooks, none hands autograd a parameter."""
    torch.manual_seed(0)
    layers = (Block(8), Block(8))
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(4))
    graphed = leangraph.make_graphed_callables(
        layers, samples, order=[1, 1, -1, -1], num_layers_per_chunk=2,
        fuse_grad_accumulation=True, accumulator_hooks="python")
    fired: list[str] = []
    for index, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda _, tag=f"{index}.{name}": fired.append(tag))
    accumulators = {id(_accumulator(p)) for layer in layers for p in layer.parameters()}
    outs = []
    for microbatch in range(2):
        out = graphed[2 * microbatch + 1](graphed[2 * microbatch](torch.randn(4, 8)))
        reached = {id(node) for node, _ in out.grad_fn.next_functions if node is not None}
        assert not accumulators & reached
        outs.append(out)
    for out in outs:
        out.sum().backward()
    assert len(fired) == 2 * 12  # every parameter once per microbatch's backward
    leangraph.reset_all(graphed)


def _tied_pair() -> tuple[torch.nn.Linear, torch.nn.Linear]:
    first = torch.nn.Linear(8, 8)
    second = torch.nn.Linear(8, 8)
    second.weight, second.bias = first.weight, first.bias
    return first, second


@pytest.mark.parametrize("hooks", [True, "python"], ids=["relay", "python"])
def test_r17_two_calls_calling_one_parameters_hooks_in_one_pass(hooks):
    """Two modules tied to the same parameters, graphed by two calls, both in one backward
    pass: eager fires the hooks once, after both gradients. The relay does so too; called
    by the replays, the second call's replay refuses."""
    torch.manual_seed(0)
    eager = _tied_pair()
    tied = copy.deepcopy(eager)
    assert tied[0].weight is tied[1].weight
    counts = {"eager": 0, "graphed": 0}
    for name, pair in (("eager", eager), ("graphed", tied)):
        pair[0].weight.register_post_accumulate_grad_hook(
            lambda _, name=name: counts.__setitem__(name, counts[name] + 1))
    graphed = [leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks) for module in tied]
    x = torch.randn(4, 8)
    (eager[0](x).sum() + eager[1](x).sum()).backward()
    loss = graphed[0](x).sum() + graphed[1](x).sum()
    if hooks == "python":
        with raises(RuntimeError, "parameter 'bias': the replay of another graph",
                    "Capture with accumulator_hooks=True"):
            loss.backward()
        return
    loss.backward()
    assert counts == {"eager": 1, "graphed": 1}
    assert torch.equal(eager[0].weight.grad, tied[0].weight.grad)


def test_tied_parameters_of_two_callables_keep_the_relay_with_python_hooks():
    """Within one call the graphs training a parameter another callable trains keep the
    relay, so the hooks fire once per pass, after both gradients, as in eager."""
    torch.manual_seed(0)
    eager = _tied_pair()
    tied = copy.deepcopy(eager)
    counts = {"eager": 0, "graphed": 0}
    for name, pair in (("eager", eager), ("graphed", tied)):
        pair[0].weight.register_post_accumulate_grad_hook(
            lambda _, name=name: counts.__setitem__(name, counts[name] + 1))
    graphed = leangraph.make_graphed_callables(
        tied, tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(2)),
        fuse_grad_accumulation=True, accumulator_hooks="python")
    for _ in range(2):
        for module in (*eager, *tied):
            # From None, adding the two graphs' gradients one by one rounds as eager's sum of
            # them; onto an existing .grad it may not (docs/concepts.md).
            module.zero_grad(set_to_none=True)
        x = torch.randn(4, 8)
        eager[1](eager[0](x)).sum().backward()
        graphed[1](graphed[0](x)).sum().backward()
        assert torch.equal(eager[0].weight.grad, tied[0].weight.grad)
    assert counts == {"eager": 2, "graphed": 2}


@pytest.mark.parametrize("hooks", [True, "python"], ids=["relay", "python"])
@pytest.mark.parametrize("create_graph", [False, True])
def test_hooks_see_the_grad_mode_of_the_backward_pass_as_in_eager(hooks, create_graph):
    """Autograd runs accumulators, and their hooks, in the pass's grad mode (on with
    ``create_graph=True``); the replay's calls do the same."""
    eager, module = _block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks)
    seen: dict[str, list[bool]] = {"eager": [], "graphed": []}
    for name, m in (("eager", eager), ("graphed", module)):
        m.up.weight.register_post_accumulate_grad_hook(
            lambda _, name=name: seen[name].append(torch.is_grad_enabled()))
    x = torch.randn(4, 8, requires_grad=True)
    eager(x).square().sum().backward(create_graph=create_graph)
    graphed(x).square().sum().backward(create_graph=create_graph)
    assert seen["graphed"] == seen["eager"] == [create_graph]
    for m in (eager, module):  # create_graph=True leaves .grad in a cycle with the parameter
        m.zero_grad(set_to_none=True)
