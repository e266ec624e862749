"""Pipeline orders: the order convention, its validation and the graph-index layout.

An *order* is the list TransformerEngine's ``_order`` and Megatron-LM use to describe what one
pipeline rank runs: ``+c`` is the next microbatch's forward of model chunk ``c`` (1-based) and
``-c`` is the backward of chunk ``c``'s oldest outstanding forward (first in, first out per
chunk). Zero-bubble schedules split a backward in two: ``-(c + 0.5)`` is the deferred
weight-gradient step of chunk ``c``'s oldest backward whose weight step has not run, and when
an order has such entries its ``-c`` entries compute input gradients only.

This module turns such a list into immutable :class:`Step` records and owns the only copy of
the index arithmetic that maps (chunk, microbatch, layer) to a position in ``sample_args``
and in the tuple :func:`leangraph.make_graphed_callables` returns.
"""

from __future__ import annotations

import enum
import itertools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

__all__ = [
    "GraphId",
    "Layout",
    "OrderEntry",
    "Step",
    "StepKind",
    "parse_order",
    "unordered_layout",
]


class StepKind(enum.Enum):
    """What a step of an order runs."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"


@dataclass(frozen=True, slots=True)
class GraphId:
    """Where one graph sits in a pipeline schedule.

    ``chunk`` is the 1-based model-chunk id of the order convention; ``microbatch`` and
    ``layer`` (within the chunk) are 0-based.
    """

    chunk: int
    microbatch: int
    layer: int

    def __str__(self) -> str:
        return f"chunk {self.chunk}, microbatch {self.microbatch}, layer {self.layer}"


@dataclass(frozen=True, slots=True)
class Step:
    """One entry of an order: a forward or backward of one microbatch of one chunk.

    ``position`` is the entry's index in the user's order list (``None`` for steps leangraph
    made up itself, such as the default order of unordered callables).
    """

    kind: StepKind
    chunk: int
    microbatch: int
    position: int | None = None

    def __str__(self) -> str:
        return f"{self.kind.value} c{self.chunk} m{self.microbatch}"


# An entry of an order as callers write it: a chunk id (``+c`` forward, ``-c`` backward), a
# weight step ``-(c + 0.5)`` (a float), or a :class:`Step` record naming its microbatch.
OrderEntry: TypeAlias = int | float | Step


@dataclass(frozen=True, slots=True)
class Layout:
    """How graphs are laid out: chunk -> microbatch -> layer.

    The graph of chunk ``c`` (1-based), microbatch ``m`` and layer ``l`` sits at
    ``prefix[c] * M + m * L_c + l``, where ``prefix[c]`` is the number of layers in the chunks
    before ``c``; layer ``l`` of chunk ``c`` is callable ``prefix[c] + l``.
    """

    layers_per_chunk: tuple[int, ...]
    num_microbatches: int

    def __post_init__(self) -> None:
        """Refuse a layout no order can have, so that no index it gives is silently wrong.

        Raises:
            TypeError: for ``layers_per_chunk`` that is not a tuple or list of ints, or a
                ``num_microbatches`` that is not an int.
            ValueError: for no chunk, a chunk of no layer, or fewer than one microbatch.
        """
        chunks = self.layers_per_chunk
        if not isinstance(chunks, (tuple, list)) or not all(map(_is_int, chunks)):
            raise TypeError(
                "Layout: layers_per_chunk must be a tuple of ints (layers per chunk), got "
                f"{_described(chunks)}"
            )
        if not chunks or min(chunks) < 1:
            raise ValueError(
                "Layout: layers_per_chunk must hold at least one chunk, each of at least one "
                f"layer, got {tuple(chunks)}"
            )
        if not _is_int(self.num_microbatches):
            raise TypeError(
                f"Layout: num_microbatches must be an int, got {_described(self.num_microbatches)}"
            )
        if self.num_microbatches < 1:
            raise ValueError(f"Layout: num_microbatches must be >= 1, got {self.num_microbatches}")
        # A list would make the frozen record unhashable and mutable from outside.
        object.__setattr__(self, "layers_per_chunk", tuple(int(n) for n in chunks))

    @property
    def num_chunks(self) -> int:
        """Number of chunks (model chunks of the rank)."""
        return len(self.layers_per_chunk)

    @property
    def num_callables(self) -> int:
        """Number of callables (layers over all chunks)."""
        return sum(self.layers_per_chunk)

    @property
    def num_graphs(self) -> int:
        """Number of graphs: one per (chunk, microbatch, layer)."""
        return self.num_callables * self.num_microbatches

    def layer_prefix(self, chunk: int) -> int:
        """Number of layers in the chunks before ``chunk`` (1-based)."""
        return sum(self.layers_per_chunk[: chunk - 1])

    def graph_index(self, chunk: int, microbatch: int, layer: int) -> int:
        """Position of graph (chunk, microbatch, layer) in ``sample_args`` and the result.

        Raises:
            IndexError: for a chunk, microbatch or layer outside the layout (``chunk`` is
                1-based), which would name another graph's position.
        """
        self._check_chunk_layer("graph_index", chunk, layer)
        if not (_is_int(microbatch) and 0 <= microbatch < self.num_microbatches):
            raise IndexError(
                f"Layout.graph_index: microbatch must be in [0, {self.num_microbatches}) "
                f"(0-based), got {microbatch!r}"
            )
        layers = self.layers_per_chunk[chunk - 1]
        return self.layer_prefix(chunk) * self.num_microbatches + microbatch * layers + layer

    def callable_index(self, chunk: int, layer: int) -> int:
        """Position of layer ``layer`` of ``chunk`` in ``callables``.

        Raises:
            IndexError: for a chunk or layer outside the layout (``chunk`` is 1-based).
        """
        self._check_chunk_layer("callable_index", chunk, layer)
        return self.layer_prefix(chunk) + layer

    def _check_chunk_layer(self, method: str, chunk: int, layer: int) -> None:
        # Unchecked, chunk 0 read the last chunk's size and a layer past the chunk's end the
        # next microbatch's or chunk's graph: a valid-looking index of another graph.
        if not (_is_int(chunk) and 1 <= chunk <= self.num_chunks):
            raise IndexError(
                f"Layout.{method}: chunk must be in [1, {self.num_chunks}] (chunk ids are "
                f"1-based), got {chunk!r}"
            )
        layers = self.layers_per_chunk[chunk - 1]
        if not (_is_int(layer) and 0 <= layer < layers):
            raise IndexError(
                f"Layout.{method}: layer must be in [0, {layers}) (0-based; chunk {chunk} has "
                f"{layers} layer(s)), got {layer!r}"
            )

    def callable_of_graph(self, index: int) -> int:
        """Position in ``callables`` of the callable graph ``index`` runs."""
        graph_id = self.graph_id(index)
        return self.callable_index(graph_id.chunk, graph_id.layer)

    def graph_id(self, index: int) -> GraphId:
        """Inverse of :meth:`graph_index`."""
        if not 0 <= index < self.num_graphs:
            raise IndexError(f"graph index {index} out of range [0, {self.num_graphs})")
        start = 0
        for chunk, layers in enumerate(self.layers_per_chunk, start=1):
            size = layers * self.num_microbatches
            if index < start + size:
                microbatch, layer = divmod(index - start, layers)
                return GraphId(chunk, microbatch, layer)
            start += size
        raise AssertionError("unreachable")


def _is_int(value: object) -> bool:
    """An integer that is not a bool (``True`` is 1 to Python, never a count here)."""
    # ``type(...) is int`` first: the abstract-class check costs about a microsecond, and
    # ``Layout.graph_index`` runs three of them for every replay of a training loop.
    return type(value) is int or (
        isinstance(value, numbers.Integral) and not isinstance(value, bool)
    )


def _described(value: object) -> str:
    """``float 2.0``, ``list [2, 2.0]``: a value's type and value, for messages."""
    return f"{type(value).__name__} {value!r}"


def unordered_layout(num_callables: int) -> Layout:
    """The layout of callables given without an order: one chunk, one microbatch."""
    return Layout(layers_per_chunk=(num_callables,), num_microbatches=1)


def _entry(position: int, entry: object) -> tuple[StepKind, int]:
    """The kind and chunk of one order entry: ``+c``, ``-c`` or ``-(c + 0.5)``."""
    if isinstance(entry, bool) or not isinstance(entry, numbers.Real):
        raise ValueError(
            f"order[{position}] = {entry!r}: entries must be non-zero integers "
            f"(+c forward, -c backward of chunk c) or -(c + 0.5) (weight step of chunk c), "
            f"got {type(entry).__name__}"
        )
    if isinstance(entry, numbers.Integral):
        value = int(entry)
        if value == 0:
            raise ValueError(f"order[{position}] = 0: chunk ids are 1-based, 0 is not a chunk")
        return (StepKind.FORWARD if value > 0 else StepKind.BACKWARD), abs(value)
    twice = float(entry) * 2
    if (
        math.isfinite(twice)
        and entry < 0
        and twice == int(twice)
        and int(twice) % 2
        and entry <= -1.5
    ):
        return StepKind.WEIGHT, int(-float(entry) - 0.5)
    raise ValueError(
        f"order[{position}] = {entry!r}: entries must be non-zero integers (+c forward, -c "
        "backward of chunk c) or -(c + 0.5) (weight step of chunk c), got "
        f"{type(entry).__name__} {entry!r}"
    )


def _resolve_layers(
    num_layers_per_chunk: int | Sequence[int] | None, num_chunks: int, num_callables: int
) -> tuple[int, ...]:
    if num_layers_per_chunk is None:
        if num_callables % num_chunks:
            raise ValueError(
                f"{num_callables} callables cannot be split equally over {num_chunks} chunks; "
                "pass num_layers_per_chunk"
            )
        return (num_callables // num_chunks,) * num_chunks
    if isinstance(num_layers_per_chunk, numbers.Integral) and not isinstance(
        num_layers_per_chunk, bool
    ):
        layers = (int(num_layers_per_chunk),) * num_chunks
    elif not isinstance(num_layers_per_chunk, (list, tuple)):
        raise TypeError(
            "num_layers_per_chunk must be an int or a list or tuple of ints, got "
            f"{type(num_layers_per_chunk).__name__} {num_layers_per_chunk!r}"
        )
    else:
        layers = tuple(num_layers_per_chunk)
        if len(layers) != num_chunks:
            raise ValueError(
                f"num_layers_per_chunk has {len(layers)} entries but the order uses "
                f"{num_chunks} chunks"
            )
    for chunk, count in enumerate(layers, start=1):
        if not _is_int(count) or count < 1:
            raise ValueError(
                f"num_layers_per_chunk for chunk {chunk} must be an int >= 1, got {count!r}"
            )
    if sum(layers) != num_callables:
        raise ValueError(
            f"num_layers_per_chunk {list(layers)} sums to {sum(layers)} layers but "
            f"{num_callables} callables were given"
        )
    return tuple(int(n) for n in layers)


def _count_steps(
    order: Sequence[object], entries: Sequence[tuple[StepKind, int]], num_chunks: int
) -> list[Step]:
    """Number each entry's microbatch (first in, first out per chunk and kind)."""
    # By (kind, chunk), not in lists num_chunks long: a chunk id may be far above the chunks
    # an order can run (refused by _refuse_missing_chunks, which must not wait for them).
    counts: dict[tuple[StepKind, int], int] = {}
    steps = []
    for position, (kind, chunk) in enumerate(entries):
        entry = order[position]
        if chunk > num_chunks:
            raise ValueError(
                f"order[{position}] = {entry}: unknown chunk {chunk}, the model "
                f"has {num_chunks} chunks"
            )
        before = {StepKind.BACKWARD: StepKind.FORWARD, StepKind.WEIGHT: StepKind.BACKWARD}
        done = counts.get((kind, chunk), 0)
        if kind in before and done >= counts.get((before[kind], chunk), 0):
            what = "backward" if kind is StepKind.BACKWARD else "weight step"
            needs = "forward" if kind is StepKind.BACKWARD else "backward"
            raise ValueError(
                f"order[{position}] = {entry}: {what} of chunk {chunk} with no outstanding {needs}"
            )
        steps.append(Step(kind, chunk, done, position))
        counts[(kind, chunk)] = done + 1
    return steps


def _refuse_missing_chunks(steps: Sequence[Step], num_chunks: int) -> None:
    """Refuse an order of fewer steps than chunks (some chunk runs no forward) with the error
    :func:`_check_counts` gives, counting only the chunks that run: the per-chunk counts are
    lists ``num_chunks`` long, which for a chunk id such as ``10**9`` would take minutes and
    gigabytes before saying so."""
    forwards: dict[int, int] = {}
    for step in steps:
        if step.kind is StepKind.FORWARD:
            forwards[step.chunk] = forwards.get(step.chunk, 0) + 1
    first = forwards.get(1, 0)
    differing = [chunk for chunk, count in forwards.items() if count != first]
    if first:  # then the first chunk that runs no forward differs too
        differing.append(next(c for c in itertools.count(1) if c not in forwards))
    chunk = min(differing)  # some chunk in 1..num_chunks runs none, and every step one's
    raise ValueError(
        f"order runs {forwards.get(chunk, 0)} forwards of chunk {chunk} but {first} of chunk 1; "
        "every chunk must run every microbatch"
    )


def _explicit_steps(order: Sequence[Step]) -> list[Step]:
    """Check an order given as :class:`Step` records (microbatches named, in any sequence).

    Each (chunk, microbatch) must run its forward, then its backward, then (if any) its
    weight step, each once; the microbatches of a chunk must be ``0 .. M - 1``.
    """
    before = {StepKind.BACKWARD: StepKind.FORWARD, StepKind.WEIGHT: StepKind.BACKWARD}
    done: set[tuple[StepKind, int, int]] = set()
    steps = []
    for position, step in enumerate(order):
        _check_step_fields(position, step)
        if step.chunk < 1 or step.microbatch < 0:
            raise ValueError(
                f"order[{position}] = {step}: chunks count from 1, microbatches from 0"
            )
        key = (step.kind, step.chunk, step.microbatch)
        if key in done:
            raise ValueError(f"order[{position}] = {step}: runs a second time")
        need = before.get(step.kind)
        if need is not None and (need, step.chunk, step.microbatch) not in done:
            raise ValueError(
                f"order[{position}] = {step}: its {need.name.lower()} step has not run yet"
            )
        done.add(key)
        steps.append(Step(step.kind, step.chunk, step.microbatch, position))
    for chunk in {s.chunk for s in steps}:
        seen = sorted(
            s.microbatch for s in steps if s.chunk == chunk and s.kind is StepKind.FORWARD
        )
        if seen != list(range(len(seen))):
            raise ValueError(f"chunk {chunk} runs microbatches {seen}; they must be 0 .. M - 1")
    return steps


def _check_step_fields(position: int, step: Step) -> None:
    """A :class:`Step` record's fields: a :class:`StepKind` and two ints (not bools)."""
    if not isinstance(step.kind, StepKind):
        raise ValueError(
            f"order[{position}] = {step!r}: kind must be a leangraph.order.StepKind "
            f"(FORWARD, BACKWARD or WEIGHT), got {type(step.kind).__name__} {step.kind!r}"
        )
    for field in ("chunk", "microbatch"):
        value = getattr(step, field)
        if not _is_int(value):
            raise ValueError(
                f"order[{position}] = {step!r}: {field} must be an int, got "
                f"{type(value).__name__} {value!r}"
            )


def _check_weight_steps(
    steps: Sequence[Step], backwards: Sequence[int], layers: Sequence[int]
) -> None:
    """With weight steps, every backward needs one, and every chunk exactly one layer."""
    for chunk, count in enumerate(backwards, start=1):
        weights = sum(1 for s in steps if s.kind is StepKind.WEIGHT and s.chunk == chunk)
        if weights != count:
            raise ValueError(
                f"order runs {count} backwards but {weights} weight steps of chunk {chunk}; "
                "with -(c + 0.5) entries every -c (input gradients only) needs its weight step"
            )
        if layers[chunk - 1] != 1:
            raise ValueError(
                f"chunk {chunk} has {layers[chunk - 1]} layers, but an order with weight steps "
                "needs exactly one layer per chunk: a weight step belongs to one graph, and a "
                "-(c + 0.5) entry of a chunk with several layers would stand for several weight "
                "graphs whose relative order (which fixes how the shared pool may be reused) "
                "the order does not give; graph one layer per chunk, as TransformerEngine does"
            )


def _is_explicit(order: Sequence[object]) -> bool:
    """Whether ``order`` is :class:`Step` records (else chunk ids); refuse non-lists and mixes."""
    if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
        raise ValueError(f"order must be a list of chunk ids, got {type(order).__name__}")
    if not order:
        raise ValueError("order is empty")
    explicit = [isinstance(entry, Step) for entry in order]
    if any(explicit) and not all(explicit):
        raise ValueError(
            f"order[{explicit.index(not explicit[0])}]: an order is either all chunk ids or all "
            "leangraph.order.Step records, not a mix"
        )
    return all(explicit)


def _num_chunks(used: int, num_layers_per_chunk: int | Sequence[int] | None) -> int:
    """The model's chunks: one per ``num_layers_per_chunk`` entry, else those the order uses."""
    if isinstance(num_layers_per_chunk, Sequence):
        return len(num_layers_per_chunk)
    return used


def _order_steps(
    order: Sequence[object], num_layers_per_chunk: int | Sequence[int] | None
) -> tuple[list[Step], int]:
    """One :class:`Step` per entry of ``order``, and the number of chunks of the model."""
    if _is_explicit(order):
        steps = _explicit_steps(order)  # type: ignore[arg-type]
        num_chunks = _num_chunks(max(step.chunk for step in steps), num_layers_per_chunk)
        bad = next((step for step in steps if step.chunk > num_chunks), None)
        if bad is not None:
            raise ValueError(
                f"order[{bad.position}] = {bad}: unknown chunk {bad.chunk}, the model "
                f"has {num_chunks} chunks"
            )
        return steps, num_chunks
    entries = [_entry(position, entry) for position, entry in enumerate(order)]
    num_chunks = _num_chunks(max(chunk for _, chunk in entries), num_layers_per_chunk)
    return _count_steps(order, entries, num_chunks), num_chunks


def _per_chunk(steps: Sequence[Step], kind: StepKind, num_chunks: int) -> list[int]:
    """How many steps of ``kind`` each chunk runs (entry ``c - 1`` for chunk ``c``)."""
    return [
        sum(1 for s in steps if s.kind is kind and s.chunk == c) for c in range(1, num_chunks + 1)
    ]


def _check_counts(forwards: Sequence[int], backwards: Sequence[int]) -> None:
    """Every chunk runs every microbatch, and every forward has its backward."""
    for chunk, (fwd, bwd) in enumerate(zip(forwards, backwards), start=1):
        if fwd != forwards[0]:
            raise ValueError(
                f"order runs {fwd} forwards of chunk {chunk} but {forwards[0]} of chunk 1; "
                "every chunk must run every microbatch"
            )
        if bwd != fwd:
            raise ValueError(
                f"order runs {fwd} forwards but {bwd} backwards of chunk {chunk}; "
                "every forward needs its backward"
            )


def parse_order(
    order: Sequence[object],
    *,
    num_callables: int,
    num_samples: int | None,
    num_layers_per_chunk: int | Sequence[int] | None = None,
) -> tuple[Layout, tuple[Step, ...]]:
    """Validate an order and expand it into steps.

    Args:
        order: The pipeline order (``+c`` forward, ``-c`` backward, ``-(c + 0.5)`` weight
            step, chunks 1-based), or :class:`Step` records that name each step's microbatch
            (for schedules whose backwards are not first in, first out, such as
            ``ScheduleLoopedBFS``; see ``leangraph.schedules.from_pipelining(explicit=True)``).
        num_callables: ``len(callables)``: the layers of all chunks, chunk by chunk.
        num_samples: ``len(sample_args)``; must be ``num_callables * num_microbatches``
            (None: the caller checks the count itself).
        num_layers_per_chunk: Layers of each chunk (an int for all, or one per chunk);
            default: an equal split.

    Returns:
        The layout and one :class:`Step` per order entry.

    Raises:
        ValueError: naming the position and entry of the first malformed entry, or the counts
            that do not match.
    """
    steps, num_chunks = _order_steps(order, num_layers_per_chunk)
    if num_chunks > len(steps):
        _refuse_missing_chunks(steps, num_chunks)
    forwards = _per_chunk(steps, StepKind.FORWARD, num_chunks)
    backwards = _per_chunk(steps, StepKind.BACKWARD, num_chunks)
    _check_counts(forwards, backwards)
    layers = _resolve_layers(num_layers_per_chunk, num_chunks, num_callables)
    if any(s.kind is StepKind.WEIGHT for s in steps):
        _check_weight_steps(steps, backwards, layers)
    layout = Layout(layers_per_chunk=layers, num_microbatches=forwards[0])
    if num_samples is not None and num_samples != layout.num_graphs:
        raise ValueError(
            f"sample_args has {num_samples} entries but the order needs {layout.num_graphs} "
            f"({layout.num_callables} layers x {layout.num_microbatches} microbatches)"
        )
    return layout, tuple(steps)
