"""Graphed layers under ``torch.distributed.pipelining``'s own runtime.

:func:`graph_pipeline_stages` captures one rank's layers in the order a torch schedule class
runs them (:func:`leangraph.schedules.from_pipelining`) and hands back ``PipelineStage``
objects for that schedule to drive. What it takes to run graphs under torch's runtime, and
why:

* torch's runtime calls a stage's module without saying which microbatch it runs, so each
  stage here is a ``PipelineStage`` subclass that names the microbatch around
  ``forward_one_chunk``; the module then replays the graph of (chunk, microbatch, layer);
* a call outside ``forward_one_chunk`` (metadata inference on the first ``step()``), a call
  without a backward or without gradients (``schedule.eval()``, ``torch.no_grad()``: torch's
  receive buffers then do not require grad, unlike the inputs the graphs were captured for),
  and a call with the layers in another training mode than at capture run the layers eagerly;
* the runtime must run the captured order step by step: graphs that share memory are only
  safe replayed in it, so any other step raises :class:`leangraph.LeangraphError` naming the
  step and the one expected;
* the last stage keeps its outputs until ``step()`` merges them, past their backward, which
  a later replay would overwrite: an output there that aliases graph memory is cloned;
* zero-bubble schedules split backwards, and torch's default weight step differentiates saved
  autograd state that a replay does not have, so those stages pass torch a ``dw_builder``
  that replays the microbatch's weight-gradient graphs (``GraphedCallable.backward_dw``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from leangraph import (
    GraphedCallable,
    GraphedSet,
    Layout,
    LeangraphError,
    Step,
    StepKind,
    make_graphed_callables,
)
from leangraph.order import parse_order
from leangraph.schedules import from_pipelining

from ._options import capture_options

__all__ = ["GraphedPipeline", "StageModules", "graph_pipeline_stages", "stage_placement"]

# torch's V-shaped schedules place their stages themselves (their constructors rebuild
# stage_index_to_group_rank in the "v" style): rank r holds stages r and 2 * pp_size - 1 - r.
# Every other schedule places stage s on rank s % pp_size.
_V_SCHEDULE_NAMES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")

# Options graph_pipeline_stages computes itself; passing them as capture options is refused.
_KIND_WORDS = {
    StepKind.FORWARD: "forward",
    StepKind.BACKWARD: "backward",
    StepKind.WEIGHT: "weight step",
}


@dataclass(frozen=True)
class StageModules:
    """One pipeline stage: layers to graph, between optional glue that runs eagerly.

    The stage computes ``post(layers[-1](... layers[0](pre(inputs))))``. ``pre`` (an
    embedding, say, on the first stage) and ``post`` (the final norm and head on the last)
    always run eagerly; each layer is graphed once per microbatch. A layer takes the previous
    one's output (a tuple is spread into positional arguments) and returns a tensor or a tuple
    of tensors; a stage's keyword arguments reach ``pre`` only.

    Args:
        layers: The layers, in the order the stage runs them (at least one).
        pre: Eager glue run on the stage's inputs before the layers, or None.
        post: Eager glue run on the last layer's output, or None.
    """

    layers: Sequence[nn.Module]
    pre: nn.Module | None = None
    post: nn.Module | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.layers, (str, bytes))
            or not isinstance(self.layers, Iterable)
            or (isinstance(self.layers, nn.Module) and not isinstance(self.layers, nn.ModuleList))
        ):
            raise TypeError(
                "StageModules layers must be a sequence of layers (a list, tuple or "
                f"nn.ModuleList), got {type(self.layers).__name__}; pass [module] to graph a "
                "module as one layer, or list(module) to graph each child of an nn.Sequential "
                "as a layer of its own"
            )
        layers = tuple(self.layers)
        if not layers:
            raise ValueError("StageModules needs at least one layer to graph, got none")
        for index, layer in enumerate(layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"StageModules layer {index} must be an nn.Module, got {layer!r}")
        for name in ("pre", "post"):
            glue = getattr(self, name)
            if glue is not None and not isinstance(glue, nn.Module):
                raise TypeError(f"StageModules {name} must be an nn.Module or None, got {glue!r}")
        object.__setattr__(self, "layers", layers)


@dataclass(frozen=True, eq=False)
class GraphedPipeline:
    """One rank's graphed stages, ready for torch's schedule, and the capture behind them.

    Memory aliasing: the stages' modules replay graphs whose outputs are views of graph-owned
    buffers, valid as :class:`leangraph.GraphedCallable` says (until the graph's backward or
    weight step); what ``step()`` returns on the last stage has storage of its own.

    Attributes:
        stages: The rank's ``PipelineStage`` objects, by ascending stage index (chunk
            ``k + 1`` of the order is ``stages[k]``). Hand them to ``schedule_class`` as
            torch expects (a single-stage schedule takes ``stages[0]``), or call
            :meth:`schedule`.
        graphed_set: The capture's :class:`leangraph.GraphedSet`; reset it (or call
            :meth:`reset`) before ``torch.distributed.destroy_process_group``.
        graphed: The graphed callables, at ``layout.graph_index(chunk, microbatch, layer)``.
        layout: The order's graph layout (chunk -> microbatch -> layer).
        order: The steps captured, in the sequence torch's runtime must run them.
        schedule_class: The torch schedule class the order came from.
        num_microbatches: Microbatches per ``step()``.
        rank: This rank in the pipeline's process group.
        stage_indices: The global stage index of each entry of ``stages``.
    """

    stages: tuple[PipelineStage, ...]
    graphed_set: GraphedSet
    graphed: tuple[GraphedCallable, ...]
    layout: Layout
    order: tuple[Step, ...]
    schedule_class: type
    num_microbatches: int
    rank: int
    stage_indices: tuple[int, ...]

    def schedule(
        self, loss_fn: Callable[..., torch.Tensor] | None = None, **options: Any
    ) -> PipelineScheduleSingle | PipelineScheduleMulti:
        """Construct ``schedule_class`` on these stages with the captured microbatch count.

        Args:
            loss_fn: The loss of the last stage's output and target (None: forward only).
            **options: Further keyword arguments of ``schedule_class``.

        Raises:
            ValueError: if the schedule places a stage on another rank than captured for, or
                ``options`` name the microbatch count (fixed at capture).
        """
        if "n_microbatches" in options:
            raise ValueError(
                f"schedule: n_microbatches is fixed at capture ({self.num_microbatches}: the "
                "graphs replay that many microbatches' steps in their order), got "
                f"n_microbatches={options['n_microbatches']!r}; leave it out, or capture "
                "again with graph_pipeline_stages(..., num_microbatches=...)"
            )
        multi = issubclass(self.schedule_class, PipelineScheduleMulti)
        stage_arg: Any = list(self.stages) if multi else self.stages[0]
        schedule = self.schedule_class(stage_arg, self.num_microbatches, loss_fn=loss_fn, **options)
        placement = getattr(schedule, "stage_index_to_group_rank", None) or {}
        for stage_index in self.stage_indices:
            placed = placement.get(stage_index, self.rank)
            if placed != self.rank:
                raise ValueError(
                    f"{self.schedule_class.__name__} places stage {stage_index} on rank "
                    f"{placed}, but rank {self.rank} captured it; capture the stages that "
                    "stage_placement() names (graph_pipeline_stages' default)"
                )
        return schedule

    def reset(self) -> None:
        """Reset every graph of the capture (``graphed_set.reset()``); idempotent."""
        self.graphed_set.reset()


def _capture(
    specs: Sequence[StageModules],
    order: Sequence[Any],
    inputs: Sequence[Any],
    num_microbatches: int,
    capture_options: Mapping[str, Any],
) -> tuple[Any, Layout, tuple[Step, ...]]:
    """Graph every local stage's layers in one call, in ``order``."""
    layers = tuple(layer for spec in specs for layer in spec.layers)
    layers_per_chunk = [len(spec.layers) for spec in specs]
    layout, steps = parse_order(
        order,
        num_callables=len(layers),
        num_samples=len(layers) * num_microbatches,
        num_layers_per_chunk=layers_per_chunk,
    )
    graphed = make_graphed_callables(
        layers,
        _graph_samples(specs, inputs, layout),
        order=order,
        num_layers_per_chunk=layers_per_chunk,
        **capture_options,
    )
    return graphed, layout, tuple(steps)


def graph_pipeline_stages(
    stages: Sequence[StageModules | Sequence[nn.Module]],
    schedule_class: type,
    sample_args: Sequence[Any],
    *,
    num_microbatches: int,
    pp_size: int | None = None,
    rank: int | None = None,
    stage_indices: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
    capture_options: Mapping[str, Any] | None = None,
) -> GraphedPipeline:
    """Graph one rank's stages in the order ``schedule_class`` runs them; return torch stages.

    Call it on every rank, after ``init_process_group``, with the rank's own stages: their
    layers are captured in one :func:`leangraph.make_graphed_callables` call, in
    ``from_pipelining(..., explicit=True)``'s order, and the returned stages replay them under
    torch's runtime (the module docstring says what differs from an eager ``PipelineStage``).
    ``sample_args[k]`` is one microbatch's input of ``stages[k]`` as the stage receives it
    (inputs of later stages are given ``requires_grad=True``, as torch's receive buffers have);
    ``pre`` and the layers run once eagerly on it, RNG state put back, to sample each layer.

    Args:
        stages: The rank's stages by ascending stage index (:class:`StageModules`, or a
            sequence of layers); their layers are not modified and train as usual.
        schedule_class: A schedule class :func:`~leangraph.schedules.from_pipelining` supports.
        sample_args: One sample input per stage, for one microbatch.
        num_microbatches: Microbatches per ``step()``.
        pp_size, rank: Default (and must equal) the group's size and this rank in it.
        stage_indices: Global stage indices of ``stages``; default :func:`stage_placement`.
        device, group: The stages' device (default: the samples') and process group.
        capture_options: More ``make_graphed_callables`` options (not ``order``,
            ``num_layers_per_chunk`` or ``sample_kwargs``, which this computes).

    Memory aliasing: each layer's outputs are views of graph-owned buffers, valid until that
    graph's backward (its weight step in zero-bubble orders); the last stage's outputs, which
    torch keeps to the end of ``step()``, are copied out of graph memory.

    Raises:
        ValueError, TypeError, RuntimeError: for arguments that do not fit together, what
            torch's schedule or ``make_graphed_callables`` refuses, or a torch it cannot run.
    """
    _check_torch_runtime()
    _check_process_group()
    options = _capture_options(capture_options)  # refused before anything runs
    _check_schedule_class("graph_pipeline_stages", schedule_class)
    specs = _stage_specs(stages)
    pp_size = _group_value("pp_size", pp_size, dist.get_world_size(group))
    rank = _group_value("rank", rank, dist.get_rank(group))
    indices = (
        stage_placement(schedule_class, pp_size, rank, len(specs))
        if stage_indices is None
        else _checked_indices(stage_indices, pp_size, len(specs))
    )
    order = from_pipelining(
        schedule_class, pp_size, num_microbatches, rank, len(specs), explicit=True
    )
    inputs = _stage_inputs(sample_args, indices)
    stage_device = _device(device, inputs)
    graphed, layout, steps = _capture(specs, order, inputs, num_microbatches, options)
    cursor = _StepCursor(steps, schedule_class.__name__, rank, indices)
    built = _build_stages(
        specs,
        indices,
        pp_size * len(specs),
        graphed,
        layout,
        cursor,
        split=any(step.kind is StepKind.WEIGHT for step in steps),
        device=stage_device,
        group=group,
    )
    return GraphedPipeline(
        stages=built,
        graphed_set=GraphedSet.of(graphed),
        graphed=tuple(graphed),
        layout=layout,
        order=steps,
        schedule_class=schedule_class,
        num_microbatches=num_microbatches,
        rank=rank,
        stage_indices=indices,
    )


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def _check_process_group() -> None:
    """Refuse a call before ``init_process_group``: torch's stages take sizes from the group.

    Raises:
        RuntimeError: naming what to call first.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "graph_pipeline_stages needs torch.distributed's default process group (torch's "
            "PipelineStage takes the pipeline's size and this rank from it), got none: call "
            "torch.distributed.init_process_group() on every rank first"
        )


def _check_schedule_class(caller: str, schedule_class: object) -> None:
    """Refuse anything but a ``torch.distributed.pipelining`` schedule class.

    Raises:
        TypeError: naming ``caller`` and what was given.
    """
    if isinstance(schedule_class, type) and issubclass(
        schedule_class, (PipelineScheduleSingle, PipelineScheduleMulti)
    ):
        return
    got = (
        f"class {schedule_class.__name__}"
        if isinstance(schedule_class, type)
        else f"{type(schedule_class).__name__} {schedule_class!r}"
    )
    raise TypeError(
        f"{caller}: schedule_class must be a torch.distributed.pipelining schedule class (a "
        f"subclass of PipelineScheduleSingle or PipelineScheduleMulti, e.g. "
        f"ScheduleInterleaved1F1B), got {got}"
    )


def _check_torch_runtime() -> None:
    """Refuse a torch whose ``PipelineStage`` needs static metadata or has no ``dw_builder``.

    The stages here let torch infer shapes on the first ``step()`` (eagerly) and replace the
    weight step of split backwards, which torch 2.4's ``PipelineStage`` (``input_args``
    required, no inference) cannot.
    """
    parameters = inspect.signature(PipelineStage.__init__).parameters
    input_args = parameters.get("input_args")
    if "dw_builder" in parameters and input_args is not None and input_args.default is None:
        return
    raise RuntimeError(
        f"leangraph.integrations.pipelining needs a torch whose PipelineStage infers its "
        f"metadata (input_args optional) and takes dw_builder; torch {torch.__version__} "
        "does not"
    )


def _stage_specs(stages: Sequence[StageModules | Sequence[nn.Module]]) -> list[StageModules]:
    if isinstance(stages, (nn.Module, StageModules)) or not isinstance(stages, Sequence):
        raise TypeError(
            "stages must be a sequence with one entry per local stage (StageModules, or a "
            f"sequence of layers), got {type(stages).__name__}"
        )
    if not stages:
        raise ValueError("stages is empty; pass the rank's stages")
    specs = []
    for index, stage in enumerate(stages):
        if isinstance(stage, StageModules):
            specs.append(stage)
        elif isinstance(stage, (Sequence, nn.ModuleList)):
            specs.append(StageModules(tuple(stage)))
        else:
            raise TypeError(
                f"stages[{index}] must be StageModules or a sequence of layers, got "
                f"{type(stage).__name__}"
            )
    return specs


def _group_value(name: str, given: int | None, actual: int) -> int:
    if given is not None and given != actual:
        raise ValueError(
            f"{name}={given} but the pipeline's process group has {name} {actual}; torch's "
            "PipelineStage takes it from the group"
        )
    return actual


def stage_placement(
    schedule_class: type, pp_size: int, rank: int, stages_per_rank: int = 1
) -> tuple[int, ...]:
    """The global stage indices ``schedule_class`` gives ``rank``, ascending.

    ``rank + k * pp_size`` for ``k < stages_per_rank``, except in torch's V-shaped schedules
    (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``), which zigzag: rank ``r`` holds stages
    ``r`` and ``2 * pp_size - 1 - r``. Pick the rank's stage modules with it before
    :func:`graph_pipeline_stages`, which places them the same way by default.

    Raises:
        TypeError: if ``schedule_class`` is not a torch schedule class.
        ValueError: if a size is not a positive integer or ``rank`` is out of range.
    """
    _check_schedule_class("stage_placement", schedule_class)
    for name, value in (("pp_size", pp_size), ("stages_per_rank", stages_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < pp_size:
        raise ValueError(f"rank {rank!r} out of range for pp_size {pp_size}")
    v_shaped = any(
        issubclass(schedule_class, getattr(pipelining, name))
        for name in _V_SCHEDULE_NAMES
        if isinstance(getattr(pipelining, name, None), type)
    )
    if v_shaped:
        return tuple(
            k * pp_size + (rank if k % 2 == 0 else pp_size - 1 - rank)
            for k in range(stages_per_rank)
        )
    return tuple(rank + k * pp_size for k in range(stages_per_rank))


def _checked_indices(given: Sequence[int], pp_size: int, count: int) -> tuple[int, ...]:
    """Stage indices given by the caller: one per stage, distinct, ascending, in range."""
    if (
        isinstance(given, (str, bytes))
        or not isinstance(given, Sequence)
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in given)
    ):
        raise TypeError(
            "graph_pipeline_stages: stage_indices must be a sequence of ints, one global "
            f"stage index per entry of stages, got {type(given).__name__} {given!r}"
        )
    indices = tuple(given)
    if len(indices) != count or list(indices) != sorted(set(indices)):
        raise ValueError(
            f"stage_indices {list(given)} must be {count} distinct ascending indices, one "
            "per entry of stages"
        )
    num_stages = pp_size * count
    if indices[0] < 0 or indices[-1] >= num_stages:
        raise ValueError(
            f"stage_indices {list(given)} out of range for {num_stages} stages "
            f"(pp_size {pp_size} x {count} per rank)"
        )
    return indices


def _capture_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    return capture_options(
        options,
        why=(
            "graph_pipeline_stages computes the order and layout from the schedule and the stages, "
            "and calls layers with positional arguments only"
        ),
        check=True,
    )


def _device(device: torch.device | str | None, inputs: Sequence[tuple[Any, ...]]) -> torch.device:
    """The stages' device: ``device``, which must be the samples', or the samples'.

    Raises:
        ValueError: if ``device`` is another device than a sample tensor's (torch's stages
            allocate their receive buffers on it, and the graphs take inputs on the samples').
    """
    found = [v.device for args in inputs for v in args if isinstance(v, torch.Tensor)]
    if device is None:
        return found[0] if found else torch.device("cpu")
    given = torch.device(device)
    for stage, args in enumerate(inputs):
        for position, value in enumerate(args):
            if isinstance(value, torch.Tensor) and not _same_device(given, value.device):
                raise ValueError(
                    f"graph_pipeline_stages: device={given} but sample_args[{stage}] input "
                    f"{position} is on {value.device}; the stages receive activations on "
                    "device and the graphs take them on the samples' device: make them one"
                )
    return given


def _same_device(given: torch.device, actual: torch.device) -> bool:
    """Whether ``given`` names ``actual`` (a device without an index names any of its type)."""
    return given.type == actual.type and given.index in (None, actual.index)


# --------------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------------


def _as_args(value: Any) -> tuple[Any, ...]:
    """A value as positional arguments: a tuple or list spread, anything else alone."""
    if isinstance(value, tuple):
        return value
    if isinstance(value, list):
        return tuple(value)
    return (value,)


def _fresh(value: Any, requires_grad: bool | None = None) -> Any:
    """A tensor's detached copy (``requires_grad`` as given, else as the tensor's)."""
    if not isinstance(value, torch.Tensor):
        return value
    flag = value.requires_grad if requires_grad is None else requires_grad
    return value.detach().clone().requires_grad_(flag)


def _stage_inputs(sample_args: Sequence[Any], indices: Sequence[int]) -> list[tuple[Any, ...]]:
    """One microbatch's input per stage, floating-point inputs of later stages requiring grad
    (as torch's receive buffers do in training)."""
    if isinstance(sample_args, (torch.Tensor, str)) or not isinstance(sample_args, Sequence):
        raise TypeError(
            "sample_args must be a sequence with one sample input per stage, got "
            f"{type(sample_args).__name__}"
        )
    if len(sample_args) != len(indices):
        raise ValueError(
            f"sample_args has {len(sample_args)} entries but there are {len(indices)} stages"
        )
    inputs = []
    for stage_index, sample in zip(indices, sample_args):
        args = _as_args(sample)
        if stage_index > 0:
            args = tuple(
                _fresh(a, True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args
            )
        inputs.append(args)
    return inputs


def _layer_inputs(spec: StageModules, inputs: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """The input of each layer of a stage, from one eager pass over ``pre`` and the layers.

    Run with gradients, so each input's ``requires_grad`` is what it is in training; the RNG
    state and the modules' buffers are put back, so dropout here does not shift the caller's
    random stream, nor a batch norm's running statistics count this pass (eager stages never
    run it).
    """
    devices = [t.device for t in inputs if isinstance(t, torch.Tensor) and t.is_cuda]
    modules = [m for m in (spec.pre, *spec.layers) if m is not None]
    per_layer = []
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), _buffers_kept(modules):
        args = _as_args(spec.pre(*inputs)) if spec.pre is not None else inputs
        for layer in spec.layers:
            per_layer.append(tuple(_fresh(a) for a in args))
            args = _as_args(layer(*args))
    return per_layer


@contextlib.contextmanager
def _buffers_kept(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Put back the values of every buffer of ``modules`` on leaving (a forward in training
    mode updates running statistics in place)."""
    buffers = {id(b): b for m in modules for b in m.buffers()}.values()
    saved = [(b, b.detach().clone()) for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _graph_samples(
    specs: Sequence[StageModules], inputs: Sequence[tuple[Any, ...]], layout: Layout
) -> tuple[tuple[Any, ...], ...]:
    """``sample_args`` for ``make_graphed_callables``: a copy per graph, in layout order."""
    samples: list[tuple[Any, ...]] = [()] * layout.num_graphs
    for chunk, (spec, stage_inputs) in enumerate(zip(specs, inputs), start=1):
        for layer, args in enumerate(_layer_inputs(spec, stage_inputs)):
            for microbatch in range(layout.num_microbatches):
                index = layout.graph_index(chunk, microbatch, layer)
                samples[index] = tuple(_fresh(a) for a in args)
    return tuple(samples)


# --------------------------------------------------------------------------------------------
# Runtime
# --------------------------------------------------------------------------------------------


class _StepCursor:
    """Where one rank is in the captured order; torch's runtime must follow it step by step.

    Shared by the rank's stages: the order interleaves them. Restarted when a ``step()``
    begins (torch clears each stage's runtime state then).
    """

    def __init__(
        self, steps: Sequence[Step], schedule_name: str, rank: int, stage_indices: Sequence[int]
    ) -> None:
        self._steps = tuple(steps)
        self._schedule = schedule_name
        self._rank = rank
        self._stage_indices = tuple(stage_indices)
        self._position = 0

    def restart(self) -> None:
        self._position = 0

    def advance(self, kind: StepKind, chunk: int, microbatch: int) -> None:
        """Move past the next step, which must be ``kind`` of (chunk, microbatch).

        Raises:
            LeangraphError: naming the step torch's runtime runs and the one captured.
        """
        position = self._position
        expected = self._steps[position] if position < len(self._steps) else None
        if expected is not None and (expected.kind, expected.chunk, expected.microbatch) == (
            kind,
            chunk,
            microbatch,
        ):
            self._position += 1
            return
        wanted = (
            f"the {self._describe(expected.kind, expected.chunk, expected.microbatch)}"
            if expected is not None
            else f"no further step (it has {len(self._steps)})"
        )
        raise LeangraphError(
            f"torch's runtime ran the {self._describe(kind, chunk, microbatch)} on rank "
            f"{self._rank}, but at step {position} the order leangraph captured from "
            f"{self._schedule} expects {wanted}; graphs sharing memory are only safe replayed "
            "in their capture order: build the schedule with GraphedPipeline.schedule(), or "
            "capture again for the schedule and sizes that run"
        )

    def _describe(self, kind: StepKind, chunk: int, microbatch: int) -> str:
        stage = self._stage_indices[chunk - 1] if 0 < chunk <= len(self._stage_indices) else "?"
        return f"{_KIND_WORDS[kind]} of chunk {chunk} (stage {stage}), microbatch {microbatch}"


class _StageModule(nn.Module):
    """The module a graphed stage runs: ``pre``, the layers, ``post``.

    Inside :meth:`running` the layers are the graphs of that microbatch; otherwise they run
    eagerly. The graphed callables are plain attributes, not submodules: the parameters are
    the layers' own.
    """

    def __init__(
        self,
        spec: StageModules,
        graphs: Sequence[Sequence[GraphedCallable]],
        *,
        is_last: bool,
    ) -> None:
        super().__init__()
        self.pre = spec.pre
        self.layers = nn.ModuleList(spec.layers)
        self.post = spec.post
        self._graphs = tuple(tuple(per_microbatch) for per_microbatch in graphs)
        self._captured_training = _training_modes(spec.layers)
        self._microbatch: int | None = None
        # Per microbatch, the graphs of its last forward replay whose outputs need a gradient:
        # only they get a backward, and so a weight step (a frozen layer on model inputs
        # gets neither).
        self._differentiated: dict[int, tuple[GraphedCallable, ...]] = {}
        # Only the last stage's outputs outlive their backward (torch merges them at the end
        # of step()), and a later replay would overwrite those that alias graph memory.
        self._is_last = is_last

    def differentiated(self, microbatch: int) -> tuple[GraphedCallable, ...]:
        """The graphs of ``microbatch``'s last forward replay whose outputs need a gradient,
        in layer order."""
        return self._differentiated.get(microbatch, ())

    def matches_capture(self) -> bool:
        """Whether every layer, and every module inside it, is in the training mode it was
        captured in."""
        return _training_modes(self.layers) == self._captured_training

    @contextlib.contextmanager
    def running(self, microbatch: int) -> Iterator[None]:
        """Replay the graphs of ``microbatch`` in forwards called inside this context."""
        self._microbatch = microbatch
        try:
            yield
        finally:
            self._microbatch = None

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if kwargs and self.pre is None:
            raise TypeError(
                f"graphed layers take positional arguments only, got keyword arguments "
                f"{sorted(kwargs)}; give the stage a pre module to take them"
            )
        args = _as_args(self.pre(*inputs, **kwargs)) if self.pre is not None else inputs
        graphs = self._graphs[self._microbatch] if self._microbatch is not None else None
        graph_storages: set[int] = set()
        differentiated = []
        for index, layer in enumerate(self.layers):
            run: Callable[..., Any] = layer if graphs is None else graphs[index]
            args = _as_args(run(*args))
            if graphs is not None and self._is_last:
                graph_storages.update(_storages(args))
            if graphs is not None and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args
            ):
                differentiated.append(graphs[index])
        if self._microbatch is not None:
            self._differentiated[self._microbatch] = tuple(differentiated)
        output = (
            self.post(*args) if self.post is not None else (args[0] if len(args) == 1 else args)
        )
        return _own_storage(output, graph_storages) if graph_storages else output


def _storages(values: Sequence[Any]) -> list[int]:
    """The storage addresses of the tensors among ``values``."""
    return [v.untyped_storage().data_ptr() for v in values if isinstance(v, torch.Tensor)]


def _own_storage(output: Any, graph_storages: set[int]) -> Any:
    """``output`` (a tensor, or a tuple or list of them) with every tensor that lives in one
    of ``graph_storages`` cloned."""

    def own(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in graph_storages:
            return value.clone()
        return value

    if isinstance(output, (tuple, list)):
        return type(output)(own(value) for value in output)
    return own(output)


class _GraphedStage(PipelineStage):
    """A ``PipelineStage`` whose module replays graphs in the steps the order captured."""

    def __init__(
        self,
        module: _StageModule,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        *,
        chunk: int,
        cursor: _StepCursor,
        split_backward: bool,
        group: dist.ProcessGroup | None,
    ) -> None:
        self._module = module
        self._chunk = chunk
        self._cursor = cursor
        self._split = split_backward
        self._graphed_microbatches: set[int] = set()
        self._backward_microbatch: int | None = None
        super().__init__(
            module,
            stage_index,
            num_stages,
            device,
            group=group,
            dw_builder=self._weight_runner if split_backward else None,
        )

    def clear_runtime_states(self) -> None:
        """torch calls this when a ``step()`` begins: the order starts over."""
        super().clear_runtime_states()
        self._cursor.restart()
        self._graphed_microbatches.clear()

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if not (self.has_backward and torch.is_grad_enabled() and self._module.matches_capture()):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._cursor.advance(StepKind.FORWARD, self._chunk, fwd_chunk_id)
        self._graphed_microbatches.add(fwd_chunk_id)
        with self._module.running(fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        if not self.has_backward or bwd_chunk_id not in self._graphed_microbatches:
            # An eager forward: autograd computes every gradient, the weight runner is a no-op.
            super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
            return
        self._cursor.advance(StepKind.BACKWARD, self._chunk, bwd_chunk_id)
        self._backward_microbatch = bwd_chunk_id
        try:
            super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        finally:
            self._backward_microbatch = None
        if not self._split:
            self._graphed_microbatches.discard(bwd_chunk_id)

    def _weight_runner(self) -> Callable[[], None]:
        """torch's ``dw_builder``: called inside ``backward_one_chunk``, it returns the weight
        step of that microbatch, which torch runs at the order's W (at once for a full B)."""
        microbatch = self._backward_microbatch
        if microbatch is None:
            return _no_weight_step
        graphs = self._module.differentiated(microbatch)

        def run() -> None:
            self._cursor.advance(StepKind.WEIGHT, self._chunk, microbatch)
            for graph in reversed(graphs):  # as the backward ran: last layer first
                graph.backward_dw()
            self._graphed_microbatches.discard(microbatch)

        return run


def _no_weight_step() -> None:
    """The weight step of an eager forward: its backward already computed the gradients."""


def _build_stages(
    specs: Sequence[StageModules],
    indices: Sequence[int],
    num_stages: int,
    graphed: Sequence[GraphedCallable],
    layout: Layout,
    cursor: _StepCursor,
    *,
    split: bool,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> tuple[PipelineStage, ...]:
    """One graphed stage per local stage; ``split``: the order splits backwards (W steps)."""
    stages = []
    for chunk, (spec, stage_index) in enumerate(zip(specs, indices), start=1):
        graphs = [
            [graphed[layout.graph_index(chunk, m, l)] for l in range(len(spec.layers))]
            for m in range(layout.num_microbatches)
        ]
        module = _StageModule(spec, graphs, is_last=stage_index == num_stages - 1)
        stages.append(
            _GraphedStage(
                module,
                stage_index,
                num_stages,
                device,
                chunk=chunk,
                cursor=cursor,
                split_backward=split,
                group=group,
            )
        )
    return tuple(stages)


def _training_modes(layers: Iterable[nn.Module]) -> tuple[bool, ...]:
    """The ``training`` flags of ``layers`` and of every module inside them."""
    return tuple(module.training for layer in layers for module in layer.modules())
