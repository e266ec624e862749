"""Tests of leangraph.schedules.inspection (CPU only): validate_order and max_in_flight,
against hand counts and a brute-force count over random orders of the builders."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from models import TORCH_ZERO_BUBBLE_SCHEDULES
from reference_orders import megatron_accepts
from torch.distributed import pipelining as pl

from leangraph.order import Step, StepKind
from leangraph.schedules import (
    InFlight,
    from_pipelining,
    gpipe,
    interleaved_1f1b,
    max_in_flight,
    one_f_one_b,
    validate_order,
)


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ([1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1], InFlight((2, 2), 4)),
        ([1, -1], InFlight((1,), 1)),
        ([1, 1, 1, -1, -1, -1], InFlight((3,), 3)),
        ([1, -1, 1, -1], InFlight((1,), 1)),
        # chunk 1 peaks at 2 while chunk 2 is idle; together never more than 2
        ([1, 1, -1, -1, 2, 2, -2, -2], InFlight((2, 2), 2)),
        (one_f_one_b(4, 0, 8), InFlight((4,), 4)),
        (one_f_one_b(4, 3, 8), InFlight((1,), 1)),
        (interleaved_1f1b(2, 2, 0, 4), InFlight((4, 2), 5)),
        (interleaved_1f1b(4, 2, 0, 16), InFlight((8, 4), 11)),
        (gpipe(3, 2), InFlight((3, 3), 6)),
    ],
)
def test_max_in_flight(order: list[int], expected: InFlight) -> None:
    assert max_in_flight(order) == expected


def test_in_flight_is_frozen() -> None:
    result = max_in_flight([1, -1])
    with pytest.raises(AttributeError):
        result.total = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("order", "message"),
    [
        ([1, 1.5, -1], r"order\[1\] = 1\.5"),
        ([1, "2", -1], r"order\[1\] = '2'"),
        ([True, -1], r"order\[0\] = True"),
        ([1, 0, -1], r"order\[1\] = 0"),
        ([-1, 1], r"order\[0\] = -1: backward of chunk 1 with no outstanding forward"),
        ([1, -1, -1, 1], r"order\[2\] = -1: backward of chunk 1 with no outstanding forward"),
        ([1, 1, -1], "2 forwards but 1 backwards of chunk 1"),
        ([1, 2, -2, -1, 1, -1], "1 forwards of chunk 2 but 2 of chunk 1"),
        ([2, -2], "1 forwards of chunk 2 but 0 of chunk 1"),
        ([10**9, -(10**9)], r"order\[0\] = 1000000000: chunk 1000000000 cannot be run by an order of 2"),
        ([1, 1, -1, -1, 3, -3], "0 forwards of chunk 2 but 2 of chunk 1"),
        # The lenient size reading leaves malformed Step fields to the order's own checks.
        ([Step(StepKind.FORWARD, None, 0), Step(StepKind.BACKWARD, 1, 0)],  # type: ignore[arg-type]
         r"order\[0\] = .*chunk must be an int, got NoneType None"),
        ([Step(StepKind.FORWARD, 1, 0), Step(StepKind.BACKWARD, "1", 0)],  # type: ignore[arg-type]
         r"order\[1\] = .*chunk must be an int, got str '1'"),
        ([], "order is empty"),
        ("1-1", "must be a list"),
        (None, "must be a list"),
    ],
)
def test_validate_order_errors(order: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_order(order)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        max_in_flight(order)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "order",
    [
        [1, -1],
        (1, 2, -2, -1),
        [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1],
        gpipe(4, 3),
        interleaved_1f1b(3, 3, 1, 6),
    ],
)
def test_validate_order_accepts(order: list[int]) -> None:
    assert validate_order(order) is None


def test_max_in_flight_counts_a_split_backward_until_its_weight_step() -> None:
    # The weight steps come last: every forward stays in flight until then.
    order = [1, 1, -1, -1, -1.5, -1.5]
    assert max_in_flight(order) == InFlight(per_chunk=(2,), total=2)
    assert max_in_flight([1, -1, -1.5, 1, -1, -1.5]) == InFlight(per_chunk=(1,), total=1)
    assert max_in_flight([1, -1, 1, -1, -1.5, -1.5]) == InFlight(per_chunk=(2,), total=2)


# --------------------------------------------------------------------------------------------
# max_in_flight against a brute-force count
# --------------------------------------------------------------------------------------------


def _kind_and_chunk(entry: object) -> tuple[str, int]:
    """``("F" | "B" | "W", chunk)`` of an order entry or Step record."""
    if isinstance(entry, Step):
        return entry.kind.value, entry.chunk
    assert isinstance(entry, (int, float))
    if entry > 0:
        return "F", int(entry)
    if float(entry).is_integer():
        return "B", int(-entry)
    return "W", int(-entry)  # -(c + 0.5)


def _brute_force_in_flight(order: list) -> InFlight:
    """Outstanding forwards counted afresh over every prefix of ``order``.

    Per chunk: forwards run so far minus forwards retired so far, retired by their weight step
    in an order that has weight steps, else by their backward.
    """
    steps = [_kind_and_chunk(entry) for entry in order]
    retire = "W" if any(kind == "W" for kind, _ in steps) else "B"
    chunks = range(1, max(chunk for _, chunk in steps) + 1)
    prefixes = [steps[: end + 1] for end in range(len(steps))]

    def outstanding(prefix: list[tuple[str, int]], chunk: int) -> int:
        return prefix.count(("F", chunk)) - prefix.count((retire, chunk))

    per_chunk = tuple(max(outstanding(p, c) for p in prefixes) for c in chunks)
    return InFlight(per_chunk, max(sum(outstanding(p, c) for c in chunks) for p in prefixes))


@st.composite
def _builder_orders(draw: st.DrawFn) -> list[int]:
    """An order of one of the builders, with sizes it accepts."""
    builder = draw(st.sampled_from(["interleaved_1f1b", "one_f_one_b", "gpipe"]))
    pp = draw(st.integers(1, 4))
    rank = draw(st.integers(0, pp - 1))
    if builder == "gpipe":
        return gpipe(draw(st.integers(1, 6)), vp_size=draw(st.integers(1, 3)))
    if builder == "one_f_one_b":
        return one_f_one_b(pp, rank, draw(st.integers(1, 10)))
    m = draw(st.integers(pp, 10))
    group = draw(st.sampled_from([g for g in range(pp, m + 1) if megatron_accepts(pp, m, g)]))
    return interleaved_1f1b(pp, draw(st.integers(1, 3)), rank, m, microbatch_group_size=group)


@st.composite
def _split_backwards(draw: st.DrawFn, order: list[int]) -> list[float]:
    """``order`` as a zero-bubble order: every backward ``-c`` computes input gradients only,
    and its weight step ``-(c + 0.5)`` runs after it, at once or deferred past later steps
    (at the latest at the end), weight steps of different chunks in any sequence."""
    split: list[float] = []
    waiting: list[int] = []  # chunks of the backwards whose weight step has not run yet
    for entry in order:
        split.append(entry)
        if entry < 0:
            waiting.append(-entry)
        while waiting and draw(st.booleans()):
            split.append(-(waiting.pop(draw(st.integers(0, len(waiting) - 1))) + 0.5))
    return split + [-(chunk + 0.5) for chunk in waiting]


@settings(max_examples=200, deadline=None)
@given(order=_builder_orders(), data=st.data())
def test_max_in_flight_equals_a_brute_force_count(order: list[int], data: st.DataObject) -> None:
    assert max_in_flight(order) == _brute_force_in_flight(order)
    split = data.draw(_split_backwards(order), label="split")
    validate_order(split)
    assert max_in_flight(split) == _brute_force_in_flight(split)


@pytest.mark.parametrize("cls", TORCH_ZERO_BUBBLE_SCHEDULES)
@pytest.mark.parametrize("rank", [0, 1])
def test_max_in_flight_of_torch_zero_bubble_orders_equals_a_brute_force_count(
    cls: type, rank: int
) -> None:
    order = from_pipelining(cls, 2, 6, rank, stages_per_rank=2)
    assert max_in_flight(order) == _brute_force_in_flight(order)


@pytest.mark.parametrize("rank", [0, 1])
def test_max_in_flight_of_explicit_steps_equals_a_brute_force_count(rank: int) -> None:
    # ScheduleLoopedBFS runs backwards newest first: only Step records can say so.
    steps = from_pipelining(pl.ScheduleLoopedBFS, 2, 4, rank, stages_per_rank=2, explicit=True)
    assert max_in_flight(steps) == _brute_force_in_flight(steps) == InFlight((4, 4), 8)
