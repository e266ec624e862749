"""``make_graphed_callables``: validate, probe, plan buffers, build, hand back the result.

The stages run one way, each taking and returning frozen records: :func:`validate_call`
(:class:`~leangraph._call.Call`), :func:`~leangraph.probe.probe` (a
:class:`~leangraph.probe.GraphFacts` per graph), the memory check, the buffer plan
(:class:`~leangraph.buffers.BufferPlan`), :func:`~leangraph.build.builder.build_graphs` (a
:class:`~leangraph.build.record.GraphRecord` per graph), then one
:class:`~leangraph.GraphedCallable` per record in one :class:`~leangraph.GraphedSet`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypedDict, TypeVar, overload

import torch
from typing_extensions import Unpack

from ._call import (
    Call,
    CaptureOptions,
    check_callable_or_none,
    check_capturable,
    check_options,
    validate_call,
)
from ._restore import SavedState
from .backends import GraphBackend, check_backend_name, check_generator_states, make_backend
from .build.builder import Built, build_graphs
from .build.record import GraphRecord
from .hooks import CaptureHooks, normalize_hooks
from .memory import available_bytes, check_fits, memory_plan_of, shared_buffers
from .order import OrderEntry, StepKind
from .probe import probe
from .progress import ProgressCallback
from .result import GraphedSet, is_graphed
from .runtime.graphed import GraphedCallable, autocast_state, install_forward
from .runtime.kernels import KernelSettings
from .runtime.overlap import AdditionFence
from .runtime.pending import PendingBackwards
from .runtime.sequence import ReplaySequence

__all__ = ["check_option_values", "make_graphed_callables", "option_defaults"]

log = logging.getLogger("leangraph")

SampleArgs = tuple[Any, ...]
_Module = TypeVar("_Module", bound=torch.nn.Module)


class _OptionsButOrder(TypedDict, total=False):
    """The keyword options of :func:`make_graphed_callables` but ``order`` (see its
    docstring): the overloads tell apart a single callable with and without an order."""

    sample_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None
    num_warmup_iters: int
    allow_unused_input: bool
    pool: Any | None
    num_layers_per_chunk: int | Sequence[int] | None
    retain_graph_in_backward: bool
    backend: str | None
    share_buffers: bool
    debug_outputs: bool
    progress: ProgressCallback | None
    check_memory: bool
    pre_warmup_hook: Callable[[], None] | None
    post_warmup_hook: Callable[[], None] | None
    capture_time_hooks: Sequence[Mapping[str, Sequence[Callable[..., None]]] | None] | None
    fuse_grad_accumulation: bool
    accumulator_hooks: bool | Literal["python"]
    overlap_grad_accumulation: bool
    generator_states: Sequence[torch.Generator]


class CaptureKeywords(_OptionsButOrder, total=False):
    """The keyword options of :func:`make_graphed_callables` (see its docstring)."""

    order: Sequence[OrderEntry] | None


# A single callable with an order comes back as a GraphedCallable, module or not; without
# one, a module comes back as itself and a plain function as a GraphedCallable. A module is
# also callable, so the Module overload overlaps the next, and mypy must be told it is meant.
@overload
def make_graphed_callables(
    callables: Callable[..., Any],
    sample_args: SampleArgs,
    *,
    order: Sequence[OrderEntry],
    **options: Unpack[_OptionsButOrder],
) -> GraphedCallable: ...


@overload
def make_graphed_callables(  # type: ignore[overload-overlap]
    callables: _Module,
    sample_args: SampleArgs,
    *,
    order: None = None,
    **options: Unpack[_OptionsButOrder],
) -> _Module: ...


@overload
def make_graphed_callables(
    callables: Callable[..., Any], sample_args: SampleArgs, **options: Unpack[CaptureKeywords]
) -> GraphedCallable: ...


@overload
def make_graphed_callables(
    callables: tuple[Callable[..., Any], ...],
    sample_args: tuple[SampleArgs, ...],
    **options: Unpack[CaptureKeywords],
) -> tuple[Any, ...]: ...


def make_graphed_callables(
    callables: Callable[..., Any] | tuple[Callable[..., Any], ...],
    sample_args: SampleArgs | tuple[SampleArgs, ...],
    *,
    sample_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any | None = None,
    order: Sequence[OrderEntry] | None = None,
    num_layers_per_chunk: int | Sequence[int] | None = None,
    retain_graph_in_backward: bool = False,
    backend: str | None = None,
    share_buffers: bool = True,
    debug_outputs: bool = False,
    progress: ProgressCallback | None = None,
    check_memory: bool = True,
    pre_warmup_hook: Callable[[], None] | None = None,
    post_warmup_hook: Callable[[], None] | None = None,
    capture_time_hooks: Sequence[Mapping[str, Sequence[Callable[..., None]]] | None] | None = None,
    fuse_grad_accumulation: bool = False,
    accumulator_hooks: bool | Literal["python"] = True,
    overlap_grad_accumulation: bool = False,
    generator_states: Sequence[torch.Generator] = (),
) -> Any:
    """Capture callables into forward and backward graphs, optionally in a pipeline order.

    Without ``order``, a drop-in for ``torch.cuda.make_graphed_callables``: a single callable
    comes back alone, a tuple as a tuple; a function as a :class:`GraphedCallable`, a module
    as itself with a graphed ``forward`` (eager outside the training mode it was captured in).
    Replays then run forwards in the given order and backwards in reverse, as torch requires.
    With ``order`` (``+c`` forward of chunk ``c``'s next microbatch, ``-c`` backward of its
    oldest, ``-(c + 0.5)`` its weight step), ``callables`` are the layers chunk by chunk,
    ``sample_args`` has one entry per graph laid out chunk -> microbatch -> layer
    (:class:`leangraph.Layout`), a :class:`GraphedCallable` comes back at each position (a
    single callable with a one-microbatch order: that graph alone, a module's ``forward``
    untouched), and replays follow the order. The call's :class:`GraphedSet`
    (``.graphed_set`` of any returned callable, or of a graphed module's ``forward``) owns the
    record and the pool.

    Memory aliasing: replay outputs are views of graph-owned buffers. With ``share_buffers``
    they stay valid until their graph's backward replay (or, without a backward, its next
    forward replay), and samples may be freed after the call; with ``share_buffers=False``
    sample tensors become the static inputs (but for those a replay's copy must not write:
    overlapping another, a parameter or a buffer, or expanded) and outputs stay valid until
    the callable's next replay (docs/concepts.md: the warm-up, buffer and pool model).

    Args:
        callables: A callable or ``nn.Module``, or a tuple of them.
        sample_args: One tuple of sample arguments (tensor pytrees) per graph.
        sample_kwargs: One dict of keyword sample arguments per graph, or None.
        num_warmup_iters: Eager warm-up passes before capture (after a probe forward). A
            pass runs, in the order, one graph per callable and sample layout (graphs alike
            run the same kernels), so its cost does not grow with the microbatches.
        allow_unused_input: Allow inputs and parameters the outputs do not depend on.
        pool: A graph memory pool handle (``torch.cuda.graph_pool_handle()``) to share.
        order: The pipeline order: chunk ids (``+c``, ``-c``, ``-(c + 0.5)``) or
            :class:`leangraph.Step` records naming each step's microbatch; None for the
            torch drop-in behaviour.
        num_layers_per_chunk: Layers of each chunk with ``order`` (default: equal split).
        retain_graph_in_backward: Let a backward replay more than once per forward.
        backend: ``"cuda"``, ``"cpu"`` or None (by the samples' device).
        share_buffers: Schedule-driven reuse of static buffers (False: torch's behaviour).
        debug_outputs: Outputs that raise ``RuntimeError`` when read after their window.
        progress: Called with a :class:`leangraph.ProgressEvent` after every step.
        check_memory: On CUDA, raise :class:`leangraph.CaptureMemoryError` before warm-up
            if the memory plan of the probed forwards does not fit.
        pre_warmup_hook, post_warmup_hook: Called once before and after the whole warm-up.
        capture_time_hooks: One dict of hook lists per callable (or None); they run around
            warm-up and capture steps, never at replay (:mod:`leangraph.hooks`).
        fuse_grad_accumulation: Add parameter gradients into ``main_grad`` (where present)
            or ``.grad`` inside the backward graphs; both then alias graph-written memory
            until reset ([concepts](docs/concepts.md): zeroing, hooks, Megatron's flag).
            The graphs of callables that train a parameter another callable trains too
            (tied weights) add none in: they hand autograd their gradients unfused, so that
            the tied ones are summed before they accumulate, as in eager.
        accumulator_hooks: With ``fuse_grad_accumulation``, how the hooks on the
            parameters' accumulators fire after each backward replay (post-accumulate-grad
            hooks, torch DDP's and Megatron-core DDP's gradient-ready hooks). True: autograd
            runs every accumulator, so every hook fires, C++ ones included, at some
            microseconds of host time per parameter. ``"python"``: the replay calls the
            hooks registered from Python itself (Megatron-core DDP's among them), in eager's
            order, and autograd runs no accumulator; for loops without torch DDP, whose
            hooks are C++. False: no hook fires, and a parameter with a post-accumulate-grad hook
            or a hook on its accumulator node is refused.
            A forward replay inside torch DDP is refused with either (errors.md R17).
        overlap_grad_accumulation: Without ``fuse_grad_accumulation``, have autograd add
            the parameter gradients into ``.grad`` on a side stream, overlapping the next
            layer's backward graph (a stream wait per parameter per backward replay on the
            host); values and hooks stay the default's, the hooks run with that stream
            current ([concepts](docs/concepts.md): what it holds, torch's warning, limits).
        generator_states: Graph-safe CUDA generator states the callables switch to while
            they run (Megatron's graph-safe RNG tracker), registered with every graph.

    Raises:
        ValueError, TypeError, RuntimeError: for misuse, before any warm-up where it can be
            seen (docs/errors.md lists each case).
    """
    options = CaptureOptions(
        num_warmup_iters=num_warmup_iters,
        allow_unused_input=allow_unused_input,
        retain_graph_in_backward=retain_graph_in_backward,
        share_buffers=share_buffers,
        debug_outputs=debug_outputs,
        check_memory=check_memory,
        pre_warmup_hook=pre_warmup_hook,
        post_warmup_hook=post_warmup_hook,
        fuse_grad_accumulation=fuse_grad_accumulation,
        accumulator_hooks=accumulator_hooks,
        overlap_grad_accumulation=overlap_grad_accumulation,
    )
    check_callable_or_none("progress", progress)
    states = _generator_states(generator_states)
    call = validate_call(callables, sample_args, sample_kwargs, order, num_layers_per_chunk)
    check_options(call, options)
    check_capturable(call, is_graphed)
    hooks = normalize_hooks(capture_time_hooks, call.callables)
    graph_backend = make_backend(backend, call.device, pool, states)
    built = _build(call, options, graph_backend, hooks, progress)
    return _hand_back(call, built, options)


def option_defaults() -> dict[str, Any]:
    """Every keyword option of :func:`make_graphed_callables`, with its default."""
    return {
        name: parameter.default
        for name, parameter in inspect.signature(make_graphed_callables).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }


def check_option_values(options: Mapping[str, Any]) -> None:
    """Run the checks of :func:`make_graphed_callables` on the options in ``options`` that
    need no call (no callables, samples or order), the others at their defaults: the flags,
    ``num_warmup_iters``, the hooks and ``progress``, ``accumulator_hooks`` with
    ``fuse_grad_accumulation`` and ``overlap_grad_accumulation``, ``generator_states``, the
    ``backend`` name. For integrations that take options long before they capture.

    Raises:
        TypeError, ValueError: as :func:`make_graphed_callables` would (docs/errors.md).
    """
    values = {**option_defaults(), **options}
    fields = dataclasses.fields(CaptureOptions)
    CaptureOptions(**{field.name: values[field.name] for field in fields})
    check_callable_or_none("progress", values["progress"])
    check_generator_states(_generator_states(values["generator_states"]))
    check_backend_name(values["backend"])


def _generator_states(value: object) -> tuple[Any, ...]:
    """``generator_states`` as a tuple (its entries are checked with the backend).

    Raises:
        TypeError: for anything but a list or tuple.
    """
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            "generator_states must be a list or tuple of CUDA generators, got "
            f"{type(value).__name__}"
        )
    return tuple(value)


def _build(
    call: Call,
    options: CaptureOptions,
    backend: GraphBackend,
    hooks: Sequence[CaptureHooks],
    progress: ProgressCallback | None,
) -> Built:
    """Probe, check, plan the buffers, build; on failure put the caller's state back."""
    saved = SavedState(call.callables)
    try:
        facts = probe(call, where=backend.warmup())
        buffer_plan = shared_buffers(call, facts) if options.share_buffers else None
        if options.check_memory and backend.name == "cuda":
            # The check walks the buffers of sharing (the default) whether it is on or not.
            plan = memory_plan_of(
                call,
                facts,
                buffer_plan,
                fuse_grad_accumulation=options.fuse_grad_accumulation,
                overlap_grad_accumulation=options.overlap_grad_accumulation,
            )
            check_fits(plan, available_bytes(call.device))
        built = build_graphs(
            call, facts, buffer_plan, backend, options, hooks=hooks, progress=progress
        )
    except BaseException as exc:
        saved.restore(exc)
        raise
    finally:
        backend.teardown()
    log.info(
        "captured %d graphs on %s: warm-up %.2f s, capture %.2f s",
        len(built.records),
        built.capture.device,
        built.capture.warmup_seconds,
        built.capture.capture_seconds,
    )
    return built


def _hand_back(call: Call, built: Built, options: CaptureOptions) -> Any:
    """One graphed callable per record in the call's set; modules graphed without an order
    get it as their ``forward``; torch's return form."""
    graphed_set = GraphedSet(built.capture, single=call.single)
    pending = PendingBackwards(len(built.records))
    settings = KernelSettings(call.device.type)  # one capture, one device type
    steps = _replay_steps(call, built.records)
    sequence = ReplaySequence(
        steps,
        [record.label for record in built.records],
        pending.awaits,
    )
    fence = (
        AdditionFence(
            [graph for graph, kind in steps if kind is StepKind.BACKWARD],
            call.device,
        )
        if options.overlap_grad_accumulation and call.device.type == "cuda"
        else None
    )
    members = [
        GraphedCallable(
            record,
            graphed_set,
            pending,
            sequence,
            debug_outputs=options.debug_outputs,
            overlap_grad_accumulation=options.overlap_grad_accumulation,
            addition_fence=fence,
            captured_under_no_grad=not call.grad_enabled,
            autocast_at_capture=autocast_state(call.device.type),
            kernel_settings=settings,
        )
        for record in built.records
    ]
    entries: list[Any] = []
    for member, record in zip(members, built.records):
        module = record.module.module() if record.module is not None else None
        if module is not None:
            install_forward(module, member)
            entries.append(module)
        else:
            entries.append(member)
    graphed_set.adopt(entries, members)
    return graphed_set.returned()


def _replay_steps(call: Call, records: Sequence[GraphRecord]) -> list[tuple[int, StepKind]]:
    """The replays one pass runs, in capture order: every forward, and the backward and
    weight steps of graphs that have a backward."""
    return [
        (step.graph, step.kind)
        for step in call.plan.capture
        if step.kind is StepKind.FORWARD or records[step.graph].has_backward
    ]
