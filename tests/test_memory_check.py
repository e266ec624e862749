"""The pre-capture memory check: a memory plan's peak against the bytes available."""

from __future__ import annotations

import pytest
import torch
from models import Block

import leangraph
from leangraph.memory import check_fits


def _plan() -> leangraph.MemoryPlan:
    torch.manual_seed(0)
    layers = tuple(Block(8) for _ in range(2))
    samples = tuple((torch.randn(4, 8, requires_grad=True),) for _ in range(4))
    return leangraph.plan_memory(layers, samples, order=[1, 1, -1, -1])


def test_check_passes_exactly_when_the_larger_peak_fits():
    plan = _plan()
    needed = max(plan.warmup_peak_bytes, plan.capture_peak_bytes)
    assert needed > 0
    check_fits(plan, needed)  # fits to the byte
    with pytest.raises(leangraph.CaptureMemoryError) as caught:
        check_fits(plan, needed - 1)
    assert caught.value.needed_bytes == needed and caught.value.available_bytes == needed - 1


def test_check_error_names_the_figures_and_where_the_peak_falls():
    plan = _plan()
    with pytest.raises(leangraph.CaptureMemoryError, match=r"but only 0.0 MiB") as caught:
        check_fits(plan, 1024)
    assert caught.value.step == plan.peak_step
    assert plan.peak_step in str(caught.value) and "check_memory=False" in str(caught.value)


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
def test_plans_measure_any_callable_they_can_run(callable_):
    """The probe runs the real code, so data-dependent modules and plain functions are
    measured like any other (a meta-device check could not run them)."""
    plan = leangraph.plan_memory(callable_, (torch.randn(4, 8, requires_grad=True),))
    # The output (4 x 8 floats) awaits its backward from the forward on.
    assert plan.layers[0].output_bytes == 4 * 8 * 4
    with pytest.raises(leangraph.CaptureMemoryError):
        check_fits(plan, 0)
