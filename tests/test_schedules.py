"""Tests of leangraph.schedules (CPU only).

Megatron-LM orders, torch.distributed.pipelining orders, in-flight counts and validation.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import re
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed import pipelining as pl

from leangraph.order import StepKind, parse_order
from leangraph.schedules import (
    InFlight,
    from_pipelining,
    gpipe,
    interleaved_1f1b,
    max_in_flight,
    one_f_one_b,
    validate_order,
)
from models import TORCH_ZERO_BUBBLE_SCHEDULES

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _parse(order: list[int]):
    """Run the order through leangraph.order.parse_order (one layer per chunk)."""
    chunks = max(abs(e) for e in order)
    microbatches = order.count(1)
    return parse_order(
        order, num_callables=chunks, num_samples=chunks * microbatches, num_layers_per_chunk=1
    )


def _leading_forwards(order: list[int]) -> int:
    """Forwards before the first backward."""
    for position, entry in enumerate(order):
        if entry < 0:
            return position
    return len(order)


def _megatron_reference(pp: int, vp: int, rank: int, m: int, group: int) -> list[int]:
    """Megatron-LM's interleaved rule, formulated independently of leangraph.schedules.

    Chunk of virtual microbatch k computed arithmetically from Megatron's table layout (full
    groups of ``group`` microbatches, each run by chunk 0, 1, ..., then a last block of the
    ``m % group`` left over). The 1F1B merge: backward ``j`` directly follows forward
    ``j + warmup``; the backwards that never get a forward partner come last.
    """
    full_groups, rest = divmod(m, group)

    def chunk_of(k: int) -> int:
        if k < full_groups * group * vp:
            return (k % (group * vp)) // group
        return (k - full_groups * group * vp) // rest

    total = m * vp
    warmup = pp - rank - 1 if vp == 1 else 2 * (pp - rank - 1) + (vp - 1) * group
    warmup = min(warmup, total)
    order: list[int] = []
    backward = 0
    for k in range(total):
        order.append(chunk_of(k) + 1)
        if k >= warmup:
            order.append(-(vp - chunk_of(backward)))
            backward += 1
    order.extend(-(vp - chunk_of(j)) for j in range(backward, total))
    return order


_ACTION_RE = re.compile(r"^(\d+)([A-Z_]+?)(\d*)$")


@contextlib.contextmanager
def _fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """A 'fake' process group, so that real PipelineStage objects can be built on CPU."""
    # torch's fake process group has no public home: torch.testing._internal it is.
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=fake_pg.FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _real_stage(stage_index: int, num_stages: int) -> pl.PipelineStage:
    """A real PipelineStage of a Linear(2, 2) on CPU (inside a fake process group)."""
    module, device = torch.nn.Linear(2, 2), torch.device("cpu")
    input_args = inspect.signature(pl.PipelineStage).parameters["input_args"]
    if input_args.default is inspect.Parameter.empty:  # torch 2.4 / 2.5: example inputs required
        return pl.PipelineStage(module, stage_index, num_stages, device, torch.zeros(1, 2))
    return pl.PipelineStage(module, stage_index, num_stages, device)


# Letters of the compute kinds (_ComputationType member names, torch 2.4 .. 2.13).
_KIND_LETTERS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD": "B", "BACKWARD_INPUT": "I",
                 "BACKWARD_WEIGHT": "W", "WEIGHT": "W"}


def _action_str(action, full_backward: bool) -> str:
    """``5F3`` style, from the fields (torch 2.4 prints ``F3_s5``); a composite action as
    torch prints it. A ``BACKWARD`` that torch 2.5's runtime runs without weight gradients
    (``use_full_backward`` False) is an ``I``, as torch 2.6 names it."""
    if getattr(action, "sub_actions", None) is not None:
        return str(action)
    name = action.computation_type.name
    kind = "I" if name == "BACKWARD" and not full_backward else _KIND_LETTERS.get(name, name)
    microbatch = "" if action.microbatch_index is None else action.microbatch_index
    return f"{action.stage_index}{kind}{microbatch}"


def _recorded_step(schedule, stage, m: int) -> list[str]:
    """The compute actions torch's own ``_step_microbatches`` runs, in order, on ``stage``.

    For single-stage schedules of a torch that keeps no ``pipeline_order`` for them: the
    stage's compute records its call instead of computing, and its communication is empty.
    """
    ran: list[str] = []

    def forward(mb: int, *args, **kwargs) -> torch.Tensor:
        ran.append(f"{stage.stage_index}F{mb}")
        return torch.zeros(())

    def backward(mb: int, *args, **kwargs) -> None:
        ran.append(f"{stage.stage_index}B{mb}")

    stage.forward_one_chunk, stage.backward_one_chunk = forward, backward
    for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
        setattr(stage, name, lambda *args, **kwargs: [])
    # torch's private step function is what is compared against (there is no public route to
    # run it without real communication).
    stage._prepare_forward_infra = stage._prepare_backward_infra = lambda *a, **k: None
    schedule._step_microbatches([()] * m, [{}] * m, [torch.zeros(())] * m, None)
    return ran


def _torch_actions(schedule_class: type, pp: int, m: int, rank: int, spr: int = 1) -> list[str]:
    """Return torch's own compute actions of ``rank`` as strings such as ``5F3``.

    Built with real PipelineStage objects on a fake process group; idle steps and
    REDUCE_GRAD dropped. Where torch keeps no ``pipeline_order`` (single-stage schedules
    before ``_get_pipeline_order``), what its ``_step_microbatches`` runs.
    """
    with _fake_process_group(rank, pp):
        stages = [_real_stage(rank + k * pp, pp * spr) for k in range(spr)]
        multi = issubclass(schedule_class, pl.schedules.PipelineScheduleMulti)
        stage = stages if multi else stages[0]
        schedule = schedule_class(stage, m, loss_fn=lambda out, target: out.sum())
        if getattr(schedule, "pipeline_order", None) is None:
            return _recorded_step(schedule, stage, m)
        full_backward = getattr(schedule, "use_full_backward", True) is not False
        actions = [_action_str(a, full_backward) for a in schedule.pipeline_order[rank] if a]
    return [a for a in actions if "REDUCE_GRAD" not in a]


def _actions_as_order(actions: list[str]) -> list[int]:
    """Map torch action strings to an order: chunk = rank of the stage among the rank's stages."""
    parsed = [_ACTION_RE.match(a).groups() for a in actions]  # type: ignore[union-attr]
    stages = sorted({int(stage) for stage, _, _ in parsed})
    chunk = {stage: c for c, stage in enumerate(stages, start=1)}
    sign = {"F": 1, "B": -1}
    return [sign[kind] * chunk[int(stage)] for stage, kind, _ in parsed]


def _torch_microbatches(actions: list[str]) -> list[tuple[str, int, int]]:
    """(kind, chunk, microbatch) of each torch action."""
    parsed = [_ACTION_RE.match(a).groups() for a in actions]  # type: ignore[union-attr]
    stages = sorted({int(stage) for stage, _, _ in parsed})
    chunk = {stage: c for c, stage in enumerate(stages, start=1)}
    return [(kind, chunk[int(stage)], int(mb)) for stage, kind, mb in parsed]


@functools.cache
def _torch_interleaved_has_rounds() -> bool:
    """Whether torch's ScheduleInterleaved1F1B groups microbatches in rounds
    (``microbatches_per_round``); torch 2.4 / 2.5 group them by pp_size instead."""
    with _fake_process_group(0, 2):
        stages = [_real_stage(0, 4), _real_stage(2, 4)]
        schedule = pl.ScheduleInterleaved1F1B(stages, 2, loss_fn=lambda out, target: out.sum())
    return hasattr(schedule, "microbatches_per_round")


def _torch_group(pp: int, m: int) -> int | None:
    """The microbatch group torch's ScheduleInterleaved1F1B uses; None where it refuses M.

    With rounds: ``max(1, M // pp)`` rounds of ``M // rounds`` (microbatches_per_round), M a
    multiple of the rounds. Without (torch 2.4 / 2.5): groups of pp, M a multiple of pp.
    """
    if _torch_interleaved_has_rounds():
        rounds = max(1, m // pp)
        return None if m % rounds else m // rounds
    return None if m % pp else pp


def _megatron_accepts(pp: int, m: int, group: int) -> bool:
    return pp <= group <= m and (m % group == 0 or m % group >= pp)


# --------------------------------------------------------------------------------------------
# Megatron-LM interleaved 1F1B / plain 1F1B / GPipe
# --------------------------------------------------------------------------------------------

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
    layout, steps = _parse(order)
    assert layout.num_chunks == vp
    assert layout.num_microbatches == m
    assert len(steps) == 2 * m * vp
    validate_order(order)


@pytest.mark.parametrize(("pp", "vp", "rank", "m"), _GRID)
def test_interleaved_matches_reference(pp: int, vp: int, rank: int, m: int) -> None:
    assert interleaved_1f1b(pp, vp, rank, m) == _megatron_reference(pp, vp, rank, m, pp)


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
    assert _megatron_accepts(pp, m, group)
    order = interleaved_1f1b(pp, vp, rank, m, microbatch_group_size=group)
    assert order == _megatron_reference(pp, vp, rank, m, group)
    _parse(order)


def test_megatron_documented_schedule_table() -> None:
    # Megatron's comment: PP2 N3M5 VP2 -> model_chunk_id 0 0 0 1 1 1 0 0 1 1,
    # microbatch_id 0 1 2 0 1 2 3 4 3 4.
    order = interleaved_1f1b(2, 2, 1, 5, microbatch_group_size=3)
    _, steps = _parse(order)
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
        layout, _ = _parse(gpipe(m, vp))
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


# --------------------------------------------------------------------------------------------
# torch.distributed.pipelining
# --------------------------------------------------------------------------------------------

_SINGLE = [
    (cls, pp, m, rank)
    for cls in (pl.Schedule1F1B, pl.ScheduleGPipe)
    for pp in (2, 3, 4)
    for m in (4, 5, 8)
    for rank in range(pp)
]


@pytest.mark.parametrize(("cls", "pp", "m", "rank"), _SINGLE)
def test_from_pipelining_single_stage_matches_torch(cls: type, pp: int, m: int, rank: int) -> None:
    order = from_pipelining(cls, pp, m, rank)
    assert order == _actions_as_order(_torch_actions(cls, pp, m, rank))
    assert all(abs(e) == 1 for e in order)
    _parse(order)


@pytest.mark.parametrize(
    ("pp", "m", "rank"), [(pp, m, r) for pp in (2, 4) for m in (4, 8) for r in range(pp)]
)
def test_from_pipelining_named_orders(pp: int, m: int, rank: int) -> None:
    assert from_pipelining(pl.Schedule1F1B, pp, m, rank) == one_f_one_b(pp, rank, m)
    assert from_pipelining(pl.ScheduleGPipe, pp, m, rank) == gpipe(m)


_MULTI = [
    (cls, pp, m, rank, spr)
    for cls in (pl.ScheduleInterleaved1F1B,)
    for pp in (2, 3, 4)
    for m in (4, 6, 8)
    for rank in range(pp)
    for spr in (2, 3)
    if m % max(1, m // pp) == 0
]


@pytest.mark.parametrize(("cls", "pp", "m", "rank", "spr"), _MULTI)
def test_from_pipelining_multi_stage_matches_torch(
    cls: type, pp: int, m: int, rank: int, spr: int
) -> None:
    if _torch_group(pp, m) is None:
        pytest.skip(f"this torch's {cls.__name__} groups microbatches by pp_size and refuses "
                    f"num_microbatches={m} for pp_size={pp} (no microbatches_per_round)")
    order = from_pipelining(cls, pp, m, rank, stages_per_rank=spr)
    assert order == _actions_as_order(_torch_actions(cls, pp, m, rank, spr))
    layout, _ = _parse(order)
    assert (layout.num_chunks, layout.num_microbatches) == (spr, m)


@pytest.mark.parametrize(
    ("cls", "pp", "m", "spr"),
    [
        (pl.Schedule1F1B, 4, 8, 1),
        (pl.ScheduleGPipe, 3, 5, 1),
        (pl.ScheduleInterleaved1F1B, 4, 8, 2),
        (pl.ScheduleInterleaved1F1B, 2, 6, 3),
    ],
)
def test_from_pipelining_backwards_are_fifo(cls: type, pp: int, m: int, spr: int) -> None:
    # The order convention's microbatch numbering (FIFO per chunk) is torch's numbering.
    for rank in range(pp):
        order = from_pipelining(cls, pp, m, rank, stages_per_rank=spr)
        _, steps = _parse(order)
        torch_steps = _torch_microbatches(_torch_actions(cls, pp, m, rank, spr))
        ours = [(s.kind.value, s.chunk, s.microbatch) for s in steps]
        if cls is pl.Schedule1F1B and rank == pp - 1:
            # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last rank's forwards
            # 1..M instead of 0..M-1 (its step() runs 0..M-1); kinds and chunks still agree.
            ours = [(kind, chunk) for kind, chunk, _ in ours]  # type: ignore[misc]
            torch_steps = [(kind, chunk) for kind, chunk, _ in torch_steps]  # type: ignore[misc]
        assert ours == torch_steps


def test_looped_bfs_is_refused_because_its_backwards_are_newest_first() -> None:
    # torch runs each stage's backwards last microbatch first; -c is always the oldest.
    torch_steps = _torch_microbatches(_torch_actions(pl.ScheduleLoopedBFS, 2, 4, 0, 2))
    backwards = [(c, mb) for kind, c, mb in torch_steps if kind == "B"]
    assert backwards == [(2, 3), (2, 2), (2, 1), (2, 0), (1, 3), (1, 2), (1, 1), (1, 0)]
    # torch 2.4 prints the action as B3_s0, later versions as 0B3.
    with pytest.raises(ValueError, match=r"ScheduleLoopedBFS, rank 0: action (\d+B3|B3_s\d+) "
                                         r"runs a backward out of forward order"):
        from_pipelining(pl.ScheduleLoopedBFS, 2, 4, 0, 2)


@pytest.mark.parametrize("cls", [pl.ScheduleLoopedBFS, pl.ScheduleInterleaved1F1B, pl.Schedule1F1B])
@pytest.mark.parametrize("rank", [0, 1])
def test_explicit_orders_name_torchs_own_microbatches(cls: type, rank: int) -> None:
    spr = 1 if cls is pl.Schedule1F1B else 2
    steps = from_pipelining(cls, 2, 4, rank, stages_per_rank=spr, explicit=True)
    torch_steps = _torch_microbatches(_torch_actions(cls, 2, 4, rank, spr))
    ours = [(s.kind.value, s.chunk, s.microbatch) for s in steps]
    if cls is pl.Schedule1F1B:  # torch 2.13 numbers the last rank's forwards from 1 (see above)
        first = min(m for k, _, m in torch_steps if k == "F")
        torch_steps = [(k, c, m - first if k == "F" else m) for k, c, m in torch_steps]
    assert ours == torch_steps
    validate_order(steps)
    if cls is not pl.ScheduleLoopedBFS:  # FIFO schedules: the same as the chunk-id order
        assert [s.chunk if s.kind.value == "F" else -s.chunk for s in steps] == from_pipelining(
            cls, 2, 4, rank, stages_per_rank=spr)


# Torch's interleaved schedule against Megatron-LM's:
# torch's ScheduleInterleaved1F1B groups microbatches in rounds of
# microbatches_per_round = M // max(1, M // pp) (Megatron's microbatch_group_size), uses the same
# warm-up count (n_local - 1) * group + 2 * (pp - 1 - rank) capped at M * n_local, the same
# forward chunk (k // group) % n_local, the same mirrored backward chunk and the same F-then-B
# steady state. So the two agree whenever they use the same group: always when M % pp == 0
# (group pp, Megatron's default). They differ in which sizes they accept: for M % pp != 0
# torch silently picks a larger group (pp=4, M=10 -> 5) where Megatron's default group pp
# raises, and for M < pp torch runs with group M < pp, which Megatron rejects. Each is tested
# against the rule with its own group below. torch 2.4 / 2.5 have no rounds: their group is
# always pp, and they refuse M % pp != 0 (see _torch_group).


@pytest.mark.parametrize("rank", range(4))
def test_torch_interleaved_equals_megatron_pp4_vp2_m16(rank: int) -> None:
    torch_order = from_pipelining(pl.ScheduleInterleaved1F1B, 4, 16, rank, stages_per_rank=2)
    assert torch_order == interleaved_1f1b(4, 2, rank, 16)
    assert torch_order == _actions_as_order(
        _torch_actions(pl.ScheduleInterleaved1F1B, 4, 16, rank, 2)
    )


@pytest.mark.parametrize(
    ("pp", "m", "spr"),
    [(pp, m, spr) for pp in (2, 3, 4) for m in range(1, 13) for spr in (2, 3)],
)
def test_torch_interleaved_against_megatron_rule(pp: int, m: int, spr: int) -> None:
    group = _torch_group(pp, m)
    if group is None:
        with pytest.raises(ValueError, match="rejects"):
            from_pipelining(pl.ScheduleInterleaved1F1B, pp, m, 0, stages_per_rank=spr)
        return
    for rank in range(pp):
        torch_order = from_pipelining(pl.ScheduleInterleaved1F1B, pp, m, rank, stages_per_rank=spr)
        assert torch_order == _megatron_reference(pp, spr, rank, m, group)
        if _megatron_accepts(pp, m, group):
            assert torch_order == interleaved_1f1b(pp, spr, rank, m, microbatch_group_size=group)
        else:  # M < pp: torch's group is smaller than Megatron allows
            assert m < pp
            with pytest.raises(ValueError):
                interleaved_1f1b(pp, spr, rank, m, microbatch_group_size=group)
        if m % pp == 0:
            assert torch_order == interleaved_1f1b(pp, spr, rank, m)


def _split_actions_as_order(actions: list[str]) -> list[float]:
    """Torch's actions of a zero-bubble schedule as an order: F +c, I -c, W -(c + 0.5), and a
    full B as -c then -(c + 0.5) (an order with weight steps splits every backward)."""
    leaves = [leaf for a in actions
              for leaf in (a[1:a.index(")")].split(";") if a.startswith("(") else [a])]
    parsed = [re.match(r"^(\d+)(F|I|W|B)(\d+)$", a).groups() for a in leaves]  # type: ignore[union-attr]
    stages = sorted({int(stage) for stage, _, _ in parsed})
    chunk = {stage: c for c, stage in enumerate(stages, start=1)}
    order: list[float] = []
    for stage, kind, _ in parsed:
        c = chunk[int(stage)]
        order += {"F": [c], "I": [-c], "W": [-(c + 0.5)], "B": [-c, -(c + 0.5)]}[kind]
    return order


@pytest.mark.parametrize("cls", TORCH_ZERO_BUBBLE_SCHEDULES)
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("m", [4, 6])
def test_from_pipelining_zero_bubble_maps_i_and_w(cls: type, rank: int, m: int) -> None:
    actions = [a for a in _torch_actions(cls, 2, m, rank, 2)
               if re.match(r"^(\d+[FIWB]\d+|\(.*\)OVERLAP_F_B)$", a)]
    order = from_pipelining(cls, 2, m, rank, stages_per_rank=2)
    assert order == _split_actions_as_order(actions)
    assert any(not float(e).is_integer() for e in order)
    layout, steps = parse_order(order, num_callables=2, num_samples=2 * m,
                                num_layers_per_chunk=1)
    assert layout.num_microbatches == m and any(s.kind.value == "W" for s in steps)


@pytest.mark.skipif(
    not hasattr(pl.Schedule1F1B, "_get_pipeline_order"),
    reason="this torch's single-stage schedules keep no pipeline_order (no _get_pipeline_order): "
    "from_pipelining always takes the fallback, which test_from_pipelining_single_stage_matches_"
    "torch checks against what torch's _step_microbatches runs",
)
def test_from_pipelining_fallback_for_torch_without_single_stage_pipeline_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Older torch builds no pipeline_order for single-stage schedules; the step-logic fallback
    # must give what torch 2.13 computes.
    expected = {
        (cls, pp, m, rank): from_pipelining(cls, pp, m, rank)
        for cls in (pl.Schedule1F1B, pl.ScheduleGPipe)
        for pp, m in ((2, 4), (4, 4), (4, 7))
        for rank in range(pp)
    }
    for cls in (pl.Schedule1F1B, pl.ScheduleGPipe):  # an older torch: only privately
        monkeypatch.setattr(cls, "_get_pipeline_order", lambda self: None)
    for (cls, pp, m, rank), order in expected.items():
        assert from_pipelining(cls, pp, m, rank) == order


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: from_pipelining(pl.Schedule1F1B, 4, 8, 4), "rank 4 out of range"),
        (lambda: from_pipelining(pl.Schedule1F1B, 0, 8, 0), "pp_size must be >= 1"),
        (lambda: from_pipelining(pl.Schedule1F1B, 2, 0, 0), "num_microbatches must be >= 1"),
        (lambda: from_pipelining(pl.Schedule1F1B, 2, 4, 0, 0), "stages_per_rank must be >= 1"),
        (lambda: from_pipelining(pl.Schedule1F1B, 2, 4, 0, 2), "one stage per rank"),
        (lambda: from_pipelining(int, 2, 4, 0), "not a torch.distributed.pipelining schedule"),
        (lambda: from_pipelining("Schedule1F1B", 2, 4, 0), "must be a class"),  # type: ignore
    ],
)
def test_from_pipelining_argument_errors(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


class _CustomSingleStage(pl.schedules.PipelineScheduleSingle):
    """A single-stage schedule with a step function of its own and no pipeline_order."""

    def _step_microbatches(self, *args, **kwargs) -> None:
        raise AssertionError("never run")


def test_from_pipelining_refuses_a_single_stage_schedule_without_pipeline_order() -> None:
    # Its order is neither torch's pipeline_order nor a step function leangraph knows.
    with pytest.raises(ValueError, match=r"_CustomSingleStage keeps no pipeline_order on this "
                                         r"torch.*ScheduleGPipe and Schedule1F1B only"):
        from_pipelining(_CustomSingleStage, 2, 4, 0)


@pytest.mark.parametrize("rank", range(4))
def test_from_pipelining_fewer_microbatches_than_stages_follows_torch(rank: int) -> None:
    # torch 2.13's Schedule1F1B refuses M < num_stages in its constructor (from_pipelining
    # passes the refusal on); torch 2.4 .. 2.6 have no such check and run M warm-up forwards.
    try:
        torch_order = _actions_as_order(_torch_actions(pl.Schedule1F1B, 4, 2, rank))
    except ValueError as exc:
        assert "microbatches" in str(exc)
        with pytest.raises(ValueError, match=r"Schedule1F1B rejects .*microbatches"):
            from_pipelining(pl.Schedule1F1B, 4, 2, rank)
        return
    assert from_pipelining(pl.Schedule1F1B, 4, 2, rank) == torch_order == one_f_one_b(4, rank, 2)


# --------------------------------------------------------------------------------------------
# max_in_flight / validate_order
# --------------------------------------------------------------------------------------------


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


def _scripted(actions_of_rank: dict[int, list]) -> type:
    """A torch schedule class whose ``pipeline_order`` (what ``from_pipelining`` reads) is
    ``actions_of_rank``, whatever stages it is given."""

    class Scripted(pl.schedules.PipelineScheduleMulti):
        def __init__(self, stages, n_microbatches, loss_fn=None, **kwargs) -> None:
            # No super().__init__(): only the order is read, and the stages are stand-ins.
            self.pipeline_order = actions_of_rank

    return Scripted


def test_actions_with_comms_are_mapped() -> None:
    # torch's comm-lowered list (SEND/RECV, REDUCE_GRAD, ...) maps to the same order.
    pp, m, rank = 4, 8, 1
    with _fake_process_group(rank, pp):
        stages = [_real_stage(rank + k * pp, 2 * pp) for k in range(2)]
        schedule = pl.ScheduleInterleaved1F1B(stages, m, loss_fn=lambda out, target: out.sum())
        with_comms = getattr(schedule, "pipeline_order_with_comms", None)
    if with_comms is None:
        pytest.skip("this torch's ScheduleInterleaved1F1B keeps no pipeline_order_with_comms "
                    "(it is no _PipelineScheduleRuntime)")
    with_comms = with_comms[rank]
    kinds = {a.computation_type.name for a in with_comms}
    assert {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE_GRAD"} <= kinds
    expected = from_pipelining(pl.ScheduleInterleaved1F1B, pp, m, rank, stages_per_rank=2)
    scripted = _scripted({rank: with_comms})
    assert from_pipelining(scripted, pp, m, rank, stages_per_rank=2) == expected


@pytest.mark.skipif(not hasattr(pl.schedules, "OVERLAP_F_B"),
                    reason="this torch has no composite OVERLAP_F_B action")
def test_overlap_actions_run_their_sub_actions_in_order() -> None:
    # torch has no public way to build schedule actions: its private _Action it is.
    ts = pl.schedules
    overlap = ts._Action(-1, ts.OVERLAP_F_B, None, (ts._Action(5, ts.F, 0), ts._Action(1, ts.B, 0)))
    actions = [ts._Action(1, ts.F, 0), None, overlap, ts._Action(5, ts.B, 0)]
    assert from_pipelining(_scripted({1: actions}), 4, 1, 1, stages_per_rank=2) == [1, 2, -1, -2]
    split = [ts._Action(1, ts.F, 0), ts._Action(1, ts.I, 0), ts._Action(1, ts.W, 0)]
    assert from_pipelining(_scripted({1: split}), 4, 1, 1) == [1, -1, -1.5]


def test_actions_without_an_order_entry_are_refused_naming_them() -> None:
    # torch has no public way to build schedule actions: its private _Action it is.
    ts = pl.schedules
    forward = ts._Action(stage_index=1, computation_type=ts._ComputationType.FORWARD,
                         microbatch_index=0)  # by name: torch 2.4 orders the fields otherwise

    class Mystery:
        computation_type = "MYSTERY"
        stage_index = 1

        def __str__(self) -> str:
            return "1?0"

    with pytest.raises(ValueError, match=r"Scripted, rank 1, step 1: action 1\?0 \(MYSTERY\) "
                                         r"has no leangraph order entry"):
        from_pipelining(_scripted({1: [forward, Mystery()]}), 4, 1, 1)


def test_max_in_flight_counts_a_split_backward_until_its_weight_step() -> None:
    # The weight steps come last: every forward stays in flight until then.
    order = [1, 1, -1, -1, -1.5, -1.5]
    assert max_in_flight(order) == InFlight(per_chunk=(2,), total=2)
    assert max_in_flight([1, -1, -1.5, 1, -1, -1.5]) == InFlight(per_chunk=(1,), total=1)
    assert max_in_flight([1, -1, 1, -1, -1.5, -1.5]) == InFlight(per_chunk=(2,), total=2)
