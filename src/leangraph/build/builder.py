"""The build stage: graph sources from the call, warm-up, buffers, capture, frozen records.

:func:`build_graphs` takes the validated call, the probe's facts and the buffer plan, and
returns one :class:`~leangraph.build.record.GraphRecord` per graph with the call's
:class:`~leangraph.report.CaptureRecord`. On failure every graph made so far is released and
the exception propagates.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .._call import Call, CaptureOptions
from .._restore import buffer_bindings, module_buffers, note_out_of_memory, values_kept
from ..backends.base import GraphBackend
from ..buffers import BufferKey, BufferPlan, StaticBuffers, allocate
from ..hooks import CaptureHooks
from ..probe import GraphFacts
from ..progress import ProgressCallback
from ..report import CaptureRecord
from ..runtime.signature import CallSignature
from .accumulation import (
    AccumulationTarget,
    allocate_targets,
    check_fusable,
    fused_parameters,
    new_buffer_bytes,
    trained_parameters,
)
from .capture import run_capture
from .graph import GraphBuilder, GraphSource
from .record import GraphRecord, ModuleBinding, ModuleState, ParameterSharing
from .recorder import MemoryRecorder
from .warmup import run_warmup

__all__ = ["Built", "accumulation_buffer_bytes", "build_graphs"]


@dataclass(frozen=True)
class Built:
    """What the build stage hands on: a record per graph and what the call measured."""

    records: tuple[GraphRecord, ...]
    capture: CaptureRecord


def build_graphs(
    call: Call,
    facts: Sequence[GraphFacts],
    buffer_plan: BufferPlan | None,
    backend: GraphBackend,
    options: CaptureOptions,
    *,
    hooks: Sequence[CaptureHooks],
    progress: ProgressCallback | None,
) -> Built:
    """Warm up, allocate the static buffers of ``buffer_plan`` (None: no sharing), capture.

    Raises:
        Whatever the callables raise, with a note naming the phase, graph and step.
    """
    sources = graph_sources(call, facts, hooks, options)
    # With in-graph accumulation: per graph, the parameters its backward adds in itself.
    fused: list[list[tuple[str, torch.nn.Parameter]]] = []
    if options.fuse_grad_accumulation:
        callables = [call.callable_index(source.index) for source in sources]
        fused = fused_parameters([_trained(source) for source in sources], callables)
        for source, params in zip(sources, fused):
            check_fusable(source.label, params, delivery=options.hook_delivery)
    builders = [GraphBuilder(source, backend.new_pair()) for source in sources]
    try:
        capture = _warm_up_and_capture(
            call, builders, buffer_plan, backend, options, fused, progress
        )
        return Built(tuple(b.record() for b in builders), capture)
    except BaseException as exc:
        note_out_of_memory(exc, call.device)  # figures as at the failure, before the resets
        for builder in builders:
            builder.abandon()
        raise


def _warm_up_and_capture(
    call: Call,
    builders: Sequence[GraphBuilder],
    buffer_plan: BufferPlan | None,
    backend: GraphBackend,
    options: CaptureOptions,
    fused: Sequence[Sequence[tuple[str, torch.nn.Parameter]]],
    progress: ProgressCallback | None,
) -> CaptureRecord:
    plan = call.plan
    recorder = MemoryRecorder(call.device, getattr(backend, "pool", None))
    observers = [recorder] + ([progress] if progress is not None else [])
    warmup_steps = options.num_warmup_iters * len(plan.warmup)
    if options.pre_warmup_hook is not None:
        options.pre_warmup_hook()
    # Warm-up runs the callables on the samples, whose values are nobody's data: what it
    # writes into module buffers (BatchNorm's running statistics and num_batches_tracked, a
    # step counter) is put back in place, as the probe and a CUDA capture leave them. Entered
    # outside the backend's warm-up context, so that on CUDA the copies are taken before the
    # warm-up stream starts and put back once it is joined, before any capture begins.
    bindings = buffer_bindings(call.callables)  # after the probe: a lazy cache is made
    with values_kept(module_buffers(call.callables)):
        run_warmup(
            plan,
            builders,
            num_iters=options.num_warmup_iters,
            backend=backend,
            observers=observers,
            total_steps=warmup_steps + len(plan.capture),
        )
    _refuse_rebound_buffers(call, bindings)
    if options.post_warmup_hook is not None:
        options.post_warmup_hook()
    recorder.end_warmup()
    # Allocated after warm-up, so warm-up's peak does not carry them.
    buffers = None if buffer_plan is None else StaticBuffers.allocate(buffer_plan)
    targets: list[tuple[AccumulationTarget, ...]] = []
    if options.fuse_grad_accumulation:
        targets = allocate_targets(fused)
        for builder, graph_targets in zip(builders, targets):
            builder.fuse_into(graph_targets, delivery=options.hook_delivery)
    # A capture that runs its work adds capture-time gradients into the targets and updates
    # module buffers (BatchNorm's statistics): keep what they held (an adopted .grad, a
    # main_grad) and put it back, as a CUDA capture, which runs nothing, leaves it.
    kept = (
        values_kept([t.buffer for graph in targets for t in graph] + module_buffers(call.callables))
        if backend.capture_runs_work
        else contextlib.nullcontext()
    )
    with kept:
        run_capture(
            plan,
            builders,
            backend=backend,
            buffers=buffers,
            observers=observers,
            steps_before=warmup_steps,
            hold_param_grads=options.overlap_grad_accumulation,
        )
    return recorder.finish()


def _refuse_rebound_buffers(call: Call, bindings: Sequence[Any]) -> None:
    """Refuse, before capture, a forward that assigns a new tensor to its own buffer (a step
    counter ``self.count = self.count + 1``): warm-up ran it again after the probe, so it does
    so at every call, and a replay runs only the captured kernels, so the buffer would stay
    as it was where eager's forward replaces it. (The caller's tensors are bound again by the
    failed call's restore.)"""
    for binding in bindings:
        if not binding.holds():
            graph = next(
                g
                for g in range(call.plan.layout.num_graphs)
                if call.callable_index(g) == binding.callable_index
            )
            raise ValueError(
                f"{call.label(graph)}: its forward assigns a new tensor to buffer "
                f"{binding.name!r} at every call (seen in warm-up); a replay runs only the "
                "captured kernels, so the buffer would never change, where eager's forward "
                "replaces it. Expected a forward that updates its buffers in place "
                "(self.count.add_(1), buf.copy_(new)), or that returns the new value"
            )


def graph_sources(
    call: Call,
    facts: Sequence[GraphFacts],
    hooks: Sequence[CaptureHooks],
    options: CaptureOptions,
) -> list[GraphSource]:
    """What every graph is built from, in graph order."""
    named_by_callable = [_named_parameters(fn) for fn in call.callables]
    sharing = parameter_sharing(call, facts, [tuple(p for _, p in n) for n in named_by_callable])
    # Without sharing the samples become the static inputs (torch's model): the memory kept
    # so far, and that of the callables' parameters and buffers, which none may overwrite.
    kept: Extents | None = None if options.share_buffers else {}
    held: Extents = {} if options.share_buffers else _held_extents(call.callables)
    last_signature: dict[int, CallSignature] = {}  # per callable: its graphs share a structure
    states = [
        ModuleState.of(fn) if isinstance(fn, torch.nn.Module) else None for fn in call.callables
    ]
    sources = []
    for graph in range(call.plan.layout.num_graphs):
        fn = call.callable_of(graph)
        index = call.callable_index(graph)
        leaves, tree = pytree.tree_flatten(call.samples[graph])
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        samples = _static_leaves(tensors, kept, held)
        given = iter(samples)
        call_leaves = [next(given) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        named = named_by_callable[index]
        label = call.label(graph)
        signature = CallSignature(
            label,
            call_leaves,
            tree,
            like=last_signature.get(index),
            named_keywords=_named_keywords(fn.forward if isinstance(fn, torch.nn.Module) else fn),
        )
        last_signature[index] = signature
        sources.append(
            GraphSource(
                index=graph,
                label=label,
                graph_id=call.plan.layout.graph_id(graph) if call.plan.ordered else None,
                fn=fn.forward if isinstance(fn, torch.nn.Module) else fn,
                samples=samples,
                signature=signature,
                params=tuple(p for _, p in named),
                param_names=tuple(n for n, _ in named),
                facts=facts[graph],
                hooks=hooks[index],
                sharing=sharing[graph],
                module=_binding(fn) if not call.plan.ordered else None,
                modules=states[index],
                allow_unused_input=options.allow_unused_input,
                retain_graph=options.retain_graph_in_backward,
                split_backward=call.plan.split_backward,
            )
        )
    return sources


def accumulation_buffer_bytes(call: Call, facts: Sequence[GraphFacts]) -> int:
    """What ``fuse_grad_accumulation=True`` allocates for ``call`` after warm-up, before
    capture, outside the pool, and keeps until reset: a buffer per parameter a graph adds
    into itself (:func:`fused_parameters`; each once) that has neither a ``main_grad`` nor a
    ``.grad`` of its layout."""
    # Read once per callable: a callable graphed at many microbatches has a graph per each.
    named = [_named_parameters(fn) for fn in call.callables]
    callables = [call.callable_index(graph) for graph in range(len(facts))]
    trained = [
        trained_parameters(named[index], graph_facts.trains, has_backward=graph_facts.has_backward)
        for index, graph_facts in zip(callables, facts)
    ]
    return new_buffer_bytes(p for params in fused_parameters(trained, callables) for _, p in params)


def _named_parameters(fn: object) -> tuple[tuple[str, torch.nn.Parameter], ...]:
    """A callable's parameters with their names, in gradient order (none for a function)."""
    return tuple(fn.named_parameters()) if isinstance(fn, torch.nn.Module) else ()


def _trained(source: GraphSource) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a graph trains, with their names, in gradient order."""
    named = list(zip(source.param_names, source.params))
    return trained_parameters(named, source.facts.trains, has_backward=source.facts.has_backward)


def _binding(fn: object) -> ModuleBinding | None:
    """How a module graphed without an order falls back to eager outside its modes.

    A module's own ``forward`` method is held weakly (it holds the module, which will hold
    the graphed callable). A ``torch.compile``d module's ``forward`` is a function set on the
    instance, closing over the wrapped module only, so it is held as it is.
    """
    if not isinstance(fn, torch.nn.Module):
        return None
    forward = fn.forward
    eager: Callable[[], Callable[..., Any] | None]
    if isinstance(forward, types.MethodType):
        eager = weakref.WeakMethod(forward)
    else:
        eager = functools.partial(_itself, forward)
    return ModuleBinding(module=weakref.ref(fn), eager_forward=eager)


def _itself(value: Callable[..., Any]) -> Callable[..., Any]:
    return value


Extents = dict[int, list[tuple[int, int]]]
"""Byte ranges of memory in use, by the address of the storage they lie in."""


def _static_leaves(
    leaves: list[torch.Tensor], kept: Extents | None, held: Extents
) -> tuple[torch.Tensor, ...]:
    """Sample tensors as detached leaves.

    With ``kept`` (``share_buffers=False``: the samples become the static inputs; ``kept``
    holds the memory of those kept so far, across graphs) a sample is copied into a buffer
    of its own, of its layout where it has a dense one, if a replay's copy into it would
    write over another static input (a tensor given twice, overlapping views of one tensor:
    a replay's second copy overwrote the first), a parameter or buffer (``held``, or a view
    of any ``nn.Parameter``: every replay wrote the caller's values into it), or itself (an
    expanded sample, which no copy can write).
    """
    static = []
    for leaf in leaves:
        tensor = leaf.detach()
        if kept is not None:
            storage, start, end = _extent(tensor)
            if (
                _overlaps(kept, storage, start, end)
                or _overlaps(held, storage, start, end)
                or isinstance(leaf, torch.nn.Parameter)
                or isinstance(leaf._base, torch.nn.Parameter)
                or _overlaps_itself(tensor)
            ):
                tensor = _fresh_copy(tensor)
            else:
                kept.setdefault(storage, []).append((start, end))
        static.append(tensor.requires_grad_(leaf.requires_grad))
    return tuple(static)


def _extent(tensor: torch.Tensor) -> tuple[int, int, int]:
    """The storage address of ``tensor`` and the byte range its elements lie in."""
    size = tensor.element_size()
    start = int(tensor.storage_offset()) * size
    if tensor.numel() == 0:
        return tensor.untyped_storage().data_ptr(), start, start
    last = sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride()))
    return tensor.untyped_storage().data_ptr(), start, start + (last + 1) * size


def _overlaps(extents: Extents, storage: int, start: int, end: int) -> bool:
    return any(s < end and start < e for s, e in extents.get(storage, ()))


def _held_extents(callables: Sequence[Any]) -> Extents:
    """The memory of the modules' parameters and buffers."""
    held: Extents = {}
    for fn in callables:
        if isinstance(fn, torch.nn.Module):
            for tensor in (*fn.parameters(), *fn.buffers()):
                storage, start, end = _extent(tensor.detach())
                held.setdefault(storage, []).append((start, end))
    return held


def _overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` may share memory (a stride-0 dimension of an
    expanded tensor, or strides that interleave): walking the dimensions by increasing
    stride, each must step past everything the smaller ones reach."""
    reach = 0
    for stride, size in sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.shape) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _fresh_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in a buffer of its own, of its dense layout where it has one
    (kernels chosen for a transposed sample may differ from a contiguous copy's)."""
    (buffer,) = allocate([BufferKey.of(tensor, keep_layout=True)], requires_grad=False)
    with torch.no_grad():
        buffer.copy_(tensor)
    return buffer


def parameter_sharing(
    call: Call,
    facts: Sequence[GraphFacts],
    params_by_callable: Sequence[Sequence[torch.nn.Parameter]] | None = None,
) -> list[ParameterSharing]:
    """Per graph, which other graphs train one of its parameters, known before capture
    (``params_by_callable``: each callable's parameters in gradient order, if known)."""
    if params_by_callable is None:
        params_by_callable = [[p for _, p in _named_parameters(fn)] for fn in call.callables]
    params_of: list[Sequence[torch.nn.Parameter]] = []
    trained_by: dict[int, list[int]] = {}
    for graph in range(call.plan.layout.num_graphs):
        params = params_by_callable[call.callable_index(graph)]
        params_of.append(params)
        for param, trains in zip(params, facts[graph].trains):
            if trains:
                trained_by.setdefault(id(param), []).append(graph)
    # A layer's graphs (one per microbatch) share the same parameters: find their peers once.
    found: dict[tuple[int, ...], tuple[int, ...]] = {}
    result = []
    for graph, params in enumerate(params_of):
        shared = tuple(id(p) for p in params if len(trained_by.get(id(p), ())) > 1)
        if shared not in found:
            found[shared] = tuple(sorted({g for key in shared for g in trained_by[key]}))
        peers = tuple(g for g in found[shared] if g != graph)
        result.append(ParameterSharing(peers, frozenset(shared)))
    return result


def _named_keywords(fn: Callable[..., Any]) -> frozenset[str] | None:
    """For ``fn`` (a module's ``forward``) taking ``**kwargs``, whose order it sees, the
    keywords that bind to named parameters instead (any order); None where it takes no
    ``**kwargs``; an empty set where its signature cannot be read (every order counts)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in parameters if p.kind in by_name)
