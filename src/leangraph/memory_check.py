"""The memory check before capture: the plan of a call against the GPU memory available.

``make_graphed_callables`` runs it first on CUDA, so a capture that cannot fit fails with
:class:`~leangraph.CaptureMemoryError` before any warm-up or capture work rather than dying
midway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from .errors import CaptureMemoryError
from .memory_plan import plan_memory

__all__ = ["check_fits"]


def _available_bytes(device: torch.device) -> int:
    """What the caching allocator can still hand out on ``device``.

    Free device memory, capped by ``set_per_process_memory_fraction``, plus blocks the
    allocator has reserved but not allocated.
    """
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = get_fraction(device) if get_fraction is not None else 1.0
    growth = min(free, int(fraction * total) - reserved)
    return max(growth, 0) + reserved - torch.cuda.memory_allocated(device)


@contextlib.contextmanager
def _buffers_kept(callables: tuple[Any, ...]) -> Iterator[None]:
    """Put module buffers back as they were: a forward may update some (BatchNorm's running
    statistics), and the check's forward is not one the user asked for."""
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for fn in callables:
        if isinstance(fn, torch.nn.Module):
            for buffer in fn.buffers():
                kept.setdefault(id(buffer), (buffer, buffer.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept.values():
                buffer.copy_(value)


def check_fits(
    callables: tuple[Any, ...],
    sample_args: Any,
    sample_kwargs: Any,
    order: Sequence[int] | None,
    num_layers_per_chunk: Any,
    device: torch.device,
    *,
    where: AbstractContextManager[Any] | None = None,
) -> None:
    """Raise :class:`CaptureMemoryError` if the plan for these arguments does not fit.

    The plan measures one forward of each distinct callable on the device, inside ``where``
    (the backend's warm-up context: the same stream warm-up uses next, so lazily created
    per-stream state is where capture expects it). That is the callables' own code, plain
    functions included; its allocations are freed before the free memory is read, and module
    buffers it updates are put back. The caller keeps the RNG states.
    """
    with _buffers_kept(callables), where if where is not None else contextlib.nullcontext():
        plan = plan_memory(
            callables,
            tuple(sample_args),
            sample_kwargs=sample_kwargs,
            order=order,
            num_layers_per_chunk=num_layers_per_chunk,
        )
    needed = max(plan.warmup_peak_bytes, plan.capture_peak_bytes)
    available = _available_bytes(device)
    if needed > available:
        raise CaptureMemoryError(needed, available, plan.peak_step)
