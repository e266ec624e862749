"""Tests of leangraph.schedules.megatron (CPU only): Megatron-LM interleaved 1F1B, plain 1F1B
and GPipe orders against Megatron-LM's rule and hand-checked schedules."""

from __future__ import annotations

import itertools

import pytest
from reference_orders import megatron_accepts, megatron_reference, parse_one_layer_per_chunk

from leangraph.order import StepKind
from leangraph.schedules import (
    InFlight,
    gpipe,
    interleaved_1f1b,
    max_in_flight,
    one_f_one_b,
    validate_order,
)


def _leading_forwards(order: list[int]) -> int:
    """Forwards before the first backward."""
    for position, entry in enumerate(order):
        if entry < 0:
            return position
    return len(order)


_GRID = [
    (pp, vp, rank, m)
    for pp in (1, 2, 3, 4)
    for vp in (1, 2, 3)
    for rank in range(pp)
    for m in (1, 2, 3, 4, 6, 8, 12, 16)
    if vp == 1 or (m >= pp and m % pp == 0)
]


@pytest.mark.parametrize(("pp", "vp", "rank", "m"), _GRID)
def test_interleaved_is_a_valid_order(pp: int, vp: int, rank: int, m: int) -> None:
    order = interleaved_1f1b(pp, vp, rank, m)
    layout, steps = parse_one_layer_per_chunk(order)
    assert layout.num_chunks == vp
    assert layout.num_microbatches == m
    assert len(steps) == 2 * m * vp
    validate_order(order)


@pytest.mark.parametrize(("pp", "vp", "rank", "m"), _GRID)
def test_interleaved_matches_reference(pp: int, vp: int, rank: int, m: int) -> None:
    assert interleaved_1f1b(pp, vp, rank, m) == megatron_reference(pp, vp, rank, m, pp)


@pytest.mark.parametrize(
    ("pp", "vp", "rank", "m", "group"),
    [
        (2, 2, 0, 5, 3),
        (2, 2, 1, 5, 3),
        (4, 2, 0, 10, 5),
        (4, 3, 1, 14, 5),
        (3, 2, 2, 7, 4),
        (4, 2, 3, 12, 6),
        (2, 3, 0, 8, 3),
    ],
)
def test_interleaved_relaxed_groups_match_reference(
    pp: int, vp: int, rank: int, m: int, group: int
) -> None:
    # Newer Megatron-LM: a last group smaller than the others (but >= pp) is allowed.
    assert megatron_accepts(pp, m, group)
    order = interleaved_1f1b(pp, vp, rank, m, microbatch_group_size=group)
    assert order == megatron_reference(pp, vp, rank, m, group)
    parse_one_layer_per_chunk(order)


def test_megatron_documented_schedule_table() -> None:
    # Megatron's comment: PP2 N3M5 VP2 -> model_chunk_id 0 0 0 1 1 1 0 0 1 1,
    # microbatch_id 0 1 2 0 1 2 3 4 3 4.
    order = interleaved_1f1b(2, 2, 1, 5, microbatch_group_size=3)
    _, steps = parse_one_layer_per_chunk(order)
    forwards = [s for s in steps if s.kind is StepKind.FORWARD]
    assert [s.chunk - 1 for s in forwards] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert [s.microbatch for s in forwards] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]


@pytest.mark.parametrize(
    ("pp", "vp", "rank", "m", "group", "warmup"),
    [
        (4, 1, 0, 8, None, 3),
        (4, 1, 1, 8, None, 2),
        (4, 1, 3, 8, None, 0),
        (4, 1, 0, 2, None, 2),  # capped at num_microbatches
        (1, 1, 0, 3, None, 0),
        (2, 2, 0, 4, None, 4),
        (2, 2, 1, 4, None, 2),
        (4, 2, 0, 16, None, 10),
        (4, 2, 1, 16, None, 8),
        (4, 2, 3, 16, None, 4),
        (4, 2, 0, 4, None, 8),  # 10 capped at 4 * 2
        (4, 3, 1, 8, None, 12),
        (2, 4, 1, 4, None, 6),
        (2, 4, 0, 8, 4, 14),
        (2, 4, 1, 4, 4, 12),
        (3, 2, 0, 6, 6, 10),
    ],
)
def test_warmup_forwards(
    pp: int, vp: int, rank: int, m: int, group: int | None, warmup: int
) -> None:
    order = interleaved_1f1b(pp, vp, rank, m, group)
    total = m * vp
    # The steady state starts with a forward, so one more forward precedes the first backward.
    assert _leading_forwards(order) == min(warmup + 1, total)
    assert max_in_flight(order).total == min(warmup + 1, total)


def test_hand_checked_interleaved_pp2_vp2_rank0_m4() -> None:
    # group 2: forward chunks 1 1 2 2 1 1 2 2, backward chunks 2 2 1 1 2 2 1 1, warm-up 4.
    assert interleaved_1f1b(2, 2, 0, 4) == [
        1, 1, 2, 2,  # warm-up
        1, -2, 1, -2, 2, -1, 2, -1,  # steady 1F1B
        -2, -2, -1, -1,  # cool-down
    ]  # fmt: skip


def test_hand_checked_interleaved_pp2_vp2_rank1_m4() -> None:
    assert interleaved_1f1b(2, 2, 1, 4) == [
        1, 1,
        2, -2, 2, -2, 1, -1, 1, -1, 2, -2, 2, -2,
        -1, -1,
    ]  # fmt: skip


def test_hand_checked_one_f_one_b() -> None:
    assert one_f_one_b(4, 0, 8) == [1, 1, 1] + [1, -1] * 5 + [-1, -1, -1]
    assert one_f_one_b(4, 3, 8) == [1, -1] * 8
    assert one_f_one_b(4, 0, 2) == [1, 1, -1, -1]
    assert one_f_one_b(1, 0, 3) == [1, -1, 1, -1, 1, -1]
    assert one_f_one_b(4, 1, 6) == interleaved_1f1b(4, 1, 1, 6)


def test_interleaved_vp1_ignores_group() -> None:
    assert interleaved_1f1b(4, 1, 0, 6, microbatch_group_size=1) == one_f_one_b(4, 0, 6)


def test_gpipe() -> None:
    assert gpipe(3) == [1, 1, 1, -1, -1, -1]
    assert gpipe(2, vp_size=2) == [1, 2, 1, 2, -2, -1, -2, -1]
    assert gpipe(1, vp_size=3) == [1, 2, 3, -3, -2, -1]
    for m, vp in itertools.product((1, 2, 5), (1, 2, 3)):
        layout, _ = parse_one_layer_per_chunk(gpipe(m, vp))
        assert (layout.num_chunks, layout.num_microbatches) == (vp, m)
        assert max_in_flight(gpipe(m, vp)) == InFlight(per_chunk=(m,) * vp, total=m * vp)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: interleaved_1f1b(0, 1, 0, 4), "pp_size must be >= 1"),
        (lambda: interleaved_1f1b(2, 0, 0, 4), "vp_size must be >= 1"),
        (lambda: interleaved_1f1b(2, 2, 2, 4), "rank 2 out of range"),
        (lambda: interleaved_1f1b(2, 2, -1, 4), "rank must be >= 0"),
        (lambda: interleaved_1f1b(2, 2, 0, 0), "num_microbatches must be >= 1"),
        (lambda: interleaved_1f1b(2, 2, 0, 4, 0), "microbatch_group_size must be >= 1"),
        (lambda: interleaved_1f1b(4, 2, 0, 2), r"\[pp_size, num_microbatches\]"),
        (lambda: interleaved_1f1b(4, 2, 0, 8, 2), r"\[pp_size, num_microbatches\]"),
        (lambda: interleaved_1f1b(4, 2, 0, 6), "last microbatch group of 2"),
        (lambda: interleaved_1f1b(4, 2, 2, 10, 4), "last microbatch group of 2"),
        (lambda: interleaved_1f1b(2, 3, 0, 7, 2), "last microbatch group of 1"),
        (lambda: interleaved_1f1b(2.0, 1, 0, 4), "pp_size must be an integer"),  # type: ignore
        (lambda: interleaved_1f1b(2, True, 0, 4), "vp_size must be an integer"),
        (lambda: one_f_one_b(2, 5, 4), "rank 5 out of range"),
        (lambda: gpipe(0), "num_microbatches must be >= 1"),
        (lambda: gpipe(2, 0), "vp_size must be >= 1"),
    ],
)
def test_argument_errors(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()



def _megatron_core_order(pp: int, vp: int, rank: int, m: int, group: int) -> list[int]:
    """The interleaved order from megatron-core's own table and warm-up count
    (``get_schedule_table``, ``get_pp_rank_microbatches``) and its 1F1B loops: forward
    ``k + warmup`` then backward ``k``, a backward's chunk mirrored (``vp - 1 - chunk``)."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel import schedules

    group_of = SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    comm = SimpleNamespace(pp_group=group_of, virtual_pipeline_model_parallel_size=vp)
    total, _, warmup, remaining = schedules.get_pp_rank_microbatches(
        m, vp, group, p2p_communicator=comm
    )
    table = [chunk for _, chunk in schedules.get_schedule_table(m, vp, group)]
    order = [table[k] + 1 for k in range(warmup)]
    for k in range(remaining):
        order += [table[k + warmup] + 1, -(vp - table[k])]
    return order + [-(vp - table[k]) for k in range(remaining, total)]


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_interleaved_matches_megatron_core_and_refuses_what_it_refuses(pp: int) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    for vp, m in itertools.product((2, 3), range(1, 13)):
        for group, rank in itertools.product(range(1, m + 1), range(pp)):
            # forward_backward_pipelining_with_interleaving's two checks, as it states them.
            refused = not pp <= group <= m or 0 < m % group < pp
            if refused:
                with pytest.raises(ValueError, match=r"microbatch.group"):
                    interleaved_1f1b(pp, vp, rank, m, microbatch_group_size=group)
            else:
                assert interleaved_1f1b(pp, vp, rank, m, microbatch_group_size=group) == (
                    _megatron_core_order(pp, vp, rank, m, group)
                ), (vp, rank, m, group)
