"""What ``torch.cuda.make_graphed_callables`` documents and PyTorch's own tests exercise, in the
cases ``tests/test_parity.py`` (torch's three tests restated) and ``tests/test_parity_dropin.py``
(case by case against eager) leave out: outputs returned more than once, output containers of
every kind, one function graphed twice, one tensor given for two arguments, and torch's
sectioned model with BatchNorm sections under autocast at any warm-up count. Each runs a few
training steps (an SGD step between them) drop-in, with an order and with
``share_buffers=False``, and equals eager bitwise on the CPU reference backend; the ``cuda``
variants run the same steps on a GPU (``torch.testing.assert_close`` there)."""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from helpers import backward_keeping, sgd_history
from torch import nn
from torch.utils import _pytree as pytree

import leangraph

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, needs_cuda]),
]
MODES = ["drop-in", "ordered", "unshared"]


@dataclass
class Case:
    """``callables`` and ``samples`` as ``make_graphed_callables`` takes them; ``step(used)``
    runs one training step with the eager callables or the graphed ones and returns what
    must equal eager's (tensors are cloned at once: graphed outputs alias static buffers)."""

    callables: Any
    samples: Any
    step: Callable[[Any], list[Any]]
    params: list[torch.Tensor] = field(default_factory=list)
    capture_in: Callable[[], Any] = contextlib.nullcontext  # a context to capture in


def _options(case: Case, mode: str) -> dict[str, Any]:
    if mode == "unshared":
        return {"share_buffers": False}
    if mode == "ordered":  # each callable its own chunk: torch's replay order
        count = len(case.callables) if isinstance(case.callables, tuple) else 1
        options: dict[str, Any] = {"order": [*range(1, count + 1), *range(-count, 0)]}
        if count > 1:
            options["num_layers_per_chunk"] = [1] * count
        return options
    return {}


def _history(build: Callable[[str], Case], device: str, mode: str | None, steps: int = 3,
             **options: Any) -> list[list[Any]]:  # fmt: skip
    """``build``'s case from seed 0, graphed in ``mode`` (None: eager), ``steps`` steps each
    from its own seed; what every step returned, then the parameters."""
    torch.manual_seed(0)
    case = build(device)
    used = case.callables
    if mode is not None:
        options.update(_options(case, mode))
        if mode == "ordered" and not isinstance(case.callables, tuple):
            used, samples = (case.callables,), (case.samples,)
        else:
            samples = case.samples
        with case.capture_in():
            used = leangraph.make_graphed_callables(used, samples, **options)
        if mode == "ordered" and not isinstance(case.callables, tuple):
            used = used[0]
    history = sgd_history(case.params, lambda _: case.step(used), steps)
    if mode is not None:
        leangraph.reset_all(used)
    return history


def assert_like_eager(build: Callable[[str], Case], device: str, mode: str, **options: Any) -> None:
    """Graphed in ``mode``, ``build``'s case computes what eager computes: bitwise on the CPU."""
    if device == "cpu":
        options.setdefault("debug_outputs", True)  # and no read outside an output's window
    eager = _history(build, device, None)
    graphed = _history(build, device, mode, **options)
    assert len(eager) == len(graphed)
    for step, (want, got) in enumerate(zip(eager, graphed)):
        assert len(want) == len(got), step
        for item, (a, b) in enumerate(zip(want, got)):
            where = f"step {step} item {item}"
            if not isinstance(a, torch.Tensor):
                assert a == b, f"{where}: eager {a!r} graphed {b!r}"
            elif device == "cpu":
                assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {a} vs {b}"
            else:
                torch.testing.assert_close(b, a, msg=lambda m: f"{where}: {m}")


def _leaf(*shape: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, device=device, requires_grad=True)


# ----------------------------------------------------------- an output returned more than once


class _Twice(nn.Module):
    """Returns one intermediate in four places, as a module may hand back its hidden state
    beside a cache holding it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        y = self.lin(x)
        return y, y.tanh(), [y], {"again": y}


def _returned_twice(device: str) -> Case:
    module = _Twice().to(device)

    def step(used: Any) -> list[Any]:
        x = _leaf(3, 4, device=device)
        y, t, (same,), rest = used(x)
        identity = [same is y, rest["again"] is y]
        # Every use adds its gradient into y's: eager adds them in the order autograd runs
        # the uses' backwards, which the graphed callable must keep to be bitwise eager's.
        loss = y.square().sum() + (t * same).sum() + rest["again"].sin().sum()
        kept = backward_keeping([y, t], loss)
        return [*kept, *identity, x.grad, *(p.grad for p in module.parameters())]

    return Case(module, (_leaf(3, 4, device=device),), step, list(module.parameters()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_an_output_returned_more_than_once_is_one_tensor_as_in_eager(device, mode):
    """torch's graphs return a tensor per place, whose gradients the backward graph adds in
    its own order (other last bits than eager's); leangraph returns the one tensor eager
    returned, so autograd adds them as eager's does."""
    assert_like_eager(_returned_twice, device, mode)


@pytest.mark.parametrize("device", DEVICES)
def test_an_in_place_write_into_an_output_returned_twice_shows_in_both_as_in_eager(device):
    torch.manual_seed(0)
    module = _Twice().to(device)
    eager = copy.deepcopy(module)
    graphed = leangraph.make_graphed_callables(module, (_leaf(3, 4, device=device),))
    x = torch.randn(3, 4, device=device)
    with torch.no_grad():  # outputs that need no backward: free to write into
        y, _, (same,), _ = graphed(x)
        want, _, (want_same,), _ = eager(x)
        y.mul_(2)
        want.mul_(2)
        assert same is y and want_same is want
        torch.testing.assert_close(same, want_same, rtol=0, atol=0)
    leangraph.reset_all(graphed)


# ----------------------------------------------------------------- output containers, any kind

_Pair = collections.namedtuple("_Pair", "first second")


def _containers(x: torch.Tensor, w: torch.Tensor) -> list[Any]:
    h = x @ w
    return [
        _Pair(h.relu(), (h.sigmoid(),)),
        collections.OrderedDict(late=h * 2, early=h.exp()),
        (h.sum(),),
        {"deep": [h[0], (h[1:],)]},
    ]


def _output_containers(device: str) -> Case:
    # Small weights: with unit ones the exp and cube overflow by the second SGD step.
    w = (torch.randn(4, 4, device=device) * 0.1).requires_grad_()

    def step(used: Any) -> list[Any]:
        x = _leaf(3, 4, device=device)
        out = used(x, w)
        structure = pytree.tree_structure(out)  # list, namedtuple, OrderedDict order, ...
        pair, ordered, (total,), deep = out
        loss = pair.first.square().sum() + pair.second[0].sum() * 3 + ordered["late"].sum()
        loss = loss + ordered["early"].mean() + total * 2 + deep["deep"][0].pow(3).sum()
        loss = loss + deep["deep"][1][0].cos().sum()
        kept = backward_keeping(pytree.tree_leaves(out), loss * 0.01)  # SGD steps that stay small
        return [structure, list(ordered), *kept, x.grad, w.grad]

    return Case(_containers, (_leaf(3, 4, device=device), w), step, [w])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_outputs_come_back_in_the_containers_eager_returned(device, mode):
    """torch unflattens its outputs with the structure of capture: a list stays a list, a
    namedtuple its own type, an OrderedDict keeps its key order, a 1-tuple stays a tuple."""
    assert_like_eager(_output_containers, device, mode)


# ------------------------------------------------------------ a function graphed twice, tensors


def _gate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) * x


def _one_function_twice(device: str) -> Case:
    """One Python function in two places of the tuple (torch replaces no forward for a
    function, so each entry is a graph of its own), fed different shapes."""
    w1, w2 = _leaf(4, 4, device=device), _leaf(4, 4, device=device)

    def step(used: Any) -> list[Any]:
        x = _leaf(3, 4, device=device)
        y = used[1](used[0](x, w1).repeat(2, 1), w2)
        y = backward_keeping(y, y.square().sum())
        return [y, x.grad, w1.grad, w2.grad]

    samples = ((_leaf(3, 4, device=device), w1), (_leaf(6, 4, device=device), w2))
    return Case((_gate, _gate), samples, step, [w1, w2])


@pytest.mark.parametrize("mode", MODES)
def test_one_function_graphed_twice_in_a_tuple_trains_like_eager(mode):
    assert_like_eager(_one_function_twice, "cpu", mode)


def _same_tensor_twice(device: str) -> Case:
    """One tensor given for two arguments: eager adds both arguments' gradients into it."""
    w = _leaf(4, 4, device=device)

    def step(used: Any) -> list[Any]:
        x = _leaf(4, 4, device=device)
        y = used(x, x @ w)
        y = backward_keeping(y, y.square().sum())
        return [y, x.grad, w.grad]

    x = _leaf(4, 4, device=device)
    return Case(_gate, (x, x), step, [w])


@pytest.mark.parametrize("mode", MODES)
def test_one_tensor_for_two_arguments_trains_like_eager(mode):
    assert_like_eager(_same_tensor_twice, "cpu", mode)


# ------------------------------------------- torch's sectioned model, with BatchNorm sections


class _NormSection(nn.Module):
    """Linear, BatchNorm, Dropout: buffers updated by every training forward."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, d_out), nn.BatchNorm1d(d_out), nn.Dropout(0.2))

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(inputs["x"])


def _autocast(device: str) -> torch.autocast:
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    return torch.autocast(device, dtype=dtype, cache_enabled=False)


def _sectioned(device: str) -> Case:
    """torch's test model with statistics: a BatchNorm section called with a dict, a second
    BatchNorm section, two functions (relu, the loss), graphed as one tuple under autocast
    (its cache disabled), each sample in the dtype that section receives there."""
    first = _NormSection(8, 16).to(device)
    second = nn.Sequential(nn.Linear(16, 4), nn.BatchNorm1d(4)).to(device)
    relu, loss_fn = nn.functional.relu, nn.functional.mse_loss
    act = _autocast(device).fast_dtype
    h = torch.randn(6, 16, device=device, dtype=act, requires_grad=True)
    out = torch.randn(6, 4, device=device, dtype=act, requires_grad=True)  # BatchNorm keeps it
    target = torch.randn(6, 4, device=device)
    samples = (({"x": torch.randn(6, 8, device=device)},), (h,), (out,), (out, target))
    norms = [first.net[1], second[1]]
    params = [*first.parameters(), *second.parameters()]

    def step(used: Any) -> list[Any]:
        with _autocast(device):
            y = used[1](used[0]({"x": torch.randn(6, 8, device=device)}))
            loss = used[3](used[2](y), torch.randn(6, 4, device=device))
        kept = backward_keeping(loss, loss)
        stats = [t for n in norms for t in (n.running_mean, n.running_var, n.num_batches_tracked)]
        return [kept, *stats, *(p.grad for p in params), torch.rand(1, device=device)]

    return Case((first, second, relu, loss_fn), samples, step, params, lambda: _autocast(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["drop-in", "unshared"])
@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_sectioned_model_with_batch_norm_under_autocast_trains_like_eager(device, mode, warmup):
    """Every replay updates the running statistics as eager's step does, the dropout masks
    are eager's from the same seed, whatever number of warm-up passes ran; with the modules
    in eval mode afterwards they run eagerly, as torch's drop-in does."""
    assert_like_eager(_sectioned, device, mode, num_warmup_iters=warmup)
    torch.manual_seed(0)
    case = _sectioned(device)
    eager = copy.deepcopy(case.callables[:2])
    with case.capture_in():
        graphed = leangraph.make_graphed_callables(case.callables, case.samples,
                                                   num_warmup_iters=warmup)  # fmt: skip
    x = {"x": torch.randn(6, 8, device=device)}
    for modules in (case.callables[:2], eager):
        for module in modules:
            module.eval()
    with _autocast(device):
        got, want = graphed[1](graphed[0](x)), eager[1](eager[0](x))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    leangraph.reset_all(graphed)
