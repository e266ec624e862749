"""Orders of ``torch.distributed.pipelining`` schedules.

:func:`from_pipelining` reads the action list that a ``torch.distributed.pipelining`` schedule
class computes for one rank and maps it, with :func:`order_from_actions`, to an order in the
convention of :mod:`leangraph.order`. How the action list is read on each torch version is
:mod:`leangraph.schedules._torch_compat`'s business.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..order import Step, StepKind
from ._arguments import check_int, check_rank
from ._torch_compat import action_kind, rank_actions

__all__ = ["from_pipelining", "order_from_actions"]


# Action kinds (torch 2.6+ names, see _torch_compat.action_kind) that run nothing an order
# expresses, and those that only an order with split backwards has.
_SKIPPED_KINDS = frozenset(
    {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"}
)
_SPLIT_BACKWARD_KINDS = frozenset({"BACKWARD_INPUT", "BACKWARD_WEIGHT"})


def _action_entries(action: Any, local_chunks: dict[int, int], split: bool) -> list[float]:
    """Map one torch action to order entries (none for actions that run nothing).

    ``F`` is ``+c``; ``I`` (input gradients) is ``-c`` and ``W`` (weight gradients)
    ``-(c + 0.5)``; a full ``B`` is ``-c``, or, in an order that splits backwards, ``-c``
    followed at once by ``-(c + 0.5)`` (there ``-c`` alone computes input gradients only).

    Raises:
        ValueError: for actions an order cannot express, naming the action.
    """
    kind = action_kind(action)
    if kind in _SKIPPED_KINDS:
        return []
    chunk = local_chunks[action.stage_index]
    if kind == "FORWARD":
        return [chunk]
    if kind == "FULL_BACKWARD":
        return [-chunk, -(chunk + 0.5)] if split else [-chunk]
    if kind == "BACKWARD_INPUT":
        return [-chunk]
    if kind == "BACKWARD_WEIGHT":
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


def order_from_actions(
    actions: Sequence[Any],
    *,
    schedule_name: str,
    rank: int,
    explicit: bool = False,
) -> list[Any]:
    """Map one rank's torch action list to an order, chunk ids by ascending stage index.

    :func:`from_pipelining` builds the action list itself; this maps one built elsewhere, such
    as ``pipeline_order[rank]`` of a schedule constructed on real stages, or its
    ``pipeline_order_with_comms[rank]``. Actions map as :func:`from_pipelining` describes.

    Note:
        Kinds are read as torch 2.6 and later name them: torch 2.4 / 2.5's ``BACKWARD`` as a
        full backward, torch 2.5's ``WEIGHT`` as a weight step. torch 2.5's
        ``ScheduleInterleavedZeroBubble`` runs its ``BACKWARD`` actions without weight
        gradients (``use_full_backward=False``), which its action list does not say: take such
        a schedule's order from :func:`from_pipelining`.

    Args:
        actions: The rank's torch ``_Action`` records in the order they run, ``None`` for an
            idle step.
        schedule_name: The schedule's name, for error messages.
        rank: The rank the actions belong to, for error messages.
        explicit: Return :class:`~leangraph.order.Step` records naming each microbatch (by
            its rank among the stage's microbatch indices), so backwards need not be first in,
            first out; without, backwards must be, and the order is chunk ids.

    Returns:
        The order with chunk ids ``1..`` (number of stages in ``actions``), or the steps.

    Raises:
        TypeError: if ``actions`` is not a sequence of actions (and None).
        ValueError: for an action an order cannot express, or (without ``explicit``)
            backwards that are not first in, first out per stage; the message names the
            schedule, the rank, the action and its step.
    """
    _check_actions(actions)
    leaves = [(pos, leaf) for pos, action in enumerate(actions) for leaf in _leaf_actions(action)]
    stage_ids = sorted({leaf.stage_index for _, leaf in leaves})
    local_chunks = {stage: chunk for chunk, stage in enumerate(stage_ids, start=1)}
    split = any(action_kind(leaf) in _SPLIT_BACKWARD_KINDS for _, leaf in leaves)
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


def _check_actions(actions: Any) -> None:
    """Refuse anything but a sequence of torch actions (or None for idle steps).

    Raises:
        TypeError: naming the entry and what it is.
    """
    if isinstance(actions, (str, bytes)) or not isinstance(actions, Sequence):
        raise TypeError(
            "order_from_actions: actions must be a sequence of torch.distributed.pipelining "
            f"_Action records (one rank's pipeline_order), got {type(actions).__name__}"
        )
    for position, action in enumerate(actions):
        if action is not None and not (
            hasattr(action, "computation_type") and hasattr(action, "stage_index")
        ):
            raise TypeError(
                f"order_from_actions: actions[{position}] must be a torch.distributed."
                "pipelining _Action (with stage_index, computation_type and microbatch_index) "
                f"or None for an idle step, got {type(action).__name__} {action!r}; parse "
                "action text with torch's _Action.from_str"
            )


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
    actions = rank_actions(schedule_class, pp_size, num_microbatches, rank, spr)
    return order_from_actions(
        actions, schedule_name=schedule_class.__name__, rank=rank, explicit=explicit
    )
