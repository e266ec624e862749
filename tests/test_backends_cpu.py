"""The CPU backend replays what was captured, as a CUDA graph would (backends/cpu.py and the
trace it records).

Most tests go through ``make_graphed_callables(..., backend="cpu")``; the graph pair is used
directly where its protocol (poisoned capture, replays into static buffers, reset) is the
unit. "What CUDA would do" is always: the kernels recorded at capture, run on the memory as it
is at replay.
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import torch
import torch.nn.functional as F
from helpers import assert_replays_like_eager, notes, raises, sample
from models import Block
from torch import nn
from torch.utils.checkpoint import checkpoint

import leangraph
from leangraph.backends import CpuBackend
from leangraph.cli.workloads import BlockShape, TransformerBlock

NOTES = sys.version_info >= (3, 11)  # exc.__notes__ / add_note
HERE = Path(__file__).name


def mgc(*args: Any, **kwargs: Any) -> Any:
    return leangraph.make_graphed_callables(*args, backend="cpu", **kwargs)


def leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def twin(x: torch.Tensor) -> torch.Tensor:
    """A leaf with ``x``'s values, for the eager run."""
    return x.detach().clone().requires_grad_(x.requires_grad)


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name


# ----------------------------------------------------------------- exact, layer by layer


class Attention(nn.Module):
    """Causal multi-head self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attn.transpose(1, 2).reshape(batch, seq, width))


LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "linear": (lambda: nn.Linear(8, 8), (4, 8)),
    "layer_norm": (lambda: nn.LayerNorm(8), (4, 8)),
    "gelu": (lambda: nn.GELU(), (4, 8)),
    "attention": (Attention, (2, 6, 8)),
    "mlp_block": (lambda: Block(8), (4, 8)),
    "transformer_block": (
        lambda: TransformerBlock(BlockShape(hidden=16, heads=2, sequence=8)),
        (1, 8, 16),
    ),
}


@pytest.mark.parametrize("name", LAYERS)
def test_outputs_and_gradients_equal_eager_bitwise(name):
    make, shape = LAYERS[name]
    torch.manual_seed(0)
    module = make()
    eager = copy.deepcopy(module)
    graphed = mgc(module, (leaf(*shape),))
    for _ in range(3):  # gradients accumulate in both, replay after replay
        x = leaf(*shape)
        x_eager = twin(x)
        out, expected = graphed(x), eager(x_eager)
        assert torch.equal(out, expected)
        seed = torch.randn_like(out)
        out.backward(seed)
        expected.backward(seed)
        assert torch.equal(x.grad, x_eager.grad)
        assert_same_grads(module, eager)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
def test_an_lstm_trains_exactly_like_eager(layers, bidirectional, batch_first):
    """nn.LSTM's oneDNN kernel (aten.mkldnn_rnn_layer) returns the workspace its backward reads
    only with grad enabled: a replay runs it under the grad mode of its capture. Before, the
    replay ran it under no_grad and the first replay crashed on the missing workspace."""
    torch.manual_seed(0)
    module = nn.LSTM(4, 5, num_layers=layers, bidirectional=bidirectional,
                     batch_first=batch_first)  # fmt: skip
    eager = copy.deepcopy(module)
    shape = (2, 3, 4) if batch_first else (3, 2, 4)
    graphed = mgc(module, (leaf(*shape),))
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    for _ in range(3):
        x = leaf(*shape)
        x_eager = twin(x)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out, (h, c) = graphed(x)
        assert not saved  # the grad-enabled kernels replay below autograd: no graph
        expected, (h_eager, c_eager) = eager(x_eager)
        assert torch.equal(out, expected)
        assert torch.equal(h, h_eager) and torch.equal(c, c_eager)
        (out.square().sum() + 2 * h.sum() + c.sum()).backward()
        (expected.square().sum() + 2 * h_eager.sum() + c_eager.sum()).backward()
        assert torch.equal(x.grad, x_eager.grad)
        assert_same_grads(module, eager)


# An operator whose kernel branches on the grad mode, as aten.mkldnn_rnn_layer's does.
_LIBRARY = torch.library.Library("leangraph_cpu_tests", "FRAGMENT")
_LIBRARY.define("grad_mode_scaled(Tensor x) -> Tensor")
_LIBRARY.impl(
    "grad_mode_scaled", lambda x: x * (2.0 if torch.is_grad_enabled() else 3.0), "CPU"
)


class GradModeReader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with_grad = torch.ops.leangraph_cpu_tests.grad_mode_scaled(x.detach())
        with torch.no_grad():
            without = torch.ops.leangraph_cpu_tests.grad_mode_scaled(x.detach())
        return self.linear(x) * with_grad + without


def test_a_kernel_replays_under_the_grad_mode_it_ran_under_at_capture():
    torch.manual_seed(0)
    module = GradModeReader()
    eager = copy.deepcopy(module)
    graphed = mgc(module, (leaf(2, 4),))
    assert_replays_like_eager(graphed, eager, lambda: leaf(2, 4), replays=3)
    assert_same_grads(module, eager)
    x = leaf(2, 4)
    with torch.no_grad():  # the caller's grad mode changes neither kernel's
        out = graphed(x)
    assert torch.equal(out, eager(twin(x)))


def test_chained_layers_train_exactly_through_an_order():
    torch.manual_seed(0)
    layers = tuple(Block(8) for _ in range(3))
    eager = copy.deepcopy(layers)
    graphed = mgc(layers, tuple((leaf(4, 8),) for _ in range(6)), order=[1, 1, -1, -1],
                  num_layers_per_chunk=3)
    for _ in range(2):
        xs = [leaf(4, 8), leaf(4, 8)]
        outs, expected = [], []
        for m, x in enumerate(xs):
            hidden, reference = x, twin(x)
            for index in range(3):
                hidden = graphed[m * 3 + index](hidden)
                reference = eager[index](reference)
            outs.append(hidden)
            expected.append(reference)
        for out, ref in zip(outs, expected):
            assert torch.equal(out, ref)
            out.square().sum().backward()
            ref.square().sum().backward()
        for layer, twin_layer in zip(layers, eager):
            assert_same_grads(layer, twin_layer)


# ------------------------------------------------------- only the recorded kernels replay


class Branchy(nn.Module):
    """Takes one of two branches on a flag the caller sets from the input's values."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.positive = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return h.relu() if self.positive else (-h).relu()


def test_a_data_dependent_branch_replays_the_branch_taken_at_capture():
    torch.manual_seed(0)
    module = Branchy()
    eager = copy.deepcopy(module)
    sample = leaf(2, 4).detach().abs().requires_grad_()
    module.positive = bool(sample.sum() > 0)  # read on the host, before the graphed call
    graphed = mgc(module, (sample,))
    x = (-sample.detach().abs()).requires_grad_()
    module.positive = bool(x.sum() > 0)  # this input takes the other branch now
    assert not module.positive
    out = graphed(x)
    eager.positive = True  # the branch that was captured: what the CUDA graph replays
    captured_branch = eager(twin(x))
    eager.positive = False
    other_branch = eager(twin(x))
    assert not torch.equal(captured_branch, other_branch)
    assert torch.equal(out, captured_branch)


class Chatty(nn.Module):
    """Counts and prints its forwards, and counts the backwards of its autograd Function."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.forwards = 0
        self.backwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        print("forward ran")
        return _Counted.apply(self.linear(x), self)


class _Counted(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, owner: Chatty) -> torch.Tensor:
        ctx.owner = owner
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.owner.backwards += 1
        return grad * 2, None


def test_python_side_effects_run_at_capture_and_never_at_replay(capsys):
    torch.manual_seed(0)
    module = Chatty()
    graphed = mgc(module, (leaf(2, 4),), num_warmup_iters=2)
    # The probe's forward, two warm-up passes, one capture (the probe runs no backward).
    assert (module.forwards, module.backwards) == (4, 3)
    assert capsys.readouterr().out.count("forward ran") == 4
    x = leaf(2, 4)
    for _ in range(3):
        graphed(x).sum().backward()
    assert (module.forwards, module.backwards) == (4, 3)
    assert "forward ran" not in capsys.readouterr().out
    torch.testing.assert_close(x.grad, 3 * 2 * module.linear.weight.sum(0).expand(2, 4))


class Hooked(nn.Module):
    """A tensor hook doubles its gradient (an op, replayed) and counts itself (Python)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.hooks = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        h.register_hook(self._hook)
        return h.tanh()

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        self.hooks += 1
        return grad * 2


def test_a_tensor_hook_runs_once_but_what_it_computes_replays():
    torch.manual_seed(0)
    module = Hooked()
    eager = copy.deepcopy(module)
    graphed = mgc(module, (leaf(2, 4),), num_warmup_iters=1)
    assert module.hooks == 2
    x = leaf(2, 4)
    x_eager = twin(x)
    graphed(x).sum().backward()
    eager(x_eager).sum().backward()
    assert module.hooks == 2
    assert torch.equal(x.grad, x_eager.grad)
    assert_same_grads(module, eager)


# ------------------------------------------------------------------- host reads refused


class Reads(nn.Module):
    """``linear`` then a function that may read values on the host."""

    def __init__(self, then: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.then = then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.then(self.linear(x))


def _printed(h: torch.Tensor) -> torch.Tensor:
    print(h)
    return h


REFUSED: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "item": (lambda h: h * h.sum().item(), "Tensor.item()"),
    "branch": (lambda h: h if h.sum() > 0 else -h, "bool()"),
    "print": (_printed, "printing a tensor"),
    "tolist": (lambda h: h * len(h.tolist()), "Tensor.tolist()"),
    "numpy": (lambda h: h * float(h.detach().numpy().sum()), "Tensor.numpy()"),
    "cpu": (lambda h: h.cpu() * 2, "Tensor.cpu() (a copy to the host)"),
    "nonzero": (lambda h: h * h.nonzero().shape[0], "aten.nonzero"),
    "mask": (lambda h: h + h[h > 0].sum(), "indexing with a boolean mask"),
    "equal": (lambda h: h * torch.equal(h, h), "aten.equal"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_host_read_is_refused_at_capture_naming_what_and_where(name):
    then, what = REFUSED[name]
    module = Reads(then)
    module(leaf(2, 4))  # fine eagerly
    with pytest.raises(RuntimeError) as info:
        mgc(module, (leaf(2, 4),))
    message = str(info.value)
    assert message.startswith("the CPU backend cannot capture "), message
    assert what in message and "operation not permitted when stream is capturing" in message
    assert f"{HERE}:" in message  # the line of the test's callable that did it
    if NOTES:
        assert "leangraph: raised during capture of callable 0 (Reads)" in info.value.__notes__[0]


class ReadsItem(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(x)
        return hidden / hidden.abs().max().item()


def test_w8_a_host_read_during_capture_is_refused_on_the_cpu_backend():
    module = ReadsItem()
    module(sample())  # eagerly fine: warm-up runs it
    with raises(
        RuntimeError,
        "the CPU backend cannot capture Tensor.item(), or bool(), int() or float() of a tensor",
        f"{HERE}:",
        "in forward: it reads a tensor's values on the host",
        "'operation not permitted when stream is capturing'",
    ) as info:
        mgc(module, (sample(),))
    if NOTES:
        assert notes(info.value).startswith("leangraph: raised during capture of callable 0 (")


def test_w8_a_host_read_in_a_torch_module_graphed_as_it_is_names_its_forward():
    """No user frame lies between the capture and the read: the module's own code (torch's
    batch norm reads ``num_batches_tracked`` with ``momentum=None``) is named, not the line
    of the make_graphed_callables call."""
    with raises(RuntimeError, "the CPU backend cannot capture Tensor.item()",
                f"at {Path(torch.nn.modules.batchnorm.__file__)}:",
                " in forward: it reads a tensor's values on the host") as info:
        mgc(nn.BatchNorm1d(4, momentum=None), (leaf(8, 4),))
    assert __file__ not in str(info.value)


def test_indexing_with_integer_indices_is_captured_and_replays_exactly():
    index = torch.tensor([3, 0, 0, 2])
    torch.manual_seed(0)
    module = Reads(lambda h: h[:, index] * h[index])
    eager = copy.deepcopy(module)
    graphed = mgc(module, (leaf(4, 4),))
    x = leaf(4, 4)
    x_eager = twin(x)
    out, expected = graphed(x), eager(x_eager)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert torch.equal(x.grad, x_eager.grad)


def _spd(h: torch.Tensor) -> torch.Tensor:
    return h @ h.mT + torch.eye(4, device=h.device)


# What CUDA runs with a host sync that the CPU kernel hides inside (torch documents each as
# synchronizing a CUDA device with the CPU): the error checks of torch.linalg's functions, the
# convergence checks of the SVD and eigh, MAGMA's eig, histc finding its own range.
CUDA_SYNCS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "cholesky": (lambda h: torch.linalg.cholesky(_spd(h)), "aten._linalg_check_errors"),
    "inv": (lambda h: torch.linalg.inv(_spd(h)), "aten._linalg_check_errors"),
    "solve": (lambda h: torch.linalg.solve(_spd(h), h), "aten._linalg_check_errors"),
    "lu_factor": (lambda h: torch.linalg.lu_factor(h)[0], "aten._linalg_check_errors"),
    "cholesky_ex": (
        lambda h: torch.linalg.cholesky_ex(_spd(h), check_errors=True)[0],
        "aten.linalg_cholesky_ex.default with check_errors=True",
    ),
    "eigh": (lambda h: torch.linalg.eigh(h + h.mT)[0], "aten._linalg_eigh"),
    "svdvals": (lambda h: h * torch.linalg.svdvals(h), "aten._linalg_svd"),
    "matrix_norm_2": (lambda h: h * torch.linalg.matrix_norm(h, 2), "aten._linalg_svd"),
    "eigvals": (lambda h: torch.linalg.eigvals(h).real, "aten.linalg_eig"),
    "pinv": (lambda h: torch.linalg.pinv(h), "aten.linalg_pinv"),
    "histc": (lambda h: h * torch.histc(h, bins=4).sum(), "torch.histc with min == max == 0"),
}


@pytest.mark.parametrize("name", CUDA_SYNCS)
def test_w12_an_operator_cuda_runs_with_a_host_sync_is_refused_at_capture(name):
    then, what = CUDA_SYNCS[name]
    module = Reads(then)
    module(leaf(4, 4))  # fine eagerly, and its CPU kernel reads nothing the trace sees
    with raises(
        RuntimeError,
        "the CPU backend cannot capture ",
        what,
        f"{HERE}:",
        "on CUDA it reads a result on the host",
        "'operation not permitted when stream is capturing'",
    ) as info:
        mgc(module, (leaf(4, 4),))
    if NOTES:
        assert notes(info.value).startswith("leangraph: raised during capture of callable 0 (")


# Their forms that stay on the device: captured, and replayed bitwise as eager.
DEVICE_FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "cholesky_ex": lambda h: torch.linalg.cholesky_ex(_spd(h))[0],
    "inv_ex": lambda h: torch.linalg.inv_ex(_spd(h))[0],
    "solve_ex": lambda h: torch.linalg.solve_ex(_spd(h), h)[0],
    "histc_range": lambda h: h * torch.histc(h.detach(), bins=4, min=-1.0, max=1.0).sum(),
    "qr": lambda h: torch.linalg.qr(h)[0],
}


@pytest.mark.parametrize("name", DEVICE_FORMS)
def test_linalg_forms_that_stay_on_the_device_replay_exactly(name):
    torch.manual_seed(0)
    module = Reads(DEVICE_FORMS[name])
    eager = copy.deepcopy(module)
    graphed = mgc(module, (leaf(4, 4),))
    for _ in range(2):
        assert_replays_like_eager(graphed, eager, lambda: leaf(4, 4), replays=1)
        assert_same_grads(module, eager)


# ------------------------------------------------------------------------- memory model


class InPlace(nn.Module):
    """In-place ops through views of intermediates, an in-place metadata change (``t_``) and
    non-contiguous views read back."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x) * 1.0
        h.mul_(2)
        v = h.view(2, 2, 8)
        v[:, 0].add_(1.0)  # writes h through a view
        t = v.transpose(1, 2)
        s = h[1:3] * 1.0
        same = s.view(2, 8)  # the same view of the same memory as s
        s.t_()  # s changes its own metadata in place; same does not
        out = t.reshape(4, 8).tanh() * h + h.t()[::2].repeat(1, 2)
        return out + same.repeat(2, 1) * s.t().repeat(2, 1)


def test_in_place_ops_and_views_replay_exactly():
    torch.manual_seed(0)
    module = InPlace()
    eager = copy.deepcopy(module)
    graphed = mgc(module, (leaf(4, 8),))
    for _ in range(2):
        assert_replays_like_eager(graphed, eager, lambda: leaf(4, 8), replays=1)
        assert_same_grads(module, eager)


def test_buffers_updated_in_place_advance_at_every_replay():
    torch.manual_seed(0)
    module = nn.BatchNorm1d(4)
    eager = copy.deepcopy(module)
    graphed = mgc(module, (leaf(8, 4),))  # warm-up and capture leave the statistics alone
    for _ in range(3):
        x = leaf(8, 4)
        assert torch.equal(graphed(x), eager(twin(x)))
    assert int(module.num_batches_tracked) == int(eager.num_batches_tracked) == 3
    assert torch.equal(module.running_mean, eager.running_mean)
    assert torch.equal(module.running_var, eager.running_var)


def test_a_closed_over_tensor_is_read_as_it_is_at_replay():
    scale = torch.full((4,), 2.0)
    graphed = mgc(lambda x: x * scale, (leaf(2, 4),))
    x = leaf(2, 4)
    assert torch.equal(graphed(x), x.detach() * 2)
    scale.fill_(3.0)  # the same memory, new contents: what a CUDA graph would read
    out = graphed(x)
    assert torch.equal(out, x.detach() * 3)
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((2, 4), 3.0))


class Dropping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(F.dropout(x, 0.5, training=self.training)).relu()


def test_dropout_draws_a_fresh_mask_at_every_replay():
    torch.manual_seed(0)
    module = Dropping()
    eager = copy.deepcopy(module)
    graphed = mgc(module, (leaf(16, 8),))
    x = leaf(16, 8)
    torch.manual_seed(7)
    first = graphed(x).detach().clone()
    torch.manual_seed(7)  # the same generator state: eager draws the same mask
    assert torch.equal(first, eager(twin(x)))
    second = graphed(x)  # the generator moved on: another mask, as eager would draw
    assert not torch.equal(second, first)
    torch.manual_seed(7)
    eager(twin(x))
    assert torch.equal(second, eager(twin(x)))


def test_a_backward_uses_the_mask_of_the_forward_it_differentiates():
    torch.manual_seed(0)
    module = Dropping()
    eager = copy.deepcopy(module)
    graphed = mgc(module, (leaf(16, 8),))
    for seed in (3, 4):
        x = leaf(16, 8)
        x_eager = twin(x)
        torch.manual_seed(seed)
        out = graphed(x)
        torch.manual_seed(seed)
        expected = eager(x_eager)
        torch.randn(100)  # the generator moves on; the backward must not draw again
        out.sum().backward()
        expected.sum().backward()
        assert torch.equal(x.grad, x_eager.grad)
        assert_same_grads(module, eager)


def test_a_split_backward_reads_the_forward_replays_mask_in_its_weight_step():
    torch.manual_seed(0)
    module = Dropping()
    eager = copy.deepcopy(module)
    (graphed,) = mgc((module,), ((leaf(16, 8),),), order=[1, -1, -1.5])
    x = leaf(16, 8)
    x_eager = twin(x)
    torch.manual_seed(5)
    out = graphed(x)
    torch.manual_seed(5)
    expected = eager(x_eager)
    assert torch.equal(out, expected)
    out.square().sum().backward()
    assert x.grad is not None and all(p.grad is None for p in module.parameters())
    torch.randn(100)  # between the backward and its weight step the generator moves on
    graphed.backward_dw()
    expected.square().sum().backward()
    assert torch.equal(x.grad, x_eager.grad)
    assert_same_grads(module, eager)


def test_retain_graph_lets_a_backward_replay_twice_per_forward():
    torch.manual_seed(0)
    module = Block(4)
    eager = copy.deepcopy(module)
    graphed = mgc(module, (leaf(2, 4),), retain_graph_in_backward=True)
    x = leaf(2, 4)
    x_eager = twin(x)
    out, expected = graphed(x), eager(x_eager)
    seed = torch.randn(2, 4)
    out.backward(seed, retain_graph=True)
    once = x.grad.clone()
    out.backward(seed)  # the same forward replay, differentiated again
    expected.backward(seed, retain_graph=True)
    expected.backward(seed)
    assert torch.equal(x.grad, once + once)
    assert torch.equal(x.grad, x_eager.grad)
    assert_same_grads(module, eager)


def test_autocast_applies_as_at_capture():
    """The trace records the kernels autocast chose at capture; a replay under the same
    autocast equals eager's under it (another autocast is refused: R22)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    eager = copy.deepcopy(module)
    graphed = mgc(module, (leaf(4, 8),))  # captured without autocast: float32 kernels
    x = leaf(4, 8)
    assert torch.equal(graphed(x), eager(twin(x)))
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        graphed = mgc(copy.deepcopy(eager), (leaf(4, 8),))  # bfloat16 kernels
        out, expected = graphed(x), eager(twin(x))
    assert torch.equal(out, expected) and not torch.equal(out.float(), eager(twin(x)))


class _Checkpointed(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def test_checkpointing_without_random_ops_replays_exactly():
    torch.manual_seed(0)
    inner = Block(8)
    eager = copy.deepcopy(inner)
    graphed = mgc(_Checkpointed(inner), (leaf(4, 8),))
    x = leaf(4, 8)
    x_eager = twin(x)
    out, expected = graphed(x), eager(x_eager)
    assert torch.equal(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert torch.equal(x.grad, x_eager.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(inner.parameters(), eager.parameters()))


# ------------------------------------------------------------ what a replay cannot follow


def test_reseeding_the_generator_inside_the_callable_is_refused():
    def reseeds(x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)
        return F.dropout(x, 0.5)

    with pytest.raises(RuntimeError, match="re-seeded or restored during the capture"):
        mgc(reseeds, (leaf(4, 8),))


def test_a_draw_of_another_thread_during_the_capture_is_refused_naming_the_thread():
    """The default generator's state moves with every thread's draws: the check cannot tell
    them from a reset, and says so, with the way out (a generator of the thread's own)."""
    def draws_while_another_thread_draws(x: torch.Tensor) -> torch.Tensor:
        out = F.dropout(x, 0.5)
        other = threading.Thread(target=torch.randn, args=(3,))  # a data thread, say
        other.start()
        other.join()
        return F.dropout(out, 0.5)

    with raises(RuntimeError, "re-seeded or restored during the capture",
                "or drawn from by another thread (its state cannot tell which)",
                "give a thread that draws while others capture a torch.Generator of its own"):
        mgc(draws_while_another_thread_draws, (leaf(4, 8),))


def _forks(x: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng():  # draws, then puts the generator back as it found it
        return F.dropout(x, 0.5)


def _reseeds_after_drawing(x: torch.Tensor) -> torch.Tensor:
    out = F.dropout(x, 0.5)
    torch.manual_seed(1)
    return out


@pytest.mark.parametrize("body", [_forks, _reseeds_after_drawing], ids=["fork_rng", "reseed"])
def test_w8_a_generator_reset_after_the_last_draw_is_refused(body):
    # Eagerly the generator ends where the reset left it; a replay would draw and not reset,
    # so everything drawn after it would differ from eager. No draw follows for the check
    # at the next draw to see: the end of the capture checks it.
    with raises(
        RuntimeError,
        "the CPU backend cannot capture a re-seeded or restored CPU generator: the callable",
        "torch.random.fork_rng",
        "CUDA refuses to seed or restore a generator during capture too",
    ) as info:
        mgc(body, (leaf(4, 8),))
    if NOTES:
        assert notes(info.value).startswith("leangraph: raised during capture of callable 0 (")


def test_checkpointing_dropout_is_refused_as_its_recompute_restores_the_generator():
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="preserve_rng_state=False"):
        mgc(_Checkpointed(Dropping()), (leaf(4, 8),))


class Stash(nn.Module):
    """Keeps an intermediate in Python state, which a second callable reads."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept = self.linear(x).tanh()
        return self.kept * 2


def test_reading_another_graphs_intermediate_is_refused():
    stash = Stash()
    # Detached: a read of a tensor needing a gradient is refused by the probe already (W5).
    reader = Reads(lambda h: h + stash.kept.detach())
    with pytest.raises(RuntimeError, match="another graph's capture created") as info:
        mgc((stash, reader), ((leaf(2, 4),), (leaf(2, 4),)))
    assert "Pass it as an input or an output instead" in str(info.value)


# --------------------------------------------------------------------------- the pair


def _linear_pair() -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pair capturing ``x @ w`` (x static, w a parameter) and its gradient for w."""
    backend = CpuBackend()
    pair = backend.new_pair()
    x, w = torch.randn(3, 4), torch.randn(4, 2, requires_grad=True)
    seed = torch.randn(3, 2)
    return pair, x, w, seed


def test_the_pair_captures_poisoned_buffers_and_replays_into_them_in_place():
    pair, x, w, seed = _linear_pair()
    captured = pair.capture_forward(lambda: (x @ w,))
    (output,) = captured.outputs
    assert captured.requires_grad == (True,) and torch.isnan(output).all()
    (grad,) = pair.capture_backward(
        lambda outs: torch.autograd.grad(outs, [w], grad_outputs=[seed]), retain_graph=False
    )
    assert torch.isnan(grad).all()
    pair.replay_forward()
    x.copy_(torch.randn(3, 4))  # the static input changes after the forward replay
    pair.replay_forward()  # the backward differentiates this, the last, replay
    assert torch.equal(output, x @ w.detach())
    seed.copy_(torch.randn(3, 2))
    pair.replay_backward()
    assert torch.equal(grad, x.t() @ seed)
    with pytest.raises(RuntimeError, match="no forward replay to differentiate"):
        pair.replay_backward()  # without retain_graph: once per forward replay
    pair.reset()
    with pytest.raises(RuntimeError, match="forward graph was reset"):
        pair.replay_forward()
    with pytest.raises(RuntimeError, match="backward graph was reset"):
        pair.replay_backward()


def test_the_pair_takes_disowned_buffers_for_later_captures():
    backend = CpuBackend()
    first, second = backend.new_pair(), backend.new_pair()
    x = torch.randn(2, 4)
    (old,) = first.capture_forward(lambda: (x * 2,)).outputs
    first.replay_forward()
    backend.disown(old)
    (new,) = second.capture_forward(lambda: (x + 1,)).outputs
    assert new.data_ptr() == old.data_ptr()  # the same memory, as a CUDA pool block
    second.replay_forward()
    assert torch.equal(old, x + 1)  # the later graph's replay overwrote it


def test_a_replay_builds_no_autograd_graph():
    torch.manual_seed(0)
    graphed = mgc(Block(4), (leaf(2, 4),))
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)  # autograd saves tensors only while it records a graph
        return tensor

    x = leaf(2, 4)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = graphed(x)
        replayed = len(saved)
        out.sum().backward()
        Block(4)(twin(x))  # an eager forward saves its activations through the hook
    assert replayed == 0 and saved
