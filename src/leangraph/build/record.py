"""The hand-off from build to runtime: one frozen record per captured graph."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..backends.base import GraphPair
from ..leaves import LeafTemplate
from ..order import GraphId
from ..probe import OutputView
from ..runtime.signature import CallSignature
from .accumulation import FusedGradients

__all__ = ["GraphRecord", "ModuleBinding", "ModuleState", "ParameterSharing"]


@dataclass(frozen=True, slots=True)
class ModuleBinding:
    """How a module's graphed ``forward`` falls back to eager outside its training modes."""

    module: weakref.ref[torch.nn.Module]
    eager_forward: Callable[[], Callable[..., Any] | None]  # None once the module is gone


@dataclass(frozen=True, slots=True)
class ModuleState:
    """A graphed module's tree as capture saw it: what its graphs replay only as it was.

    Attributes:
        root: The module (held weakly: a graphed module holds its graphed callable).
        submodules: Every submodule, by qualified name, in ``named_modules()`` order.
        parents: Per submodule, its parent's position in ``(root, *submodules)``.
        local_names: Per submodule, its name in its parent's ``_modules``.
        training: The ``training`` flags of ``(root, *submodules)``.
        buffers: Every buffer of the tree (a ``None`` one is no tensor a graph reads), by
            qualified name, per module in ``(root, *submodules)`` order. Held: the graphs read
            their memory for as long as they live, replaced or not.
    """

    root: weakref.ref[torch.nn.Module]
    submodules: tuple[tuple[str, torch.nn.Module], ...]
    parents: tuple[int, ...]
    local_names: tuple[str, ...]
    training: tuple[bool, ...]
    buffers: tuple[tuple[str, torch.Tensor], ...]

    @classmethod
    def of(cls, module: torch.nn.Module) -> ModuleState:
        named = list(module.named_modules(remove_duplicate=False))[1:]
        position = {"": 0, **{name: i + 1 for i, (name, _) in enumerate(named)}}
        parents, local_names = [], []
        for name, _ in named:
            path, _, local = name.rpartition(".")
            parents.append(position[path])
            local_names.append(local)
        return cls(
            root=weakref.ref(module),
            submodules=tuple(named),
            parents=tuple(parents),
            local_names=tuple(local_names),
            training=(module.training, *(m.training for _, m in named)),
            buffers=tuple(
                (f"{path}.{local}" if path else local, buffer)
                for path, owner in (("", module), *named)
                for local, buffer in owner._buffers.items()
                if buffer is not None
            ),
        )


@dataclass(frozen=True, slots=True)
class ParameterSharing:
    """Which other graphs of the call train one of this graph's parameters (the same
    layer's other microbatches, tied weights), and those parameters' ids; known from the
    layout and the probe before capture."""

    peers: tuple[int, ...] = ()
    shared_param_ids: frozenset[int] = frozenset()


@dataclass(frozen=True, eq=False)
class GraphRecord:
    """Everything one graph's replay needs, as capture left it.

    Tensors here are graph-owned static buffers: replays overwrite the outputs and gradients
    in place. After capture with buffer sharing (``released``), the outputs and gradient
    buffers are non-owning views into the pool, valid only within the plan's windows.

    Attributes:
        index: The graph's position in the call's result.
        label: How errors name it.
        graph_id: Chunk, microbatch and layer with an order, else None.
        pair: The backend's forward, backward (and weight-gradient) graphs.
        signature: What a replay's arguments must match.
        static_inputs: One static buffer per input leaf.
        chained_from: Per input leaf, the label of the graph whose output buffer it is.
        static_outputs: One static buffer per output leaf (tensor outputs only).
        output_tree: The structure the outputs are returned in.
        output_template: The output leaves: a slot per static output, constants in place.
        output_repeats: Per output, the first output that is the same tensor (its own
            where none is): a replay returns one tensor there, as eager did; empty where
            every output is a tensor of its own.
        output_views: The outputs eager returned as views of another output
            (:class:`leangraph.probe.OutputView`): a replay returns them as views of its
            own output there.
        output_requires_grad: Per output, whether it needs a gradient.
        saved_outputs: Positions of outputs the backward graph reads (saved for it).
        saved_params: Positions among ``params`` of those the backward graph reads.
        saved_inputs: Positions among ``static_inputs`` of those the backward graph reads.
        saved_buffers: Qualified names of the module's buffers the backward graph reads.
        output_reach: Per output, the inputs and parameters its gradient reaches (positions
            among the input leaves, then the parameters).
        static_grad_outputs: Per output, the seed buffer its incoming gradient is copied into.
        seed_from: The label of the graph whose input gradient buffer output 0's seed is
            (the next layer of a chain, whose backward replay writes it: no copy), else None.
        static_grads: The backward graph's gradients: inputs that require grad, then (for a
            full backward) the trained parameters.
        static_weight_grads: The weight-gradient graph's parameter gradients (split backward).
        params: The callable's parameters; ``param_names`` and ``param_trains`` alongside.
        reads_requires_grad: Positions among ``params`` of those whose ``requires_grad`` the
            forward's Python code read at capture (its path may depend on the flag).
        released: Whether outputs and gradient buffers were handed back to the pool.
        split_backward: Whether the backward is split (zero-bubble weight steps).
        retain_graph: Whether a backward may replay more than once per forward.
        sharing: Which other graphs train one of its parameters.
        module: The module binding for graphed module forwards, else None.
        modules: For a module callable, its tree as capture saw it, else None.
        input_grad_lent: Whether input 0's gradient buffer is the previous layer's seed (a
            chain): a backward replay lends it to autograd uncopied, since the node it flows
            to is that layer's replay, which reads it in place (settled once read, as a
            parameter's lent gradient is: ``runtime.grads``).
        fused: With in-graph gradient accumulation, its targets and hook relay, else None.
    """

    index: int
    label: str
    graph_id: GraphId | None
    pair: GraphPair
    signature: CallSignature
    static_inputs: tuple[torch.Tensor, ...]
    chained_from: tuple[str | None, ...]
    static_outputs: tuple[torch.Tensor, ...]
    output_tree: pytree.TreeSpec
    output_template: LeafTemplate
    output_repeats: tuple[int, ...]
    output_views: tuple[OutputView, ...]
    output_requires_grad: tuple[bool, ...]
    saved_outputs: tuple[int, ...]
    saved_params: tuple[int, ...]
    saved_inputs: tuple[int, ...]
    saved_buffers: tuple[str, ...]
    output_reach: tuple[frozenset[int], ...]
    static_grad_outputs: tuple[torch.Tensor | None, ...]
    seed_from: str | None
    static_grads: tuple[torch.Tensor | None, ...]
    static_weight_grads: tuple[torch.Tensor | None, ...]
    params: tuple[torch.nn.Parameter, ...]
    param_names: tuple[str, ...]
    param_trains: tuple[bool, ...]
    reads_requires_grad: tuple[int, ...]
    released: bool
    split_backward: bool
    retain_graph: bool
    sharing: ParameterSharing
    module: ModuleBinding | None
    modules: ModuleState | None
    input_grad_lent: bool
    fused: FusedGradients | None

    @property
    def has_backward(self) -> bool:
        """Whether any output needs a gradient."""
        return any(self.output_requires_grad)

    def delivers_param_grads(self) -> bool:
        """Whether a backward replay hands the parameters' gradients to autograd: neither
        in-graph accumulation (the graphs add them) nor weight steps (they come at
        ``backward_dw()``)."""
        return self.fused is None and not self.split_backward

    def reached_by(self, got_grad: Sequence[bool]) -> frozenset[int]:
        """The positions (inputs, then parameters) that the outputs with a gradient
        (``got_grad[o]``) reach (``output_reach``): eager's backward gives the others none,
        not zeros."""
        return frozenset().union(*(reach for reach, got in zip(self.output_reach, got_grad) if got))

    def params_unreached(self, reached: frozenset[int]) -> frozenset[int]:
        """The positions among ``params`` of the trained parameters outside ``reached``
        (:meth:`reached_by`'s positions)."""
        offset = len(self.signature.specs)
        return frozenset(
            i for i, trains in enumerate(self.param_trains) if trains and i + offset not in reached
        )

    def trained_params(self) -> tuple[torch.nn.Parameter, ...]:
        """The parameters the graphs differentiate, in gradient order."""
        return tuple(p for p, trains in zip(self.params, self.param_trains) if trains)

    def owned_tensors(self) -> list[torch.Tensor]:
        """The static tensors this graph keeps allocated (shared ones included)."""
        owned = [t for t, source in zip(self.static_inputs, self.chained_from) if source is None]
        seeds = self.static_grad_outputs[1:] if self.seed_from else self.static_grad_outputs
        owned += [g for g in seeds if g is not None]
        if not self.released:
            owned += list(self.static_outputs)
            owned += [g for g in (*self.static_grads, *self.static_weight_grads) if g is not None]
        return owned
