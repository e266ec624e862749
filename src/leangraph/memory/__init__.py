"""Memory planning: the bytes warm-up and capture of a call hold, and the pre-capture check.

:func:`plan_memory` (:mod:`.plan`) validates a call as ``make_graphed_callables`` does, probes
one forward of each distinct callable and walks the liveness plan (:mod:`.walk`) into a
:class:`MemoryPlan` (:mod:`.records`); :mod:`.check` compares one with the memory available;
:mod:`.meta_attention` emulates fused attention on meta tensors.
"""

from __future__ import annotations

from ..probe import LayerMemory
from .check import available_bytes, check_fits
from .plan import memory_plan_of, plan_memory, shared_buffers
from .records import MemoryPlan, StepMemory, format_bytes

__all__ = [
    "LayerMemory",
    "MemoryPlan",
    "StepMemory",
    "available_bytes",
    "check_fits",
    "format_bytes",
    "memory_plan_of",
    "plan_memory",
    "shared_buffers",
]
