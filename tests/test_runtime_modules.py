"""A graphed module changed after capture (runtime.modules.ModuleWatch).

Graphs replay the kernels capture recorded, so a module's graphs stand for it only as it was:
its submodules in their places, each in its capture-time training mode, and no module hook
inside it. Without an order a graphed module's ``forward`` falls back to eager where a mode
differs (a submodule's too) and refuses a hook or a replaced submodule; with an order, where
the callables are no module's forward, each of them is refused, naming the callable and the
submodule.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import leangraph
from leangraph.schedules import one_f_one_b


class Net(nn.Module):
    """Batch norm and dropout, whose kernels depend on the training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.lin(x)))


def _graphed_and_eager() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = Net()
    graphed = copy.deepcopy(eager)
    leangraph.make_graphed_callables(graphed, (torch.randn(8, 6, requires_grad=True),))
    return graphed, eager


def _step(module: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, list]:
    torch.manual_seed(seed)
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.square().sum().backward()
    return out.detach(), [p.grad for p in module.parameters()]


@pytest.mark.parametrize("submodule", ["norm", "drop"])
def test_a_submodule_in_eval_mode_falls_back_to_eager(submodule: str) -> None:
    graphed, eager = _graphed_and_eager()
    x = torch.randn(8, 6, requires_grad=True)
    # In eval mode the module runs eagerly; back in the capture's modes the graphs replay
    # again, as eager trains.
    for seed, mode in ((1, "eval"), (2, "train")):
        for module in (graphed, eager):
            getattr(getattr(module, submodule), mode)()
        out, grads = _step(graphed, x, seed=seed)
        want, want_grads = _step(eager, x, seed=seed)
        assert torch.equal(out, want)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
        assert torch.equal(graphed.norm.running_mean, eager.norm.running_mean)


def _hook(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
    return output * 2


@pytest.mark.parametrize(
    ("register", "kind"),
    [
        (lambda m: m.lin.register_forward_hook(_hook), "_forward_hooks"),
        (lambda m: m.lin.register_forward_pre_hook(lambda mod, args: None), "_forward_pre_hooks"),
        (lambda m: m.norm.register_full_backward_hook(lambda mod, gi, go: None), "_backward_hooks"),
    ],
    ids=["forward", "forward-pre", "backward"],
)
def test_r21_a_submodule_hook_registered_after_capture_is_refused(register, kind: str) -> None:
    graphed, _ = _graphed_and_eager()
    handle = register(graphed)
    with pytest.raises(RuntimeError, match=rf"submodule '(lin|norm)' got {kind} since capture"):
        graphed(torch.randn(8, 6))
    handle.remove()
    graphed(torch.randn(8, 6)).sum().backward()  # replays again once it is gone


def test_a_hook_on_the_graphed_module_itself_runs_around_the_replay() -> None:
    graphed, eager = _graphed_and_eager()
    for module in (graphed, eager):
        module.register_forward_hook(_hook)
    x = torch.randn(8, 6)
    out, _ = _step(graphed, x, seed=3)
    want, _ = _step(eager, x, seed=3)
    assert torch.equal(out, want)


def test_r21_a_global_module_hook_registered_after_capture_is_refused() -> None:
    graphed, _ = _graphed_and_eager()
    handle = nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)
    try:
        with pytest.raises(RuntimeError, match="global module hooks were registered since "
                                               r"capture \(_global_forward_hooks\)"):
            graphed(torch.randn(8, 6))
    finally:
        handle.remove()


def test_r21_a_submodule_replaced_after_capture_is_refused() -> None:
    graphed, _ = _graphed_and_eager()
    graphed.lin = nn.Linear(6, 6)
    with pytest.raises(RuntimeError, match="submodule 'lin' must be the module it was captured "
                                           "with, got another Linear"):
        graphed(torch.randn(8, 6))


class _Optional(nn.Module):
    """A linear layer without bias, a buffer and a submodule registered as None: eager's
    forward uses what is set there later."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6, bias=False)
        self.register_buffer("shift", None)
        self.post = None  # a plain attribute: a submodule set later is a new entry

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.shift is not None:
            y = y + self.shift
        return y if self.post is None else self.post(y)


@pytest.mark.parametrize(("fill", "message"), [
    (lambda m: setattr(m.lin, "bias", nn.Parameter(torch.ones(6))),
     "parameter 'lin.bias' was None at capture and is a Parameter now"),
    (lambda m: setattr(m, "shift", torch.ones(6)),
     "buffer 'shift' was None at capture and is a Tensor now"),
    (lambda m: setattr(m, "post", nn.Linear(6, 6)),
     "submodule 'post' was added since capture \\(a Linear\\); the graphs were captured "
     "without it, so"),
])
def test_r21_a_slot_none_at_capture_and_set_since_is_refused(fill, message) -> None:
    """Before, the replay ran as captured: without the new bias (which got no gradient),
    shift or submodule, where eager's forward uses them."""
    torch.manual_seed(0)
    module = _Optional()
    leangraph.make_graphed_callables(module, (torch.randn(8, 6, requires_grad=True),))
    module(torch.randn(8, 6)).sum().backward()  # as captured: replays
    fill(module)
    with pytest.raises(RuntimeError, match=r"callable 0 \(_Optional\): " + message + ".*"
                       "a replay would neither (use|run) nor train it"):
        module(torch.randn(8, 6))
    leangraph.reset_all([module])


def _ordered() -> tuple[tuple[Net, ...], tuple]:
    torch.manual_seed(0)
    layers = (Net(), Net())
    samples = tuple((torch.randn(8, 6, requires_grad=True),) for _ in range(2 * 2))
    graphed = leangraph.make_graphed_callables(
        layers, samples, order=one_f_one_b(1, 0, 2), num_layers_per_chunk=2)
    return layers, graphed


def test_r21_with_an_order_a_mode_switched_after_capture_is_refused() -> None:
    layers, graphed = _ordered()
    layers[1].drop.eval()
    x = torch.randn(8, 6, requires_grad=True)
    hidden = graphed[0](x)  # layer 0 is as captured
    with pytest.raises(RuntimeError, match=r"graph \(chunk 1, microbatch 0, layer 1\): "
                                           "submodule 'drop' is in eval mode but was captured "
                                           "in training mode"):
        graphed[1](hidden)
    layers[1].drop.train()
    layers[0].eval()
    with pytest.raises(RuntimeError, match="the module is in eval mode but was captured in "
                                           "training mode; its graphs replay the kernels of "
                                           "the captured modes"):
        graphed[0](x)
    leangraph.reset_all(graphed)


def test_r21_with_an_order_a_hook_on_the_layer_itself_is_refused() -> None:
    """The callables replace the layers: nothing would run a hook on the layer module."""
    layers, graphed = _ordered()
    layers[0].register_forward_hook(_hook)
    with pytest.raises(RuntimeError, match=r"layer 0\): the module got _forward_hooks since "
                                           "capture"):
        graphed[0](torch.randn(8, 6, requires_grad=True))
    leangraph.reset_all(graphed)


def test_r13_with_an_order_a_parameter_replaced_after_capture_is_refused() -> None:
    layers, graphed = _ordered()
    layers[0].lin.weight = nn.Parameter(torch.randn(6, 6))
    with pytest.raises(RuntimeError, match="parameter 'lin.weight' must be the tensor it was "
                                           "captured with"):
        graphed[0](torch.randn(8, 6, requires_grad=True))
    leangraph.reset_all(graphed)


@pytest.mark.parametrize(
    "change",
    [lambda m: m.half(), lambda m: m.to(torch.float64),
     lambda m: setattr(m.lin.weight, "data", torch.randn(6, 6))],
    ids=["half", "to-float64", "data-assigned"],
)
def test_r13_a_parameter_whose_data_was_swapped_after_capture_is_refused(change) -> None:
    graphed, _ = _graphed_and_eager()
    change(graphed)
    with pytest.raises(RuntimeError, match="parameter 'lin.weight' must keep the data it was "
                                           "captured with, got other memory"):
        graphed(torch.randn(8, 6))


def test_data_changed_in_place_is_what_the_graphs_read() -> None:
    """``load_state_dict`` and optimizers write parameters in place: the same memory."""
    graphed, eager = _graphed_and_eager()
    state = {k: v + 1 if v.is_floating_point() else v for k, v in eager.state_dict().items()}
    for module in (graphed, eager):
        module.load_state_dict(state)
    x = torch.randn(8, 6)
    assert torch.equal(_step(graphed, x, seed=4)[0], _step(eager, x, seed=4)[0])


@pytest.mark.parametrize(("at_capture", "at_replay"), [(False, True), (True, False)],
                         ids=["captured-off", "captured-on"])
def test_r22_a_replay_under_another_autocast_than_capture_is_refused(at_capture, at_replay):
    """The graphs run the kernels and precision capture chose: under another autocast eager
    would compute differently, so the replay refuses instead."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 6)

    def autocast(on: bool):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on, cache_enabled=False)

    with autocast(at_capture):
        graphed = leangraph.make_graphed_callables(layer, (torch.randn(8, 6, requires_grad=True),))
    with autocast(at_replay), pytest.raises(RuntimeError, match=(
            r"callable 0 \(Linear\) was captured with autocast "
            + ("on \\(torch.bfloat16\\)" if at_capture else "off") + " for cpu but is replayed "
            "with it " + ("on \\(torch.bfloat16\\)" if at_replay else "off"))):
        graphed(torch.randn(8, 6))
    with autocast(at_capture):  # under capture's autocast it replays
        graphed(torch.randn(8, 6)).float().sum().backward()


class Rope(nn.Module):
    """A buffer the forward reads (a rotary frequency table), next to a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.cos(self.freq)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _rope(device: str) -> tuple[Rope, Rope]:
    torch.manual_seed(0)
    eager = Rope().to(device)
    graphed = copy.deepcopy(eager)
    leangraph.make_graphed_callables(graphed, (torch.randn(4, 8, device=device,
                                                           requires_grad=True),))
    return graphed, eager


def _remove(module: Rope) -> None:
    del module.freq


def _assign_state(module: Rope) -> None:
    """A checkpoint loaded by assignment: the parameters as they are, the buffer a new one."""
    state = module.state_dict(keep_vars=True)
    state["freq"] = state["freq"].clone()
    module.load_state_dict(state, assign=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: setattr(m, "freq", m.freq * 4), "buffer 'freq' was replaced after capture "
                                                   r"\(another Tensor, torch.float32 on"),
        (lambda m: m.register_buffer("freq", m.freq.clone()), "buffer 'freq' was replaced"),
        (lambda m: m.freq.__setattr__("data", m.freq * 4), "buffer 'freq' must keep the data "
                                                           "it was captured with, got other "
                                                           "memory"),
        (_assign_state, "buffer 'freq' was replaced after capture"),
        (_remove, "buffer 'freq' was removed after capture"),
    ],
    ids=["assigned", "registered-again", "data-assigned", "load-state-dict-assign", "removed"],
)
def test_r23_a_buffer_replaced_or_moved_after_capture_is_refused(device, change, message):
    graphed, _ = _rope(device)
    captured, memory = graphed.freq, graphed.freq.data
    change(graphed)
    x = torch.randn(4, 8, device=device)
    with pytest.raises(RuntimeError, match=r"callable 0 \(Rope\): " + message + ".*the graphs "
                                           "(still )?read the captured tensor's memory") as info:
        graphed(x)
    if "removed" not in message:
        assert "Update it in place (buf.copy_(new)), or capture again" in str(info.value)
    # The captured tensor back in its place, on its memory: the graphs replay again.
    captured.data = memory
    graphed.register_buffer("freq", captured)
    graphed(x).sum().backward()


def test_r23_with_an_order_a_buffer_replaced_after_capture_is_refused() -> None:
    layers, graphed = _ordered()
    layers[1].norm.running_mean = torch.zeros(6)
    hidden = graphed[0](torch.randn(8, 6, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"graph \(chunk 1, microbatch 0, layer 1\): buffer "
                                           "'norm.running_mean' was replaced after capture"):
        graphed[1](hidden)
    leangraph.reset_all(graphed)


class Counter(nn.Module):
    """A forward that replaces its buffer instead of updating it in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return self.lin(x) * self.count


def test_r23_a_forward_that_replaces_its_own_buffer_is_refused_at_replay() -> None:
    """A replay runs the captured kernels, not the assignment: the count would stop. (With
    warm-up, the assignment is refused before capture: W13, tests/test_build_builder.py.)"""
    module = Counter()
    leangraph.make_graphed_callables(
        module, (torch.randn(2, 4, requires_grad=True),), num_warmup_iters=0
    )
    with pytest.raises(RuntimeError, match="buffer 'count' was replaced after capture.*or by "
                                           "the forward itself, whose assignment a replay does "
                                           "not run"):
        module(torch.randn(2, 4))


@pytest.mark.parametrize("device", DEVICES)
def test_a_buffer_updated_in_place_after_capture_is_what_the_graphs_read(device) -> None:
    graphed, eager = _rope(device)
    x = torch.randn(4, 8, device=device)
    for module in (graphed, eager):
        module.freq.mul_(4)  # a rope rescale, in place
    assert torch.equal(graphed(x), eager(x))
    for module in (graphed, eager):
        module.freq.copy_(torch.linspace(1.0, 2.0, 8))
    assert torch.equal(graphed(x), eager(x))
