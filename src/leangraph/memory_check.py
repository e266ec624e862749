"""The memory check before capture: the plan of a call against the GPU memory available.

``make_graphed_callables`` runs it first on CUDA, so a capture that cannot fit fails with
:class:`~leangraph.CaptureMemoryError` before any warm-up or capture work rather than dying
midway.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .errors import CaptureMemoryError
from .memory_plan import plan_memory

__all__ = ["check_fits"]

log = logging.getLogger("leangraph")


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


class _MetaTwin(torch.nn.Module):
    """A module's stand-in on the meta device: same forward, meta parameters and buffers.

    The memory check measures these, so it allocates nothing and launches no kernel on the
    GPU (running the real module there before warm-up can disturb lazily created CUDA state).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self._twin_of = (module,)  # a tuple: not registered as a submodule
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            meta = torch.empty_like(tensor, device="meta")
            if isinstance(tensor, torch.nn.Parameter):
                self.register_parameter(
                    name.replace(".", "__"), torch.nn.Parameter(meta, tensor.requires_grad)
                )
            else:
                self.register_buffer(name.replace(".", "__"), meta)
        self._names = [n for n, _ in (*module.named_parameters(), *module.named_buffers())]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = {name: getattr(self, name.replace(".", "__")) for name in self._names}
        return torch.func.functional_call(self._twin_of[0], state, args, kwargs)


def _to_meta(tree: Any) -> Any:
    return pytree.tree_map(
        lambda t: (
            torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
            if isinstance(t, torch.Tensor)
            else t
        ),
        tree,
    )


def check_fits(
    callables: tuple[Any, ...],
    sample_args: Any,
    sample_kwargs: Any,
    order: Sequence[int] | None,
    num_layers_per_chunk: Any,
    device: torch.device,
) -> None:
    """Raise :class:`CaptureMemoryError` if the plan for these arguments does not fit.

    The plan is computed on meta twins of the modules (nothing allocated, no kernel run).
    Plain functions, and modules that cannot run on meta tensors, are not checked (a
    warning on the ``leangraph`` logger says so).
    """
    if not all(isinstance(fn, torch.nn.Module) for fn in callables):
        log.warning(
            "check_memory skipped: plain functions cannot be measured on the meta "
            "device (their captured tensors are real); graph nn.Modules to check"
        )
        return
    twins: dict[int, _MetaTwin] = {}
    meta_callables = tuple(twins.setdefault(id(fn), _MetaTwin(fn)) for fn in callables)
    try:
        plan = plan_memory(
            meta_callables,
            _to_meta(tuple(sample_args)),
            sample_kwargs=_to_meta(sample_kwargs),
            order=order,
            num_layers_per_chunk=num_layers_per_chunk,
        )
    except (RuntimeError, NotImplementedError) as exc:
        # Data-dependent code (.item(), shapes from values) or a kernel without a meta
        # implementation cannot run on meta tensors; capture itself may still work.
        log.warning(
            "check_memory skipped: the callables cannot run on the meta device (%s: %s)",
            type(exc).__name__,
            exc,
        )
        return
    needed = max(plan.warmup_peak_bytes, plan.capture_peak_bytes)
    available = _available_bytes(device)
    if needed > available:
        raise CaptureMemoryError(needed, available, plan.peak_step)
