"""A CPU shim for Megatron-core: run its schedules, DDP and layers without a GPU.

For tests, examples and docs only (leangraph's CPU reference backend stands in for CUDA
graphs there). Megatron-core assumes a GPU in a few places that a small CPU run reaches;
:func:`cpu_shim` patches exactly those, for the duration of a ``with`` block, and puts them
back on exit:

* ``torch.cuda.current_device()`` returns ``torch.device("cpu")`` (Megatron passes it as the
  ``device=`` of its buffers, p2p shape tensors and static graph inputs);
* ``torch.cuda.synchronize()`` does nothing (the p2p code calls it after batched sends);
* factory calls given ``device="cuda"`` (the schedules' token counters) make CPU tensors, by
  a ``TorchFunctionMode`` active in the calling thread;
* ``CudaRNGStatesTracker.fork()`` (``megatron.core.tensor_parallel.random``) switches no
  generator: the CPU has no CUDA generator to switch, so dropout in tensor-parallel regions
  would draw from the default generator (the tests run without dropout).

Nothing here is used by :mod:`leangraph.integrations.megatron` itself; on a GPU run none of
it is needed. Build the model with ``use_cpu_initialization=True`` and, with pipelining,
``batch_p2p_comm=False`` (gloo has no batched p2p).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_shim"]


class _CudaToCpu(TorchFunctionMode):
    """Turns ``device="cuda"`` (or ``cuda:N``, or a CUDA ``torch.device``) into the CPU."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def _no_fork(self: Any, name: str = "") -> Iterator[None]:
    """``CudaRNGStatesTracker.fork`` on the CPU: no generator to switch."""
    del self, name
    yield


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _no_sync(device: Any = None) -> None:
    del device


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Patch what Megatron-core needs to run on the CPU (module docstring), then restore it.

    Raises:
        ImportError: if megatron-core is not installed.
    """
    tracker = importlib.import_module("megatron.core.tensor_parallel.random").CudaRNGStatesTracker
    saved = (torch.cuda.current_device, torch.cuda.synchronize, tracker.fork)
    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    torch.cuda.synchronize = _no_sync
    tracker.fork = _no_fork
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize, tracker.fork = saved
