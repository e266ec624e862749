"""Graph backends: ``cuda`` (the product) and ``cpu`` (a reference for tests)."""

from __future__ import annotations

from typing import Any

import torch

from .base import GraphBackend, GraphPair
from .cpu import CpuBackend

__all__ = ["CpuBackend", "GraphBackend", "GraphPair", "make_backend"]


def make_backend(name: str | None, device: torch.device, pool: Any | None) -> GraphBackend:
    """The backend called ``name``, or the one that fits ``device`` when ``name`` is None.

    Raises:
        ValueError: for an unknown name, or a backend that does not fit the device.
        RuntimeError: for ``cuda`` when CUDA is not available.
    """
    if name is None:
        name = "cuda" if device.type == "cuda" else "cpu"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend 'cpu' needs CPU sample tensors, got tensors on {device}")
        if pool is not None:
            raise ValueError("backend 'cpu' has no memory pool; pass pool=None")
        return CpuBackend()
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'cuda' needs a CUDA GPU, and torch sees none")
        if device.type != "cuda":
            raise ValueError(f"backend 'cuda' needs CUDA sample tensors, got tensors on {device}")
        from .cuda import CudaBackend

        return CudaBackend(device, pool)
    raise ValueError(f"backend must be 'cuda', 'cpu' or None, got {name!r}")
