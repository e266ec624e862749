"""Memory planning: how many bytes warm-up and capture of a pipeline order hold, step by step.

:func:`plan_memory` takes the arguments of :func:`leangraph.make_graphed_callables`, measures
one forward of every distinct callable (what autograd saves for backward, what it returns, what
its backward produces) and walks the liveness plan of :mod:`leangraph.plan` with the engine's
memory model:

* **Warm-up** runs the order eagerly on the sample tensors. At each step the forwards whose
  backward has not run yet hold their saved activations and their outputs; a backward step
  transiently adds its gradients (grad-inputs + parameter grads) and the zero grad-outputs it
  seeds the backward with. Nothing else is allocated (the samples are the caller's).
* **Static buffers** (allocated before capture, outside the pool) come from the engine's own
  buffer plan, :func:`leangraph.buffers.plan_buffers`, over the probe's buffer keys: graphs
  whose lifetimes ``[forward, backward]`` never overlap share input slots of the same shape,
  dtype, device and ``requires_grad``; a layer's first input is the previous layer's output
  (chained, no slot); gradient seeds (static grad-outputs) are needed once per key.
* **Capture** follows the same sequence into one pool. A graph's saved activations and its
  outputs stay in the pool until its backward is recorded, after which later captures reuse
  them; its gradients are released right after its backward. The capture peak is the static
  buffers plus the in-flight forwards plus the backward's gradients; what is held after
  capture is the static buffers plus the pool's high-water mark of in-flight forwards (the
  gradients are taken to fit in blocks the backward frees; add ``peak_transient_bytes`` for an
  upper bound).

It works on the ``meta`` device (nothing is allocated: sizes come from tensor metadata), so a
70B-parameter model can be planned on a laptop, and on CPU or CUDA (measured the same way,
never from allocator statistics). On ``meta``, fused attention is emulated
(:mod:`leangraph.memory.meta_attention`).

Parameters and buffers are known only for ``nn.Module`` callables: tensors a plain function
closes over (a weight, say) count as activations when autograd saves them.

Not modelled: forward temporaries that are not saved for backward (they live only inside one
step), tensors a custom ``autograd.Function`` stores on ``ctx`` directly rather than through
``save_for_backward``, allocator fragmentation and rounding, the caller's sample tensors, and
``share_buffers=False``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._call import (
    Call,
    check_accumulation_modes,
    check_flag,
    check_overlap_order,
    check_plannable,
    validate_call,
)
from ..buffers import BufferPlan, plan_buffers
from ..build.builder import accumulation_buffer_bytes
from ..order import OrderEntry
from ..probe import GraphFacts, probe
from ..result import is_graphed
from .meta_attention import MetaAttention
from .records import MemoryPlan
from .walk import walk_plan

__all__ = ["memory_plan_of", "plan_memory", "shared_buffers"]

SampleArgs = tuple[Any, ...]


def plan_memory(
    callables: Callable[..., Any] | tuple[Callable[..., Any], ...],
    sample_args: SampleArgs | tuple[SampleArgs, ...],
    *,
    sample_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
    order: Sequence[OrderEntry] | None = None,
    num_layers_per_chunk: int | Sequence[int] | None = None,
    meta_attention: str = "cuda",
    fuse_grad_accumulation: bool = False,
    overlap_grad_accumulation: bool = False,
) -> MemoryPlan:
    """Plan the memory of ``make_graphed_callables`` with the same arguments, without capturing.

    Every distinct callable (the same object counts once) is run forward once per distinct
    sample signature under ``torch.autograd.graph.saved_tensors_hooks`` (the probe that
    ``make_graphed_callables`` runs too); nothing runs backward (gradient sizes come from
    tensor metadata). Then the plan's warm-up and capture sequences are walked step by step
    (see the module docstring for the model).

    Args:
        callables: A callable or ``nn.Module``, or a tuple of them (the layers, chunk by chunk).
        sample_args: One tuple of sample arguments per graph (one tuple for a single callable),
            laid out as for ``make_graphed_callables``. Meta tensors allocate nothing.
        sample_kwargs: One dict of keyword sample arguments per graph (a dict for a single
            callable), or None.
        order: The pipeline order (chunk ids or :class:`leangraph.Step` records, as for
            ``make_graphed_callables``); None for the torch drop-in plan (each callable's forward
            and backward back to back in warm-up; all forwards then all backwards in capture).
        num_layers_per_chunk: Layers of each chunk with ``order`` (default: an equal split).
        meta_attention: Which kernel ``scaled_dot_product_attention`` on meta tensors without
            an ``attn_mask`` stands for: ``"cuda"`` (CUDA's flash kernel: saves q, k, v, the
            output, its fp32 log-sum-exp and the RNG seed and offset), ``"cpu"`` (what CPU's
            SDPA runs on such tensors, which is what a CPU run measures: its flash kernel,
            which saves the same without the RNG state, or its math path where CPU's kernel
            choice picks that) or ``"math"`` (PyTorch's own meta fallback, the unfused math
            path that saves the ``s x s`` attention probabilities).
        fuse_grad_accumulation: Plan ``make_graphed_callables(...,
            fuse_grad_accumulation=True)``: capture and what is held after it add the
            buffers the backward graphs add parameter gradients into, one per trained
            parameter that has neither a ``main_grad`` nor a ``.grad`` of its layout (as the
            parameters stand now: ``zero_grad(set_to_none=True)`` before the call counts
            them all).
        overlap_grad_accumulation: Plan ``overlap_grad_accumulation=True``: capture keeps
            each backward's parameter gradients in the pool until the next backward is
            recorded.

    Returns:
        The :class:`MemoryPlan`.

    Raises:
        TypeError: for callables that are not callable, sample arguments that are not tuples
            of tensor pytrees, or outputs that are not tensors.
        ValueError: for a malformed order, mismatched counts, tensors on several devices, an
            unknown ``meta_attention``, or callables graphed already (a graphed callable, or
            a module that is or holds one: its forward replays, which save nothing); for
            both accumulation modes at once, or ``overlap_grad_accumulation`` with an order
            that has weight steps.
    """
    MetaAttention(meta_attention)  # refuse an unknown kind before any work
    check_flag("fuse_grad_accumulation", fuse_grad_accumulation)
    check_flag("overlap_grad_accumulation", overlap_grad_accumulation)
    check_accumulation_modes(fuse_grad_accumulation, overlap_grad_accumulation)
    call = validate_call(callables, sample_args, sample_kwargs, order, num_layers_per_chunk)
    check_overlap_order(call, overlap_grad_accumulation)
    check_plannable(call, is_graphed)
    facts = probe(call, around_forward=lambda: MetaAttention(meta_attention))
    return memory_plan_of(
        call,
        facts,
        fuse_grad_accumulation=fuse_grad_accumulation,
        overlap_grad_accumulation=overlap_grad_accumulation,
    )


def shared_buffers(call: Call, facts: Sequence[GraphFacts]) -> BufferPlan:
    """The static buffers the engine allocates for ``call`` when it shares buffers (the
    default), from the plan and the probe's ``facts``."""
    return plan_buffers(
        call.plan,
        [f.inputs for f in facts],
        [f.outputs for f in facts],
        chainable=call.chainable(),
    )


def memory_plan_of(
    call: Call,
    facts: Sequence[GraphFacts],
    buffers: BufferPlan | None = None,
    *,
    fuse_grad_accumulation: bool = False,
    overlap_grad_accumulation: bool = False,
) -> MemoryPlan:
    """The memory plan of ``call`` from the probe's ``facts``, with the buffers the engine
    allocates when it shares buffers (the default): ``buffers`` where the caller planned
    them already; with the accumulation mode's own memory (see :func:`plan_memory`)."""
    if buffers is None:
        buffers = shared_buffers(call, facts)
    return walk_plan(
        call.plan,
        [f.memory for f in facts],
        buffers,
        accumulation_bytes=accumulation_buffer_bytes(call, facts) if fuse_grad_accumulation else 0,
        hold_param_grads=overlap_grad_accumulation,
    )
