"""leangraph as the graph implementation behind Megatron-core's CUDA-graph path.

Megatron-core graphs its transformer layers with ``config.cuda_graph_impl =
"transformer_engine"``: ``TECudaGraphHelper`` (``megatron/core/transformer/cuda_graphs.py``)
builds the pipeline order, one sample per (chunk, microbatch, layer), and calls
TransformerEngine's ``make_graphed_callables``; each layer then replays
``layer.cuda_graphs[microbatch]`` with Megatron's call convention (``hidden_states`` and the
block's keyword arguments, most of them None, plus ``is_first_microbatch``). :func:`install`
puts :func:`make_graphed_callables` here in TransformerEngine's place, so that the helper,
Megatron's schedules (``get_forward_backward_func``), its DDP and its optimizers run as they
are, without TransformerEngine. The patches, each named in :data:`PATCHES` and applied only to
the megatron-core versions in :data:`SUPPORTED_VERSIONS`:

* ``cuda_graphs.HAVE_TE_GRAPHS``: the helper refuses to start without TransformerEngine;
* ``cuda_graphs.make_graphed_callables``: the capture itself, this module's adapter;
* ``cuda_graphs.is_te_min_version``: the helper picks its arguments by TransformerEngine's
  version; it is told the features the adapter has (keyword samples, layers per chunk,
  buffer reuse, ``reset()``: those of TransformerEngine 2.10), whatever TE is installed;
* ``TransformerLayer._get_te_cuda_graph_replay_args``: Megatron's version imports
  TransformerEngine and swaps a None ``attention_mask`` for an all-zeros one (which
  TransformerEngine's causal attention ignores and Megatron's local attention does not); the
  patched one passes the arguments on as they are.

fp8 and fp4 (``config.fp8``, ``config.fp4``) are refused: their scaling state lives in
TransformerEngine, outside any graph leangraph captures; so is ``config.variable_seq_lengths``
(a graph replays one sequence length).
"""

from __future__ import annotations

import gc
import importlib
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from leangraph import GraphedCallable, GraphedSet
from leangraph import make_graphed_callables as _capture
from leangraph._call import check_callables_form
from leangraph.order import parse_order

from ._options import capture_options as _capture_options

__all__ = [
    "PATCHES",
    "SUPPORTED_VERSIONS",
    "TE_FEATURE_VERSION",
    "MegatronGraphedLayer",
    "MegatronPatches",
    "Patch",
    "install",
    "installed",
    "make_graphed_callables",
    "megatron_version",
    "te_min_version",
]

SUPPORTED_VERSIONS = ((0, 16),)
"""The megatron-core ``(major, minor)`` releases whose code these patches were checked
against (and tested on); :func:`install` refuses any other."""

TE_FEATURE_VERSION = (2, 10, 0)
"""The TransformerEngine version whose ``make_graphed_callables`` features the adapter has;
the patched ``is_te_min_version`` answers for it."""


@dataclass(frozen=True)
class Patch:
    """One attribute of Megatron-core that :func:`install` replaces.

    Attributes:
        module: The module holding it, e.g. ``"megatron.core.transformer.cuda_graphs"``.
        owner: The class holding it inside ``module`` (``""``: the module itself).
        attribute: The attribute replaced.
        why: What Megatron does there that needs replacing.
        optional: Whether Megatron may lack it (``make_graphed_callables`` is imported from
            TransformerEngine only where TE is installed); :meth:`MegatronPatches.uninstall`
            then removes it again.
    """

    module: str
    owner: str
    attribute: str
    why: str
    optional: bool = False

    @property
    def name(self) -> str:
        """``module[.owner].attribute``."""
        return ".".join(part for part in (self.module, self.owner, self.attribute) if part)

    def target(self) -> Any:
        """The module or class the attribute lives on."""
        holder: Any = importlib.import_module(self.module)
        return getattr(holder, self.owner) if self.owner else holder


_GRAPHS = "megatron.core.transformer.cuda_graphs"
_LAYER = "megatron.core.transformer.transformer_layer"
PATCHES = (
    Patch(_GRAPHS, "", "HAVE_TE_GRAPHS", "TECudaGraphHelper asserts TransformerEngine"),
    Patch(
        _GRAPHS, "", "make_graphed_callables", "TECudaGraphHelper captures with it", optional=True
    ),
    Patch(_GRAPHS, "", "is_te_min_version", "the helper picks its arguments by TE version"),
    Patch(
        _LAYER,
        "TransformerLayer",
        "_get_te_cuda_graph_replay_args",
        "imports TransformerEngine and replaces a None attention_mask with zeros",
    ),
)
"""Every patch :func:`install` applies, in order."""

_SET_BY_ADAPTER = {
    "order": "Megatron's pipeline schedule, the helper's _order",
    "num_layers_per_chunk": "the helper's _num_layers_per_chunk",
    "sample_kwargs": "Megatron's static inputs, the layers' get_layer_static_inputs",
    "share_buffers": "_reuse_graph_input_output_buffers, which the helper passes as True",
    "num_warmup_iters": (
        "the helper's num_warmup_iters, computed from Megatron's config.cuda_graph_warmup_steps"
    ),
    "allow_unused_input": "the helper's allow_unused_input, True",
    "retain_graph_in_backward": "Megatron's config.cuda_graph_retain_backward_graph",
}
"""The options of ``leangraph.make_graphed_callables`` the adapter sets itself, each with
where it takes it from: ``capture_options`` may not set them."""

# The adapter's own keyword arguments (TransformerEngine's) that capture_options may give
# instead; the helper passes none of them.
_EITHER = ("pool", "pre_warmup_hook", "post_warmup_hook")


def _checked_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``capture_options``, checked as far as it can be without a capture."""
    return _capture_options(
        options,
        why="leangraph's Megatron adapter sets these itself",
        sets=_SET_BY_ADAPTER,
        check=True,
    )


# --------------------------------------------------------------------------------------------
# The adapter: TransformerEngine's make_graphed_callables signature
# --------------------------------------------------------------------------------------------


class MegatronGraphedLayer:
    """One graph of one layer, called as Megatron calls ``layer.cuda_graphs[microbatch]``.

    ``hidden_states`` positionally, keyword arguments as the transformer block passes them:
    those captured (tensors, ``attention_mask`` and ``rotary_pos_emb`` say) go to the graph;
    the rest must be None, as they were at capture (the layer ran with its defaults);
    ``is_first_microbatch`` (TransformerEngine's fp8 weight caching, refused here) is
    ignored. Returns the graph's outputs, a tuple (Megatron's layer returns
    ``(hidden_states, context)`` from them): views of graph-owned memory, valid until this
    graph's backward replay.

    Attributes:
        graphed: The :class:`leangraph.GraphedCallable` behind it.
    """

    def __init__(self, graphed: GraphedCallable, captured_kwargs: Sequence[str]) -> None:
        self.graphed = graphed
        self._captured = frozenset(captured_kwargs)

    @property
    def graphed_set(self) -> GraphedSet:
        """The capture's :class:`leangraph.GraphedSet` (every graph of the call)."""
        return self.graphed.graphed_set

    def __repr__(self) -> str:
        return f"MegatronGraphedLayer({self.graphed.label})"

    def __call__(self, *args: Any, is_first_microbatch: bool | None = None, **kwargs: Any) -> Any:
        del is_first_microbatch  # TransformerEngine's fp8 weight caching; fp8 is refused
        if "hidden_states" in kwargs and "hidden_states" not in self._captured:
            raise TypeError(
                f"{self.graphed.label}: hidden_states must be passed positionally, as "
                "Megatron's layer passes it to its graphs (layer.cuda_graphs[m](hidden_states, "
                "attention_mask=..., ...)), got it as a keyword argument"
            )
        passed = {}
        for name, value in kwargs.items():
            if name in self._captured:
                passed[name] = value
            elif value is not None:
                raise ValueError(
                    f"{self.graphed.label}: keyword argument {name!r} was not captured (the "
                    f"layer ran with its default, None), got a {type(value).__name__}; "
                    "Megatron's get_layer_static_inputs must sample it to graph it"
                )
        for name in self._captured.difference(passed):
            passed[name] = None  # the graph's signature check names what it expected
        try:
            return self.graphed(*args, **passed)
        except RuntimeError as exc:
            if "still await their backward" in str(exc) and _in_forward_only_schedule():
                raise RuntimeError(f"{exc}. {_FORWARD_ONLY_HINT}") from exc
            raise

    def backward_dw(self) -> None:
        """The weight-gradient step of a split backward (``-(c + 0.5)`` in the order)."""
        self.graphed.backward_dw()

    def reset(self) -> None:
        """Release this graph; idempotent. A later replay raises ``GraphResetError``."""
        self.graphed.reset()


_FORWARD_ONLY_HINT = (
    "Megatron's schedule runs with forward_only=True here, in training mode with grad "
    "enabled, so the layers replay their training graphs and no backward comes: use "
    "torch.no_grad() or model.eval() for forward-only passes"
)
_SCHEDULES = os.path.join("pipeline_parallel", "schedules.py")


def _in_forward_only_schedule() -> bool:
    """Whether a Megatron schedule (``get_forward_backward_func()``) on the stack runs with
    ``forward_only=True`` (looked at only when a replay was refused)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_SCHEDULES) and "forward_only" in code.co_varnames:
            return frame.f_locals.get("forward_only") is True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def make_graphed_callables(
    callables: Any,
    sample_args: Any,
    *,
    sample_kwargs: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None = None,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any | None = None,
    retain_graph_in_backward: bool = False,
    pre_warmup_hook: Callable[[], None] | None = None,
    post_warmup_hook: Callable[[], None] | None = None,
    fp8_enabled: bool | Sequence[bool] = False,
    fp8_recipe: Any | None = None,
    fp8_group: Any | None = None,
    fp8_weight_caching: bool = False,
    _order: Sequence[float] | None = None,
    _num_layers_per_chunk: Sequence[int] | None = None,
    _reuse_graph_input_output_buffers: bool = False,
    capture_options: Mapping[str, Any] | None = None,
) -> Any:
    """Capture Megatron layers with leangraph, taking TransformerEngine's keyword signature.

    What ``TECudaGraphHelper`` passes (``_order`` in leangraph's notation, samples chunk ->
    microbatch -> layer) goes on to :func:`leangraph.make_graphed_callables`;
    ``_reuse_graph_input_output_buffers`` selects ``share_buffers`` (:func:`_partial_layers`
    aside). Without ``_order``: each callable once, forwards in order, backwards in reverse.

    Args:
        callables: The layers (a non-empty tuple, not a list), or one callable.
        sample_args, sample_kwargs: One tuple and one dict of samples per graph.
        num_warmup_iters, allow_unused_input, pool, retain_graph_in_backward,
            pre_warmup_hook, post_warmup_hook: As for ``leangraph.make_graphed_callables``.
        fp8_enabled, fp8_recipe, fp8_group, fp8_weight_caching: TransformerEngine's fp8
            options: fp8 is refused; the rest carry nothing without it.
        _order, _num_layers_per_chunk, _reuse_graph_input_output_buffers: TE's pipeline
            options (``order``, ``num_layers_per_chunk``, ``share_buffers``).
        capture_options: Further ``leangraph.make_graphed_callables`` options, checked
            as by :func:`install` (not those the adapter sets itself; ``pool`` and the
            warm-up hooks only where the arguments above leave them None).

    Returns:
        A tuple of :class:`MegatronGraphedLayer`, one per graph in TE's layout (a single one
        for a single callable).

    Raises:
        ValueError: for fp8 or fp4, for ``config.variable_seq_lengths=True``, for a layer
            that still holds graphs (a second capture before ``delete_cuda_graphs()``), and
            for what leangraph refuses (no callables too), before any warm-up.
        TypeError: for an unknown capture option (as :func:`install`), or a list (V19).
    """
    del fp8_recipe, fp8_group, fp8_weight_caching  # nothing to do without fp8
    options = _with_arguments(
        _checked_options(capture_options),
        {"pool": pool, "pre_warmup_hook": pre_warmup_hook, "post_warmup_hook": post_warmup_hook},
    )
    check_callables_form(callables, "TransformerEngine's make_graphed_callables")  # V19
    single = not isinstance(callables, tuple)
    layers = (callables,) if single else callables
    args = (sample_args,) if single else tuple(sample_args)
    _refuse_layers(layers, args, fp8_enabled)
    kwargs = _per_graph_kwargs(sample_kwargs, len(args))
    order, per_chunk = _order_or_default(_order, _num_layers_per_chunk)
    _check_dtypes(layers, args, order, per_chunk)
    states = _tracker_states(args)
    if states:
        options["generator_states"] = (*options.get("generator_states", ()), *states)
    graphs = _capture(
        _through_call(layers),
        args,
        sample_kwargs=kwargs,
        num_warmup_iters=num_warmup_iters,
        allow_unused_input=allow_unused_input,
        order=order,
        num_layers_per_chunk=per_chunk,
        retain_graph_in_backward=retain_graph_in_backward,
        share_buffers=_reuse_graph_input_output_buffers and not _partial_layers(layers),
        **options,
    )
    wrapped = tuple(MegatronGraphedLayer(g, tuple(k)) for g, k in zip(graphs, kwargs))
    return wrapped[0] if single else wrapped


def _with_arguments(options: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with the adapter's own arguments that capture_options may give instead
    (``pool`` and the warm-up hooks); refused when given both ways."""
    for name in _EITHER:
        if name in options and given[name] is not None:
            raise ValueError(
                f"{name} is given both as the adapter's argument and in capture_options; "
                "expected one of them"
            )
        options.setdefault(name, given[name])
    return options


def _tracker_states(sample_args: Sequence[Any]) -> tuple[torch.Generator, ...]:
    """Megatron's CUDA RNG tracker states, for every graph to register (CUDA samples only).

    Megatron's attention and dropout fork the tracker (its "model-parallel-rng" state) even
    with dropout 0, switching the CUDA generator inside the capture. CUDA allows that only
    for graph-safe states registered with the graph, as Megatron's own CUDA-graph paths
    register them; a tracker that is not graph-safe would set the generator's seed, which
    CUDA refuses mid-capture, so it is refused here, before warm-up.

    Raises:
        ValueError: for CUDA samples and a tracker seeded without ``use_cudagraphable_rng``.
    """
    on_cuda = any(
        isinstance(t, torch.Tensor) and t.is_cuda
        for args in sample_args
        for t in (args if isinstance(args, (tuple, list)) else (args,))
    )
    if not on_cuda:
        return ()
    megatron_random: Any = importlib.import_module("megatron.core.tensor_parallel.random")
    tracker = megatron_random.get_cuda_rng_tracker()
    if not getattr(tracker, "use_cudagraphable_rng", False):
        raise ValueError(
            "leangraph's Megatron adapter: Megatron's CUDA RNG tracker is not graph-safe, so "
            "its fork() inside the layers would set the CUDA generator mid-capture, which "
            "CUDA refuses; seed it with tensor_parallel.model_parallel_cuda_manual_seed(seed, "
            "use_cudagraphable_rng=True), as Megatron's own CUDA-graph paths need"
        )
    return tuple(megatron_random.get_all_rng_states().values())


class _ThroughCall(torch.nn.Module):
    """A layer, called through its own ``__call__``.

    Megatron's graphable layers override ``__call__`` (while ``TECudaGraphHelper`` captures,
    it runs ``_te_cuda_graph_capture``, whose outputs differ from ``forward``'s), and leangraph
    runs a module's ``forward``; this module's ``forward`` is the layer's ``__call__``. The
    layer is its only submodule, so the parameters, and leangraph's hook checks, are its own.
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.train(layer.training)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.layer(*args, **kwargs)


def _through_call(layers: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(_ThroughCall(x) if isinstance(x, torch.nn.Module) else x for x in layers)


def _refuse_layers(
    layers: Sequence[Any], sample_args: Sequence[Any], fp8_enabled: bool | Sequence[bool]
) -> None:
    """What the adapter refuses in the layers before anything runs: live graphs (V4), fp8 or
    fp4, and variable sequence lengths (V37)."""
    _refuse_graphed_layers(layers)
    _refuse_fp8(fp8_enabled, layers)
    _refuse_variable_seq_lengths(layers, sample_args)


def _refuse_graphed_layers(layers: Sequence[Any]) -> None:
    """Refuse layers that still hold graphs: Megatron's layer ``__call__`` replays
    ``layer.cuda_graphs`` whenever it is not empty, inside this capture too, which would then
    record those replays instead of the layer."""
    for index, layer in enumerate(layers):
        graphs = getattr(layer, "cuda_graphs", None)
        if not isinstance(graphs, list) or not graphs:
            continue
        name = _layer_name(layer)
        live = sum(isinstance(g, MegatronGraphedLayer) and not g.graphed.is_reset for g in graphs)
        held = (
            f"already has leangraph graphs that are not reset ({live} of the {len(graphs)} in "
            "layer.cuda_graphs)"
            if live
            else f"still holds {len(graphs)} graphs in layer.cuda_graphs (reset, or not "
            "leangraph's)"
        )
        raise ValueError(
            f"leangraph's Megatron adapter: layer {index} ({name}) {held}; its __call__ replays "
            "them, so this capture would record their replays instead of the layer. Call the "
            "first TECudaGraphHelper's delete_cuda_graphs() (it resets them and empties "
            "layer.cuda_graphs) before capturing again"
        )


def _partial_layers(layers: Sequence[Any]) -> list[int]:
    """The layers whose graph covers only part of the layer (``config.cuda_graph_scope``).

    With a partial scope Megatron runs the rest of each layer eagerly around its graph (the
    MLP after an attention-only graph, the attention before an MLP-only one), so a layer's
    graph never takes the previous layer's graph output. Shared buffers would chain the
    graphs of a chunk (each graph's static input is the previous graph's output buffer) and
    refuse every replay; such captures keep their own buffers (``share_buffers=False``).
    """
    partial = []
    for index, layer in enumerate(layers):
        scope = getattr(getattr(layer, "config", None), "cuda_graph_scope", None)
        if not scope:  # Megatron's default, "full" normalised to []: the whole layer
            continue
        names = {getattr(entry, "name", entry) for entry in scope}
        rest = "moe" if getattr(layer, "is_moe_layer", False) else "mlp"
        if not {"attn", rest} <= names:
            partial.append(index)
    return partial


def _refuse_variable_seq_lengths(layers: Sequence[Any], sample_args: Sequence[Any]) -> None:
    """Refuse ``config.variable_seq_lengths=True`` (V37): it tells Megatron that microbatches
    differ in sequence length (its pipeline sends each tensor's shape first), and a graph
    replays the one length of its sample. A microbatch of another length would be refused
    only at its replay, mid-step, on the rank that meets it first, while the other pipeline
    ranks wait on it. With lengths that are in fact fixed the flag only sends the shapes."""
    for index, layer in enumerate(layers):
        if getattr(getattr(layer, "config", None), "variable_seq_lengths", False) is not True:
            continue
        # Megatron samples every graph at the helper's seq_length ([s, b, h] hidden states).
        hidden = sample_args[0][0] if sample_args and sample_args[0] else None
        length = (
            f" ({hidden.shape[0]} tokens, dim 0 of hidden_states)"
            if isinstance(hidden, torch.Tensor) and hidden.dim() > 0
            else ""
        )
        raise ValueError(
            f"leangraph's Megatron adapter: layer {index} ({_layer_name(layer)}) is captured "
            "with config.variable_seq_lengths=True, but its graphs replay the sampled sequence "
            f"length only{length}; a microbatch of another length would be refused only at "
            "its replay, mid-step (in a pipeline, while the other ranks wait on it). Pad every "
            "microbatch to seq_length and set variable_seq_lengths=False (with fixed lengths "
            "it only sends the shapes), or leave these layers eager"
        )


def _layer_name(layer: Any) -> str:
    """``TransformerLayer 3``: the class and, where it has one, Megatron's layer number."""
    name = type(layer).__name__
    number = getattr(layer, "layer_number", None)
    return name if number is None else f"{name} {number}"


def _refuse_fp8(fp8_enabled: bool | Sequence[bool], layers: Sequence[Any]) -> None:
    flags = fp8_enabled if isinstance(fp8_enabled, (tuple, list)) else [fp8_enabled]
    for index, layer in enumerate(layers):
        config = getattr(layer, "config", None)
        quantized = [name for name in ("fp8", "fp4") if getattr(config, name, None)]
        if quantized or (flags[index % len(flags)] if flags else False):
            what = (
                f"config.{quantized[0]}={getattr(config, quantized[0])!r}"
                if quantized
                else ("fp8_enabled=True")
            )
            raise ValueError(
                f"leangraph's Megatron adapter: layer {index} ({type(layer).__name__}) is "
                f"captured with {what}; fp8/fp4 scaling state lives in TransformerEngine, "
                "outside leangraph's graphs: train without fp8/fp4, or use TE's graphs"
            )


def _per_graph_kwargs(
    sample_kwargs: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None, count: int
) -> list[dict[str, Any]]:
    if sample_kwargs is None:
        return [{} for _ in range(count)]
    if isinstance(sample_kwargs, Mapping):
        return [dict(sample_kwargs) for _ in range(count)]
    kwargs = [dict(k or {}) for k in sample_kwargs]
    if len(kwargs) != count:
        raise ValueError(
            f"sample_kwargs has {len(kwargs)} entries, expected one per graph ({count}, as "
            "sample_args)"
        )
    return kwargs


def _check_dtypes(
    layers: Sequence[Any],
    sample_args: Sequence[Any],
    order: Sequence[Any],
    per_chunk: Sequence[int] | None,
) -> None:
    """Refuse hidden states whose dtype is not the layer's ``config.params_dtype``.

    Megatron samples ``hidden_states`` in bfloat16 whatever the model trains in
    (``get_layer_static_inputs``); the layer could not run on them, nor a replay take the
    model's activations.
    """
    layout, _ = parse_order(
        order,
        num_callables=len(layers),
        num_samples=len(sample_args),
        num_layers_per_chunk=per_chunk,
    )
    for index, args in enumerate(sample_args):
        graph = layout.graph_id(index)
        layer = layers[layout.callable_index(graph.chunk, graph.layer)]
        dtype = getattr(getattr(layer, "config", None), "params_dtype", None)
        hidden = args[0] if args else None
        if (
            isinstance(dtype, torch.dtype)
            and isinstance(hidden, torch.Tensor)
            and hidden.is_floating_point()
            and hidden.dtype != dtype
        ):
            raise ValueError(
                f"graph ({graph}) of {type(layer).__name__}: sample hidden_states has dtype "
                f"{hidden.dtype} but the layer trains in {dtype} (config.params_dtype); "
                "Megatron's static inputs are bfloat16: train in bf16 (config.bf16, "
                "params_dtype=torch.bfloat16)"
            )


def _order_or_default(
    order: Sequence[float] | None, per_chunk: Sequence[int] | None
) -> tuple[list[Any], list[int] | None]:
    """TE's ``_order``; without one a single chunk and microbatch (forwards in layer order,
    backwards in reverse, as TE and torch replay them)."""
    return [1, -1] if order is None else list(order), None if per_chunk is None else list(per_chunk)


# --------------------------------------------------------------------------------------------
# Installing the adapter into Megatron-core
# --------------------------------------------------------------------------------------------


_ABSENT = object()  # an optional patch's original where Megatron lacks the attribute


class _Adapter:
    """What ``cuda_graphs.make_graphed_callables`` becomes: the adapter with the capture
    options given to :func:`install`."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)

    def __call__(self, callables: Any, sample_args: Any, **kwargs: Any) -> Any:
        try:
            return make_graphed_callables(
                callables, sample_args, capture_options=self.options, **kwargs
            )
        except BaseException:
            _end_megatron_capture()
            raise


def _end_megatron_capture() -> None:
    """After a failed capture, put back what ``TECudaGraphHelper._start_capturing`` set
    before calling the adapter (its ``_finish_capturing`` runs only after a success): the
    global capture flag, under which the layers would run their capture path and Megatron's
    DDP hooks would return early, and the frozen garbage collector."""
    graphs_module = importlib.import_module(_GRAPHS)
    if not graphs_module.is_graph_capturing():
        return  # not called by the helper
    graphs_module._set_capture_end()
    if getattr(graphs_module, "FREEZE_GC", False):
        gc.unfreeze()


class MegatronPatches:
    """The patches :func:`install` applied; :meth:`uninstall` puts Megatron's back.

    Also a context manager: ``with install(): ...`` uninstalls on exit.

    Attributes:
        version: The megatron-core version patched.
        names: The patched attributes (:attr:`Patch.name`), in :data:`PATCHES` order.
    """

    def __init__(self, version: str, originals: Sequence[tuple[Patch, Any]]) -> None:
        self.version = version
        self.names = tuple(patch.name for patch, _ in originals)
        self._originals = list(originals)

    def uninstall(self) -> None:
        """Restore Megatron's attributes; idempotent. Graphs already captured stay usable
        (their layers keep replaying them) until ``TECudaGraphHelper.delete_cuda_graphs()``."""
        while self._originals:
            patch, original = self._originals.pop()
            if original is _ABSENT:
                delattr(patch.target(), patch.attribute)
            else:
                setattr(patch.target(), patch.attribute, original)

    def __enter__(self) -> MegatronPatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        state = "installed" if self._originals else "uninstalled"
        return f"MegatronPatches(megatron-core {self.version}, {state}: {', '.join(self.names)})"


def install(*, capture_options: Mapping[str, Any] | None = None) -> MegatronPatches:
    """Make leangraph the graph implementation behind ``cuda_graph_impl="transformer_engine"``.

    Call it once, before ``TECudaGraphHelper(...).create_cudagraphs()``; the helper, the
    layers' replays and ``delete_cuda_graphs()`` then run leangraph's graphs
    (docs/integration_megatron.md shows the training loop).

    Args:
        capture_options: Further ``leangraph.make_graphed_callables`` options for every
            capture (``backend``, ``check_memory``, ``debug_outputs``, ...), checked at once:
            the names, and the values as far as that needs no capture. Not those the adapter
            sets itself from what Megatron passes: ``order``, ``num_layers_per_chunk``,
            ``sample_kwargs``, ``share_buffers``, ``num_warmup_iters``,
            ``allow_unused_input``, ``retain_graph_in_backward``.

    Returns:
        The applied patches (:class:`MegatronPatches`); ``uninstall()`` reverts them.

    Raises:
        ImportError: if megatron-core is not installed.
        RuntimeError: for a megatron-core version outside :data:`SUPPORTED_VERSIONS`, one
            lacking an attribute of :data:`PATCHES`, or when already installed.
        ValueError: for capture options the adapter sets itself, and option values
            ``leangraph.make_graphed_callables`` refuses (docs/errors.md).
        TypeError: for an option ``leangraph.make_graphed_callables`` does not take (with the
            closest name it does), and values it refuses.
    """
    options = _checked_options(capture_options)
    version = megatron_version()
    graphs_module = importlib.import_module(_GRAPHS)
    if isinstance(getattr(graphs_module, "make_graphed_callables", None), _Adapter):
        raise RuntimeError(
            "leangraph.integrations.megatron.install(): already installed; uninstall() the "
            "MegatronPatches it returned before installing again"
        )
    values = (True, _Adapter(options), te_min_version, _replay_args)
    applied: list[tuple[Patch, Any]] = []
    for patch in PATCHES:
        target = patch.target()
        if not patch.optional and not hasattr(target, patch.attribute):
            raise RuntimeError(
                f"megatron-core {version} has no {patch.name} ({patch.why}); leangraph's "
                f"patches were checked against megatron-core {_supported_text()}"
            )
    for patch, value in zip(PATCHES, values):
        target = patch.target()
        applied.append((patch, getattr(target, patch.attribute, _ABSENT)))
        setattr(target, patch.attribute, value)
    return MegatronPatches(version, applied)


def installed() -> bool:
    """Whether :func:`install` is in force (and not uninstalled)."""
    try:
        graphs_module = importlib.import_module(_GRAPHS)
    except ImportError:
        return False
    return isinstance(getattr(graphs_module, "make_graphed_callables", None), _Adapter)


def megatron_version() -> str:
    """The installed megatron-core's version, if :func:`install` supports it.

    Raises:
        ImportError: naming the extra to install, if megatron-core is absent.
        RuntimeError: for a version outside :data:`SUPPORTED_VERSIONS`.
    """
    try:
        core = importlib.import_module("megatron.core")
    except ImportError as exc:
        raise ImportError(
            "leangraph.integrations.megatron needs megatron-core: pip install 'leangraph[megatron]'"
        ) from exc
    version = str(getattr(core, "__version__", "unknown"))
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"leangraph.integrations.megatron supports megatron-core {_supported_text()}, got "
            f"{version}; its patches replace Megatron internals checked version by version"
        )
    return version


def _supported_text() -> str:
    return ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_VERSIONS)


def te_min_version(version: str, check_equality: bool = True) -> bool:
    """The patched ``is_te_min_version``: whether the adapter has the features of
    TransformerEngine ``version`` (it has those of :data:`TE_FEATURE_VERSION`)."""
    wanted = _version_tuple(version)
    if check_equality:
        return wanted <= TE_FEATURE_VERSION
    return wanted < TE_FEATURE_VERSION


def _version_tuple(version: str) -> tuple[int, int, int]:
    """``"2.7.0.dev0"`` -> ``(2, 7, 0)``; a pre-release counts as its release."""
    major, minor, patch = [*(int(p) for p in re.findall(r"\d+", version)[:3]), 0, 0, 0][:3]
    return major, minor, patch


def _replay_args(layer: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The patched ``TransformerLayer._get_te_cuda_graph_replay_args``: Megatron's base
    version (``hidden_states`` positional, ``is_first_microbatch`` added), without importing
    TransformerEngine and with ``attention_mask`` as the block passes it."""
    module = importlib.import_module("megatron.core.transformer.module")
    base = module.GraphableMegatronModule._get_te_cuda_graph_replay_args
    graph_args, graph_kwargs = base(layer, *args, **kwargs)
    if len(graph_args) != 1:
        raise TypeError(
            f"{type(layer).__name__} {getattr(layer, 'layer_number', '?')}: a graphed layer "
            f"takes hidden_states as its only positional argument, got {len(graph_args)}"
        )
    return tuple(graph_args), dict(graph_kwargs)
