"""``accumulator_hooks=False`` and ``"python"`` (with ``fuse_grad_accumulation=True``): replays
run no autograd accumulator, so training stays exact. With False no accumulator hook fires, and
a post-accumulate-grad hook or a hook on an accumulator node is refused, before warm-up (V24)
or at the next backward (R15);
with ``"python"`` the replays call the hooks registered from Python themselves, and refuse
what they cannot call or order (R17) (CPU backend; the CUDA versions are in
test_cuda_accumulation.py; the hooks' order and Megatron's protocol in
test_runtime_accumulation.py). Then, in every mode (unfused, overlap, relay, "python", weight
steps): which hooks fire when a loss leaves outputs out, and in what order over an
interleaved-1F1B step, a retained graph's two backwards and ``torch.autograd.grad``, against
eager's."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_grads_unchanged, block_pair, fused_after_one_step, raises
from models import Block, ThreeOutputs, TwoOutputs, assert_histories_equal, train_both

import leangraph
import leangraph.schedules

ZB = [1, 2, 1, -2, 2, -1, -2.5, -2, -1.5, -1, -2.5, -1.5]


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


@pytest.mark.parametrize("hooks", [True, "python"])
def test_accumulator_node_hooks_fire_with_accumulator_hooks(hooks):
    """DDP and Megatron hook the accumulator nodes (held, as they hold them), here after
    capture: with the relay, or called by the replay, each fires once per backward."""
    _, module = block_pair()
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
    assert sorted(fired) == sorted(names * 2)


@pytest.mark.parametrize("kind", ["register_hook", "register_prehook"])
def test_v24_a_hook_on_an_accumulator_node_is_refused_before_warm_up(kind):
    """A DDP wrapper written in Python (DeepSpeed's ZeRO, say) hooks the accumulator nodes,
    which no replay runs with accumulator_hooks=False: the hook would never fire."""
    _, module = block_pair()
    node = _accumulator(module.down.bias)  # held, as such a wrapper holds it
    getattr(node, kind)(lambda *_: None)
    warmed: list[bool] = []
    with raises(ValueError, "callable 0 (Block) parameter 'down.bias' has a hook on its "
                "gradient accumulator node (node.register_hook or register_prehook",
                "which accumulator_hooks=False would never run"):
        leangraph.make_graphed_callables(
            module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
            accumulator_hooks=False, pre_warmup_hook=lambda: warmed.append(True))
    assert warmed == []


@pytest.mark.parametrize("kind", ["register_hook", "register_prehook"])
def test_r15_a_hook_on_an_accumulator_node_added_after_capture_is_refused_at_the_backward(kind):
    """The node is the one capture holds, so a hook registered on the parameter's
    accumulator after capture is seen; removed again, the refused backward may run."""
    _, module = block_pair()
    graphed, before = fused_after_one_step(module, False)
    node = _accumulator(module.up.weight)
    handle = getattr(node, kind)(lambda *_: None)
    out = graphed(torch.randn(4, 8)).sum()
    with raises(RuntimeError, "callable 0 (Block) parameter 'up.weight' has a hook on its "
                "gradient accumulator node since capture"):
        out.backward(retain_graph=True)
    assert_grads_unchanged(module, before)  # refused before the graph ran
    handle.remove()
    out.backward()  # the refused backward ran nothing: it may run now


def test_v24_a_post_accumulate_grad_hook_is_refused_before_warm_up():
    _, module = block_pair()
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
    _, module = block_pair()
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
        _, module = block_pair()
        module.down.weight.grad_added_to_main_grad = False
        graphed = leangraph.make_graphed_callables(
            module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
            accumulator_hooks=hooks)
        leangraph.reset_all(graphed)


def test_r15_a_post_accumulate_grad_hook_added_after_capture_is_refused_at_the_backward():
    _, module = block_pair()
    graphed, before = fused_after_one_step(module, False)
    module.down.weight.register_post_accumulate_grad_hook(lambda _: None)
    out = graphed(torch.randn(4, 8)).sum()
    with raises(RuntimeError, "parameter 'down.weight' has a post-accumulate-grad hook"):
        out.backward()
    assert_grads_unchanged(module, before)  # refused before the graph ran


def test_r15_megatron_ddp_built_after_capture_is_refused_at_the_backward():
    """Megatron-core's DDP wrapped around the graphed model after capture gives every
    parameter main_grad, the flag and a hook on its accumulator: without accumulator hooks
    no replay runs that hook, and main_grad stayed zero, unnoticed."""
    _, module = block_pair()
    graphed, before = fused_after_one_step(module, False)
    module.up.weight.grad_added_to_main_grad = False  # what Megatron's DDP sets on each
    out = graphed(torch.randn(4, 8)).sum()
    with raises(RuntimeError, "callable 0 (Block) parameter 'up.weight' is managed by "
                "Megatron-core's DistributedDataParallel (it has grad_added_to_main_grad since "
                "capture)", "Capture with accumulator_hooks=True or 'python', after wrapping "
                "the model in DDP"):
        out.backward(retain_graph=True)
    assert_grads_unchanged(module, before)  # refused before the graph ran
    del module.up.weight.grad_added_to_main_grad
    out.backward()  # the refused backward ran nothing: it may run now


def test_v24_option_misuse_is_refused():
    _, module = block_pair()
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
    eager, module = block_pair()
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
    _, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks)
    out = graphed(torch.randn(4, 8, requires_grad=True))
    # The node objects are held while their ids are compared: a freed one's id can be reused.
    reached_nodes = [node for node, _ in out.grad_fn.next_functions if node is not None]
    accumulator_nodes = [_accumulator(p) for p in module.parameters()]
    reached = {id(node) for node in reached_nodes}
    accumulators = {id(node) for node in accumulator_nodes}
    assert (accumulators <= reached) if hooks is True else not (accumulators & reached)
    out.sum().backward()


def test_python_hooks_get_what_autograd_gives_an_accumulator_without_a_gradient():
    """Pre-hooks, post-accumulate-grad hooks and hooks of each node, in that order, with
    autograd's arguments, grad mode as in the backward (off)."""
    _, module = block_pair()
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
    _, module = block_pair()
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
    eager, module = block_pair()
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
    _, module = block_pair()
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


def test_tied_parameters_of_two_callables_fire_once_per_pass_with_python_hooks():
    """Within one call the graphs training a parameter another callable trains hand autograd
    their gradients, so the hooks fire once per pass, after both gradients, as in eager."""
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
    for _ in range(2):  # the second onto the first's .grad
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
    eager, module = block_pair()
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


# --------------------------------------------------------------------------------------------
# Which hooks fire, and in what order, in every mode, against eager's (events of
# post-accumulate-grad hooks and of pre-hooks and hooks on the accumulator nodes, held as DDP
# and Megatron-core hold them).

MODES = {
    "default": {},
    "overlap": {"overlap_grad_accumulation": True},
    "relay": {"fuse_grad_accumulation": True},
    "python": {"fuse_grad_accumulation": True, "accumulator_hooks": "python"},
}
ALL_MODES = pytest.mark.parametrize("mode", list(MODES))


def _hook_events(modules, log: list) -> list:
    """Hook every parameter of ``modules`` (each once: tied ones under their first name) and
    its accumulator node; events ``(module index, name, kind)`` go to ``log``. Returns the
    nodes, to hold."""
    held, seen = [], set()
    for index, module in enumerate(modules):
        for name, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            key = (index, name)
            p.register_post_accumulate_grad_hook(lambda _, k=key: log.append((*k, "post")))
            node = _accumulator(p)
            node.register_prehook(lambda *_, k=key: log.append((*k, "pre")))
            node.register_hook(lambda *_, k=key: log.append((*k, "node")))
            held.append(node)
    return held


def _three_outputs_graphed(mode):
    """``ThreeOutputs`` (seeded), an eager copy, and the module graphed drop-in in ``mode``."""
    torch.manual_seed(0)
    module = ThreeOutputs()
    eager = copy.deepcopy(module)
    graphed = leangraph.make_graphed_callables(
        module, tuple(torch.randn(3, 4, requires_grad=True) for _ in range(2)), **MODES[mode])
    return module, eager, graphed


def _same_grads(got, want) -> bool:
    return all(
        (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad))
        for a, b in zip(got, want)
    )


@ALL_MODES
@pytest.mark.parametrize("used", [(0,), (1,), (2,), (0, 2), (0, 1, 2)], ids=str)
def test_hooks_fire_only_for_the_parameters_the_backward_reaches(mode, used):
    """A loss that leaves some outputs out: eager runs no accumulator for a parameter only
    those outputs reach (``.grad`` stays None, no hook fires). The replay's node has an edge
    to every parameter (or its relay), which autograd runs with no gradient; their hooks are
    passed over, so the same hooks fire, once each, and ``.grad`` is eager's, bitwise."""
    module, eager, graphed = _three_outputs_graphed(mode)
    logs: dict[str, list] = {"eager": [], "graphed": []}
    held = _hook_events([eager], logs["eager"]) + _hook_events([module], logs["graphed"])
    for step in range(3):
        x, z = torch.randn(3, 4), torch.randn(3, 4)
        for name, fn in (("graphed", graphed), ("eager", eager)):
            logs[name].append(("backward", step))
            outputs = fn(x.clone().requires_grad_(), z.clone().requires_grad_())
            sum(outputs[i].square().sum() for i in used).backward()
        assert _same_grads(module.parameters(), eager.parameters()), step
        if step == 1:
            module.zero_grad()
            eager.zero_grad()
    if mode in ("relay", "python"):
        assert logs["graphed"] == logs["eager"]  # eager's order too
    else:  # autograd's pick among a replay's accumulators (docs/concepts.md)
        assert sorted(logs["graphed"], key=str) == sorted(logs["eager"], key=str)
    assert len(logs["eager"]) > 3
    del held
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("mode", ["default", "overlap"])  # fused modes refuse tensor hooks
@pytest.mark.parametrize("eager_use", [False, True], ids=["alone", "eager-use"])
def test_a_parameters_tensor_hook_fires_only_where_a_gradient_reaches_it(mode, eager_use):
    """The loss uses the first output only: eager calls no tensor hook (``register_hook``)
    of a parameter only the others reach, unless eager code in the pass reaches it (then
    with that gradient). The replay hands such a parameter None, with which autograd would
    call the hook (``g * 0.5`` raised on it); the replay passes over it instead."""
    module, eager, graphed = _three_outputs_graphed(mode)
    logs: dict[str, list] = {"eager": [], "graphed": []}
    for name, m in (("eager", eager), ("graphed", module)):
        for key, p in m.named_parameters():
            p.register_hook(lambda g, k=key, log=logs[name]: log.append((k, g.clone())))
            p.register_hook(lambda g: g * 0.5)
    for step in range(3):
        x, z = torch.randn(3, 4), torch.randn(3, 4)
        for name, fn, m in (("graphed", graphed, module), ("eager", eager, eager)):
            logs[name].append(("backward", step))
            outputs = fn(x.clone().requires_grad_(), z.clone().requires_grad_())
            loss = outputs[0].square().sum()
            if eager_use:
                loss = loss + (m.side.weight * (step + 2)).square().sum()
            loss.backward()
        assert _same_grads(module.parameters(), eager.parameters()), step
    assert [e[0] for e in sorted(logs["graphed"], key=str)] == [
        e[0] for e in sorted(logs["eager"], key=str)]
    by_key = {name: {} for name in logs}
    for name, log in logs.items():
        for event in log:
            by_key[name].setdefault(event[0], []).append(event[1])
    for key, seen in by_key["eager"].items():
        got = by_key["graphed"][key]
        assert all(torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b
                   for a, b in zip(got, seen)), key
    assert ("side.weight" in by_key["graphed"]) is eager_use
    assert "head.weight" not in by_key["graphed"]
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("mode", ["default", "overlap", "relay"])
def test_a_parameter_the_graph_leaves_unreached_but_eager_code_reaches_fires_its_hooks(mode):
    """The loss uses the first output only, so the graph reaches neither ``side`` nor
    ``head``; eager code in the same pass reads ``side.weight`` (a weight tied to an eager
    head). Eager's backward runs that accumulator with the eager gradient, hooks and all; the
    replay passes over the hooks of its unreached parameters, but not of one a gradient
    reaches from elsewhere (they were all passed over, so Megatron's hook dropped the eager
    gradient from ``main_grad``)."""
    module, eager, graphed = _three_outputs_graphed(mode)
    logs: dict[str, list] = {"eager": [], "graphed": []}
    held = _hook_events([eager], logs["eager"]) + _hook_events([module], logs["graphed"])
    for step in range(3):
        x, z = torch.randn(3, 4), torch.randn(3, 4)
        for name, fn, m in (("graphed", graphed, module), ("eager", eager, eager)):
            logs[name].append(("backward", step))
            outputs = fn(x.clone().requires_grad_(), z.clone().requires_grad_())
            (outputs[0].square().sum() + (m.side.weight * (step + 2)).square().sum()).backward()
        assert _same_grads(module.parameters(), eager.parameters()), step
    assert module.side.bias.grad is None and module.head.weight.grad is None
    assert sorted(logs["graphed"], key=str) == sorted(logs["eager"], key=str)
    assert sum(e[1:] == ("side.weight", "node") for e in logs["graphed"]) == 3
    del held
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("mode", ["default", "relay", "python"])
def test_a_weight_step_fires_the_hooks_of_the_parameters_its_backward_reached(mode):
    """Zero-bubble weight steps: ``head`` gets a gradient, and its hooks fire, only in the
    microbatch whose loss used ``head(y)``, as in eager's weight step."""
    torch.manual_seed(0)
    eager = TwoOutputs()
    module = copy.deepcopy(eager)
    graphed = leangraph.make_graphed_callables(
        (module,),
        tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(2)),
        order=[1, 1, -1, -1.5, -1, -1.5],
        **MODES[mode],
    )
    logs: dict[str, list] = {"eager": [], "graphed": []}
    held = _hook_events([eager], logs["eager"]) + _hook_events([module], logs["graphed"])
    inputs = [torch.randn(4, 8) for _ in range(2)]
    outputs = [graphed[m](x) for m, x in enumerate(inputs)]
    for m, (y, h) in enumerate(outputs):
        for name in logs:
            logs[name].append(("microbatch", m))
        (y.sum() + (h.sum() if m == 1 else 0)).backward()
        graphed[m].backward_dw()
        y, h = eager(inputs[m])
        (y.sum() + (h.sum() if m == 1 else 0)).backward()
        assert _same_grads(module.parameters(), eager.parameters()), m
    if mode == "default":  # one node hands the weight step's gradients: autograd's pick
        assert sorted(logs["graphed"], key=str) == sorted(logs["eager"], key=str)
    else:
        assert logs["graphed"] == logs["eager"]
    assert ("microbatch", 1) in logs["eager"] and (0, "head.weight", "post") in logs["eager"]
    del held
    leangraph.reset_all(graphed)


class _Twice(torch.nn.Module):
    """A block that uses ``scale`` twice; ``lin.weight`` may be tied to another block's."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.scale = torch.nn.Parameter(torch.rand(width) + 0.5)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.lin(x * self.scale)) * self.scale)


def _passes(log: list) -> list[list]:
    """The events of each backward pass (``None`` separates them)."""
    passes: list[list] = [[]]
    for event in log:
        if event is None:
            passes.append([])
        else:
            passes[-1].append(event)
    return [p for p in passes if p]


def _interleaved_hook_logs(mode: str, tied: bool):
    """Eager and graphed runs of two steps of an interleaved 1F1B order (2 chunks x 2 layers,
    4 microbatches), every parameter and accumulator node hooked, ``None`` logged before each
    backward pass."""
    from leangraph.cli.local_pipeline import run_order
    from leangraph.order import Layout

    order = leangraph.schedules.interleaved_1f1b(pp_size=2, vp_size=2, rank=0, num_microbatches=4)
    torch.manual_seed(0)
    eager = [_Twice(8) for _ in range(4)]
    if tied:  # chunk 2's last layer shares chunk 1's first layer's weight
        eager[3].lin.weight = eager[0].lin.weight
    layers = copy.deepcopy(eager)
    layout = Layout((2, 2), 4)
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(layout.num_graphs))
    graphed = leangraph.make_graphed_callables(
        tuple(layers), samples, order=order, num_layers_per_chunk=2, **MODES[mode]
    )
    logs: dict[str, list] = {"eager": [], "graphed": []}
    held = _hook_events(eager, logs["eager"]) + _hook_events(layers, logs["graphed"])
    data = [torch.randn(4, 8) for _ in range(4)]

    def loss(out, m):
        return out.square().sum()

    for name, lookup in (
        ("eager", lambda c, m, l: eager[layout.callable_index(c, l)]),
        ("graphed", lambda c, m, l: graphed[layout.graph_index(c, m, l)]),
    ):
        log = logs[name]

        def marked(c, m, l, lookup=lookup, log=log):
            """The layer; the last of a chunk logs None before each backward pass."""
            layer = lookup(c, m, l)
            if l == 0:
                return layer

            def run(x):
                out = layer(x)
                out.register_hook(lambda _: log.append(None))
                return out

            return run

        for _ in range(2):
            run_order(order, [2, 2], marked, [d.clone() for d in data], loss)
    assert _same_grads(
        [p for m in layers for p in m.parameters()], [p for m in eager for p in m.parameters()]
    )
    return logs, held, graphed


@ALL_MODES
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hook_order_over_an_interleaved_step_as_in_eager(mode, tied):
    """The sequence of hook events over two interleaved-1F1B steps, against eager's: with the
    relay, or the hooks called by the replay, the same sequence; the layers tying a weight
    across callables hand autograd their gradients, as unfused graphs do. By default and with overlap_grad_accumulation,
    autograd picks the order among the accumulators of one replay (docs/concepts.md): the
    same events per backward pass, each layer's together, in eager's order of layers."""
    logs, held, graphed = _interleaved_hook_logs(mode, tied)
    eager, got = _passes(logs["eager"]), _passes(logs["graphed"])
    assert len(eager) == 2 * 2 * 4  # two steps of 4 microbatches x 2 chunks
    assert all(len(p) == 3 * 5 * 2 for p in eager[:2])  # 3 kinds x 5 parameters x 2 layers
    if mode in ("relay", "python") and not tied:
        assert got == eager
    else:
        assert [sorted(p, key=str) for p in got] == [sorted(p, key=str) for p in eager]
    if not tied:  # each layer's events together, the layers in eager's order
        assert [[e[0] for e in p] for p in got] == [[e[0] for e in p] for p in eager]
    del held
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("mode", ["default", "overlap", "relay", "python"])
def test_hooks_fire_once_per_backward_of_a_retained_graph(mode):
    """``backward(retain_graph=True)`` twice (captured with retain_graph_in_backward): every
    hook fires twice, and ``.grad`` holds both gradients, as in eager."""
    eager, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module,
        (torch.randn(4, 8, requires_grad=True),),
        retain_graph_in_backward=True,
        **MODES[mode],
    )
    logs: dict[str, list] = {"eager": [], "graphed": []}
    held = _hook_events([eager], logs["eager"]) + _hook_events([module], logs["graphed"])
    x = torch.randn(4, 8)
    for name, fn in (("graphed", graphed), ("eager", eager)):
        loss = fn(x.clone().requires_grad_()).square().sum()
        loss.backward(retain_graph=True)
        logs[name].append(None)
        loss.backward()
    assert _same_grads(module.parameters(), eager.parameters())
    eager_passes, got = _passes(logs["eager"]), _passes(logs["graphed"])
    assert len(eager_passes) == 2 and len(eager_passes[0]) == 3 * 6
    if mode in ("relay", "python"):
        assert got == eager_passes
    else:
        assert [sorted(p) for p in got] == [sorted(p) for p in eager_passes]
    del held
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("mode", ["default", "overlap"])
def test_torch_autograd_grad_fires_no_parameter_hook(mode):
    """``torch.autograd.grad`` with respect to the input accumulates into no parameter: no
    hook fires, ``.grad`` stays None, and the input's gradient is eager's. (Fused, the graph
    adds every gradient, so such a pass is refused: R18.)"""
    eager, module = block_pair()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(4, 8, requires_grad=True),), **MODES[mode]
    )
    logs: dict[str, list] = {"eager": [], "graphed": []}
    held = _hook_events([eager], logs["eager"]) + _hook_events([module], logs["graphed"])
    x = torch.randn(4, 8)
    grads = []
    for fn in (graphed, eager):
        xx = x.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(xx).square().sum(), xx)[0])
    assert torch.equal(grads[0], grads[1])
    assert logs["graphed"] == logs["eager"] == []
    assert all(p.grad is None for p in module.parameters())
    del held
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("mode", ["default", "relay"])
def test_hooks_passed_over_in_a_failed_pass_fire_in_the_next(mode):
    """A hook that raises ends a backward pass before autograd ran every accumulator: the
    hooks of an unreached parameter, passed over for that pass only, fire once in the next
    pass that reaches it, as eager's do."""
    torch.manual_seed(0)
    module = ThreeOutputs()
    graphed = leangraph.make_graphed_callables(
        module, tuple(torch.randn(3, 4, requires_grad=True) for _ in range(2)), **MODES[mode])
    fired: list[str] = []
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: fired.append(name))

    def fail(_):
        raise RuntimeError("hook failed")

    handle = module.body.bias.register_post_accumulate_grad_hook(fail)
    x, z = torch.randn(3, 4), torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="hook failed"):
        graphed(x, z)[0].sum().backward()  # side and head unreached
    assert "side.weight" not in fired
    handle.remove()
    fired.clear()
    sum(o.sum() for o in graphed(x, z)).backward()
    assert sorted(fired) == sorted(n for n, _ in module.named_parameters())
    leangraph.reset_all(graphed)
