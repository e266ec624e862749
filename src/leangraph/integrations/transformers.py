"""Graphed decoder layers of a Hugging Face ``transformers`` causal language model.

A HF model calls each decoder layer with the hidden states and keyword arguments it computes
itself (in transformers 5.24: ``attention_mask``, ``position_embeddings=(cos, sin)``,
``position_ids``, ``cache`` (``past_key_values`` in 5.17), ``use_cache``, and whatever the
caller passed on), which differ
between versions and attention implementations. So nothing here spells them out:
:func:`record_layer_calls` runs the model's own forward once and records the call each layer
gets, and :func:`graph_decoder_layers` captures the layers for exactly those calls.

* Without an order the layers are graphed in place (``leangraph.make_graphed_callables`` on
  the layer modules, torch's drop-in form): the model's own ``forward`` then replays them, so
  the training loop is unchanged, as long as every call has the captured shapes and the same
  constants (``use_cache=False``, a mask of the same kind).
* With a pipeline order the layers are split into chunks and graphed once per microbatch;
  :meth:`GraphedDecoderLayers.run_chunk` runs one chunk of one microbatch with the recorded
  keyword arguments, and the caller runs the steps of the order (embedding and head stay
  eager, as in any pipeline stage).

What is refused, before any warm-up, and why: a KV cache (``use_cache=True``: a replay cannot
grow a cache object), attention implementations other than ``"sdpa"`` and ``"eager"`` (the
others build objects or call kernels this was not tested with), gradient checkpointing (a
graphed forward bypasses HF's checkpointing wrapper), dropout while training (warm-up and
capture draw random numbers, so training would not match eager), and outputs recorded by
hooks (``output_attentions``, ``output_hidden_states``, ``output_router_logits``: a replay runs
no submodule hooks, and hidden states would alias graph memory). ``transformers`` is imported
only by the functions that need it, so ``import leangraph`` never needs it.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from leangraph import GraphedCallable, GraphedSet, Layout, Step, make_graphed_callables
from leangraph.order import parse_order, unordered_layout
from leangraph.runtime.graphed import remove_forward

from ._options import capture_options

__all__ = [
    "SUPPORTED_ATTENTION",
    "GraphedDecoderLayers",
    "LayerCall",
    "decoder_layers",
    "graph_causal_lm",
    "graph_decoder_layers",
    "record_layer_calls",
]

SUPPORTED_ATTENTION = ("sdpa", "eager")
"""The ``config._attn_implementation`` values whose layers are graphed (and tested)."""

# Constants a graph may take in a layer call: they are compared with the captured value at
# every replay. Anything else (a Cache, a BlockMask) is state a replay cannot honour.
_PLAIN_CONSTANTS = (type(None), bool, int, float, str)

# Modules that draw random numbers in training, and the names of rates a forward hands
# nn.functional.dropout (or a random noise): matched within a submodule's attribute names.
_DROPOUT_MODULES = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
_RANDOM_RATE = re.compile(r"dropout|pdrop|drop_prob|jitter", re.IGNORECASE)

# Keyword arguments asking for outputs HF collects with hooks inside the layers (a mixture of
# experts' router logits, for its auxiliary loss, too).
_HOOKED_OUTPUTS = ("output_attentions", "output_hidden_states", "output_router_logits")


@dataclass(frozen=True)
class LayerCall:
    """One decoder layer's call, as the model's forward makes it.

    Attributes:
        args: The positional arguments: the hidden states first (a tensor that requires grad
            wherever it does in training).
        kwargs: The keyword arguments, tensors and constants as the model passed them: a
            mapping (``{}`` for none; :func:`graph_decoder_layers` refuses None).
    """

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]

    @property
    def hidden_states(self) -> torch.Tensor:
        """The layer's input hidden states (``args[0]``)."""
        hidden: torch.Tensor = self.args[0]
        return hidden


@dataclass(frozen=True, eq=False)
class GraphedDecoderLayers:
    """A model's decoder layers, graphed, and the capture behind them.

    Memory aliasing: a graphed layer's output is a view of graph-owned memory, valid until
    that graph's backward replay (:class:`leangraph.GraphedCallable`); the model's own
    outputs (its norm and head run eagerly on the last layer's output) are ordinary tensors.

    Attributes:
        layers: The decoder layers, in the model's order. Without an order their ``forward``
            is graphed in place (eager again in another training mode than at capture).
        graphed: Without an order, ``layers`` themselves; with one, a
            :class:`leangraph.GraphedCallable` at ``layout.graph_index(chunk, microbatch,
            layer)``.
        graphed_set: The capture's :class:`leangraph.GraphedSet`.
        calls: The recorded call of each layer (the capture's samples).
        layout: Chunks of layers and microbatches (one chunk, one microbatch without order).
        order: The steps captured, in the sequence they must replay; None without an order
            (then forwards replay in layer order, backwards in reverse).
    """

    layers: tuple[nn.Module, ...]
    graphed: tuple[Any, ...]
    graphed_set: GraphedSet
    calls: tuple[LayerCall, ...]
    layout: Layout
    order: tuple[Step, ...] | None

    def run_chunk(
        self,
        chunk: int,
        microbatch: int,
        hidden_states: torch.Tensor,
        layer_kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    ) -> torch.Tensor:
        """Run the layers of ``chunk`` on ``microbatch``'s graphs; return the hidden states.

        Args:
            chunk: 1-based chunk of the order (1 without an order).
            microbatch: 0-based microbatch (0 without an order).
            hidden_states: The chunk's input, of the captured shape.
            layer_kwargs: The layers' keyword arguments for this microbatch; default: each
                layer's recorded ones (right for every microbatch of the captured sequence
                length without padding; pass the model's own for padded batches). One mapping
                per layer of ``layers`` (``[call.kwargs for call in record_layer_calls(model,
                inputs)]``), or one mapping for every layer of the chunk, where the model gave
                those layers the same arguments at recording (not where layers attend
                differently, as Gemma 2's sliding-window and full-attention layers do).

        Returns:
            The last layer's hidden states: a view of graph-owned memory, valid until the
            backward of that graph.

        Raises:
            ValueError: for a chunk or microbatch outside the layout; for one mapping where
                the chunk's layers were recorded with different arguments, or a sequence of
                another length than ``layers``; what a replay raises for arguments that
                differ from capture.
            TypeError: for ``layer_kwargs`` that is neither a mapping nor a sequence of them.
        """
        layout = self.layout
        _check_index("chunk", chunk)
        _check_index("microbatch", microbatch)
        if not 1 <= chunk <= layout.num_chunks or not 0 <= microbatch < layout.num_microbatches:
            raise ValueError(
                f"chunk {chunk}, microbatch {microbatch} is outside the capture's "
                f"{layout.num_chunks} chunks (1-based) and {layout.num_microbatches} "
                "microbatches (0-based)"
            )
        indices = [
            layout.callable_index(chunk, layer)
            for layer in range(layout.layers_per_chunk[chunk - 1])
        ]
        if isinstance(layer_kwargs, Mapping):
            _check_one_for_all(self._chunk_differences[chunk - 1], len(indices), chunk)
        per_layer = _per_layer_kwargs(layer_kwargs, self.calls, indices)
        for layer, (index, kwargs) in enumerate(zip(indices, per_layer)):
            run = self.graphed[layout.graph_index(chunk, microbatch, layer)]
            output = run(hidden_states, *self.calls[index].args[1:], **kwargs)
            hidden_states = output[0] if isinstance(output, (tuple, list)) else output
        return hidden_states

    @functools.cached_property
    def _chunk_differences(self) -> tuple[tuple[int, int, str] | None, ...]:
        """Per chunk: two of its layers the model called with different keyword arguments at
        recording and what differed, or None. Computed once (comparing the recorded tensors
        reads them on the host), at the first ``run_chunk`` given one mapping."""
        layout = self.layout
        return tuple(
            _first_difference(
                self.calls,
                [layout.callable_index(chunk, layer) for layer in range(count)],
            )
            for chunk, count in enumerate(layout.layers_per_chunk, start=1)
        )

    def reset(self) -> None:
        """Release every graph of the capture; idempotent.

        Layers graphed in place get their eager ``forward`` back, so the model runs eagerly
        afterwards (``leangraph.reset_all(graphed)`` releases the graphs but leaves the
        layers raising :class:`leangraph.GraphResetError`).
        """
        self.graphed_set.reset()
        if self.order is None:
            for layer in self.layers:
                remove_forward(layer)


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def graph_causal_lm(
    model: nn.Module,
    sample_inputs: Mapping[str, Any],
    *,
    order: Sequence[Any] | None = None,
    num_microbatches: int | None = None,
    num_layers_per_chunk: int | Sequence[int] | None = None,
    capture_options: Mapping[str, Any] | None = None,
) -> GraphedDecoderLayers:
    """Graph a HF causal LM's decoder layers for the calls its forward makes.

    :func:`record_layer_calls` runs ``model(**sample_inputs)`` once to record each layer's
    call; :func:`graph_decoder_layers` then captures the layers for those calls. Without
    ``order``, call the model afterwards exactly as before (``model(input_ids, labels=...)``)
    with inputs of the sample's shapes and the same keyword arguments.

    Args:
        model: A ``*ForCausalLM`` or ``*LMHeadModel`` (or its base ``*Model``) whose
            decoder layers :func:`decoder_layers` finds; in the training mode to capture
            for.
        sample_inputs: Keyword arguments of ``model`` for one (micro)batch, e.g.
            ``{"input_ids": ids}``; ``use_cache=False`` unless the config says so.
        order, num_microbatches, num_layers_per_chunk, capture_options: As for
            :func:`graph_decoder_layers`.

    Raises:
        ValueError, TypeError: for what is not supported (see the module docstring), named,
            before any warm-up.
    """
    _check_model("graph_causal_lm", model)
    _check_model_config(model)
    _check_inputs(type(model).__name__, sample_inputs)
    _capture_options(capture_options)  # refused before the recording forward, not after
    return graph_decoder_layers(
        decoder_layers(model),
        record_layer_calls(model, sample_inputs),
        order=order,
        num_microbatches=num_microbatches,
        num_layers_per_chunk=num_layers_per_chunk,
        capture_options=capture_options,
    )


def graph_decoder_layers(
    layers: Sequence[nn.Module],
    calls: Sequence[LayerCall] | LayerCall,
    *,
    order: Sequence[Any] | None = None,
    num_microbatches: int | None = None,
    num_layers_per_chunk: int | Sequence[int] | None = None,
    capture_options: Mapping[str, Any] | None = None,
) -> GraphedDecoderLayers:
    """Graph decoder layers for the given calls, in place or in a pipeline order.

    Each graph's samples are copies of its layer's call: the same shapes, dtypes and
    ``requires_grad`` (the hidden states always requiring grad, so that a replay on hidden
    states that do gives them their gradient), the same constants, which every replay must
    keep.

    Args:
        layers: The decoder layers, in the order the model runs them (the layers of all
            chunks, chunk by chunk, with an order).
        calls: One :class:`LayerCall` per layer (:func:`record_layer_calls`), or one for all.
        order: A pipeline order (``leangraph.schedules``), or None to graph in place.
        num_microbatches: Microbatches of ``order`` (required with it).
        num_layers_per_chunk: Layers per chunk with ``order`` (default: an equal split).
        capture_options: Further options of ``leangraph.make_graphed_callables``
            (``num_warmup_iters``, ``backend``, ...); not ``order``, ``num_layers_per_chunk``
            or ``sample_kwargs``, which this computes.

    Returns:
        The graphed layers and their capture (:class:`GraphedDecoderLayers`).

    Raises:
        ValueError, TypeError: for what is not supported (see the module docstring) or
            arguments that do not fit together, before any warm-up.
    """
    options = _capture_options(capture_options)
    layer_tuple = _checked_layers(layers)
    call_tuple = _checked_calls(calls, len(layer_tuple))
    _check_supported(layer_tuple, call_tuple)
    layout, steps = _layout(order, len(layer_tuple), num_microbatches, num_layers_per_chunk)
    samples = [call_tuple[_callable_of(layout, index)] for index in range(layout.num_graphs)]
    graphed = make_graphed_callables(
        layer_tuple,
        tuple(_sample_args(call) for call in samples),
        sample_kwargs=[_fresh(dict(call.kwargs)) for call in samples],
        order=order,
        num_layers_per_chunk=None if order is None else list(layout.layers_per_chunk),
        **options,
    )
    return GraphedDecoderLayers(
        layers=layer_tuple,
        graphed=tuple(graphed),
        graphed_set=GraphedSet.of(graphed),
        calls=call_tuple,
        layout=layout,
        order=steps,
    )


# Where a HF base model keeps its decoder layers (an nn.ModuleList), tried in turn: Llama and
# most current architectures (Mistral, Qwen, Gemma, Phi-3, GPT-NeoX, Mixtral); GPT-2, GPT-J,
# GPT-Neo, Falcon and Bloom; OPT; and a head model whose base_model_prefix names no attribute
# of its own, so that base_model is the head model itself (Llama 4's text model: its prefix
# is "language_model", its base model is at .model).
_LAYER_PATHS = (("layers",), ("h",), ("decoder", "layers"), ("model", "layers"))


def decoder_layers(model: nn.Module) -> tuple[nn.Module, ...]:
    """The decoder layers a HF model's forward runs: the base model's ``layers`` (Llama and
    most current architectures), ``h`` (GPT-2, GPT-J, GPT-Neo, Falcon, Bloom),
    ``decoder.layers`` (OPT) or ``model.layers`` (a head model that is its own
    ``base_model``: Llama 4's), cut to ``config.num_hidden_layers`` as the forward does.

    Raises:
        TypeError: if the model keeps no ``nn.ModuleList`` of layers at any of those.
    """
    base = getattr(model, "base_model", model)
    layers = next(filter(None, (_module_list_at(base, path) for path in _LAYER_PATHS)), None)
    if layers is None:
        tried = ", ".join("base_model." + ".".join(path) for path in _LAYER_PATHS)
        raise TypeError(
            f"{type(model).__name__} has no decoder layers (an nn.ModuleList) at {tried}, "
            "where graph_causal_lm and record_layer_calls find them; for another layout "
            "pass the layers and one LayerCall(args, kwargs) per layer, as the model calls "
            "it, to graph_decoder_layers yourself"
        )
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    return tuple(layers if count is None else layers[:count])


def _module_list_at(base: nn.Module, path: tuple[str, ...]) -> nn.ModuleList | None:
    """The ``nn.ModuleList`` at attribute ``path`` of ``base``, or None (an empty one too:
    a model with no layers there has them elsewhere)."""
    found: Any = base
    for name in path:
        found = getattr(found, name, None)
    return found if isinstance(found, nn.ModuleList) and len(found) else None


def record_layer_calls(model: nn.Module, sample_inputs: Mapping[str, Any]) -> tuple[LayerCall, ...]:
    """Record the call each decoder layer gets from ``model(**sample_inputs)``.

    The forward runs with gradients enabled (so each hidden state's ``requires_grad`` is what
    it is in training) and the RNG state put back, and stops as the last layer is entered:
    that layer, the final norm and the head do not run. Tensors are copied out.

    Raises:
        TypeError: if ``sample_inputs`` is not a mapping or the layers are not found.
        RuntimeError: if the forward skipped a layer, or called one twice.
    """
    _check_model("record_layer_calls", model)
    if not isinstance(sample_inputs, Mapping):
        raise TypeError(
            "sample_inputs must be a mapping of the model's keyword arguments, e.g. "
            f"{{'input_ids': ids}}, got {type(sample_inputs).__name__}"
        )
    layers = decoder_layers(model)
    calls: list[LayerCall | None] = [None] * len(layers)
    handles = [
        layer.register_forward_pre_hook(_recorder(calls, index), with_kwargs=True)
        for index, layer in enumerate(layers)
    ]
    devices = [p.device for p in model.parameters() if p.is_cuda][:1]
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            model(**sample_inputs)
    except _Recorded:
        pass
    finally:
        for handle in handles:
            handle.remove()
    missing = [index for index, call in enumerate(calls) if call is None]
    if missing:
        raise RuntimeError(
            f"{type(model).__name__}'s forward did not call decoder layers {missing}; "
            "graph_causal_lm needs a forward that runs every layer once"
        )
    return tuple(call for call in calls if call is not None)


# --------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------


class _Recorded(Exception):
    """Raised as the last layer is entered: the rest of the forward is not needed."""


def _recorder(calls: list[LayerCall | None], index: int) -> Any:
    """A forward pre-hook recording layer ``index``'s call into ``calls``."""

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if calls[index] is not None:
            raise RuntimeError(
                f"decoder layer {index} ({type(module).__name__}) was called twice in one "
                "forward; a graph replays each layer once per forward"
            )
        calls[index] = LayerCall(_fresh(tuple(args)), _fresh(dict(kwargs)))
        if index == len(calls) - 1:
            raise _Recorded

    return record


def _sample_args(call: LayerCall) -> tuple[Any, ...]:
    """A graph's positional samples: copies of the call's, the hidden states requiring grad.

    A graph computes no gradient for an input that did not require grad at capture, so hidden
    states recorded without one (``inputs_embeds`` that do not require grad) would leave the
    embedding without its gradient whenever a later call's do (``input_ids`` through a trained
    embedding). Captured requiring grad, the graph serves both: a replay whose input does not
    require grad drops that gradient, and the parameters' gradients are the same kernels.
    """
    hidden, *rest = _fresh(call.args)
    if hidden.is_floating_point():
        hidden.requires_grad_(True)
    return (hidden, *rest)


def _fresh(tree: Any) -> Any:
    """``tree`` with each tensor replaced by a detached copy of the same ``requires_grad``."""

    def copy(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return value.detach().clone().requires_grad_(value.requires_grad)

    return pytree.tree_map(copy, tree)


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def _checked_layers(layers: Sequence[nn.Module]) -> tuple[nn.Module, ...]:
    if isinstance(layers, nn.Module) and not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"layers must be a sequence of decoder layers, got a {type(layers).__name__}; for "
            "a whole model call graph_causal_lm"
        )
    result = tuple(layers)
    if not result:
        raise ValueError("layers is empty; pass the decoder layers to graph")
    for index, layer in enumerate(result):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layers[{index}] must be an nn.Module, got {type(layer).__name__}")
    return result


def _checked_calls(calls: Sequence[LayerCall] | LayerCall, count: int) -> tuple[LayerCall, ...]:
    if not isinstance(calls, (LayerCall, Sequence)) or isinstance(calls, (str, bytes)):
        raise TypeError(
            "calls must be a LayerCall or a sequence of them, one per layer "
            f"(record_layer_calls(model, inputs)), got {type(calls).__name__}"
        )
    result = (calls,) * count if isinstance(calls, LayerCall) else tuple(calls)
    if len(result) != count:
        raise ValueError(f"calls has {len(result)} entries but there are {count} layers")
    for index, call in enumerate(result):
        if not isinstance(call, LayerCall):
            raise TypeError(f"calls[{index}] must be a LayerCall, got {type(call).__name__}")
        if not call.args or not isinstance(call.args[0], torch.Tensor):
            raise TypeError(
                f"decoder layer {index}: its call must start with the hidden states (a tensor), "
                f"got {type(call.args[0]).__name__ if call.args else 'no positional argument'}"
            )
        if not isinstance(call.kwargs, Mapping):
            # LayerCall.kwargs is a mapping (record_layer_calls gives a dict, {} for none).
            where = "calls" if isinstance(calls, LayerCall) else f"calls[{index}]"
            raise TypeError(
                f"{where}.kwargs must be a mapping of the layer's keyword arguments (pass {{}} "
                f"for none), got {type(call.kwargs).__name__}"
            )
    return result


def _check_model(where: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{where}: model must be an nn.Module (a HF *ForCausalLM or its base *Model), got "
            f"{type(model).__name__}"
        )


def _check_index(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"run_chunk: {name} must be an int ({'1' if name == 'chunk' else '0'}-based), got "
            f"{type(value).__name__}{f' {value!r}' if isinstance(value, str) else ''}"
        )


def _check_model_config(model: nn.Module) -> None:
    """Refuse model-level settings whose effect a replay cannot reproduce."""
    config = getattr(model, "config", None)
    # Checked before the recording forward too: that forward would run the implementation.
    _check_config(type(model).__name__, config, training=model.training)
    for flag in _HOOKED_OUTPUTS:
        if getattr(config, flag, False):
            raise ValueError(
                f"{type(model).__name__}: config.{flag} is set; HF collects those outputs with "
                "hooks inside the layers, which a graph replay does not run (set it False)"
            )
    # What HF's is_activation_checkpointing reads, without its version-dependent name.
    if any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()):
        raise ValueError(_checkpointing_message(type(model).__name__))
    # The recording forward would replay those layers' graphs, at the capture's shapes.
    graphed = [
        index
        for index, layer in enumerate(decoder_layers(model))
        if isinstance(vars(layer).get("forward"), GraphedCallable)
    ]
    if graphed:
        raise ValueError(
            f"{type(model).__name__}: decoder layers {graphed} are graphed already (an "
            "earlier graph_causal_lm or graph_decoder_layers in place); expected eager "
            "layers: call that result's reset() first, which gives them their eager forward "
            "back"
        )


def _check_inputs(where: str, sample_inputs: Mapping[str, Any]) -> None:
    """Refuse flags of the model call before the recording forward runs with them (HF
    installs its output-collecting hooks on the model's modules for good then)."""
    if isinstance(sample_inputs, Mapping):  # else record_layer_calls names the type
        _check_flags(where, sample_inputs)


def _checkpointing_message(where: str) -> str:
    return (
        f"{where}: gradient checkpointing is on; a graphed layer bypasses HF's checkpointing "
        "wrapper, so turn it off (model.activation_checkpointing_disable(), or "
        "gradient_checkpointing_disable() in older transformers)"
    )


def _check_supported(layers: Sequence[nn.Module], calls: Sequence[LayerCall]) -> None:
    """Refuse, before warm-up, what the graphs cannot replay exactly (module docstring)."""
    for index, (layer, call) in enumerate(zip(layers, calls)):
        where = f"decoder layer {index} ({type(layer).__name__})"
        if getattr(layer, "gradient_checkpointing", False):
            raise ValueError(_checkpointing_message(where))
        for config in _configs(layer):
            _check_config(where, config, training=layer.training)
        _check_dropout(where, layer)
        _check_call(where, call)


def _check_dropout(where: str, layer: nn.Module) -> None:
    """Refuse dropout in a training submodule: a dropout module, or a rate the forward hands
    ``nn.functional.dropout`` (HF keeps those as attributes named after the config's:
    ``attention_dropout``, Starcoder2's ``residual_dropout``, ``resid_pdrop``, and Mixtral's
    ``jitter_noise``, router noise drawn at random)."""
    for name, module in layer.named_modules():
        if not module.training:
            continue
        at = f" in submodule {name!r}" if name else ""
        if isinstance(module, _DROPOUT_MODULES) and module.p > 0:
            what = f"nn.{type(module).__name__}(p={module.p}){at}"
            raise ValueError(_dropout_message(where, what))
        for attribute, value in vars(module).items():
            rate = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            if rate and _RANDOM_RATE.search(attribute):
                raise ValueError(_dropout_message(where, f"{attribute}={value}{at}"))


def _configs(layer: nn.Module) -> Iterator[Any]:
    """The distinct HF configs the layer's modules keep (attention, MLP)."""
    seen: set[int] = set()
    for module in layer.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen:
            seen.add(id(config))
            yield config


def _check_config(where: str, config: Any, *, training: bool) -> None:
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is not None and implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"{where}: attention implementation {implementation!r} is not supported; use one "
            f"of {list(SUPPORTED_ATTENTION)} (attn_implementation= of the config or of "
            "from_pretrained)"
        )
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if training and dropout > 0:
        raise ValueError(_dropout_message(where, f"attention_dropout={dropout}"))


def _dropout_message(where: str, what: str) -> str:
    return (
        f"{where} trains with {what}; warm-up and capture draw random numbers, so graphed "
        "training would not match eager: set it to 0 (or graph in eval mode)"
    )


def _check_flags(where: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse ``use_cache`` and the hooked outputs among keyword arguments."""
    if kwargs.get("use_cache"):
        raise ValueError(
            f"{where} is called with use_cache={kwargs['use_cache']!r}; a replay cannot fill a "
            "KV cache: pass use_cache=False to the model (or set model.config.use_cache = False)"
        )
    for flag in _HOOKED_OUTPUTS:
        if kwargs.get(flag):
            raise ValueError(
                f"{where} is called with {flag}={kwargs[flag]!r}; HF collects those outputs "
                "with hooks inside the layers, which a graph replay does not run"
            )


def _check_call(where: str, call: LayerCall) -> None:
    """Refuse a cache, hooked outputs and constants a replay cannot compare."""
    _check_flags(where, call.kwargs)
    for name, value in _leaves(call):
        if not isinstance(value, (torch.Tensor, *_PLAIN_CONSTANTS)):
            hint = " (a KV cache: pass use_cache=False)" if _is_cache(value) else ""
            raise TypeError(
                f"{where}: argument {name} is a {type(value).__name__}{hint}; graphs take "
                "tensors and plain constants (None, bool, int, float, str) only"
            )


def _leaves(call: LayerCall) -> Iterator[tuple[str, Any]]:
    """``(name, leaf)`` of every leaf of the call, named by its position or keyword."""
    for position, value in enumerate(call.args):
        for leaf in pytree.tree_leaves(value):
            yield f"input {position}", leaf
    for key, value in call.kwargs.items():
        for leaf in pytree.tree_leaves(value):
            yield repr(key), leaf


def _is_cache(value: Any) -> bool:
    module = _transformers_or_none()
    cache = getattr(module, "Cache", None)
    return isinstance(cache, type) and isinstance(value, cache)


def _transformers_or_none() -> ModuleType | None:
    """``transformers`` if installed (imported here only, on demand), else None."""
    try:
        return importlib.import_module("transformers")
    except ImportError:
        return None


# --------------------------------------------------------------------------------------------
# run_chunk's keyword arguments
# --------------------------------------------------------------------------------------------


def _per_layer_kwargs(
    layer_kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
    calls: Sequence[LayerCall],
    indices: Sequence[int],
) -> list[Mapping[str, Any]]:
    """The keyword arguments of each layer ``indices`` names (one chunk's), in order."""
    if layer_kwargs is None:
        return [calls[index].kwargs for index in indices]
    if isinstance(layer_kwargs, Mapping):
        return [layer_kwargs] * len(indices)
    if isinstance(layer_kwargs, (str, bytes)) or not isinstance(layer_kwargs, Sequence):
        raise TypeError(
            "run_chunk: layer_kwargs must be a mapping of keyword arguments or a sequence of "
            f"one per decoder layer ({len(calls)}), got {type(layer_kwargs).__name__}"
        )
    if len(layer_kwargs) != len(calls):
        raise ValueError(
            f"run_chunk: layer_kwargs must hold one mapping per decoder layer ({len(calls)}, "
            f"indexed like calls), got {len(layer_kwargs)}"
        )
    for index in indices:
        if not isinstance(layer_kwargs[index], Mapping):
            raise TypeError(
                f"run_chunk: layer_kwargs[{index}] must be a mapping of keyword arguments, got "
                f"{type(layer_kwargs[index]).__name__}"
            )
    return [layer_kwargs[index] for index in indices]


def _check_one_for_all(difference: tuple[int, int, str] | None, count: int, chunk: int) -> None:
    """Refuse one mapping for layers the model called with different keyword arguments (a
    sliding-window layer's mask is not a full-attention layer's): one would get the other's."""
    if difference is not None:
        first, other, what = difference
        raise ValueError(
            f"run_chunk: layer_kwargs is one mapping for the {count} layers of chunk {chunk}, "
            f"but the model called decoder layers {first} and {other} with different {what} "
            "at recording (layers that attend differently, e.g. sliding-window and full "
            "attention); expected one mapping per decoder layer, e.g. "
            "[call.kwargs for call in record_layer_calls(model, inputs)]"
        )


def _first_difference(
    calls: Sequence[LayerCall], indices: Sequence[int]
) -> tuple[int, int, str] | None:
    """The first layer of ``indices`` called unlike the first one: both, and what differs."""
    first = indices[0]
    for index in indices[1:]:
        differing = _differing_kwarg(calls[first].kwargs, calls[index].kwargs)
        if differing is not None:
            return first, index, differing
    return None


def _differing_kwarg(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """How two recorded calls' keyword arguments differ (``'attention_mask'``, ...), or None."""
    if set(a) != set(b):
        return f"keywords ({sorted(set(a) ^ set(b))})"
    for key in a:
        leaves_a, spec_a = pytree.tree_flatten(a[key])
        leaves_b, spec_b = pytree.tree_flatten(b[key])
        if spec_a != spec_b or not all(map(_same_leaf, leaves_a, leaves_b)):
            return repr(key)
    return None


def _same_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    return type(a) is type(b) and bool(a == b)


# --------------------------------------------------------------------------------------------
# Layout and options
# --------------------------------------------------------------------------------------------


def _layout(
    order: Sequence[Any] | None,
    num_layers: int,
    num_microbatches: int | None,
    num_layers_per_chunk: int | Sequence[int] | None,
) -> tuple[Layout, tuple[Step, ...] | None]:
    """The layout of the graphs, and the order's steps (None without an order)."""
    if order is None:
        if num_microbatches not in (None, 1) or num_layers_per_chunk is not None:
            raise ValueError(
                "num_microbatches and num_layers_per_chunk go with an order; without one the "
                "layers are graphed in place, once each"
            )
        return unordered_layout(num_layers), None
    if (
        isinstance(num_microbatches, bool)
        or not isinstance(num_microbatches, int)
        or num_microbatches < 1
    ):
        raise ValueError(
            f"num_microbatches (an integer >= 1) is required with an order, got "
            f"{num_microbatches!r}"
        )
    try:
        layout, steps = parse_order(
            order,
            num_callables=num_layers,
            num_samples=num_layers * num_microbatches,
            num_layers_per_chunk=num_layers_per_chunk,
        )
    except ValueError as exc:
        raise ValueError(
            f"order does not fit {num_layers} layers and num_microbatches={num_microbatches}: {exc}"
        ) from exc
    return layout, steps


def _callable_of(layout: Layout, index: int) -> int:
    """The layer graph ``index`` replays."""
    graph = layout.graph_id(index)
    return layout.callable_index(graph.chunk, graph.layer)


def _capture_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    return capture_options(
        options,
        why=("graph_decoder_layers passes the order and the recorded calls itself"),
        check=True,
    )
