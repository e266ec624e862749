"""The memory check before capture: the plan of a call against the GPU memory available.

``make_graphed_callables`` runs it first on CUDA, so a capture that cannot fit fails with
:class:`~leangraph.CaptureMemoryError` before any warm-up or capture work rather than dying
midway. The plan it checks is walked over the probe's facts and the engine's own buffer plan,
the same ones capture then uses.
"""

from __future__ import annotations

import torch

from ..errors import CaptureMemoryError
from .records import MemoryPlan

__all__ = ["available_bytes", "check_fits"]


def available_bytes(device: torch.device) -> int:
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


def check_fits(plan: MemoryPlan, available: int) -> None:
    """Raise :class:`CaptureMemoryError` if ``plan``'s peak exceeds ``available`` bytes."""
    needed = max(plan.warmup_peak_bytes, plan.capture_peak_bytes)
    if needed > available:
        raise CaptureMemoryError(needed, available, plan.peak_step)
