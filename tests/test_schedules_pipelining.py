"""Tests of leangraph.schedules.pipelining (CPU only): orders of torch.distributed.pipelining
schedules against what torch's own schedules run, and order_from_actions.

torch's pipelining API is public for stages and schedule classes, private for actions: the
tests build ``_Action`` records and read ``_ComputationType`` names because torch offers no
public way to make or name them, and they run real stages on torch's private "fake" process
group (``torch.testing._internal.distributed.fake_pg``), the only process group that needs
neither other processes nor a network.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import inspect
import re
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from models import TORCH_ZERO_BUBBLE_SCHEDULES
from reference_orders import megatron_accepts, megatron_reference, parse_one_layer_per_chunk
from torch.distributed import pipelining as pl

from leangraph.order import parse_order
from leangraph.schedules import (
    from_pipelining,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    validate_order,
)
from leangraph.schedules.pipelining import order_from_actions

# --------------------------------------------------------------------------------------------
# Helpers: torch's own actions
# --------------------------------------------------------------------------------------------

_ACTION_RE = re.compile(r"^(\d+)([A-Z_]+?)(\d*)$")


@contextlib.contextmanager
def _fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """A 'fake' process group, so that real PipelineStage objects can be built on CPU."""
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
    # torch's private API, on purpose: this runs only on torch 2.4 .. 2.6, where a single-stage
    # schedule's order exists nowhere but in its _step_microbatches. The public step() wraps it
    # but also splits real inputs and merges real outputs, which the recording stage above does
    # not make; and _prepare_*_infra (receive buffers, shape inference over the process group)
    # have no public switch, so they are stubbed here as leangraph's own stub stages do.
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


# --------------------------------------------------------------------------------------------
# from_pipelining
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
    parse_one_layer_per_chunk(order)


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
    layout, _ = parse_one_layer_per_chunk(order)
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
        _, steps = parse_one_layer_per_chunk(order)
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
        assert torch_order == megatron_reference(pp, spr, rank, m, group)
        if megatron_accepts(pp, m, group):
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
    for cls in (pl.Schedule1F1B, pl.ScheduleGPipe):
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
# order_from_actions
# --------------------------------------------------------------------------------------------


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
    name = "ScheduleInterleaved1F1B"
    assert order_from_actions(with_comms, schedule_name=name, rank=rank) == expected


@pytest.mark.skipif(not hasattr(pl.schedules, "OVERLAP_F_B"),
                    reason="this torch has no composite OVERLAP_F_B action")
def test_overlap_actions_run_their_sub_actions_in_order() -> None:
    ts = pl.schedules
    overlap = ts._Action(-1, ts.OVERLAP_F_B, None, (ts._Action(5, ts.F, 0), ts._Action(1, ts.B, 0)))
    actions = [ts._Action(1, ts.F, 0), None, overlap, ts._Action(5, ts.B, 0)]
    assert order_from_actions(actions, schedule_name="custom", rank=1) == [1, 2, -1, -2]
    split = [ts._Action(1, ts.F, 0), ts._Action(1, ts.I, 0), ts._Action(1, ts.W, 0)]
    assert order_from_actions(split, schedule_name="custom", rank=1) == [1, -1, -1.5]


def test_actions_without_an_order_entry_are_refused_naming_them() -> None:
    ts = pl.schedules
    forward = ts._Action(stage_index=1, computation_type=ts._ComputationType.FORWARD,
                         microbatch_index=0)  # by name: torch 2.4 orders the fields otherwise

    class Mystery:
        computation_type = "MYSTERY"
        stage_index = 1

        def __str__(self) -> str:
            return "1?0"

    with pytest.raises(ValueError, match=r"custom, rank 1, step 1: action 1\?0 \(MYSTERY\) has "
                                         r"no leangraph order entry"):
        order_from_actions([forward, Mystery()], schedule_name="custom", rank=1)


@pytest.mark.parametrize(("actions", "message"), [
    (5, "order_from_actions: actions must be a sequence of torch.distributed.pipelining _Action "
        r"records \(one rank's pipeline_order\), got int"),
    ("0F0", "actions must be a sequence of .*, got str"),
    ([None, "0F0"], r"order_from_actions: actions\[1\] must be a torch.distributed.pipelining "
                    r"_Action \(with stage_index, computation_type and microbatch_index\) or None "
                    r"for an idle step, got str '0F0'; parse action text with torch's "
                    r"_Action.from_str"),
])
def test_v35_order_from_actions_refuses_what_is_not_an_action_list(actions, message) -> None:
    with pytest.raises(TypeError, match=message):
        order_from_actions(actions, schedule_name="custom", rank=0)


# --------------------------------------------------------------------------------------------
# torch 2.4 / 2.5 action lists (those torches are not installed here: their actions are
# restated with torch 2.4's field order and the kind names of torch 2.4 / 2.5)
# --------------------------------------------------------------------------------------------

_OldKind = enum.Enum("_OldKind", "FORWARD BACKWARD WEIGHT SEND_F RECV_B")
_OldAction = collections.namedtuple("_OldAction", "computation_type microbatch_index stage_index")


def test_torch_2_4_and_2_5_kind_names_map_like_torch_2_6s() -> None:
    # BACKWARD (torch 2.4 / 2.5) is a full backward, WEIGHT (torch 2.5) a weight step.
    f, b, w = _OldKind.FORWARD, _OldKind.BACKWARD, _OldKind.WEIGHT
    full = [_OldAction(f, 0, 3), _OldAction(_OldKind.SEND_F, 0, 3), None, _OldAction(b, 0, 3)]
    assert order_from_actions(full, schedule_name="old", rank=0) == [1, -1]
    weights = [_OldAction(f, 0, 3), _OldAction(b, 0, 3), _OldAction(w, 0, 3)]
    assert order_from_actions(weights, schedule_name="old", rank=0) == [1, -1, -1.5, -1.5]


class _Torch25ZeroBubble(pl.schedules.PipelineScheduleMulti):
    """What torch 2.5's ScheduleInterleavedZeroBubble keeps: BACKWARD actions that its runtime
    runs for input gradients only (use_full_backward False), and WEIGHT actions."""

    def __init__(self, stages, n_microbatches: int, loss_fn=None) -> None:
        self.use_full_backward = False
        first, second = (stage.stage_index for stage in stages)
        f, b, w = _OldKind.FORWARD, _OldKind.BACKWARD, _OldKind.WEIGHT
        actions = [_OldAction(f, 0, first), _OldAction(f, 0, second), _OldAction(b, 0, second),
                   None, _OldAction(b, 0, first), _OldAction(w, 0, second), _OldAction(w, 0, first)]
        self.pipeline_order = {stages[0].group_rank: actions}


@pytest.mark.parametrize("rank", [0, 1])
def test_torch_2_5_input_only_backwards_become_backward_input(rank: int) -> None:
    order = from_pipelining(_Torch25ZeroBubble, 2, 1, rank, stages_per_rank=2)
    assert order == [1, 2, -2, -1, -2.5, -1.5]
