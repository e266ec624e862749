"""Choosing a graph backend (``leangraph.backends.make_backend``): by name or by the samples'
device, refusing what does not fit (docs/errors.md, V16)."""

from __future__ import annotations

import torch

import leangraph
from helpers import raises, sample
from leangraph.backends import CpuBackend, make_backend
from models import Block

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
