"""A replay under other kernel settings than capture's (R30; runtime.kernels).

A graph replays the kernels capture launched, which followed process-wide settings: float32
precision (TF32, bf16), deterministic algorithms, cuDNN and oneDNN on or off, the attention
kernels enabled. Changed after capture, eager's next call would run other kernels; the forward
replay refuses instead, naming each setting, before anything is copied in. Set back, it replays
as before. Settings a forward changes and restores inside itself are capture's own business."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from helpers import raises
from torch import nn

import leangraph

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
PER_BACKEND_API = hasattr(torch._C, "_get_fp32_precision_getter")  # fp32_precision, newer torch


class Attention(nn.Module):
    """A projection and scaled-dot-product attention: matmuls and an attention kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 8, 16)


# What changes: how, how back, what the refusal says, and the device types whose kernels
# follow it (the others' graphs are not refused for it).
CHANGES = {
    "deterministic": (
        lambda: torch.use_deterministic_algorithms(True),
        lambda: torch.use_deterministic_algorithms(False),
        "torch.are_deterministic_algorithms_enabled() was False at capture, is True now",
        ("cpu", "cuda"),
    ),
    "matmul precision": (
        lambda: torch.set_float32_matmul_precision("high"),
        lambda: torch.set_float32_matmul_precision("highest"),
        {  # CUDA reads torch's legacy precision first; the CPU its per-backend one, if any
            "cuda": "torch.get_float32_matmul_precision() was 'highest' at capture, is 'high' now",
            "cpu": (
                "torch.backends.mkldnn.matmul.fp32_precision was 'ieee' at capture, is 'tf32' now"
            ) if PER_BACKEND_API
            else "torch.get_float32_matmul_precision() was 'highest' at capture, is 'high' now",
        },
        ("cpu", "cuda"),
    ),
    "flash attention": (
        lambda: torch.backends.cuda.enable_flash_sdp(False),
        lambda: torch.backends.cuda.enable_flash_sdp(True),
        "torch.backends.cuda.flash_sdp_enabled() was True at capture, is False now",
        ("cpu", "cuda"),
    ),
    "cudnn deterministic": (
        lambda: setattr(torch.backends.cudnn, "deterministic", True),
        lambda: setattr(torch.backends.cudnn, "deterministic", False),
        "torch.backends.cudnn.deterministic was False at capture, is True now",
        ("cuda",),
    ),
    "memory-efficient attention": (
        lambda: torch.backends.cuda.enable_mem_efficient_sdp(False),
        lambda: torch.backends.cuda.enable_mem_efficient_sdp(True),
        "torch.backends.cuda.mem_efficient_sdp_enabled() was True at capture, is False now",
        ("cuda",),
    ),
    "default dtype": (  # factories without a dtype (a constant in the forward) follow it
        lambda: torch.set_default_dtype(torch.float64),
        lambda: torch.set_default_dtype(torch.float32),
        "torch.get_default_dtype() was torch.float32 at capture, is torch.float64 now",
        ("cpu", "cuda"),
    ),
    "onednn": (
        lambda: setattr(torch.backends.mkldnn, "enabled", False),
        lambda: setattr(torch.backends.mkldnn, "enabled", True),
        "torch.backends.mkldnn.enabled was True at capture, is False now",
        ("cpu",),
    ),
}


@pytest.fixture(autouse=True)
def _default_settings() -> Iterator[None]:
    """Every test starts and ends with torch's defaults for what it changes."""
    yield
    torch.use_deterministic_algorithms(False)
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.deterministic = False
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    torch.backends.mkldnn.enabled = True
    torch.set_default_dtype(torch.float32)


def _graphed_and_eager(device: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    module = Attention().to(device)
    eager = copy.deepcopy(module)
    leangraph.make_graphed_callables(
        module, (torch.randn(2, 8, 16, device=device, requires_grad=True),))
    return module, eager


def _trains_alike(module: nn.Module, eager: nn.Module, device: str) -> None:
    """A replay and an eager call on one input: outputs bitwise equal, parameter gradients
    too on the CPU (on CUDA memory-efficient attention's backward adds atomically)."""
    x = torch.randn(2, 8, 16, device=device)
    out, expected = module(x), eager(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for (name, a), b in zip(module.named_parameters(), eager.parameters()):
        if device == "cpu":
            assert torch.equal(a.grad, b.grad), name
        else:
            torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change", list(CHANGES))
def test_r30_a_replay_under_other_kernel_settings_is_refused_naming_them(change, device):
    change_it, change_back, said, device_types = CHANGES[change]
    said = said[device] if isinstance(said, dict) else said
    module, eager = _graphed_and_eager(device)
    _trains_alike(module, eager, device)
    static = module.forward.static_tensors()[0]
    before = static.clone()
    change_it()
    if device not in device_types:  # its kernels do not follow this setting
        _trains_alike(module, eager, device)
        return
    with raises(RuntimeError, "callable 0 (Attention) is replayed under other kernel settings "
                f"than at capture: {said}", "Set them back before replaying, or capture again"):
        module(torch.randn(2, 8, 16, device=device))
    torch.testing.assert_close(static, before, rtol=0, atol=0, equal_nan=True)  # nothing copied
    change_back()
    _trains_alike(module, eager, device)


class Restores(nn.Module):
    """A forward that turns settings on and off again inside itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # oneDNN, which a CPU graph's settings include (cuDNN's they leave out).
        with torch.backends.mkldnn.flags(enabled=False):
            return self.lin(x).relu()


def test_r30_settings_a_forward_changes_and_restores_inside_itself_are_no_change():
    graphed = leangraph.make_graphed_callables(Restores(), (torch.randn(4, 8, requires_grad=True),))
    for _ in range(2):
        graphed(torch.randn(4, 8)).sum().backward()


def test_r30_captured_under_changed_settings_it_replays_under_them_and_refuses_the_defaults():
    torch.use_deterministic_algorithms(True)
    graphed = leangraph.make_graphed_callables(
        nn.Linear(8, 8), (torch.randn(4, 8, requires_grad=True),))
    graphed(torch.randn(4, 8)).sum().backward()
    torch.use_deterministic_algorithms(False)
    with raises(RuntimeError, "torch.are_deterministic_algorithms_enabled() was True at "
                "capture, is False now"):
        graphed(torch.randn(4, 8))


_PER_BACKEND_SCRIPT = """
import sys, torch, leangraph
device = sys.argv[1]
def graphed():
    g = leangraph.make_graphed_callables(torch.nn.Linear(8, 8).to(device),
                                         (torch.randn(4, 8, device=device, requires_grad=True),))
    g(torch.randn(4, 8, device=device)).sum().backward()
    return g
def replay(g, what):
    try:
        g(torch.randn(4, 8, device=device)).sum().backward()
        print(what, "replays")
    except RuntimeError as exc:
        print(what, "refused:", exc)
g = graphed()
if device == "cpu":
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # CPU kernels ignore it
    replay(g, "cuda tf32")
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    replay(g, "mkldnn bf16")
    torch.backends.mkldnn.matmul.fp32_precision = "ieee"  # what "none" meant at capture
    replay(g, "mkldnn ieee")
else:
    # Set through the per-backend API: torch's legacy readers raise now.
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    replay(g, "cuda tf32")
    replay(graphed(), "captured again")  # and replayed under the same settings
"""


@pytest.mark.parametrize("device", DEVICES)
def test_r30_precision_set_through_torchs_per_backend_api_is_read_and_compared(device):
    """``torch.backends.*.fp32_precision``: a change a device's kernels follow is refused, one
    they ignore (a CUDA precision for a CPU graph) is not, nor a value set to what it meant
    at capture (``"ieee"`` for ``"none"``). On CUDA, once precision was set through that API,
    torch's legacy readers raise and the check reads it there, naming both forms where capture
    read the other. In a process of its own: torch's precision state cannot be put back."""
    if not PER_BACKEND_API:
        pytest.skip("this torch has no per-backend precision API")
    result = subprocess.run([sys.executable, "-c", _PER_BACKEND_SCRIPT, device],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    refusal = ("refused: callable 0 (Linear) is replayed under other kernel settings than at "
               "capture: ")
    if device == "cpu":
        assert lines[0] == "cuda tf32 replays", lines
        assert lines[1] == ("mkldnn bf16 " + refusal + "torch.backends.mkldnn.matmul.fp32_precision"
                            " was 'ieee' at capture, is 'bf16' now. Its graphs run the kernels "
                            "(and precision) chosen at capture, where eager's would follow the "
                            "new settings. Set them back before replaying, or capture again "
                            "under the settings you train with"), lines
        assert lines[2] == "mkldnn ieee replays", lines
    else:
        assert lines[0].startswith("cuda tf32 " + refusal + "float32 precision was ("), lines
        assert "torch.get_float32_matmul_precision() 'highest'" in lines[0], lines
        assert "torch.backends.cuda.matmul.fp32_precision 'tf32'" in lines[0], lines
        assert lines[1] == "captured again replays", lines
