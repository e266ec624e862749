"""Static buffers from the plan's lifetimes: who shares storage with whom.

A graph's static input must hold its value from the graph's forward replay until its backward
replay (autograd may have saved it); its gradient seed (the buffer the incoming output gradient
is copied into) only during the backward replay. Graphs whose lifetimes never overlap can
share storage when their buffers match in shape, dtype, device and ``requires_grad``, so the
number of buffers follows what the schedule holds in flight, not the number of microbatches.

Within a chunk, layer ``l + 1``'s first input can be layer ``l``'s static output itself
(*chained*): the caller passes that output back and no copy happens at replay.

Everything here is plain data computed once from the :class:`~leangraph.plan.Plan` (whose
lifetimes say how long each graph's inputs hold) and the probe's buffer keys; the engine
allocates what it says and nothing else, and the memory plan counts the same buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from .order import StepKind
from .plan import Plan

__all__ = [
    "BufferKey",
    "BufferPlan",
    "Chained",
    "StaticBuffers",
    "allocate",
    "plan_buffers",
    "same_buffer",
    "same_layout",
]


@dataclass(frozen=True, slots=True)
class BufferKey:
    """What two buffers must agree on to share storage."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    # The strides of a dense, non-contiguous layout to keep (a transposed sample: kernels
    # chosen for it may differ from a contiguous copy's); None: contiguous.
    stride: tuple[int, ...] | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor, *, keep_layout: bool = False) -> BufferKey:
        """The key of ``tensor``; with ``keep_layout``, of its dense layout too (an
        overlapping one, an expanded sample's, cannot hold copies: contiguous)."""
        stride = None
        if keep_layout and not tensor.is_contiguous():
            dense = torch.empty_like(tensor, device="meta").stride()  # preserve_format's rule
            stride = tuple(dense) if tuple(dense) == tuple(tensor.stride()) else None
        shape = tuple(tensor.shape)
        return cls(shape, tensor.dtype, tensor.device, tensor.requires_grad, stride)

    @property
    def nbytes(self) -> int:
        """Bytes of one contiguous buffer of this key."""
        element = torch.empty((), dtype=self.dtype, device="meta").element_size()
        return math.prod(self.shape) * element


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same shape, dtype, strides and device (one can stand
    in for the other as a graph's buffer)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.stride() == b.stride()
        and a.device == b.device
    )


def same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same memory with the same view (a replay argument that
    already is its static buffer needs no copy)."""
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape
    )


@dataclass(frozen=True, slots=True)
class Chained:
    """A static input that is output 0 of graph ``source`` (the previous layer).

    ``requires_grad`` is the input's as the probe saw it (the key it and the output share): a
    frozen previous layer's output does not require grad, and the backward graph must not
    differentiate with respect to it then.
    """

    source: int
    requires_grad: bool


InputSource = int | Chained
"""A slot index into :attr:`BufferPlan.slot_keys`, or a chained output."""


@dataclass(frozen=True, slots=True)
class BufferPlan:
    """Which buffer every static input and gradient seed of every graph uses.

    ``inputs[g][i]`` is the source of graph ``g``'s input leaf ``i``; ``seeds[g][o]`` the seed
    slot of its output ``o`` (None for outputs that need no gradient). ``lifetimes[g]`` is the
    (first, last) capture-step index during which graph ``g``'s inputs must hold.
    """

    slot_keys: tuple[BufferKey, ...]
    inputs: tuple[tuple[InputSource, ...], ...]
    seed_keys: tuple[BufferKey, ...]
    seeds: tuple[tuple[int | None, ...], ...]
    lifetimes: tuple[tuple[int, int], ...]

    def slot_users(self, slot: int) -> list[int]:
        """Graphs whose inputs use ``slot``."""
        return [g for g, sources in enumerate(self.inputs) if slot in sources]


def _chain_source(
    plan: Plan,
    graph: int,
    input_keys: Sequence[Sequence[BufferKey]],
    output_keys: Sequence[Sequence[BufferKey]],
    first_leaf_is_arg0: bool,
) -> int | None:
    """The previous layer of the same chunk and microbatch, if its output can feed leaf 0."""
    graph_id = plan.layout.graph_id(graph)
    if graph_id.layer == 0 or not first_leaf_is_arg0 or not input_keys[graph]:
        return None
    source = plan.layout.graph_index(graph_id.chunk, graph_id.microbatch, graph_id.layer - 1)
    outputs = output_keys[source]
    if len(outputs) == 1 and outputs[0] == input_keys[graph][0]:
        return source
    return None


class _Slots:
    """Numbered buffers handed out by key; a given-back one goes to the next taker of its key."""

    def __init__(self, share: bool) -> None:
        self.keys: list[BufferKey] = []
        self._share = share
        self._free: dict[BufferKey, list[int]] = {}

    def take(self, key: BufferKey) -> int:
        free = self._free.get(key)
        if self._share and free:
            return free.pop()
        self.keys.append(key)
        return len(self.keys) - 1

    def give_back(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self._free.setdefault(self.keys[slot], []).append(slot)


def plan_buffers(
    plan: Plan,
    input_keys: Sequence[Sequence[BufferKey]],
    output_keys: Sequence[Sequence[BufferKey]],
    *,
    chainable: Sequence[bool],
    share: bool = True,
) -> BufferPlan:
    """Assign buffers by walking the capture steps (greedy interval colouring per key).

    Args:
        plan: The liveness plan; its capture sequence is the replay sequence.
        input_keys: Per graph, the key of each static input leaf (as the probe saw them).
        output_keys: Per graph, the key of each output (``requires_grad`` says whether it
            needs a gradient seed), as the probe saw them.
        chainable: Per graph, whether input leaf 0 is positional argument 0 itself (a tensor),
            so that the previous layer's output can be passed for it.
        share: False gives every graph buffers of its own (no sharing, no chaining).
    """
    lifetimes = plan.lifetimes([any(k.requires_grad for k in keys) for keys in output_keys])
    slots = _Slots(share)
    inputs: dict[int, tuple[InputSource, ...]] = {}
    for index, step in enumerate(plan.capture):
        g = step.graph
        if step.kind is StepKind.FORWARD:
            chain = (
                _chain_source(plan, g, input_keys, output_keys, chainable[g])
                if (share and plan.ordered)
                else None
            )
            inputs[g] = tuple(
                Chained(chain, key.requires_grad)
                if (chain is not None and i == 0)
                else slots.take(key)
                for i, key in enumerate(input_keys[g])
            )
        if lifetimes[g][1] == index:  # the graph's last step: its input slots come free
            slots.give_back(s for s in inputs[g] if isinstance(s, int))
    seed_keys, seeds = _plan_seeds(plan, output_keys, share, lifetimes)
    return BufferPlan(
        tuple(slots.keys),
        tuple(inputs[g] for g in range(len(input_keys))),
        tuple(seed_keys),
        tuple(seeds),
        lifetimes,
    )


def _plan_seeds(
    plan: Plan,
    output_keys: Sequence[Sequence[BufferKey]],
    share: bool,
    lifetimes: Sequence[tuple[int, int]],
) -> tuple[list[BufferKey], list[tuple[int | None, ...]]]:
    """Gradient seeds. A seed is read only during its backward, so one per key serves every
    graph; when a weight step reads it again later, seeds are shared only among graphs whose
    [backward, weight step] spans do not overlap."""
    slots = _Slots(share)
    seeds: dict[int, tuple[int | None, ...]] = {}
    for index, step in enumerate(plan.capture):
        g = step.graph
        if step.kind is StepKind.BACKWARD:
            seeds[g] = tuple(slots.take(k) if k.requires_grad else None for k in output_keys[g])
        if step.is_backward and lifetimes[g][1] == index:
            slots.give_back(s for s in seeds.get(g, ()) if s is not None)
    rows = [seeds.get(g, tuple(None for _ in output_keys[g])) for g in range(len(output_keys))]
    return slots.keys, rows


def allocate(keys: Sequence[BufferKey], *, requires_grad: bool = True) -> list[torch.Tensor]:
    """One empty tensor per key, outside any graph pool (``requires_grad`` as the key says,
    unless ``requires_grad`` is False: gradient seeds never require grad)."""
    return [
        (
            torch.empty(k.shape, dtype=k.dtype, device=k.device)
            if k.stride is None
            else torch.empty_strided(k.shape, k.stride, dtype=k.dtype, device=k.device)
        ).requires_grad_(k.requires_grad and requires_grad)
        for k in keys
    ]


@dataclass(frozen=True, slots=True)
class StaticBuffers:
    """The allocated buffers of a :class:`BufferPlan`, handed out graph by graph at capture."""

    plan: BufferPlan
    slots: tuple[torch.Tensor, ...]
    seeds: tuple[torch.Tensor, ...]

    @classmethod
    def allocate(cls, plan: BufferPlan) -> StaticBuffers:
        return cls(
            plan,
            tuple(allocate(plan.slot_keys)),
            tuple(allocate(plan.seed_keys, requires_grad=False)),
        )

    def chained(self, graph: int) -> tuple[bool, ...]:
        """Per input leaf of ``graph``: whether it is the previous layer's output."""
        return tuple(s is not None for s in self.chain_sources(graph))

    def next_layers(self) -> dict[int, int]:
        """Per graph whose output feeds a chain, the graph whose input 0 it is (the next
        layer of the same chunk and microbatch)."""
        return {
            sources[0].source: graph
            for graph, sources in enumerate(self.plan.inputs)
            if sources and isinstance(sources[0], Chained)
        }

    def chain_sources(self, graph: int) -> tuple[int | None, ...]:
        """Per input leaf of ``graph``: the graph whose output it is, or None."""
        return tuple(s.source if isinstance(s, Chained) else None for s in self.plan.inputs[graph])

    def inputs_for(
        self, graph: int, outputs_of: Callable[[int], tuple[torch.Tensor, ...]]
    ) -> list[torch.Tensor]:
        """Static inputs of ``graph``; ``outputs_of(g)`` gives graph ``g``'s static outputs."""
        result = []
        for source in self.plan.inputs[graph]:
            if isinstance(source, Chained):
                output = outputs_of(source.source)[0]
                result.append(output.detach().requires_grad_(source.requires_grad))
            else:
                result.append(self.slots[source])
        return result

    def seeds_for(self, graph: int) -> list[torch.Tensor | None]:
        return [None if i is None else self.seeds[i] for i in self.plan.seeds[graph]]
