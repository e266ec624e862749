"""Graph backends: ``cuda`` (the product) and ``cpu`` (a reference for tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .base import GraphBackend, GraphPair
from .cpu import CpuBackend

__all__ = [
    "BACKENDS",
    "CpuBackend",
    "GraphBackend",
    "GraphPair",
    "check_backend_name",
    "check_generator_states",
    "make_backend",
]

BACKENDS = ("cuda", "cpu")
"""The backend names ``make_graphed_callables(backend=...)`` takes (None: by the device)."""


def make_backend(
    name: str | None,
    device: torch.device,
    pool: Any | None,
    generator_states: Sequence[torch.Generator] = (),
) -> GraphBackend:
    """The backend called ``name``, or the one that fits ``device`` when ``name`` is None.

    Raises:
        ValueError: for an unknown name, a backend that does not fit the device, or
            generator states that are not CUDA ``torch.Generator`` objects (or not on CUDA).
        RuntimeError: for ``cuda`` when CUDA is not available.
    """
    if name is None:
        name = "cuda" if device.type == "cuda" else "cpu"
    check_backend_name(name)
    check_generator_states(generator_states)
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend 'cpu' needs CPU sample tensors, got tensors on {device}")
        if pool is not None:
            raise ValueError("backend 'cpu' has no memory pool; pass pool=None")
        if generator_states:
            raise ValueError(
                "backend 'cpu' has no CUDA graphs to register generator_states with; pass "
                "generator_states=() (CUDA generator states are for CUDA captures)"
            )
        return CpuBackend()
    if not torch.cuda.is_available():
        raise RuntimeError("backend 'cuda' needs a CUDA GPU, and torch sees none")
    if device.type != "cuda":
        raise ValueError(f"backend 'cuda' needs CUDA sample tensors, got tensors on {device}")
    if generator_states and not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
        raise RuntimeError(
            f"generator_states needs torch.cuda.CUDAGraph.register_generator_state, which "
            f"torch {torch.__version__} does not have; use a newer torch"
        )
    from .cuda import CudaBackend

    return CudaBackend(device, pool, tuple(generator_states))


def check_backend_name(name: object) -> None:
    """Refuse a backend name other than those of :data:`BACKENDS` (or None).

    Raises:
        ValueError: naming what was given.
    """
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be 'cuda', 'cpu' or None, got {name!r}")


def check_generator_states(generator_states: Sequence[object]) -> None:
    """Refuse generator states that are not CUDA ``torch.Generator`` objects.

    Raises:
        ValueError: naming the first entry that is not one, and what it is.
    """
    for index, state in enumerate(generator_states):
        if not isinstance(state, torch.Generator) or state.device.type != "cuda":
            got = state.device if isinstance(state, torch.Generator) else type(state).__name__
            raise ValueError(
                f"generator_states[{index}] must be a CUDA torch.Generator (a graph-safe state, "
                f"e.g. torch.cuda.default_generators[0].graphsafe_get_state()), got {got}"
            )
