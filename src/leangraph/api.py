"""``make_graphed_callables``: validate, plan, warm up, capture, hand back graphed callables."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
from torch.utils import _pytree as pytree

from .backends import GraphBackend, make_backend
from .capture import run_capture
from .graphed import GraphedCallable, _ModuleBinding
from .order import parse_order
from .plan import Plan, build_plan, build_unordered_plan
from .warmup import run_warmup

__all__ = ["make_graphed_callables", "reset_all"]

SampleArgs = tuple[Any, ...]
Graphed = Union[GraphedCallable, torch.nn.Module]


def make_graphed_callables(
    callables: Union[Callable[..., Any], tuple[Callable[..., Any], ...]],
    sample_args: Union[SampleArgs, tuple[SampleArgs, ...]],
    *,
    sample_kwargs: Optional[Union[dict[str, Any], Sequence[dict[str, Any]]]] = None,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Optional[Any] = None,
    order: Optional[Sequence[int]] = None,
    num_layers_per_chunk: Optional[Union[int, Sequence[int]]] = None,
    retain_graph_in_backward: bool = False,
    backend: Optional[str] = None,
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

    Memory aliasing: sample tensors become the graphs' static inputs (a tensor given for more
    than one graph is copied for the later ones). Outputs of a replay alias static buffers
    valid until the same callable's next replay.

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

    Returns:
        The graphed callables, in the form described above.

    Raises:
        ValueError: for a malformed order, mismatched counts, modules with hooks, buffers that
            require grad, unused inputs, tensors on several devices.
        TypeError: for sample arguments that are not tuples of tensor pytrees.
        RuntimeError: for autocast with its cache enabled, or a missing CUDA device.
    """
    single = not isinstance(callables, tuple)
    if single:
        callables = (callables,)  # type: ignore[assignment]
        sample_args = (sample_args,)
        sample_kwargs = None if sample_kwargs is None else (sample_kwargs,)  # type: ignore[assignment]
    assert isinstance(callables, tuple)
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) \
            or num_warmup_iters < 0:
        raise ValueError(f"num_warmup_iters must be an int >= 0, got {num_warmup_iters!r}")
    _check_autocast()
    for index, fn in enumerate(callables):
        _check_callable(index, fn)
    if order is None:
        _check_distinct_modules(callables)
    plan = _make_plan(callables, sample_args, order, num_layers_per_chunk)
    samples = _normalize_samples(sample_args, sample_kwargs, plan.layout.num_graphs)
    device = _common_device(samples, callables)
    graph_backend = make_backend(backend, device, pool)
    graphs = _build_graphs(plan, callables, samples, graph_backend,
                           allow_unused_input=allow_unused_input,
                           retain_graph_in_backward=retain_graph_in_backward)
    try:
        run_warmup(plan, graphs, num_iters=num_warmup_iters, backend=graph_backend)
        run_capture(plan, graphs, backend=graph_backend)
    except BaseException:
        for graph in graphs:
            graph.reset()
        raise
    finally:
        graph_backend.teardown()
    return _hand_back(plan, callables, graphs, single)


def reset_all(graphed: Union[Graphed, Sequence[Graphed]]) -> None:
    """Reset every graphed callable of one ``make_graphed_callables`` result.

    Accepts what ``make_graphed_callables`` returned: a :class:`GraphedCallable`, a module
    whose ``forward`` is one, or a tuple of those. Idempotent, like each ``reset()``.

    Raises:
        TypeError: for anything that is not such a result.
    """
    items = graphed if isinstance(graphed, (tuple, list)) else (graphed,)
    for index, item in enumerate(items):
        forward = item.__dict__.get("forward") if isinstance(item, torch.nn.Module) else item
        if not isinstance(forward, GraphedCallable):
            raise TypeError(
                f"reset_all: entry {index} is a {type(item).__name__}, expected a "
                "GraphedCallable or a module whose forward was graphed by leangraph"
            )
        forward.reset()


# ---------------------------------------------------------------------------- validation


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


def _make_plan(
    callables: tuple[Any, ...],
    sample_args: Any,
    order: Optional[Sequence[int]],
    num_layers_per_chunk: Optional[Union[int, Sequence[int]]],
) -> Plan:
    if not isinstance(sample_args, (tuple, list)):
        raise TypeError(f"sample_args must be a tuple, got {type(sample_args).__name__}")
    if order is None:
        if num_layers_per_chunk is not None:
            raise ValueError("num_layers_per_chunk needs an order")
        if len(sample_args) != len(callables):
            raise ValueError(
                f"sample_args has {len(sample_args)} entries for {len(callables)} callables; "
                "without an order each callable needs exactly one"
            )
        return build_unordered_plan(len(callables))
    layout, steps = parse_order(order, num_callables=len(callables),
                                num_samples=len(sample_args),
                                num_layers_per_chunk=num_layers_per_chunk)
    return build_plan(layout, steps)


def _normalize_samples(sample_args: Any, sample_kwargs: Any, count: int) -> list[tuple[Any, Any]]:
    """One ``(args, kwargs)`` pair per graph, every leaf a tensor."""
    if sample_kwargs is None:
        sample_kwargs = ({},) * count
    if not isinstance(sample_kwargs, (tuple, list)) or len(sample_kwargs) != count:
        got = len(sample_kwargs) if isinstance(sample_kwargs, (tuple, list)) else sample_kwargs
        raise ValueError(f"sample_kwargs must have one dict per graph ({count}), got {got!r}")
    samples = []
    for index, (args, kwargs) in enumerate(zip(sample_args, sample_kwargs)):
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"sample_args[{index}] must be a tuple of arguments, got "
                f"{type(args).__name__} (wrap a single tensor as (tensor,))"
            )
        if not isinstance(kwargs, dict):
            raise TypeError(f"sample_kwargs[{index}] must be a dict, got {type(kwargs).__name__}")
        for leaf in pytree.tree_leaves((tuple(args), kwargs)):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"sample_args[{index}]: every argument leaf must be a tensor, got "
                    f"{type(leaf).__name__}"
                )
        samples.append((tuple(args), dict(kwargs)))
    return samples


def _common_device(samples: list[tuple[Any, Any]], callables: tuple[Any, ...]) -> torch.device:
    devices = {t.device for s in samples for t in pytree.tree_leaves(s)}
    devices |= {p.device for fn in callables if isinstance(fn, torch.nn.Module)
                for p in fn.parameters()}
    if len(devices) > 1:
        raise ValueError(f"sample tensors and parameters must share one device, got {devices}")
    return devices.pop() if devices else torch.device("cpu")


# ---------------------------------------------------------------------------- assembly


def _static_leaves(leaves: list[torch.Tensor], seen: set[int]) -> list[torch.Tensor]:
    """Sample tensors as static inputs; a tensor already given to another graph is copied."""
    static = []
    for leaf in leaves:
        tensor = leaf.detach()
        if id(leaf) in seen:
            tensor = tensor.clone()
        seen.add(id(leaf))
        static.append(tensor.requires_grad_(leaf.requires_grad))
    return static


def _label(plan: Plan, graph: int, fn: Any, callable_index: int) -> str:
    if plan.ordered:
        return f"graph ({plan.layout.graph_id(graph)})"
    name = type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(
        fn, "__qualname__", type(fn).__name__)
    return f"callable {callable_index} ({name})"


def _build_graphs(
    plan: Plan,
    callables: tuple[Any, ...],
    samples: list[tuple[Any, Any]],
    backend: GraphBackend,
    *,
    allow_unused_input: bool,
    retain_graph_in_backward: bool,
) -> list[GraphedCallable]:
    layout = plan.layout
    seen: set[int] = set()
    graphs = []
    for graph in range(layout.num_graphs):
        graph_id = layout.graph_id(graph)
        callable_index = layout.callable_index(graph_id.chunk, graph_id.layer)
        fn = callables[callable_index]
        leaves, tree = pytree.tree_flatten(samples[graph])
        params = tuple(fn.parameters()) if isinstance(fn, torch.nn.Module) else ()
        graphs.append(GraphedCallable(
            fn=fn.forward if isinstance(fn, torch.nn.Module) else fn,
            label=_label(plan, graph, fn, callable_index),
            graph_id=graph_id if plan.ordered else None,
            static_inputs=_static_leaves(leaves, seen),
            input_tree=tree,
            params=params,
            pair=backend.new_pair(),
            allow_unused_input=allow_unused_input,
            retain_graph_in_backward=retain_graph_in_backward,
        ))
    return graphs


def _hand_back(
    plan: Plan, callables: tuple[Any, ...], graphs: list[GraphedCallable], single: bool
) -> Any:
    results: list[Any] = []
    for graph, fn in zip(graphs, callables if not plan.ordered else [None] * len(graphs)):
        if isinstance(fn, torch.nn.Module):
            graph._finish_capture(_ModuleBinding(
                module=weakref.ref(fn),
                eager_forward=weakref.WeakMethod(fn.forward),
                training=fn.training,
            ))
            fn.forward = graph  # type: ignore[method-assign]
            results.append(fn)
        else:
            graph._finish_capture()
            results.append(graph)
    return results[0] if single else tuple(results)
