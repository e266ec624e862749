"""Orders of ``torch.distributed.pipelining`` schedules.

:func:`from_pipelining` reads the action list that a ``torch.distributed.pipelining`` schedule
class computes for one rank and maps it to an order in the convention of
:mod:`leangraph.order`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..order import Step, StepKind
from ._arguments import check_int, check_rank

__all__ = ["from_pipelining"]


# --------------------------------------------------------------------------------------------
# torch.distributed.pipelining
# --------------------------------------------------------------------------------------------
#
# How the schedules are built without a process group: torch's schedule classes only read a
# few plain attributes of their stage objects while they compute ``pipeline_order`` in
# ``__init__`` (``num_stages``, ``group_size``, ``group_rank``, ``stage_index``, ``is_first`` /
# ``is_last``, ``submod`` for the torch.compile check, ``group`` in torch 2.4 / 2.5's
# ``ScheduleInterleaved1F1B``) and write a few more (``stage_index_to_group_rank``,
# ``has_backward``). torch 2.4 and 2.5 constructors also call ``_prepare_forward_infra`` /
# ``_prepare_backward_infra``, which there only allocate receive buffers (2.6 and 2.13 call them
# in ``step()``). :class:`_StageStub` provides exactly these, so the real constructor runs and
# computes torch's own per-rank action lists. No communication happens until ``step()``, which
# is never called.
#
# What differs between the versions this was checked against (2.4.1, 2.5.1, 2.6.0, 2.13):
# * Multi-stage schedules fill ``pipeline_order`` in ``__init__`` on all of them.
#   Single-stage ones (``ScheduleGPipe``, ``Schedule1F1B``) do so only where they define
#   ``_get_pipeline_order`` (2.13, not 2.4 .. 2.6); without it, the order is the one their
#   ``_step_microbatches`` runs, which :func:`_step_logic_actions` restates for exactly
#   those two step functions.
# * Action kinds: 2.4 has ``FORWARD`` and ``BACKWARD``; 2.5 adds ``WEIGHT``, and runs a
#   ``BACKWARD`` with ``full_backward=schedule.use_full_backward``, which its
#   ``ScheduleInterleavedZeroBubble`` sets to False (input gradients only); 2.6 and 2.13 name
#   the three ``FULL_BACKWARD``, ``BACKWARD_INPUT`` and ``BACKWARD_WEIGHT``.
# * torch 2.4's ``_Action`` fields are ``(computation_type, microbatch_index, stage_index)``,
#   later ones ``(stage_index, computation_type, microbatch_index)``: fields are used by name.
# * Accepted sizes are torch's own: 2.4 / 2.5's ``ScheduleInterleaved1F1B`` wants
#   ``num_microbatches`` a multiple of ``pp_size``; 2.13's ``Schedule1F1B`` refuses fewer
#   microbatches than stages, which 2.4 .. 2.6 run.

# Action kinds (``_ComputationType`` member names, torch 2.4 .. 2.13) and what they become.
_FORWARD_KINDS = frozenset({"FORWARD"})
_BACKWARD_KINDS = frozenset({"FULL_BACKWARD", "BACKWARD"})  # "BACKWARD": torch 2.4 / 2.5
_SKIPPED_KINDS = frozenset(
    {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"}
)
_SPLIT_BACKWARD_KINDS = frozenset({"BACKWARD_INPUT", "BACKWARD_WEIGHT", "WEIGHT"})


class _StageStub:
    """The attributes of a ``_PipelineStageBase`` that schedule constructors touch."""

    def __init__(self, stage_index: int, num_stages: int, pp_size: int, rank: int) -> None:
        import torch

        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = pp_size
        self.group_rank = rank
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.has_backward = True
        self.submod = torch.nn.Module()
        self.group = None  # the default process group; only stored, never used to communicate
        self.stage_index_to_group_rank = {s: s % pp_size for s in range(num_stages)}

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> None:
        """torch 2.4 / 2.5 size receive buffers here in the constructor; none are needed."""

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> None:
        """As :meth:`_prepare_forward_infra`."""


def _unused_loss(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("leangraph only reads the schedule's order; it never runs a step")


def _pipelining_kind(schedule_class: type) -> str:
    """``"single"`` or ``"multi"`` for a torch schedule class; ValueError for anything else."""
    from torch.distributed.pipelining import schedules as torch_schedules

    if not isinstance(schedule_class, type):
        raise ValueError(f"schedule_class must be a class, got {schedule_class!r}")
    if issubclass(schedule_class, torch_schedules.PipelineScheduleSingle):
        return "single"
    if issubclass(schedule_class, torch_schedules.PipelineScheduleMulti):
        return "multi"
    raise ValueError(
        f"{schedule_class.__name__} is not a torch.distributed.pipelining schedule class"
    )


def _build_schedule(
    schedule_class: type, kind: str, pp_size: int, num_microbatches: int, rank: int, spr: int
) -> Any:
    """Construct ``schedule_class`` for ``rank`` on stub stages (see the comment above)."""
    num_stages = pp_size * spr
    stages = [_StageStub(rank + k * pp_size, num_stages, pp_size, rank) for k in range(spr)]
    stage_arg: Any = stages[0] if kind == "single" else stages
    try:
        return schedule_class(stage_arg, num_microbatches, loss_fn=_unused_loss)
    except (AssertionError, RuntimeError, ValueError) as exc:
        raise ValueError(
            f"torch's {schedule_class.__name__} rejects pp_size={pp_size}, "
            f"num_microbatches={num_microbatches}, stages_per_rank={spr}: {exc}"
        ) from exc


def _step_logic_actions(schedule: Any, num_microbatches: int, rank: int) -> list[Any]:
    """Actions of a single-stage schedule whose torch keeps no ``pipeline_order`` (2.4 .. 2.6).

    Restates the order of ``ScheduleGPipe._step_microbatches`` and
    ``Schedule1F1B._step_microbatches``; any other step function (another class, or a subclass
    that overrides it) raises ValueError rather than being guessed.
    """
    from torch.distributed.pipelining import schedules as torch_schedules

    ctype = torch_schedules._ComputationType
    backward = getattr(ctype, "FULL_BACKWARD", None) or getattr(ctype, "BACKWARD")  # noqa: B009

    def action(kind: Any, microbatch: int) -> Any:
        # By name: torch 2.4's _Action has another field order than later versions.
        return torch_schedules._Action(
            stage_index=rank, computation_type=kind, microbatch_index=microbatch
        )

    fwd = [action(ctype.FORWARD, m) for m in range(num_microbatches)]
    bwd = [action(backward, m) for m in range(num_microbatches)]
    step_logic = type(schedule)._step_microbatches
    if step_logic is torch_schedules.ScheduleGPipe._step_microbatches:
        return fwd + bwd
    if step_logic is not torch_schedules.Schedule1F1B._step_microbatches:
        raise ValueError(
            f"{type(schedule).__name__} keeps no pipeline_order on this torch, and without one "
            "leangraph knows the step functions (_step_microbatches) of ScheduleGPipe and "
            "Schedule1F1B only"
        )
    # Schedule1F1B._step_microbatches: num_stages - stage_index forwards, then B/F pairs.
    warmup = min(num_microbatches, schedule._num_stages - rank)
    steady = [a for pair in zip(bwd, fwd[warmup:]) for a in pair]
    return fwd[:warmup] + steady + bwd[num_microbatches - warmup :]


def _torch_rank_actions(
    schedule_class: type, pp_size: int, num_microbatches: int, rank: int, spr: int
) -> list[Any]:
    """Return torch's own action list for ``rank`` (``schedule.pipeline_order[rank]``).

    A ``BACKWARD`` action (torch 2.4 / 2.5's name) comes back as ``BACKWARD_INPUT``, torch
    2.6's name, where it computes input gradients only: torch 2.5's runtime runs it with
    ``full_backward=schedule.use_full_backward``, which its zero-bubble schedule sets to False
    (``WEIGHT`` does the rest).
    """
    kind = _pipelining_kind(schedule_class)
    if kind == "single" and spr != 1:
        raise ValueError(
            f"{schedule_class.__name__} runs one stage per rank; got stages_per_rank={spr}"
        )
    schedule = _build_schedule(schedule_class, kind, pp_size, num_microbatches, rank, spr)
    pipeline_order = getattr(schedule, "pipeline_order", None)
    if pipeline_order:
        actions = list(pipeline_order[rank])
    elif kind == "single":
        actions = _step_logic_actions(schedule, num_microbatches, rank)
    else:
        raise ValueError(f"torch's {schedule_class.__name__} computed no pipeline_order")
    if getattr(schedule, "use_full_backward", True) is not False:
        return actions
    return [  # None is an idle step
        a._replace(computation_type="BACKWARD_INPUT")
        if a is not None and _action_kind(a) == "BACKWARD"
        else a
        for a in actions
    ]


def _action_kind(action: Any) -> str:
    """The ``_ComputationType`` member name of a torch action."""
    ctype = action.computation_type
    return str(getattr(ctype, "name", ctype))


def _action_entries(action: Any, local_chunks: dict[int, int], split: bool) -> list[float]:
    """Map one torch action to order entries (none for actions that run nothing).

    ``F`` is ``+c``; ``I`` (input gradients) is ``-c`` and ``W`` (weight gradients)
    ``-(c + 0.5)``; a full ``B`` is ``-c``, or, in an order that splits backwards, ``-c``
    followed at once by ``-(c + 0.5)`` (there ``-c`` alone computes input gradients only).

    Raises:
        ValueError: for actions an order cannot express, naming the action.
    """
    kind = _action_kind(action)
    if kind in _SKIPPED_KINDS:
        return []
    chunk = local_chunks[action.stage_index]
    if kind in _FORWARD_KINDS:
        return [chunk]
    if kind in _BACKWARD_KINDS:
        return [-chunk, -(chunk + 0.5)] if split else [-chunk]
    if kind == "BACKWARD_INPUT":
        return [-chunk]
    if kind in ("BACKWARD_WEIGHT", "WEIGHT"):
        return [-(chunk + 0.5)]
    raise ValueError(
        f"action {action} ({kind}) has no leangraph order entry: orders express "
        "forwards (F), backwards (B) and split backwards (I, W) only"
    )


def _leaf_actions(action: Any) -> list[Any]:
    """The actions torch's runtime performs for one entry of ``pipeline_order``.

    ``None`` (an idle step) performs nothing; a composite action (``OVERLAP_F_B``) performs its
    ``sub_actions`` one after the other, as ``_PipelineScheduleRuntime`` does by default.
    """
    if action is None:
        return []
    sub_actions = getattr(action, "sub_actions", None)
    if sub_actions is None:
        return [action]
    return [leaf for sub_action in sub_actions for leaf in _leaf_actions(sub_action)]


def _actions_to_order(
    actions: Sequence[Any],
    schedule_name: str,
    rank: int,
    explicit: bool = False,
) -> list[Any]:
    """Map a rank's torch action list to an order, chunk ids by ascending stage index.

    With ``explicit`` the order is :class:`~leangraph.order.Step` records naming each
    microbatch (by its rank among the stage's microbatch indices), so backwards need not be
    first in, first out; without, backwards must be, and the order is chunk ids.
    """
    leaves = [(pos, leaf) for pos, action in enumerate(actions) for leaf in _leaf_actions(action)]
    stage_ids = sorted({leaf.stage_index for _, leaf in leaves})
    local_chunks = {stage: chunk for chunk, stage in enumerate(stage_ids, start=1)}
    split = any(_action_kind(leaf) in _SPLIT_BACKWARD_KINDS for _, leaf in leaves)
    order: list[float] = []
    keys: list[tuple[int, str]] = []
    runs: dict[tuple[int, str], list[Any]] = {}
    for position, leaf in leaves:
        try:
            entries = _action_entries(leaf, local_chunks, split)
        except ValueError as exc:
            raise ValueError(f"{schedule_name}, rank {rank}, step {position}: {exc}") from None
        for entry in entries:
            order.append(entry)
            kind = "F" if entry > 0 else ("B" if float(entry).is_integer() else "W")
            keys.append((int(abs(entry)), kind))
            runs.setdefault(keys[-1], []).append(leaf)
    if explicit:
        return _explicit_order(keys, runs)
    _check_fifo(runs, schedule_name, rank)
    return order


def _explicit_order(
    keys: Sequence[tuple[int, str]], runs: dict[tuple[int, str], list[Any]]
) -> list[Step]:
    """One :class:`Step` per entry, its microbatch the action's rank within its stage and kind."""
    kinds = {"F": StepKind.FORWARD, "B": StepKind.BACKWARD, "W": StepKind.WEIGHT}
    ranks = {key: _ranks(actions) for key, actions in runs.items()}
    seen: dict[tuple[int, str], int] = {}
    steps = []
    for key in keys:
        index = seen.get(key, 0)
        seen[key] = index + 1
        steps.append(Step(kinds[key[1]], key[0], ranks[key][index]))
    return steps


def _ranks(actions: Sequence[Any]) -> list[int]:
    """Each action's position among the microbatch indices of ``actions``, sorted."""
    found = [getattr(a, "microbatch_index", None) for a in actions]
    indices = [i for i in found if i is not None]
    if len(indices) < len(found):
        return list(range(len(found)))
    ordered = sorted(indices)
    return [ordered.index(i) for i in indices]


def _check_fifo(runs: dict[tuple[int, str], list[Any]], schedule_name: str, rank: int) -> None:
    """Refuse a schedule whose backwards are not first in, first out per stage.

    ``-c`` always means the oldest outstanding forward of chunk ``c``. A schedule that runs
    backwards in another sequence (``ScheduleLoopedBFS`` runs them newest first) would replay
    graphs out of their capture order, and graphs sharing a pool are only safe replayed in it.
    Weight steps must likewise follow their backwards in order. Microbatches are compared by
    rank, not value: torch 2.13's ``Schedule1F1B`` numbers the last rank's forwards from 1
    but its backwards from 0.
    """
    for (chunk, kind), actions in runs.items():
        if kind == "W":
            continue
        later = runs.get((chunk, "B" if kind == "F" else "W"), [])
        for fwd_rank, bwd_rank, action in zip(_ranks(actions), _ranks(later), later):
            if fwd_rank != bwd_rank:
                raise ValueError(
                    f"{schedule_name}, rank {rank}: action {action} runs a backward out of "
                    "forward order (not first in, first out); an order's -c is always the "
                    "oldest outstanding forward, and graphs replayed out of their capture "
                    "order would overwrite each other's pool memory"
                )


def from_pipelining(
    schedule_class: type,
    pp_size: int,
    num_microbatches: int,
    rank: int,
    stages_per_rank: int = 1,
    *,
    explicit: bool = False,
) -> list[Any]:
    """The order a ``torch.distributed.pipelining`` schedule class runs on one rank.

    The schedule is constructed on stand-in stage objects (no process group, no
    communication) and its own per-rank action list (``pipeline_order[rank]``) is mapped:
    a forward of local stage ``s`` becomes ``+c`` and a full backward ``-c``, where ``c`` is the
    1-based position of ``s`` among this rank's stages in ascending stage index; communication,
    FSDP and gradient-reduction actions and idle steps are dropped, and a composite
    ``OVERLAP_F_B`` action becomes its sub-actions in order (what torch's runtime runs unless
    a custom overlap function is registered).

    Note:
        An order of chunk ids does not name microbatches: ``-c`` is always the backward of
        chunk ``c``'s oldest outstanding forward. ``ScheduleLoopedBFS`` runs each stage's
        backwards newest first, which such an order cannot say, so it is refused with
        ``ValueError`` unless ``explicit=True`` asks for :class:`~leangraph.order.Step`
        records, which name each step's microbatch; ``make_graphed_callables`` accepts both.

    Args:
        schedule_class: A schedule class, e.g. ``Schedule1F1B``, ``ScheduleGPipe``,
            ``ScheduleInterleaved1F1B``.
        pp_size: Pipeline-parallel size (ranks), >= 1.
        num_microbatches: Microbatches per iteration, >= 1.
        rank: The rank whose order to return, ``0 <= rank < pp_size``.
        stages_per_rank: Stages per rank (1 for single-stage schedules); rank ``r`` holds
            stages ``r, r + pp_size, ...`` unless the schedule places them itself.
        explicit: Return :class:`~leangraph.order.Step` records (kind, chunk, microbatch)
            instead of chunk ids, for schedules whose backwards are not first in, first out.

    Returns:
        The order with chunk ids ``1..stages_per_rank`` (or the steps, with ``explicit``).

    Raises:
        ValueError: if an argument is invalid, torch rejects the sizes (with torch's reason),
            a single-stage schedule keeps no ``pipeline_order`` on this torch and steps other
            than ``ScheduleGPipe`` or ``Schedule1F1B`` do, or the schedule has an action an order
            cannot express (backwards that are not first in, first out per stage, unless
            ``explicit``); the message names the action and its step.
    """
    pp_size = check_int("pp_size", pp_size, 1)
    rank = check_rank(rank, pp_size)
    num_microbatches = check_int("num_microbatches", num_microbatches, 1)
    spr = check_int("stages_per_rank", stages_per_rank, 1)
    actions = _torch_rank_actions(schedule_class, pp_size, num_microbatches, rank, spr)
    return _actions_to_order(actions, schedule_class.__name__, rank, explicit)
