"""Drop-in parity with eager, case by case: what a demanding user of
``torch.cuda.make_graphed_callables`` tries, graphed by leangraph without an order (torch's
drop-in) and with one (each callable its own chunk: ``[1, ..., n, -n, ..., -1]``, torch's
replay order), some also with ``share_buffers=False`` (torch's buffer model), trained for a
few steps with an optimizer step between them, every output, gradient, parameter and buffer
bitwise equal to eager's on the CPU reference backend, with ``debug_outputs=True`` refusing
any read of an output after its window. ``tests/test_parity.py`` restates torch's own tests;
refusals are tested where they are raised (docs/errors.md)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from helpers import backward_keeping, detached_copy, sgd_history
from torch import nn

import leangraph

MODES = ["drop-in", "ordered"]
# share_buffers=False too, where the buffer model shows: outputs and inputs in every form.
ALL_MODES = [*MODES, "unshared"]


@dataclass
class Case:
    """What one case graphs and how a training step uses it.

    ``step(used, step)`` runs one step with ``used`` (the eager callables, or what
    ``make_graphed_callables`` returned, in the form ``callables`` was given) and returns
    what must equal eager's: tensors are cloned at once (graphed outputs alias static
    buffers), anything else is compared with ``==``."""

    callables: Any
    samples: Any
    step: Callable[[Any, int], list[Any]]
    params: list[torch.Tensor] = field(default_factory=list)
    sample_kwargs: Any = None


def _capture(case: Case, mode: str, **options: Any) -> Any:
    if case.sample_kwargs is not None:
        options["sample_kwargs"] = case.sample_kwargs
    if mode == "unshared":
        options["share_buffers"] = False
    elif mode == "ordered":
        count = len(case.callables) if isinstance(case.callables, tuple) else 1
        options["order"] = [*range(1, count + 1), *range(-count, 0)]
        if count > 1:
            options["num_layers_per_chunk"] = [1] * count
    return leangraph.make_graphed_callables(
        case.callables, case.samples, debug_outputs=True, **options
    )


def _run(build: Callable[[], Case], mode: str | None, steps: int, **options: Any) -> list:
    """Build the case from seed 0, graph it (``mode`` None: eager), run ``steps`` steps, each
    from its own seed, an SGD step after each; what every step returned, then the
    parameters."""
    torch.manual_seed(0)
    case = build()
    used = case.callables if mode is None else _capture(case, mode, **options)
    history = sgd_history(case.params, lambda step: case.step(used, step), steps)
    if mode is not None:
        leangraph.reset_all(used)
    return history


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def assert_parity(build: Callable[[], Case], mode: str, steps: int = 3, **options: Any) -> None:
    """``build``'s case graphed in ``mode`` equals eager bitwise, step by step."""
    eager = _run(build, None, steps)
    graphed = _run(build, mode, steps, **options)
    assert len(eager) == len(graphed)
    for step, (want, got) in enumerate(zip(eager, graphed)):
        assert len(want) == len(got), step
        for item, (a, b) in enumerate(zip(want, got)):
            assert _same(a, b), f"step {step} item {item}: eager {a!r} graphed {b!r}"


def _leaf(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def _single(used: Any) -> Any:
    return used[0] if isinstance(used, tuple) else used


# ----------------------------------------------------------------- callables and return forms


def _project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w + b)


def _function_with_weights(as_tuple: bool) -> Case:
    """A plain function whose weights are arguments that require grad."""
    w, b = _leaf(4, 4), _leaf(4)

    def step(used: Any, _: int) -> list[Any]:
        x = _leaf(3, 4)
        y = _single(used)(x, w, b)
        y = backward_keeping(y, y.square().sum())
        return [y, x.grad, w.grad, b.grad]

    samples = (_leaf(3, 4), w, b)
    if as_tuple:
        return Case((_project,), (samples,), step, [w, b])
    return Case(_project, samples, step, [w, b])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("as_tuple", [False, True], ids=["single", "tuple"])
def test_a_function_with_weight_arguments_trains_like_eager(mode, as_tuple):
    assert_parity(lambda: _function_with_weights(as_tuple), mode)


def _doubled_gelu(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x) * 2


def _mixed() -> Case:
    """Module, function, module, each feeding the next."""
    first, last = nn.Linear(4, 6), nn.Linear(6, 3)
    params = [*first.parameters(), *last.parameters()]

    def step(used: Any, _: int) -> list[Any]:
        x = _leaf(2, 4)
        y = used[2](used[1](used[0](x)))
        y = backward_keeping(y, y.square().sum())
        return [y, x.grad, *(p.grad for p in params)]

    samples = ((_leaf(2, 4),), (_leaf(2, 6),), (_leaf(2, 6),))
    return Case((first, _doubled_gelu, last), samples, step, params)


@pytest.mark.parametrize("mode", MODES)
def test_modules_and_functions_mixed_train_like_eager(mode):
    assert_parity(_mixed, mode)


def _same_module_twice() -> Case:
    """One module applied twice (a weight-shared layer): two layers of one chunk."""
    layer = nn.Linear(4, 4)

    def step(used: Any, _: int) -> list[Any]:
        x = _leaf(2, 4)
        y = used[1](used[0](x))
        y = backward_keeping(y, y.square().sum())
        return [y, x.grad, layer.weight.grad, layer.bias.grad]

    return Case((layer, layer), ((_leaf(2, 4),), (_leaf(2, 4),)), step, list(layer.parameters()))


def test_the_same_module_twice_trains_like_eager_with_an_order():
    """Without an order torch's drop-in replaces the module's forward once per entry, so the
    module would replay the last graph for both (refused: V7, tests/test_call.py); with an
    order each entry is a graph of its own."""
    torch.manual_seed(0)
    eager = _run(_same_module_twice, None, 3)
    torch.manual_seed(0)
    case = _same_module_twice()
    graphed = leangraph.make_graphed_callables(
        case.callables, case.samples, order=[1, -1], num_layers_per_chunk=2
    )
    history = sgd_history(case.params, lambda step: case.step(graphed, step), 3)
    for want, got in zip(eager, history):
        assert all(_same(a, b) for a, b in zip(want, got))
    leangraph.reset_all(graphed)


class _Tied(nn.Module):
    def __init__(self, weight: nn.Parameter, transpose: bool) -> None:
        super().__init__()
        self.weight, self.transpose = weight, transpose
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ (self.weight.t() if self.transpose else self.weight) + self.bias)


def _tied() -> Case:
    """One parameter registered in two graphed modules (tied input and output projections)."""
    weight = nn.Parameter(torch.randn(4, 4))
    embed, head = _Tied(weight, False), _Tied(weight, True)
    params = [weight, embed.bias, head.bias]

    def step(used: Any, _: int) -> list[Any]:
        x = _leaf(2, 4)
        y = used[1](used[0](x))
        y = backward_keeping(y, y.square().sum())
        return [y, x.grad, *(p.grad for p in params)]

    return Case((embed, head), ((_leaf(2, 4),), (_leaf(2, 4),)), step, params)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_parameter_shared_by_two_callables_trains_like_eager(mode):
    assert_parity(_tied, mode)


# ----------------------------------------------------------------------------------- outputs


class _Many(nn.Module):
    """Every kind of output: nested containers, outputs that need no gradient, an input
    returned as is (one that requires grad and one that does not), views of an output, a
    transposed output, integer outputs, a 0-dim count."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        y = self.lin(x)
        return {
            "y": y,
            "pair": [y.tanh(), (x, y.detach() * 2)],
            "view": y[:, :2],
            "t": y.t(),
            "argmax": y.argmax(-1),
            "count": (mask > 0).sum(),
            "mask": mask,
        }


def _many_outputs() -> Case:
    module = _Many()

    def step(used: Any, _: int) -> list[Any]:
        x, mask = _leaf(3, 4), torch.randn(3, 4)
        out = _single(used)(x, mask)
        tanh, (same_x, frozen) = out["pair"]
        flags = [t.requires_grad for t in (out["y"], tanh, same_x, frozen, out["argmax"])]
        loss = out["y"].square().sum() + tanh.sum() + out["view"].pow(3).sum()
        loss = loss + (out["t"] * 3).sum() + same_x.pow(2).sum()
        others = [out[k] for k in ("y", "view", "t", "argmax", "count", "mask")]
        kept = backward_keeping([*others, tanh, same_x, frozen, out["t"].stride()], loss)
        return [*kept, x.grad, module.lin.weight.grad, *flags]

    return Case(module, (_leaf(3, 4), torch.randn(3, 4)), step, list(module.parameters()))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_nested_outputs_of_every_kind_train_like_eager(mode):
    assert_parity(_many_outputs, mode)


def _input_views(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x[:, 1:], x.t(), y, x.view(-1), x * y


def _views_of_inputs() -> Case:
    def step(used: Any, _: int) -> list[Any]:
        x, y = _leaf(3, 4), _leaf(3, 4)
        outs = _single(used)(x, y)
        a, b, c, d, e = outs
        loss = a.pow(2).sum() + (b * 3).sum() + c.pow(3).sum() + d.sin().sum() + e.sum()
        kept = backward_keeping([*outs, a.stride(), b.stride()], loss)
        return [*kept, x.grad, y.grad]

    return Case(_input_views, (_leaf(3, 4), _leaf(3, 4)), step)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_views_of_inputs_and_an_input_returned_as_is_train_like_eager(mode):
    assert_parity(_views_of_inputs, mode)


class _Pooled(nn.Module):
    """Hidden states and views of them (a pooled column, a flat slice, the transpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.proj(x)
        return y, y[:, 0], y.view(-1)[2:7], y.t()


def _assert_trains_as_eager(
    make: Callable[[], nn.Module], mode: str, device: str, step: Callable[..., list[Any]]
) -> None:
    """Three steps of ``step(called, x)`` (it runs the backward and returns what to compare)
    through an eager module from ``make`` and a graphed copy captured in ``mode``: what it
    returns, the input's and the parameters' gradients are eager's, bitwise on the CPU, on
    CUDA within a float's rounding (cuBLAS may pick other kernels for the captured matmuls)."""
    torch.manual_seed(0)
    eager = make().to(device)
    layer = copy.deepcopy(eager)
    options: dict[str, Any] = {"share_buffers": False} if mode == "unshared" else {}
    if mode == "ordered":
        options["order"] = [1, -1]
    sample = _leaf(3, 4).to(device).detach().requires_grad_()
    graphed = leangraph.make_graphed_callables(layer, (sample,), **options)
    for index in range(3):
        x = _leaf(3, 4).to(device)
        results = []
        for used, model in ((eager, eager), (graphed, layer)):
            x_used = x.detach().requires_grad_()
            kept = step(used, x_used)
            results.append([*kept, x_used.grad, *(p.grad.clone() for p in model.parameters())])
            model.zero_grad()
        for a, b in zip(*results):
            if device == "cpu":
                assert torch.equal(a, b), index
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {index}")
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_outputs_that_view_another_output_share_its_memory_as_in_eager(mode, device):
    """Eager's outputs share memory, so a write into one shows in the others and in their
    gradients; the replay's do too. (Not with debug_outputs=True, whose guarded outputs
    autograd refuses to write into in place.)"""

    def step(used: Any, x: torch.Tensor) -> list[Any]:
        y, first, flat, transposed = used(x)
        first.mul_(3)  # in place on a view: y, flat and transposed see it
        assert torch.equal(y[:, 0], first) and torch.equal(transposed.t(), y)
        assert torch.equal(y.view(-1)[2:7], flat)
        loss = y.square().sum() + flat.sin().sum() + (transposed * 2).sum()
        loss.backward()
        return [loss]

    _assert_trains_as_eager(_Pooled, mode, device, step)


class _Halves(nn.Module):
    """Two overlapping views of a tensor the forward does not return."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.proj(x)
        return y[:2], y[1:]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_outputs_viewing_an_unreturned_tensor_share_its_memory_on_both_backends(mode, device):
    """Outputs viewing one tensor the callable does not return are not linked as views (no
    output to view), but they share memory as the graph's tensors did: a write into the row
    they overlap in shows in both, on the CPU backend as on CUDA. Without such a write the
    gradients are eager's."""

    def step(used: Any, x: torch.Tensor) -> list[Any]:
        top, bottom = used(x)
        assert top.untyped_storage().data_ptr() == bottom.untyped_storage().data_ptr()
        (top.square().sum() + bottom.sin().sum()).backward()
        kept = [top.detach().clone(), bottom.detach().clone()]
        with torch.no_grad():
            top[1].fill_(7.0)
        assert torch.equal(bottom[0], torch.full((4,), 7.0, device=x.device))
        return kept

    _assert_trains_as_eager(_Halves, mode, device, step)


class _DetachedAndReinterpreted(nn.Module):
    """Outputs sharing another output's memory that are not views autograd differentiates
    through: a detached copy for metrics, a detached slice, the bits as int32."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.proj(x)
        return y, y.detach(), y.detach()[:, 0], y.view(torch.int32)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_detached_and_dtype_views_of_an_output_come_back_as_eager_returned_them(mode):
    """A detached view needs no gradient and a reinterpreting view has its own dtype, in
    the replay as in eager: a loss over every output gets eager's gradients, and a write
    into the detached one shows in the output it shares memory with."""

    def step(used: Any, x: torch.Tensor) -> list[Any]:
        outputs = used(x)
        y, detached, column, bits = outputs
        assert [o.requires_grad for o in outputs] == [True, False, False, False]
        assert bits.dtype == torch.int32 and torch.equal(bits, y.detach().view(torch.int32))
        detached.mul_(2)  # shares y's memory, as in eager
        assert torch.equal(y.detach(), detached) and torch.equal(column, y[:, 0].detach())
        loss = y.square().sum() + detached.sum() + column.sum()
        loss.backward()
        return [loss]

    _assert_trains_as_eager(_DetachedAndReinterpreted, mode, "cpu", step)


def _mse(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(y, target)


def _scalar_loss() -> Case:
    def step(used: Any, _: int) -> list[Any]:
        y, target = _leaf(4, 3), torch.randn(4, 3)
        loss = _single(used)(y, target)
        loss = backward_keeping(loss, loss)  # a 0-dim output: its implicit gradient of 1
        return [loss, y.grad]

    return Case(_mse, (_leaf(4, 3), torch.randn(4, 3)), step)


@pytest.mark.parametrize("mode", MODES)
def test_a_graphed_scalar_loss_backs_off_its_implicit_gradient_like_eager(mode):
    assert_parity(_scalar_loss, mode)


# ------------------------------------------------------------------------------------ inputs


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * scale + bias


def _inputs_without_grad() -> Case:
    """An input that does not require grad between two that do."""
    module = _Gate()

    def step(used: Any, _: int) -> list[Any]:
        x, scale, bias = _leaf(2, 4), torch.randn(2, 4), _leaf(4)
        y = _single(used)(x, scale, bias)
        y = backward_keeping(y, y.square().sum())
        return [y, x.grad, scale.grad, bias.grad, *(p.grad for p in module.parameters())]

    samples = (_leaf(2, 4), torch.randn(2, 4), _leaf(4))
    return Case(module, samples, step, list(module.parameters()))


def _first_layer() -> Case:
    """No input requires grad (a first layer): only the parameters get gradients."""
    module = nn.Linear(4, 4)

    def step(used: Any, _: int) -> list[Any]:
        y = _single(used)(torch.randn(2, 4))
        y = backward_keeping(y, y.square().sum())
        return [y, module.weight.grad, module.bias.grad]

    return Case(module, (torch.randn(2, 4),), step, list(module.parameters()))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("build", [_inputs_without_grad, _first_layer], ids=["some", "none"])
def test_inputs_that_do_not_require_grad_get_none_as_in_eager(mode, build):
    assert_parity(build, mode)


def _ignores_z(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return x * 2


def _unused_input() -> Case:
    def step(used: Any, _: int) -> list[Any]:
        x, z = _leaf(3), _leaf(3)
        y = _single(used)(x, z)
        y = backward_keeping(y, y.sum())
        return [y, x.grad, z.grad]  # z.grad stays None, as in eager

    return Case(_ignores_z, (_leaf(3), _leaf(3)), step)


@pytest.mark.parametrize("mode", MODES)
def test_an_unused_input_allowed_gets_no_gradient_as_in_eager(mode):
    assert_parity(_unused_input, mode, allow_unused_input=True)


class _Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * mask * scale


def _keywords() -> Case:
    """sample_kwargs, called with the keywords in another order than the samples'."""
    module = _Keywords()

    def step(used: Any, _: int) -> list[Any]:
        x, mask, scale = _leaf(2, 4), torch.randn(2, 4), _leaf(4)
        y = _single(used)(x, scale=scale, mask=mask)
        y = backward_keeping(y, y.square().sum())
        return [y, x.grad, scale.grad, module.lin.weight.grad]

    return Case(
        (module,), ((_leaf(2, 4),),), step, list(module.parameters()),
        sample_kwargs=({"mask": torch.randn(2, 4), "scale": _leaf(4)},),
    )  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_keyword_arguments_in_any_order_train_like_eager(mode):
    assert_parity(_keywords, mode)


def _transposed() -> Case:
    """A non-contiguous input (a transposed view of a leaf), as the sample was: bitwise. (One
    of the sample's shape but other strides is copied into the sample's layout, and may
    differ in the last bits: docs/concepts.md.)"""
    module = nn.Linear(4, 4)

    def step(used: Any, _: int) -> list[Any]:
        base = _leaf(4, 2)
        y = _single(used)(base.t())
        y = backward_keeping(y, y.square().sum())
        return [y, base.grad, module.weight.grad]

    return Case(module, (_leaf(4, 2).t(),), step, list(module.parameters()))


def _scalars_and_masks(
    x: torch.Tensor, s: torch.Tensor, flag: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return (x * s).where(flag, -x)[index], s * s


def _small_tensors() -> Case:
    """A 0-dim tensor that requires grad, a bool mask and an int64 index."""

    def step(used: Any, step: int) -> list[Any]:
        x, s = _leaf(3, 4), torch.tensor(step + 0.5, requires_grad=True)
        flag, index = torch.rand(3, 4) > 0.5, torch.randint(0, 3, (2,))
        a, b = _single(used)(x, s, flag, index)
        a, b = backward_keeping((a, b), a.square().sum() + b)
        return [a, b, x.grad, s.grad]

    samples = (_leaf(3, 4), torch.tensor(2.0, requires_grad=True), torch.rand(3, 4) > 0.5,
               torch.tensor([2, 0]))  # fmt: skip
    return Case(_scalars_and_masks, samples, step)


def _embedding() -> Case:
    """Integer token ids in, through an embedding."""
    module = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))

    def step(used: Any, _: int) -> list[Any]:
        y = _single(used)(torch.randint(0, 10, (2, 3)))
        y = backward_keeping(y, y.square().sum())
        return [y, *(p.grad for p in module.parameters())]

    return Case(module, (torch.randint(0, 10, (2, 3)),), step, list(module.parameters()))


def _empty_batch() -> Case:
    module = nn.Linear(4, 4)

    def step(used: Any, _: int) -> list[Any]:
        x = _leaf(0, 4)
        y = _single(used)(x)
        y = backward_keeping(y, y.sum())
        return [y, x.grad, module.weight.grad]

    return Case(module, (_leaf(0, 4),), step, list(module.parameters()))


def _channels_last() -> Case:
    module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())

    def sample() -> torch.Tensor:
        return torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last).requires_grad_()

    def step(used: Any, _: int) -> list[Any]:
        x = sample()
        y = _single(used)(x)
        y, stride = backward_keeping((y, y.stride()), y.square().sum())
        return [y, stride, x.grad, module[1].running_var, *(p.grad for p in module.parameters())]

    return Case(module, (sample(),), step, list(module.parameters()))


def _in_dtype(dtype: torch.dtype) -> Callable[[], Case]:
    def build() -> Case:
        module = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.LayerNorm(4)).to(dtype)

        def step(used: Any, _: int) -> list[Any]:
            x = _leaf(2, 4, dtype=dtype)
            y = _single(used)(x)
            y = backward_keeping(y, y.square().sum())
            return [y, x.grad, *(p.grad for p in module.parameters())]

        return Case(module, (_leaf(2, 4, dtype=dtype),), step, list(module.parameters()))

    return build


def _complex_fn(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (z * z.conj()).real.sum(-1), z.abs()


def _complex() -> Case:
    def step(used: Any, _: int) -> list[Any]:
        z = _leaf(3, 4, dtype=torch.cfloat)
        a, b = _single(used)(z)
        a, b = backward_keeping((a, b), a.sum() + b.sum())
        return [a, b, z.grad]

    return Case(_complex_fn, (_leaf(3, 4, dtype=torch.cfloat),), step)


INPUT_CASES = {
    "transposed": _transposed,
    "0-dim-bool-int": _small_tensors,
    "embedding-ids": _embedding,
    "empty-batch": _empty_batch,
    "channels-last": _channels_last,
    "float64": _in_dtype(torch.float64),
    "bfloat16": _in_dtype(torch.bfloat16),
    "complex": _complex,
}


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("name", list(INPUT_CASES))
def test_inputs_of_every_layout_and_dtype_train_like_eager(mode, name):
    assert_parity(INPUT_CASES[name], mode)


# ------------------------------------------------------------------------------------ modules


def _norm_stack(train: bool = True, p: float = 0.0) -> Callable[[], Case]:
    """Linear, BatchNorm, Dropout(p), Linear; in training or eval mode at capture."""

    def build() -> Case:
        module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(p), nn.Linear(4, 4))
        module.train(train)
        norm = module[1]

        def step(used: Any, _: int) -> list[Any]:
            x = _leaf(8, 4)
            y = _single(used)(x)
            y = backward_keeping(y, y.square().sum())
            stats = [norm.running_mean, norm.running_var, norm.num_batches_tracked]
            return [y, x.grad, *stats, *(p.grad for p in module.parameters()), torch.rand(1)]

        return Case(module, (_leaf(8, 4),), step, list(module.parameters()))

    return build


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_batch_norm_statistics_advance_like_eager_at_any_warmup(mode, warmup):
    """Every replay updates the running statistics as an eager step does; warm-up and
    capture leave them as they were, however many passes warm-up runs."""
    assert_parity(_norm_stack(), mode, steps=4, num_warmup_iters=warmup)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_dropout_draws_what_eager_draws_from_the_same_seed(mode, warmup):
    """The masks at each replay are eager's from the same generator state, and the
    generator ends each step where eager's does (the ``torch.rand(1)`` after it)."""
    assert_parity(_norm_stack(p=0.4), mode, num_warmup_iters=warmup)


@pytest.mark.parametrize("mode", MODES)
def test_a_module_captured_in_eval_mode_replays_eval_kernels(mode):
    assert_parity(_norm_stack(train=False, p=0.4), mode)


def _noisy(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.dropout(x, 0.3) + torch.randn_like(x) * 0.1


def _random_function() -> Case:
    def step(used: Any, _: int) -> list[Any]:
        x = _leaf(4, 8)
        y = _single(used)(x)
        y = backward_keeping(y, y.square().sum())
        return [y, x.grad, torch.rand(1)]

    return Case(_noisy, (_leaf(4, 8),), step)


@pytest.mark.parametrize("mode", MODES)
def test_random_operators_in_a_function_draw_what_eager_draws(mode):
    assert_parity(_random_function, mode)


def _frozen(everything: bool) -> Callable[[], Case]:
    def build() -> Case:
        module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        if everything:  # nothing requires grad: a graph without a backward
            module.requires_grad_(False)
        else:
            module[0].weight.requires_grad_(False)
        trained = [p for p in module.parameters() if p.requires_grad]

        def step(used: Any, _: int) -> list[Any]:
            x = torch.randn(2, 4, requires_grad=not everything)
            y = _single(used)(x)
            flag = y.requires_grad
            y = backward_keeping(y, y.square().sum()) if flag else detached_copy(y)
            return [y, flag, x.grad, *(p.grad for p in module.parameters())]

        sample = torch.randn(2, 4, requires_grad=not everything)
        return Case(module, (sample,), step, trained)

    return build


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("everything", [False, True], ids=["one", "all"])
def test_parameters_that_do_not_require_grad_get_none_as_in_eager(mode, everything):
    assert_parity(_frozen(everything), mode)


class _Counter(nn.Module):
    """A buffer the forward updates in place (a step counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return self.lin(x) * self.count


def _counter() -> Case:
    module = _Counter()

    def step(used: Any, _: int) -> list[Any]:
        x = _leaf(2, 4)
        y = _single(used)(x)
        y = backward_keeping(y, y.square().sum())
        return [y, x.grad, module.count, module.lin.weight.grad]

    return Case(module, (_leaf(2, 4),), step, list(module.parameters()))


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_updated_in_place_advances_like_eager(mode):
    assert_parity(_counter, mode)


# --------------------------------------------------------------------------- grad modes, eval


def _calls_without_grad(context: Callable[[], Any]) -> Callable[[], Case]:
    """Training steps with calls under ``context`` (no_grad, inference_mode) between them,
    on a training-mode module with batch norm and dropout: those calls replay the training
    graph as torch's drop-in does (eager's forward in training mode, without autograd)."""

    def build() -> Case:
        module = _norm_stack(p=0.3)().callables
        norm = module[1]

        def step(used: Any, _: int) -> list[Any]:
            graphed = _single(used)
            x = _leaf(8, 4)
            y = graphed(x)
            kept = [backward_keeping(y, y.square().sum()), x.grad]
            with context():
                for plain in (torch.randn(8, 4), torch.randn(8, 4, requires_grad=True)):
                    out = graphed(plain)
                    kept += [detached_copy(out), out.requires_grad]
            kept += [norm.running_mean.clone(), norm.num_batches_tracked.clone()]
            x = _leaf(8, 4)
            y = graphed(x)  # training goes on
            y = backward_keeping(y, y.square().sum())
            return [*kept, y, x.grad, *(p.grad for p in module.parameters())]

        return Case(module, (_leaf(8, 4),), step, list(module.parameters()))

    return build


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode],
                         ids=["no_grad", "inference_mode"])  # fmt: skip
def test_calls_without_grad_between_steps_compute_what_eager_computes(mode, context):
    assert_parity(_calls_without_grad(context), mode)


def _eval_after_capture(captured_in_train: bool) -> Callable[[], Case]:
    """The module switched to the other mode after capture, and back, within each step: the
    other mode runs the eager forward (another shape too), as torch's drop-in does."""

    def build() -> Case:
        case = _norm_stack(train=captured_in_train, p=0.4)()
        module = case.callables

        def step(used: Any, _: int) -> list[Any]:
            x = _leaf(8, 4)
            y = used(x)
            kept = [backward_keeping(y, y.square().sum()), x.grad]
            module.train(not captured_in_train)
            other = _leaf(8, 4)
            out = used(other)
            out = backward_keeping(out, out.square().sum())
            kept += [out, other.grad, used(torch.randn(3, 4))]  # eager takes any shape
            module.train(captured_in_train)
            return [*kept, module[1].running_mean, *(p.grad for p in module.parameters())]

        return Case(module, case.samples, step, case.params)

    return build


@pytest.mark.parametrize("mode", ["drop-in", "unshared"])
@pytest.mark.parametrize("captured_in_train", [True, False], ids=["train", "eval"])
def test_a_module_in_another_mode_after_capture_runs_eagerly(mode, captured_in_train):
    assert_parity(_eval_after_capture(captured_in_train), mode)


def _hooks_after_capture() -> Case:
    """Forward, forward-pre and full backward hooks registered on the graphed module after
    capture (torch allows it): they run around the replay as eager runs them."""
    module = nn.Linear(4, 4)

    def step(used: Any, step: int) -> list[Any]:
        if step == 0:
            module.register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
            module.register_forward_hook(lambda mod, args, out: out * 2)
            module.register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 3,))
        x = _leaf(2, 4)
        y = used(x)
        y = backward_keeping(y, y.square().sum())
        return [y, x.grad, module.weight.grad]

    return Case(module, (_leaf(2, 4),), step, list(module.parameters()))


@pytest.mark.parametrize("mode", ["drop-in", "unshared"])
def test_module_hooks_registered_after_capture_run_as_in_eager(mode):
    assert_parity(_hooks_after_capture, mode)


# ------------------------------------------------------------------------------ gradients


def _grad_of_inputs() -> Case:
    """torch.autograd.grad instead of backward(): .grad stays untouched, as in eager."""
    module = nn.Linear(4, 4)

    def step(used: Any, _: int) -> list[Any]:
        x = _leaf(2, 4)
        y = _single(used)(x)
        kept = detached_copy(y)
        gx, gw = torch.autograd.grad(y.square().sum(), (x, module.weight))
        return [kept, gx, gw, x.grad, module.weight.grad]

    return Case(module, (_leaf(2, 4),), step)


def _accumulating() -> Case:
    """Gradients adding up over steps in .grad, never zeroed (no optimizer)."""
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

    def step(used: Any, _: int) -> list[Any]:
        x = _leaf(2, 4)
        y = _single(used)(x)
        y = backward_keeping(y, y.square().sum())
        return [y, x.grad, *(p.grad for p in module.parameters())]

    return Case(module, (_leaf(2, 4),), step)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("build", [_grad_of_inputs, _accumulating], ids=["autograd.grad", "sum"])
def test_gradients_reach_where_eagers_do(mode, build):
    assert_parity(build, mode, steps=4)


def test_capture_warns_about_nothing_in_these_cases():
    """None of the cases above is a misuse: capturing them warns about nothing."""
    builds = [_mixed, _many_outputs, _keywords, _norm_stack(p=0.4), _tied, _counter]
    for build in builds:
        torch.manual_seed(0)
        case = build()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            leangraph.reset_all(_capture(case, "drop-in"))
