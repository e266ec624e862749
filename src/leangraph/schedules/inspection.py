"""Inspecting orders: whether one is valid, and how many forwards it keeps in flight.

Both read any order (chunk ids or :class:`~leangraph.order.Step` records) through
:func:`leangraph.order.parse_order`, with one layer per chunk; :func:`max_in_flight` counts
what the liveness plan (:mod:`leangraph.plan`, the only place that folds what is alive) keeps
alive.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

from ..order import Layout, Step, StepKind, parse_order
from ..plan import build_plan

__all__ = ["InFlight", "max_in_flight", "validate_order"]


@dataclass(frozen=True)
class InFlight:
    """The most forwards an order keeps outstanding (run, backward not yet run).

    ``per_chunk[i]`` is the maximum for chunk ``i + 1``; ``total`` the maximum over all chunks
    together at any point of the order (not the sum of the per-chunk maxima).
    """

    per_chunk: tuple[int, ...]
    total: int


def _size(order: Sequence[object]) -> tuple[int, int]:
    """The chunks and microbatches ``order`` runs, as ``parse_order``'s counts need them.

    Read leniently: for a malformed order any counts do, as ``parse_order`` then reports what
    is wrong with the order before it compares counts.
    """
    if not isinstance(order, Sequence) or isinstance(order, (str, bytes)):
        return 1, 1
    if order and all(isinstance(e, Step) for e in order):
        explicit: Sequence[Step] = order  # type: ignore[assignment]
        # Only int chunks: parse_order names a field of another type itself.
        chunks = max((s.chunk for s in explicit if _is_id(s.chunk) and s.chunk >= 1), default=1)
        return chunks, sum(1 for s in explicit if s.kind is StepKind.FORWARD and s.chunk == 1)
    ids = [int(e) for e in order if _is_id(e)]
    chunks = max((abs(e) for e in ids), default=1) or 1
    return chunks, sum(1 for e in ids if e == 1)


def _is_id(value: object) -> TypeGuard[int]:
    """An int entry or chunk id (not a bool), as a lenient size reading may count."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _parse(order: Sequence[object]) -> tuple[Layout, tuple[Step, ...]]:
    """Validate ``order`` with :func:`leangraph.order.parse_order`, one layer per chunk."""
    chunks, microbatches = _size(order)
    return parse_order(
        order,
        num_callables=chunks,
        num_samples=chunks * microbatches,
        num_layers_per_chunk=1,
    )


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
    # With one layer per chunk each graph is one forward, and the plan keeps its outputs alive
    # until its last step: the weight step when the order splits backwards (the activations
    # live until then), else the backward. So live graphs are outstanding forwards.
    plan = build_plan(*_parse(order))
    return InFlight(
        per_chunk=plan.max_live_per_chunk(plan.capture), total=plan.max_live(plan.capture)
    )
