"""The pre-capture memory check, exercised on the CPU with the allocator figure stubbed."""

from __future__ import annotations

import pytest
import torch

import leangraph
from leangraph import memory_check as api
from models import Block


def _stack():
    torch.manual_seed(0)
    layers = tuple(Block(8) for _ in range(2))
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(4))
    return layers, samples


def test_check_runs_on_meta_twins_and_passes_when_memory_suffices(monkeypatch):
    layers, samples = _stack()
    monkeypatch.setattr(api, "_available_bytes", lambda device: 1 << 40)
    before = [p.detach().clone() for layer in layers for p in layer.parameters()]
    api.check_fits(layers, samples, None, [1, 1, -1, -1], None, torch.device("cpu"))
    api.check_fits(layers, samples, ({},) * 4, [1, 1, -1, -1], None, torch.device("cpu"))
    after = [p.detach() for layer in layers for p in layer.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_check_raises_capture_memory_error_naming_the_figures(monkeypatch):
    layers, samples = _stack()
    monkeypatch.setattr(api, "_available_bytes", lambda device: 1024)
    plan = leangraph.plan_memory(layers, samples, order=[1, 1, -1, -1])
    with pytest.raises(leangraph.CaptureMemoryError, match=r"but only 0.0 MiB") as caught:
        api.check_fits(layers, samples, None, [1, 1, -1, -1], None, torch.device("cpu"))
    assert caught.value.needed_bytes == max(plan.warmup_peak_bytes, plan.capture_peak_bytes)
    assert caught.value.step == plan.peak_step and caught.value.available_bytes == 1024


def test_meta_twin_matches_the_module_it_stands_for():
    layers, samples = _stack()
    twin = api._MetaTwin(layers[0])
    out = twin(*api._to_meta(samples[0]))
    assert out.device.type == "meta" and out.shape == (4, 8)
    assert sum(p.numel() for p in twin.parameters()) == sum(p.numel() for p in layers[0].parameters())


class DataDependent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(x.detach().abs().max())  # needs real data: impossible on meta
        return x * self.weight * scale


def test_check_is_skipped_with_a_warning_when_the_callable_cannot_run_on_meta(
    monkeypatch, caplog
):
    monkeypatch.setattr(api, "_available_bytes", lambda device: 0)
    layer = DataDependent()
    samples = ((torch.randn(4, 8, requires_grad=True),),)
    with caplog.at_level("WARNING", logger="leangraph"):
        api.check_fits((layer,), samples, None, None, None, torch.device("cpu"))
    assert "check_memory skipped: the callables cannot run on the meta device" in caplog.text
