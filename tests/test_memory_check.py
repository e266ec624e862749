"""The pre-capture memory check, exercised on the CPU with the allocator figure stubbed."""

from __future__ import annotations

import contextlib

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


def test_check_passes_when_memory_suffices_and_leaves_the_modules_alone(monkeypatch):
    layers, samples = _stack()
    monkeypatch.setattr(api, "_available_bytes", lambda device: 1 << 40)
    before = [p.detach().clone() for layer in layers for p in layer.parameters()]
    api.check_fits(layers, samples, None, [1, 1, -1, -1], None, torch.device("cpu"))
    api.check_fits(layers, samples, ({},) * 4, [1, 1, -1, -1], None, torch.device("cpu"))
    after = [p.detach() for layer in layers for p in layer.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(p.grad is None for layer in layers for p in layer.parameters())


def test_check_raises_capture_memory_error_naming_the_figures(monkeypatch):
    layers, samples = _stack()
    monkeypatch.setattr(api, "_available_bytes", lambda device: 1024)
    plan = leangraph.plan_memory(layers, samples, order=[1, 1, -1, -1])
    with pytest.raises(leangraph.CaptureMemoryError, match=r"but only 0.0 MiB") as caught:
        api.check_fits(layers, samples, None, [1, 1, -1, -1], None, torch.device("cpu"))
    assert caught.value.needed_bytes == max(plan.warmup_peak_bytes, plan.capture_peak_bytes)
    assert caught.value.step == plan.peak_step and caught.value.available_bytes == 1024


def test_check_runs_the_callables_inside_the_given_context(monkeypatch):
    monkeypatch.setattr(api, "_available_bytes", lambda device: 1 << 40)
    log = []

    @contextlib.contextmanager
    def where():
        log.append("enter")
        yield
        log.append("exit")

    def scaled(x):
        log.append("forward")
        return x * 2

    api.check_fits((scaled,), ((torch.randn(3, requires_grad=True),),), None, None, None,
                   torch.device("cpu"), where=where())
    assert log == ["enter", "forward", "exit"]


def test_check_puts_back_buffers_that_a_forward_updates(monkeypatch):
    monkeypatch.setattr(api, "_available_bytes", lambda device: 1 << 40)
    norm = torch.nn.BatchNorm1d(8)
    before = {name: b.clone() for name, b in norm.named_buffers()}
    api.check_fits((norm,), ((torch.randn(4, 8, requires_grad=True),),), None, None, None,
                   torch.device("cpu"))
    assert all(torch.equal(b, before[name]) for name, b in norm.named_buffers())


class DataDependent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(x.detach().abs().max())  # needs real data
        return x * self.weight * scale


@pytest.mark.parametrize(
    "callable_", [DataDependent(), lambda x: x.exp()], ids=["data-dependent module", "function"]
)
def test_check_measures_any_callable_it_can_run(monkeypatch, callable_):
    """The check runs the real code, so data-dependent modules and plain functions are
    measured like any other (a meta-device check could not run them)."""
    monkeypatch.setattr(api, "_available_bytes", lambda device: 0)
    samples = ((torch.randn(4, 8, requires_grad=True),),)
    with pytest.raises(leangraph.CaptureMemoryError) as caught:
        api.check_fits((callable_,), samples, None, None, None, torch.device("cpu"))
    plan = leangraph.plan_memory(callable_, samples[0])
    assert caught.value.needed_bytes == max(plan.warmup_peak_bytes, plan.capture_peak_bytes) > 0
