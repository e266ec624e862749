"""torch's own per-rank action lists, read the same way on torch 2.4 .. 2.13.

Everything that touches ``torch.distributed.pipelining`` itself (its schedule classes, their
private attributes, the differences between torch versions) lives here, so that
:mod:`leangraph.schedules.pipelining` maps actions of one form only: :func:`rank_actions`
returns torch's action list for one rank, and :func:`action_kind` names each action's kind as
torch 2.6 and later do.

How the schedules are built without a process group: torch's schedule classes only read a few
plain attributes of their stage objects while they compute ``pipeline_order`` in ``__init__``
(``num_stages``, ``group_size``, ``group_rank``, ``stage_index``, ``is_first`` / ``is_last``,
``submod`` for the torch.compile check, ``group`` in torch 2.4 / 2.5's
``ScheduleInterleaved1F1B``) and write a few more (``stage_index_to_group_rank``,
``has_backward``). torch 2.4 and 2.5 constructors also call ``_prepare_forward_infra`` /
``_prepare_backward_infra``, which there only allocate receive buffers (2.6 and 2.13 call them in
``step()``). :class:`_StageStub` provides exactly these, so the real constructor runs and computes
torch's own per-rank action lists. No communication happens until ``step()``, which is never
called.

What differs between the versions this was checked against (2.4.1, 2.5.1, 2.6.0, 2.13):

* Multi-stage schedules fill ``pipeline_order`` in ``__init__`` on all of them. Single-stage ones
  (``ScheduleGPipe``, ``Schedule1F1B``) do so only where they define ``_get_pipeline_order``
  (2.13, not 2.4 .. 2.6); without it, the order is the one their ``_step_microbatches`` runs,
  which :func:`_step_logic_actions` restates for exactly those two step functions.
* Action kinds: 2.4 has ``FORWARD`` and ``BACKWARD``; 2.5 adds ``WEIGHT``, and runs a
  ``BACKWARD`` with ``full_backward=schedule.use_full_backward``, which its
  ``ScheduleInterleavedZeroBubble`` sets to False (input gradients only); 2.6 and 2.13 name the
  three ``FULL_BACKWARD``, ``BACKWARD_INPUT`` and ``BACKWARD_WEIGHT``.
* torch 2.4's ``_Action`` fields are ``(computation_type, microbatch_index, stage_index)``, later
  ones ``(stage_index, computation_type, microbatch_index)``: fields are used by name.
* Accepted sizes are torch's own: 2.4 / 2.5's ``ScheduleInterleaved1F1B`` wants
  ``num_microbatches`` a multiple of ``pp_size``; 2.13's ``Schedule1F1B`` refuses fewer
  microbatches than stages, which 2.4 .. 2.6 run.

``torch.distributed.pipelining`` is imported inside the functions that need it, so that importing
:mod:`leangraph.schedules` for its Megatron-LM builders does not import it (it is slow to import,
and missing where ``torch.distributed`` is not available).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["action_kind", "rank_actions"]

# Action kinds as torch 2.4 / 2.5 name them -> as torch 2.6 and later do. torch 2.5's
# input-only ``BACKWARD`` is renamed by :func:`_input_only_backwards` before this applies.
_RENAMED_KINDS = {"BACKWARD": "FULL_BACKWARD", "WEIGHT": "BACKWARD_WEIGHT"}


class _StageStub:
    """The attributes of a ``_PipelineStageBase`` that schedule constructors touch."""

    def __init__(self, stage_index: int, num_stages: int, pp_size: int, rank: int) -> None:
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

    # Named as torch's stage methods are: torch 2.4 / 2.5 constructors call them.
    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> None:
        """torch 2.4 / 2.5 size receive buffers here in the constructor; none are needed."""

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> None:
        """As :meth:`_prepare_forward_infra`."""


def _unused_loss(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("leangraph only reads the schedule's order; it never runs a step")


def _kind_name(action: Any) -> str:
    """The ``_ComputationType`` member name of a torch action, as this torch names it."""
    ctype = action.computation_type
    return str(getattr(ctype, "name", ctype))


def action_kind(action: Any) -> str:
    """The kind of a torch action, named as torch 2.6 and later name it.

    ``FORWARD``, ``FULL_BACKWARD``, ``BACKWARD_INPUT``, ``BACKWARD_WEIGHT`` or any other
    ``_ComputationType`` member name (communication and the like) unchanged: torch 2.4 / 2.5's
    ``BACKWARD`` is a ``FULL_BACKWARD`` and torch 2.5's ``WEIGHT`` a ``BACKWARD_WEIGHT``.
    """
    name = _kind_name(action)
    return _RENAMED_KINDS.get(name, name)


def _schedule_kind(schedule_class: type) -> str:
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
    """Construct ``schedule_class`` for ``rank`` on stub stages (see the module docstring)."""
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


def _input_only_backwards(schedule: Any, actions: list[Any]) -> list[Any]:
    """Rename torch 2.5's input-gradient-only ``BACKWARD`` actions ``BACKWARD_INPUT``.

    torch 2.5's runtime runs a ``BACKWARD`` with ``full_backward=schedule.use_full_backward``,
    which its zero-bubble schedule sets to False (``WEIGHT`` does the rest); torch 2.6 calls
    that action ``BACKWARD_INPUT``. Other schedules and torch versions keep their actions.
    """
    if getattr(schedule, "use_full_backward", True) is not False:
        return actions
    return [  # None is an idle step
        a._replace(computation_type="BACKWARD_INPUT")
        if a is not None and _kind_name(a) == "BACKWARD"
        else a
        for a in actions
    ]


def rank_actions(
    schedule_class: type, pp_size: int, num_microbatches: int, rank: int, spr: int
) -> list[Any]:
    """Return torch's own action list for ``rank`` (``schedule.pipeline_order[rank]``).

    ``None`` entries are idle steps. Where this torch keeps no ``pipeline_order`` for a
    single-stage schedule, the list is what its step function runs; a torch 2.5 ``BACKWARD``
    that computes input gradients only comes back as ``BACKWARD_INPUT`` (torch 2.6's name).

    Raises:
        ValueError: if ``schedule_class`` is not a torch schedule class, a single-stage one is
            asked for several stages per rank, torch rejects the sizes, or no action list can
            be read.
    """
    kind = _schedule_kind(schedule_class)
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
    return _input_only_backwards(schedule, actions)
