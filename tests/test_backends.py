"""Choosing a graph backend (``leangraph.backends.make_backend``): by name or by the samples'
device, refusing what does not fit (docs/errors.md, V16)."""

from __future__ import annotations

import pytest
import torch
from helpers import raises, sample
from models import Block

import leangraph
from leangraph.backends import CpuBackend, make_backend

mgc = leangraph.make_graphed_callables


def test_v16_backend_choice():
    with raises(ValueError, "backend must be 'cuda', 'cpu' or None, got 'tpu'"):
        mgc(Block(4), (sample(),), backend="tpu")
    with raises(ValueError, "backend 'cpu' has no memory pool; pass pool=None"):
        mgc(Block(4), (sample(),), pool=(0, 1))
    meta = torch.nn.Linear(4, 4, device="meta")
    with raises(ValueError, "backend 'cpu' needs CPU sample tensors, got tensors on meta"):
        mgc(meta, (torch.randn(2, 4, device="meta"),))
    if not torch.cuda.is_available():
        with raises(RuntimeError, "backend 'cuda' needs a CUDA GPU"):
            mgc(Block(4), (sample(),), backend="cuda")


def test_the_samples_device_picks_the_backend_when_none_is_named():
    for name in (None, "cpu"):
        backend = make_backend(name, torch.device("cpu"), None)
        assert isinstance(backend, CpuBackend) and backend.name == "cpu"
    with raises(ValueError, "backend 'cpu' needs CPU sample tensors, got tensors on meta"):
        make_backend(None, torch.device("meta"), None)  # meta is no CUDA: the CPU backend


def test_v23_generator_states_must_be_cuda_generators_and_need_the_cuda_backend():

    with pytest.raises(ValueError, match=r"generator_states\[0\] must be a CUDA torch.Generator "
                                         r".*got object"):
        make_backend(None, torch.device("cpu"), None, (object(),))
    with pytest.raises(ValueError, match=r"generator_states\[0\] must be a CUDA torch.Generator "
                                         r".*got cpu"):
        make_backend("cpu", torch.device("cpu"), None, (torch.Generator(),))


@pytest.mark.cuda
def test_generator_states_let_captured_code_switch_to_a_graph_safe_state():
    """As Megatron's graph-safe RNG tracker does: the callable switches the CUDA generator to
    another state around its dropout. Registered with the graphs, the state advances at every
    replay (fresh masks), as it would eagerly."""
    torch.cuda.init()  # default_generators is filled when CUDA initialises
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    other = generator.clone_state()

    class Forking(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            original = generator.graphsafe_get_state()
            generator.graphsafe_set_state(other)
            try:
                return torch.nn.functional.dropout(self.lin(x), 0.5)
            finally:
                generator.graphsafe_set_state(original)

    module = Forking().cuda()
    sample = torch.randn(32, 64, device="cuda", requires_grad=True)
    graphed = leangraph.make_graphed_callables(module, (sample,), generator_states=[other])
    x = torch.randn(32, 64, device="cuda")
    first = graphed(x).detach().clone()
    second = graphed(x)
    second.sum().backward()
    assert not torch.equal(first != 0, second != 0)
    assert module.lin.weight.grad is not None
