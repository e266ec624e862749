"""``make_graphed_callables``: validate, plan, warm up, capture, hand back graphed callables."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .arguments import Samples, as_tuples, common_device, make_plan, normalize_samples
from .backends import GraphBackend, make_backend
from .buffers import BufferKey, StaticBuffers, plan_buffers
from .capture import run_capture
from .graphed import GraphedCallable, _ModuleBinding, graphed_callables_of
from .hooks import CaptureHooks, normalize_hooks
from .memory_check import check_fits
from .plan import Plan
from .progress import ProgressCallback
from .report import CaptureRecord, MemoryRecorder
from .warmup import run_warmup

__all__ = ["make_graphed_callables", "reset_all"]

log = logging.getLogger("leangraph")

SampleArgs = tuple[Any, ...]
Graphed = GraphedCallable | torch.nn.Module


def make_graphed_callables(
    callables: Callable[..., Any] | tuple[Callable[..., Any], ...],
    sample_args: SampleArgs | tuple[SampleArgs, ...],
    *,
    sample_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any | None = None,
    order: Sequence[int] | None = None,
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
) -> Any:
    """Capture callables into forward and backward graphs, optionally in a pipeline order.

    Without ``order`` this is a drop-in for ``torch.cuda.make_graphed_callables``: a single
    callable comes back alone, a tuple as a tuple; a plain function comes back as a
    :class:`GraphedCallable` and an ``nn.Module`` as the same module whose ``forward`` is one
    (replaying only in the training mode it was captured in, eager otherwise). The callables
    must then run forwards in the given order and backwards in reverse, as torch requires.

    With ``order`` (``+c`` forward of chunk ``c``'s next microbatch, ``-c`` backward of its
    oldest outstanding one), ``callables`` are the layers chunk by chunk and ``sample_args``
    has one entry per (chunk, microbatch, layer), laid out chunk -> microbatch -> layer: the
    graph of chunk ``c``, microbatch ``m``, layer ``l`` is at ``prefix[c] * M + m * L_c + l``
    (see :class:`leangraph.order.Layout`). Every returned entry is a :class:`GraphedCallable`
    at the same position, and replays must follow the order.

    Warm-up keeps only the outputs of forwards whose backward has not run yet; capture records
    graphs in the order into one pool, so graph memory follows what the schedule holds in
    flight rather than the number of microbatches.

    Memory aliasing: outputs of a replay are views of graph-owned buffers. With
    ``share_buffers`` (the default) they stay valid until their graph's backward replay (or,
    for graphs without a backward, its next forward replay); samples are used for warm-up
    only and may be freed after the call. With ``share_buffers=False`` sample tensors become
    the static inputs (a tensor given for more than one graph is copied for the later ones)
    and outputs stay valid until the same callable's next replay.

    Args:
        callables: A callable or ``nn.Module``, or a tuple of them.
        sample_args: One tuple of sample arguments (pytrees of tensors) per graph; for a single
            callable, one tuple.
        sample_kwargs: One dict of keyword sample arguments per graph (a dict for a single
            callable), or None. Keyword tensors are static inputs like positional ones.
        num_warmup_iters: Eager warm-up passes before capture.
        allow_unused_input: Allow inputs and parameters that require grad but that the
            outputs do not depend on (their gradient is None).
        pool: A graph memory pool handle (``torch.cuda.graph_pool_handle()``) to share.
        order: The pipeline order; None for the torch drop-in behaviour.
        num_layers_per_chunk: Layers of each chunk with ``order`` (int or one per chunk);
            default: ``len(callables)`` split equally.
        retain_graph_in_backward: Keep saved activations so a backward may be replayed more
            than once per forward (costs their memory for as long as the graph lives).
        backend: ``"cuda"``, ``"cpu"`` or None (``"cuda"`` for GPU sample tensors).
        share_buffers: Schedule-driven buffer reuse (default). Static inputs and gradient
            seeds of graphs whose lifetimes never overlap share storage; a layer's first input
            is the previous layer's output buffer (with an order, within a chunk); outputs and
            gradient buffers are released to the pool once the plan is done with them. Then
            an output stays valid until its graph's backward (or next forward) replay. False
            keeps torch's behaviour: sample tensors are the static inputs and every graph owns
            its buffers for its whole life.
        debug_outputs: Return outputs that raise ``RuntimeError`` when used after their
            validity window (slower; for finding reads of reused buffers).
        progress: Called with a :class:`leangraph.progress.ProgressEvent` after every warm-up
            and capture step.
        pre_warmup_hook: Called once before the whole warm-up.
        post_warmup_hook: Called once after the whole warm-up (before capture).
        capture_time_hooks: One entry per callable (or None), a dict with lists of
            ``forward_pre``, ``forward``, ``backward_pre`` and ``backward`` hooks that run
            outside stream capture around every warm-up and capture step of that callable,
            in schedule order, and never at replay (see :mod:`leangraph.hooks`).
        check_memory: On CUDA, first compute :func:`leangraph.plan_memory` for these
            arguments (one forward of each distinct callable, on the warm-up stream) and
            raise :class:`leangraph.CaptureMemoryError` if its peak does not fit in the
            memory available, before any warm-up or capture work.

    Returns:
        The graphed callables, in the form described above.

    Raises:
        ValueError: for a malformed order, mismatched counts, modules with hooks, buffers that
            require grad, unused inputs, tensors on several devices.
        TypeError: for sample arguments that are not tuples of tensor pytrees.
        RuntimeError: for autocast with its cache enabled, or a missing CUDA device.
    """
    fns, samples_given, kwargs_given, single = as_tuples(callables, sample_args, sample_kwargs)
    _check_arguments(fns, order, num_warmup_iters)
    plan = make_plan(len(fns), samples_given, order, num_layers_per_chunk)
    samples = normalize_samples(samples_given, kwargs_given, plan.layout.num_graphs)
    device = common_device(samples, fns)
    graph_backend = make_backend(backend, device, pool)
    saved = _SavedState(fns)
    if check_memory and graph_backend.name == "cuda":
        # The check runs the callables' code once: what it draws must not move the RNGs, on
        # success or failure, and a failure there restores module state as later ones do.
        with (
            torch.random.fork_rng(devices=[device], device_type="cuda"),
            saved.restoring("the memory check (check_memory=True), before warm-up"),
        ):
            check_fits(
                fns,
                samples_given,
                kwargs_given,
                order,
                num_layers_per_chunk,
                device,
                where=graph_backend.warmup(),
            )
    graphs = _build_graphs(
        plan,
        fns,
        samples,
        graph_backend,
        normalize_hooks(capture_time_hooks, fns),
        allow_unused_input=allow_unused_input,
        retain_graph_in_backward=retain_graph_in_backward,
        share_buffers=share_buffers,
    )
    stages = _Stages(
        num_warmup_iters=num_warmup_iters,
        share_buffers=share_buffers,
        progress=progress,
        pre_warmup_hook=pre_warmup_hook,
        post_warmup_hook=post_warmup_hook,
    )
    try:
        record = _warm_up_and_capture(plan, graphs, samples, graph_backend, device, stages)
    except BaseException as exc:
        _note_out_of_memory(exc, device)  # figures as at the failure, before the resets
        for graph in graphs:
            graph.reset()
        saved.restore(exc)
        raise
    finally:
        graph_backend.teardown()
    log.info(
        "captured %d graphs on %s: warm-up %.2f s, capture %.2f s",
        len(graphs),
        record.device,
        record.warmup_seconds,
        record.capture_seconds,
    )
    return _hand_back(plan, fns, graphs, single, debug_outputs=debug_outputs, record=record)


@dataclass(frozen=True)
class _Stages:
    """The options warm-up and capture need, travelling together."""

    num_warmup_iters: int
    share_buffers: bool
    progress: ProgressCallback | None
    pre_warmup_hook: Callable[[], None] | None
    post_warmup_hook: Callable[[], None] | None


def _warm_up_and_capture(
    plan: Plan,
    graphs: list[GraphedCallable],
    samples: Samples,
    backend: GraphBackend,
    device: torch.device,
    stages: _Stages,
) -> CaptureRecord:
    """Warm up, plan the static buffers from what warm-up saw, capture; return the record."""
    recorder = MemoryRecorder(device, getattr(backend, "pool", None))
    observers = [recorder] + ([stages.progress] if stages.progress is not None else [])
    warmup_steps = stages.num_warmup_iters * len(plan.warmup)
    if stages.pre_warmup_hook is not None:
        stages.pre_warmup_hook()
    run_warmup(
        plan,
        graphs,
        num_iters=stages.num_warmup_iters,
        backend=backend,
        observers=observers,
        total_steps=warmup_steps + len(plan.capture),
    )
    if stages.post_warmup_hook is not None:
        stages.post_warmup_hook()
    recorder.end_warmup()
    buffers = _plan_static_buffers(
        plan,
        graphs,
        samples,
        known_outputs=stages.num_warmup_iters > 0,
        share=stages.share_buffers,
    )
    run_capture(
        plan,
        graphs,
        backend=backend,
        buffers=buffers,
        observers=observers,
        steps_before=warmup_steps,
    )
    return recorder.finish()


def reset_all(graphed: Graphed | Sequence[Graphed]) -> None:
    """Reset every graphed callable of one ``make_graphed_callables`` result.

    Accepts what ``make_graphed_callables`` returned: a :class:`GraphedCallable`, a module
    whose ``forward`` is one, or a tuple of those. Idempotent, like each ``reset()``.

    Raises:
        TypeError: for anything that is not such a result.
    """
    for callable_ in graphed_callables_of(graphed, "reset_all"):
        callable_.reset()


# ---------------------------------------------------------------------------- validation


def _check_arguments(fns: tuple[Any, ...], order: Any, num_warmup_iters: Any) -> None:
    if (
        isinstance(num_warmup_iters, bool)
        or not isinstance(num_warmup_iters, int)
        or num_warmup_iters < 0
    ):
        raise ValueError(f"num_warmup_iters must be an int >= 0, got {num_warmup_iters!r}")
    _check_autocast()
    for index, fn in enumerate(fns):
        _check_callable(index, fn)
    if order is None:
        _check_distinct_modules(fns)


def _check_autocast() -> None:
    enabled = any(torch.is_autocast_enabled(d) for d in ("cuda", "cpu"))
    if enabled and torch.is_autocast_cache_enabled():
        raise RuntimeError(
            "make_graphed_callables does not support the autocast cache: the cache would keep "
            "capture-time casts alive; use torch.autocast(..., cache_enabled=False)"
        )


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _check_callable(index: int, fn: object) -> None:
    if not callable(fn):
        raise TypeError(f"callables[{index}] is a {type(fn).__name__}, which is not callable")
    if not isinstance(fn, torch.nn.Module):
        return
    if isinstance(fn.__dict__.get("forward"), GraphedCallable):
        raise ValueError(
            f"callables[{index}] ({type(fn).__name__}) was already graphed; reset it and "
            "capture a fresh module"
        )
    global_hooks = [
        kind for kind in _MODULE_HOOKS if getattr(torch.nn.modules.module, f"_global{kind}", None)
    ]
    if global_hooks:
        raise ValueError(
            f"callables[{index}] ({type(fn).__name__}): global module hooks are registered "
            f"({', '.join(f'_global{kind}' for kind in global_hooks)}); graphs cannot replay "
            "them; remove them (torch.nn.modules.module.register_module_*_hook) before capture"
        )
    for name, module in fn.named_modules():
        hooks = [kind for kind in _MODULE_HOOKS if getattr(module, kind, None)]
        if hooks:
            where = f"submodule {name!r}" if name else "the module"
            raise ValueError(
                f"callables[{index}] ({type(fn).__name__}): {where} has {', '.join(hooks)}, "
                "which graphs cannot replay; remove them before capture"
            )
    for name, buffer in fn.named_buffers():
        if buffer.requires_grad:
            raise ValueError(
                f"callables[{index}] ({type(fn).__name__}): buffer {name!r} requires grad; "
                "graphed modules' buffers must not require grad"
            )


def _check_distinct_modules(callables: tuple[Any, ...]) -> None:
    first: dict[int, int] = {}
    for index, fn in enumerate(callables):
        if isinstance(fn, torch.nn.Module):
            if id(fn) in first:
                raise ValueError(
                    f"callables[{index}] is the same module as callables[{first[id(fn)]}]; "
                    "without an order each module is graphed once (its forward is replaced)"
                )
            first[id(fn)] = index


# ---------------------------------------------------------------------------- failure


class _SavedState:
    """What a failed warm-up or capture puts back: RNG states and modules' training flags.

    Taken before the memory check and warm-up. On success nothing is restored, as in
    ``torch.cuda.make_graphed_callables``: warm-up and capture advance the RNGs the callables
    draw from. Parameters' ``.grad`` need no saving: warm-up and capture differentiate with
    ``torch.autograd.grad``, which never touches ``.grad``.
    """

    def __init__(self, callables: tuple[Any, ...]) -> None:
        self.cpu_rng = torch.get_rng_state()
        # Only where CUDA is already initialised (a CUDA backend initialises it): reading the
        # CUDA RNG would otherwise initialise CUDA for a CPU-only call.
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.training = [
            (module, module.training)
            for fn in callables
            if isinstance(fn, torch.nn.Module)
            for module in fn.modules()
        ]

    def restore(self, exc: BaseException) -> None:
        """Put everything back; a step that fails is noted on ``exc``, which stays the error."""
        steps: list[tuple[str, Callable[[], None]]] = [
            ("the CPU RNG state", lambda: torch.set_rng_state(self.cpu_rng))
        ]
        if self.cuda_rng is not None:
            cuda_rng = self.cuda_rng
            steps.append(("the CUDA RNG states", lambda: torch.cuda.set_rng_state_all(cuda_rng)))
        for what, step in steps:
            try:
                step()
            except Exception as error:
                _add_note(exc, f"leangraph: could not restore {what} after the failure: {error!r}")
        for module, training in self.training:
            module.training = training

    @contextlib.contextmanager
    def restoring(self, during: str) -> Iterator[None]:
        """Restore on any exception passing by, noting where it was raised; re-raise it."""
        try:
            yield
        except BaseException as exc:
            _add_note(exc, f"leangraph: raised during {during}")
            self.restore(exc)
            raise


def _add_note(exc: BaseException, note: str) -> None:
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(note)


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _note_out_of_memory(exc: BaseException, device: torch.device) -> None:
    """Add the CUDA allocator's figures to an out-of-memory error raised by warm-up or capture."""
    if not isinstance(exc, torch.cuda.OutOfMemoryError) or device.type != "cuda":
        return
    try:
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch>=2.7
        fraction = (
            ""
            if get_fraction is None
            else f", per-process memory fraction {get_fraction(device):g}"
        )
    except Exception:
        return
    _add_note(
        exc,
        (
            f"leangraph: out of memory on {device} in make_graphed_callables: memory_allocated "
            f"{_mib(allocated)}, memory_reserved {_mib(reserved)}, free on the device {_mib(free)} "
            f"of {_mib(total)}{fraction}; the graphs made so far were reset, and "
            "torch.cuda.empty_cache() returns their memory once this error is dropped"
        ),
    )


# ---------------------------------------------------------------------------- assembly


def _static_leaves(
    leaves: list[torch.Tensor], seen: set[int], *, copy_repeats: bool
) -> list[torch.Tensor]:
    """Sample tensors as detached leaves; with ``copy_repeats`` (samples that will be static
    inputs) a tensor already given to another graph is copied."""
    static = []
    for leaf in leaves:
        tensor = leaf.detach()
        if copy_repeats and id(leaf) in seen:
            tensor = tensor.clone()
        seen.add(id(leaf))
        static.append(tensor.requires_grad_(leaf.requires_grad))
    return static


def _label(plan: Plan, graph: int, fn: Any, callable_index: int) -> str:
    if plan.ordered:
        return f"graph ({plan.layout.graph_id(graph)})"
    name = (
        type(fn).__name__
        if isinstance(fn, torch.nn.Module)
        else getattr(fn, "__qualname__", type(fn).__name__)
    )
    return f"callable {callable_index} ({name})"


def _build_graphs(
    plan: Plan,
    callables: tuple[Any, ...],
    samples: list[tuple[Any, Any]],
    backend: GraphBackend,
    hooks: list[CaptureHooks],
    *,
    allow_unused_input: bool,
    retain_graph_in_backward: bool,
    share_buffers: bool,
) -> list[GraphedCallable]:
    layout = plan.layout
    seen: set[int] = set()
    graphs = []
    for graph in range(layout.num_graphs):
        graph_id = layout.graph_id(graph)
        callable_index = layout.callable_index(graph_id.chunk, graph_id.layer)
        fn = callables[callable_index]
        leaves, tree = pytree.tree_flatten(samples[graph])
        named = tuple(fn.named_parameters()) if isinstance(fn, torch.nn.Module) else ()
        graphs.append(
            GraphedCallable(
                fn=fn.forward if isinstance(fn, torch.nn.Module) else fn,
                label=_label(plan, graph, fn, callable_index),
                graph_id=graph_id if plan.ordered else None,
                samples=_static_leaves(leaves, seen, copy_repeats=not share_buffers),
                input_tree=tree,
                params=tuple(p for _, p in named),
                param_names=tuple(n for n, _ in named),
                pair=backend.new_pair(),
                allow_unused_input=allow_unused_input,
                retain_graph_in_backward=retain_graph_in_backward,
                split_backward=plan.split_backward,
                hooks=hooks[callable_index],
            )
        )
    return graphs


def _plan_static_buffers(
    plan: Plan,
    graphs: list[GraphedCallable],
    samples: list[tuple[Any, Any]],
    *,
    known_outputs: bool,
    share: bool,
) -> StaticBuffers | None:
    """The buffer plan from what warm-up saw, allocated; None without sharing."""
    if not share:
        return None
    input_keys = [[BufferKey.of(t) for t in g._samples] for g in graphs]
    output_keys = [g._output_keys for g in graphs] if known_outputs else None
    chainable = [bool(args) and isinstance(args[0], torch.Tensor) for args, _ in samples]
    return StaticBuffers.allocate(plan_buffers(plan, input_keys, output_keys, chainable=chainable))


def _link_parameter_peers(graphs: Sequence[GraphedCallable]) -> None:
    """Tell every graph which other graphs train one of its parameters."""
    trained_by: dict[int, list[GraphedCallable]] = {}
    for graph in graphs:
        for param, trains in zip(graph._params, graph._param_trains):
            if trains:
                trained_by.setdefault(id(param), []).append(graph)
    # A layer's graphs (one per microbatch) share the same parameters: find their peers once.
    sharing: dict[tuple[int, ...], list[GraphedCallable]] = {}
    for graph in graphs:
        shared = tuple(id(p) for p in graph._params if len(trained_by.get(id(p), ())) > 1)
        if shared not in sharing:
            sharing[shared] = list({id(g): g for key in shared for g in trained_by[key]}.values())
        peers = [peer for peer in sharing[shared] if peer is not graph]
        graph._share_parameters_with(peers, frozenset(shared))


def _hand_back(
    plan: Plan,
    callables: tuple[Any, ...],
    graphs: list[GraphedCallable],
    single: bool,
    *,
    debug_outputs: bool,
    record: CaptureRecord,
) -> Any:
    _link_parameter_peers(graphs)
    results: list[Any] = []
    for graph, fn in zip(graphs, callables if not plan.ordered else [None] * len(graphs)):
        if isinstance(fn, torch.nn.Module):
            graph._finish_capture(
                _ModuleBinding(
                    module=weakref.ref(fn),
                    eager_forward=weakref.WeakMethod(fn.forward),
                    training=fn.training,
                ),
                debug_outputs=debug_outputs,
                record=record,
            )
            fn.forward = graph
            results.append(fn)
        else:
            graph._finish_capture(debug_outputs=debug_outputs, record=record)
            results.append(graph)
    return results[0] if single else tuple(results)
