"""Inspecting orders: whether one is valid, and how many forwards it keeps in flight.

Both read any order (chunk ids or :class:`~leangraph.order.Step` records) through
:func:`leangraph.order.parse_order`, with one layer per chunk.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from ..order import Step, StepKind, parse_order

__all__ = ["InFlight", "max_in_flight", "validate_order"]


@dataclass(frozen=True)
class InFlight:
    """The most forwards an order keeps outstanding (run, backward not yet run).

    ``per_chunk[i]`` is the maximum for chunk ``i + 1``; ``total`` the maximum over all chunks
    together at any point of the order (not the sum of the per-chunk maxima).
    """

    per_chunk: tuple[int, ...]
    total: int


def _parse(order: Sequence[object]) -> tuple[Step, ...]:
    """Validate ``order`` with :func:`leangraph.order.parse_order`, one layer per chunk."""
    chunks, microbatches = 1, 1
    if isinstance(order, Sequence) and not isinstance(order, (str, bytes)):
        if order and all(isinstance(e, Step) for e in order):
            explicit: Sequence[Step] = order  # type: ignore[assignment]
            chunks = max(step.chunk for step in explicit)
            microbatches = sum(
                1 for step in explicit if step.kind is StepKind.FORWARD and step.chunk == 1
            )
        else:
            ids = [
                int(e) for e in order if isinstance(e, numbers.Integral) and not isinstance(e, bool)
            ]
            chunks = max((abs(e) for e in ids), default=1) or 1
            microbatches = sum(1 for e in ids if e == 1)
    _, steps = parse_order(
        order,
        num_callables=chunks,
        num_samples=chunks * microbatches,
        num_layers_per_chunk=1,
    )
    return steps


def validate_order(order: Sequence[object]) -> None:
    """Check that ``order`` is a complete, well-formed pipeline order.

    Args:
        order: The order (``+c`` forward, ``-c`` backward, chunks 1-based).

    Raises:
        ValueError: naming the position and entry of the first malformed entry (not an
            integer, zero, a backward with no outstanding forward), or the chunk whose
            forwards and backwards differ in count, or chunks with different microbatch
            counts (every chunk ``1..max`` must run every microbatch).
    """
    _parse(order)


def max_in_flight(order: Sequence[object]) -> InFlight:
    """The most forwards ``order`` keeps outstanding, per chunk and in total.

    A forward is outstanding until its backward, or its weight step in an order with
    ``-(c + 0.5)`` entries.

    Args:
        order: A valid order (see :func:`validate_order`).

    Returns:
        The per-chunk and overall maxima of outstanding forwards.

    Raises:
        ValueError: if ``order`` is malformed (as :func:`validate_order`).
    """
    steps = _parse(order)
    num_chunks = max(step.chunk for step in steps)
    # A forward is outstanding until its last step: the weight step when the order splits
    # backwards (the activations live until then), else the backward.
    last = StepKind.WEIGHT if any(s.kind is StepKind.WEIGHT for s in steps) else StepKind.BACKWARD
    outstanding = [0] * num_chunks
    peak = [0] * num_chunks
    total = peak_total = 0
    for step in steps:
        delta = 1 if step.kind is StepKind.FORWARD else (-1 if step.kind is last else 0)
        outstanding[step.chunk - 1] += delta
        total += delta
        peak[step.chunk - 1] = max(peak[step.chunk - 1], outstanding[step.chunk - 1])
        peak_total = max(peak_total, total)
    return InFlight(per_chunk=tuple(peak), total=peak_total)
