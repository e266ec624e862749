"""``leangraph bench``: eager vs ``torch.cuda.make_graphed_callables`` vs leangraph vs the
whole step as one CUDA graph, one process.

One pipeline rank's layers (Megatron interleaved 1F1B order of that rank) are trained for a
step four ways, each from the same initial weights and on the same data, one after the other
with the allocator emptied in between. For every method the figures are taken relative to the
memory held when that method starts (weights and data included there, so "above the weights"):

* ``step_peak``: peak allocated during one training step (for graphed methods, peak
  *reserved*, since graphs write pool blocks the allocator counts as free);
* ``capture_peak``: peak allocated during warm-up plus capture;
* ``held``: reserved right after capture;
* times: capture wall time and the median step time; with ``rounds`` the graphed methods
  are then captured and timed again, in turn, that many times (median and spread);
* with ``launch_steps``: kernel and graph launches per step (:func:`count_launches`), from
  that many profiled steps of each method once all timing (rounds included) is done.

torch's callables are listed in the schedule's forward order (its best case: it captures all
forwards in that order, then all backwards in reverse). Its graphs are then replayed in the
pipeline order, which its contract does not cover; the loss check says whether that held.

The ``whole-step`` method is the limit a graphed step is measured against: the rank's whole
training step (eager's step, every forward and backward of the order) captured by hand as one
``torch.cuda.CUDAGraph`` (:class:`WholeStepGraph`), one graph launch per step. Every method's
step time is also given as a ratio to it (``x limit``) when it ran.

The evidence scripts of ``benchmarks/`` build on the same pieces: :class:`BenchWorkload` (the
workload and its training step), :func:`capture_torch`, :func:`capture_leangraph`,
:func:`capture_whole_step` and :func:`capture_method` (one graphed method over a copy of the
blocks), :func:`graph_methods`, :func:`profile_steps`, :func:`count_launches`,
:func:`self_device_us`, :data:`LAUNCH_BOUND`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import inspect
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, cast

import torch

from leangraph import (
    CaptureMemoryError,
    GraphedCallable,
    make_graphed_callables,
    memory_report,
    plot_memory,
    reset_all,
)
from leangraph.order import Layout, StepKind
from leangraph.progress import ProgressCallback
from leangraph.report import MemoryReport, TimelinePoint
from leangraph.schedules import interleaved_1f1b

from .local_pipeline import LayerLookup, order_steps, run_steps
from .phases import PhaseProgress
from .workloads import (
    BlockShape,
    Shape,
    hidden_batches,
    make_blocks,
    plural,
    sample_hidden,
)

__all__ = [
    "CUDA_METHODS",
    "FUSED",
    "FUSED_NO_HOOKS",
    "FUSED_PYTHON_HOOKS",
    "GRAD_HOOKS_WITHOUT_ACCUMULATORS",
    "GRAPHED_METHODS",
    "GRAPH_LAUNCH_CALLS",
    "KERNEL_LAUNCH_CALLS",
    "LAUNCH_BOUND",
    "LEANGRAPH_METHODS",
    "LIMIT",
    "METHODS",
    "OPT_IN_METHODS",
    "OVERLAP",
    "BenchConfig",
    "BenchResult",
    "BenchWorkload",
    "Captured",
    "GradReadyHooks",
    "LaunchCounts",
    "MethodResult",
    "RoundTimes",
    "WholeStepGraph",
    "capture_leangraph",
    "capture_method",
    "capture_torch",
    "capture_whole_step",
    "count_launches",
    "format_table",
    "fused_unavailable",
    "graph_methods",
    "launch_counts",
    "method_unavailable",
    "plot_bars",
    "plot_timeline",
    "profile_steps",
    "run_bench",
    "run_guarded",
    "self_device_us",
    "timeline_references",
]

MIB = 1024 * 1024

OVERLAP = "leangraph-overlap"
"""leangraph with autograd's additions of parameter gradients on a side stream, overlapping the
next layer's backward graph (``overlap_grad_accumulation=True``)."""
FUSED = "leangraph-fused"
"""leangraph with in-graph gradient accumulation (``fuse_grad_accumulation=True``)."""
FUSED_PYTHON_HOOKS = "leangraph-fused-python"
"""In-graph accumulation whose replays call the accumulators' Python hooks themselves
(``accumulator_hooks="python"``: autograd runs no accumulator; Megatron-core DDP's hooks, and
post-accumulate-grad hooks, still fire)."""
FUSED_NO_HOOKS = "leangraph-fused-nohooks"
"""In-graph accumulation whose replays run no autograd accumulator (``accumulator_hooks=False``:
no gradient-ready hook fires, for loops that register none)."""
METHODS = (
    "eager",
    "torch",
    "leangraph",
    OVERLAP,
    FUSED,
    FUSED_PYTHON_HOOKS,
    FUSED_NO_HOOKS,
    "whole-step",
)
"""Every method the bench knows, in the order it runs them."""
GRAPHED_METHODS = METHODS[1:]
"""The methods that capture graphs (and so have capture figures and timing rounds)."""
LEANGRAPH_METHODS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "leangraph": MappingProxyType({}),
        OVERLAP: MappingProxyType({"overlap_grad_accumulation": True}),
        FUSED: MappingProxyType({"fuse_grad_accumulation": True}),
        FUSED_PYTHON_HOOKS: MappingProxyType(
            {"fuse_grad_accumulation": True, "accumulator_hooks": "python"}
        ),
        FUSED_NO_HOOKS: MappingProxyType(
            {"fuse_grad_accumulation": True, "accumulator_hooks": False}
        ),
    }
)
"""The methods that call ``leangraph.make_graphed_callables``, each with its options."""
OPT_IN_METHODS = (OVERLAP, FUSED, FUSED_PYTHON_HOOKS, FUSED_NO_HOOKS)
"""The methods the bench runs only when asked (``--methods``, or a preset's own list)."""
GRAD_HOOKS_WITHOUT_ACCUMULATORS = (
    f"the {FUSED_NO_HOOKS} method cannot run with gradient-ready hooks (grad_hooks): "
    "accumulator_hooks=False runs no accumulator, so it refuses a parameter whose "
    "accumulator node has a hook, which would never fire"
)
"""Why :data:`FUSED_NO_HOOKS` and ``BenchConfig.grad_hooks`` do not go together."""
CUDA_METHODS: Mapping[str, str] = MappingProxyType(
    {"torch": "torch.cuda.make_graphed_callables", "whole-step": "torch.cuda.CUDAGraph"}
)
"""The methods that need a CUDA device, each with the torch API that makes it so."""
LIMIT = "whole-step"
"""The method every step time is compared with (``x limit``): the whole step as one graph."""


def fused_unavailable(name: str = FUSED) -> str | None:
    """Why an opt-in method (:data:`OPT_IN_METHODS`) cannot run with the installed leangraph,
    or None."""
    taken = inspect.signature(make_graphed_callables).parameters
    missing = [option for option in LEANGRAPH_METHODS[name] if option not in taken]
    if not missing:
        return None
    wanted = ", ".join(f"{option}={value}" for option, value in LEANGRAPH_METHODS[name].items())
    return (
        f"needs make_graphed_callables({wanted}), which the installed leangraph does not take yet"
    )


def method_unavailable(name: str, device: str) -> str | None:
    """Why method ``name`` cannot run on ``device`` here (one clause), or None when it can."""
    if name in CUDA_METHODS and not device.startswith("cuda"):
        return f"needs a CUDA device ({CUDA_METHODS[name]})"
    if name in OPT_IN_METHODS:
        return fused_unavailable(name)
    return None


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """The workload: one rank of a pp x vp interleaved pipeline of transformer blocks."""

    pp_size: int = 4
    vp_size: int = 2
    rank: int = 0
    num_microbatches: int = 16
    layers_per_chunk: int = 4
    shape: Shape = field(
        default_factory=lambda: BlockShape(
            hidden=1024, heads=16, sequence=2048, dtype=torch.bfloat16
        )
    )
    steps: int = 5
    warmup_iters: int = 3
    methods: tuple[str, ...] = tuple(m for m in METHODS if m not in OPT_IN_METHODS)
    device: str = "cuda"
    rounds: int = 0  # extra rounds timing the graphed methods in turn (see RoundTimes)
    launch_steps: int = 0  # steps profiled per method after all timing (0: no launch counts)
    # The initial blocks every method copies from, kept in host memory instead of on the
    # device (a workload whose weights are a good part of the GPU, as the presets').
    initial_on_host: bool = False
    preset: str | None = None  # the name of the preset this config is, for the record
    # A gradient-ready hook on every parameter's accumulator node, for every method but the
    # whole-step graph (see GradReadyHooks).
    grad_hooks: bool = False

    def __post_init__(self) -> None:
        unknown = [name for name in self.methods if name not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
        cuda = self.device.startswith("cuda")
        for name in self.methods:
            why = method_unavailable(name, self.device)
            if why is not None:
                raise ValueError(f"the {name} method {why}")
        if self.grad_hooks and FUSED_NO_HOOKS in self.methods:
            raise ValueError(GRAD_HOOKS_WITHOUT_ACCUMULATORS)
        if self.launch_steps < 0:
            raise ValueError(f"launch_steps must be at least 0, got {self.launch_steps}")
        if self.launch_steps and not cuda:
            raise ValueError(
                "launch counts need a CUDA device (they read torch.profiler's CUDA activity)"
            )


LAUNCH_BOUND = BenchConfig(
    num_microbatches=8,
    shape=BlockShape(hidden=256, heads=4, sequence=128, dtype=torch.bfloat16),
    steps=50,
)
"""The launch-bound workload of ``docs/benchmarks.md``: small blocks, host-bound steps."""


@dataclass(frozen=True)
class LaunchCounts:
    """What one training step launches, per step, from ``torch.profiler``'s CUDA activity.

    ``kernel_launches``: kernels the host launched one by one (a ``cudaLaunchKernel``-like
    call each: eager ops, autograd's gradient accumulation outside graphs); ``graph_launches``:
    ``cudaGraphLaunch`` calls, each running a whole graph; ``gpu_kernels``: kernels the GPU
    ran, in graphs or not, of which ``gpu_kernels_in_graphs`` came from a graph launch (by
    CUPTI correlation). ``gpu_kernels - gpu_kernels_in_graphs`` counts the kernels outside
    graphs again from the GPU's side, a check on ``kernel_launches``.
    """

    steps: int
    graph_launches: float
    kernel_launches: float
    gpu_kernels: float
    gpu_kernels_in_graphs: float

    @property
    def gpu_kernels_outside_graphs(self) -> float:
        """Kernels the GPU ran outside graphs, per step (equal to ``kernel_launches``)."""
        return self.gpu_kernels - self.gpu_kernels_in_graphs


@dataclass
class MethodResult:
    """Figures of one method; bytes relative to its start, None where not applicable."""

    name: str
    step_peak_bytes: int | None = None
    capture_peak_bytes: int | None = None
    held_bytes: int | None = None
    capture_seconds: float | None = None
    step_seconds: float | None = None
    memory_check_seconds: float | None = None  # part of capture_seconds (leangraph)
    start_allocated_bytes: int | None = None  # allocated at the start: the zero of the above
    losses: list[float] = field(default_factory=list)
    launches: LaunchCounts | None = None  # with BenchConfig.launch_steps
    grad_hook_calls_per_step: float | None = None  # with BenchConfig.grad_hooks
    # Why the method has no figures (it ran out of memory), and the peak allocated when it
    # did, above start_allocated_bytes: since the method started, or since leangraph last
    # restarted the peak counter (it does so per phase).
    failure: str | None = None
    failure_peak_bytes: int | None = None


@dataclass
class RoundTimes:
    """Capture and step times of one graphed method over the timing rounds.

    One capture per method says little about a difference of a few percent: on a shared host
    it drifts by more than that between runs. Each round captures every graphed method afresh
    from the same initial blocks and times its steps, the methods taking turns to go first.
    """

    capture_seconds: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)

    @staticmethod
    def spread(values: list[float], scale: float = 1.0) -> str:
        """``median [min-max]`` of ``values`` times ``scale``."""
        low, mid, high = (scale * v for v in (min(values), statistics.median(values), max(values)))
        return f"{mid:.3g} [{low:.3g}-{high:.3g}]"


@dataclass
class BenchResult:
    """All methods' figures, with the config and whether losses agree with eager's."""

    config: dict[str, Any]
    methods: dict[str, MethodResult]
    losses_agree: dict[str, bool]
    report: MemoryReport | None = None
    rounds: dict[str, RoundTimes] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # method -> why it cannot run

    def to_json(self) -> dict[str, Any]:
        """Plain data (the memory report's timeline included) for ``json.dump``."""
        data: dict[str, Any] = {
            "config": self.config,
            "losses_agree": self.losses_agree,
            "methods": {name: asdict(m) for name, m in self.methods.items()},
            "ratios_to_eager_step_peak": {
                name: {
                    f: self.ratio(name, f)
                    for f in ("step_peak_bytes", "capture_peak_bytes", "held_bytes")
                }
                for name in self.methods
            },
        }
        if LIMIT in self.methods:
            data["step_ratios_to_whole_step"] = {n: self.limit_ratio(n) for n in self.methods}
        if self.rounds:
            data["rounds"] = {name: asdict(times) for name, times in self.rounds.items()}
        if LIMIT in self.rounds:
            data["round_step_ratios_to_whole_step"] = {
                n: self.limit_ratio(n, rounds=True) for n in self.rounds
            }
        if self.unavailable:
            data["unavailable"] = self.unavailable
        if self.report is not None:
            # The CPU backend samples no allocator: its points' allocated_bytes are null.
            data["leangraph_timeline"] = [asdict(p) for p in self.report.timeline]
        return data

    def ratio(self, method: str, figure: str) -> float | None:
        """``figure`` of ``method`` over the eager step peak."""
        eager = self.methods.get("eager")
        value = getattr(self.methods.get(method), figure, None) if method in self.methods else None
        if eager is None or not eager.step_peak_bytes or value is None:
            return None
        return float(value) / eager.step_peak_bytes

    def limit_ratio(self, method: str, *, rounds: bool = False) -> float | None:
        """Step time of ``method`` over the whole-step graph's: of the first table, or with
        ``rounds`` of the rounds' medians. None unless both were timed."""
        times: dict[str, float | None]
        if rounds:
            times = {
                n: statistics.median(t.step_seconds)
                for n, t in self.rounds.items()
                if t.step_seconds
            }
        else:
            times = {n: m.step_seconds for n, m in self.methods.items()}
        limit, value = times.get(LIMIT), times.get(method)
        return None if not limit or value is None else value / limit


class _Meter:
    """Peak and current memory relative to where it was created (CUDA), else None."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.allocated: int | None = None
        self.reserved = 0
        gc.collect()  # the previous method's graphs may sit in reference cycles
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.allocated = torch.cuda.memory_allocated()
            self.reserved = torch.cuda.memory_reserved()

    def restart_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak_allocated(self) -> int | None:
        if self.allocated is None:
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.allocated

    def peak_reserved(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_reserved() - self.reserved

    def held(self) -> int | None:
        return torch.cuda.memory_reserved() - self.reserved if self.cuda else None


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class BenchWorkload:
    """Order, layout, data and the initial blocks every method starts from.

    Every method graphs or runs a copy of ``blocks`` (:meth:`copy_blocks`), so all start
    from the same weights; ``blocks`` are on the host with ``config.initial_on_host``, else on
    the device. ``inputs`` and ``targets`` hold one tensor per microbatch (fixed seed).
    """

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.order = interleaved_1f1b(
            config.pp_size, config.vp_size, config.rank, config.num_microbatches
        )
        self.layers_per_chunk = [config.layers_per_chunk] * config.vp_size
        self.layout = Layout(tuple(self.layers_per_chunk), config.num_microbatches)
        # Parsed once, as a training loop parses its schedule: not a cost of any method's step.
        self.steps = order_steps(self.order, self.layers_per_chunk, config.num_microbatches)
        made = make_blocks(self.layout.num_callables, config.shape, config.device)
        self.blocks: list[torch.nn.Module] = (
            [block.to("cpu") for block in made] if config.initial_on_host else list(made)
        )
        del made
        gen = torch.Generator().manual_seed(1)
        count = config.num_microbatches
        self.inputs = hidden_batches(config.shape, count, config.device, gen)
        self.targets = hidden_batches(config.shape, count, config.device, gen)

    def copy_blocks(self) -> list[torch.nn.Module]:
        """A copy of the initial blocks on the device, for one method to train."""
        return [copy.deepcopy(block).to(self.config.device) for block in self.blocks]

    def sample(self) -> tuple[torch.Tensor]:
        """A fresh sample argument tuple of one graph (a random activation)."""
        return (sample_hidden(self.config.shape, self.config.device),)

    def train_step(
        self,
        lookup: LayerLookup,
        blocks: list[torch.nn.Module],
        inputs: list[torch.Tensor] | None = None,
        targets: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """One training step in the order, as every method runs it: gradients of ``blocks``
        set to None, then every forward and backward through ``lookup`` on ``inputs`` and
        ``targets`` (default: the workload's). Returns the losses as tensors, so that it can be
        captured: reading them is the caller's (:meth:`step`, :meth:`WholeStepGraph.step`)."""
        inputs = self.inputs if inputs is None else inputs
        targets = self.targets if targets is None else targets
        for block in blocks:
            block.zero_grad(set_to_none=True)
        steps = (
            self.steps
            if len(inputs) == self.config.num_microbatches
            else order_steps(self.order, self.layers_per_chunk, len(inputs))
        )
        result = run_steps(
            steps,
            self.layers_per_chunk,
            lookup,
            inputs,
            lambda out, m: torch.nn.functional.mse_loss(out.float(), targets[m].float()),
        )
        return result.losses

    def step(self, lookup: LayerLookup, blocks: list[torch.nn.Module]) -> list[float]:
        """One training step in the order (gradients of ``blocks`` zeroed first); the losses."""
        return [float(loss) for loss in self.train_step(lookup, blocks)]

    def timed_steps(
        self,
        step: Callable[[], list[float]],
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[list[float], float]:
        """One untimed ``step()``, then ``config.steps`` timed ones: its losses, the median time.

        ``on_step`` is called with the number of steps done after each (1 to ``steps + 1``).
        """
        losses = step()  # not timed: first replays, lazy inits
        times = []
        for done in range(1, self.config.steps + 1):
            if on_step is not None:
                on_step(done)
            _sync(self.config.device)
            start = time.perf_counter()
            step()
            _sync(self.config.device)
            times.append(time.perf_counter() - start)
        if on_step is not None:
            on_step(self.config.steps + 1)
        return losses, statistics.median(times)

    def eager_lookup(self, blocks: list[torch.nn.Module]) -> LayerLookup:
        """What to run per (chunk, microbatch, layer) eagerly: the layer's block itself."""
        return self.tabled(lambda c, m, l: blocks[self.layout.callable_index(c, l)])

    def tabled(self, pick: Callable[[int, int, int], Any]) -> LayerLookup:
        """``pick`` as a lookup that reads a table of its results for every graph of the
        layout: one dict read per layer call, whichever method it is (a layout's validated
        index arithmetic would cost some methods more host time per step than others)."""
        graph_ids = map(self.layout.graph_id, range(self.layout.num_graphs))
        table = {
            (g.chunk, g.microbatch, g.layer): pick(g.chunk, g.microbatch, g.layer)
            for g in graph_ids
        }
        return lambda c, m, l: table[(c, m, l)]


class GradReadyHooks:
    """A Python hook on every parameter's accumulator node, as Megatron-core's DDP registers
    its gradient-ready hooks (and, as it does, the nodes held): what a training loop that
    reduces gradients during the backward adds to each method's step. Each call counts.

    Registered after capture: accumulator nodes held from before a CUDA capture break it.
    The whole-step graph gets none (a Python hook in a captured graph does not run at
    replay).
    """

    def __init__(self, blocks: Sequence[torch.nn.Module]) -> None:
        self.calls = 0
        self._nodes = []
        for block in blocks:
            for param in block.parameters():
                grad_fn = param.view_as(param).grad_fn
                assert grad_fn is not None
                node = grad_fn.next_functions[0][0]
                assert node is not None
                node.register_hook(self._called)
                self._nodes.append(node)

    def _called(self, *_: object) -> None:
        self.calls += 1


@dataclass(frozen=True)
class Captured:
    """One graphed method's result over its own copy of the blocks of ``work``.

    :meth:`step` trains one step with it. ``lookup`` gives what to run for (chunk, microbatch,
    layer); the whole-step method has nothing per layer and gives ``whole_step`` instead.
    ``graphed`` is leangraph's result (None for the others), for ``memory_report``. The graphs
    alias their own static buffers until :meth:`release` (leangraph, whole-step) or until the
    object is dropped (torch).
    """

    work: BenchWorkload
    blocks: list[torch.nn.Module]
    lookup: LayerLookup | None = None
    graphed: tuple[GraphedCallable, ...] | None = None
    whole_step: WholeStepGraph | None = None
    grad_hooks: GradReadyHooks | None = None  # with BenchConfig.grad_hooks

    def __post_init__(self) -> None:
        if (self.lookup is None) == (self.whole_step is None):
            raise ValueError("a Captured runs its step through a lookup or a whole-step graph")

    def step(self) -> list[float]:
        """One training step of this method: :meth:`BenchWorkload.step` through ``lookup``, or
        one replay of the whole-step graph; its losses."""
        if self.whole_step is not None:
            return self.whole_step.step()
        assert self.lookup is not None  # __post_init__: one of the two
        return self.work.step(self.lookup, self.blocks)

    def release(self) -> None:
        """Free leangraph's graphs (``reset_all``) and the whole-step graph now; torch's go
        with the last reference."""
        if self.graphed is not None:
            reset_all(self.graphed)
        if self.whole_step is not None:
            self.whole_step.release()


def _forward_positions(work: BenchWorkload) -> dict[tuple[int, int, int], int]:
    """(chunk, microbatch, layer) -> position in the schedule's forward order."""
    positions: dict[tuple[int, int, int], int] = {}
    for step in work.steps:
        if step.kind is StepKind.FORWARD:
            for layer in range(work.layers_per_chunk[step.chunk - 1]):
                positions[(step.chunk, step.microbatch, layer)] = len(positions)
    return positions


class _SharedParams(torch.nn.Module):
    """A distinct module per graph over one block's parameters (torch graphs modules once)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def capture_torch(work: BenchWorkload, blocks: list[torch.nn.Module]) -> Captured:
    """Graph ``blocks`` with ``torch.cuda.make_graphed_callables`` (CUDA only).

    One wrapper module per graph, listed in the schedule's forward order (torch's best case:
    it captures every forward in that order, then every backward in reverse).
    """
    positions = _forward_positions(work)
    by_position = sorted(positions.items(), key=lambda item: item[1])
    wrappers = [
        _SharedParams(blocks[work.layout.callable_index(c, l)]) for (c, _, l), _ in by_position
    ]
    graphed = torch.cuda.make_graphed_callables(
        tuple(wrappers),
        tuple(work.sample() for _ in wrappers),
        num_warmup_iters=work.config.warmup_iters,
    )
    modules = cast(tuple[torch.nn.Module, ...], graphed)  # a tuple of modules in, modules out
    return Captured(work, blocks, work.tabled(lambda c, m, l: modules[positions[(c, m, l)]]))


def capture_leangraph(
    work: BenchWorkload,
    blocks: list[torch.nn.Module],
    *,
    progress: ProgressCallback | None = None,
    **options: Any,
) -> Captured:
    """Graph ``blocks`` with ``leangraph.make_graphed_callables`` in the workload's order.

    ``options`` go to ``make_graphed_callables`` as they are (``check_memory=False``, say).
    """
    sample = work.sample()  # one sample for every graph: leangraph copies what it needs
    graphed = make_graphed_callables(
        tuple(blocks),
        tuple(sample for _ in range(work.layout.num_graphs)),
        order=work.order,
        num_layers_per_chunk=work.layers_per_chunk,
        num_warmup_iters=work.config.warmup_iters,
        progress=progress,
        **options,
    )
    lookup = work.tabled(lambda c, m, l: graphed[work.layout.graph_index(c, m, l)])
    return Captured(work, blocks, lookup, graphed)


class WholeStepGraph:
    """One rank's whole training step, captured by hand as one ``torch.cuda.CUDAGraph``.

    The captured step is :meth:`BenchWorkload.train_step` itself (eager's step: the same
    blocks, order and loss) over static copies of the workload's inputs and targets, which
    :meth:`step` copies in again before each replay, as a training loop would its next batch.
    Parameter gradients are set to None before capture, as eager's step sets them, so each
    parameter's first backward in the graph creates its ``.grad`` in the graph's pool and the
    later ones add into it in place (autograd accumulates in place outside ``create_graph``):
    a replay computes eager's gradients from zero with eager's own kernels, and no zero-fill
    joins the limit.

    Memory aliasing: the losses :meth:`step` reads and every ``.grad`` of ``blocks`` after a
    replay are graph-pool tensors, rewritten by each replay and valid until the next one or
    :meth:`release`.
    """

    def __init__(self, work: BenchWorkload, blocks: list[torch.nn.Module]) -> None:
        self.work = work
        self.blocks = blocks
        self.inputs = [x.clone() for x in work.inputs]
        self.targets = [t.clone() for t in work.targets]
        self.losses: list[torch.Tensor] = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def run(self) -> list[torch.Tensor]:
        """The step the graph holds, run eagerly on the static inputs: the warm-up's and the
        capture's step (and, on the CPU, what the tests compare with eager's)."""
        lookup = self.work.eager_lookup(self.blocks)
        return self.work.train_step(lookup, self.blocks, self.inputs, self.targets)

    def capture(self) -> None:
        """Warm up ``config.warmup_iters`` steps on a side stream, then capture one step on it.

        The warm-up keeps lazy set-up (cuBLAS handles and workspaces, autograd's device
        threads) out of the graph, on the stream the capture then uses.

        Raises:
            RuntimeError: when the workload is not on a CUDA device.
        """
        if not self.inputs[0].is_cuda:
            raise RuntimeError(
                f"the whole-step graph needs CUDA tensors (torch.cuda.CUDAGraph); the "
                f"workload is on {self.inputs[0].device}"
            )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(1, self.work.config.warmup_iters)):
                self.run()
        torch.cuda.current_stream().wait_stream(side)
        for block in self.blocks:  # warm-up's gradients go back before capture starts
            block.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            self.losses = self.run()
        self.graph = graph

    def step(self) -> list[float]:
        """Copy the workload's inputs and targets in, replay the step; its losses.

        Raises:
            RuntimeError: before :meth:`capture` or after :meth:`release`.
        """
        if self.graph is None:
            raise RuntimeError("the whole-step graph is not captured (or was released)")
        for static, batch in zip(self.inputs + self.targets, self.work.inputs + self.work.targets):
            static.copy_(batch)
        self.graph.replay()
        return [float(loss) for loss in self.losses]

    def release(self) -> None:
        """Free the graph and its pool now: the graph, its losses and the blocks' gradients
        (pool tensors) go."""
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        self.losses = []
        for block in self.blocks:
            block.zero_grad(set_to_none=True)


def capture_whole_step(work: BenchWorkload, blocks: list[torch.nn.Module]) -> Captured:
    """Capture the whole training step over ``blocks`` as one graph (CUDA only); see
    :class:`WholeStepGraph`."""
    whole = WholeStepGraph(work, blocks)
    whole.capture()
    return Captured(work, blocks, whole_step=whole)


def capture_method(
    work: BenchWorkload,
    name: str,
    blocks: list[torch.nn.Module] | None = None,
    *,
    progress: ProgressCallback | None = None,
    **options: Any,
) -> Captured:
    """Graph ``blocks`` (default: a fresh copy of the workload's initial blocks) with ``name``.

    ``progress`` and ``options`` go to leangraph's ``make_graphed_callables`` (leangraph-fused
    adds ``fuse_grad_accumulation=True``: :data:`LEANGRAPH_METHODS`); torch and whole-step
    take neither.

    Raises:
        ValueError: for a name outside :data:`GRAPHED_METHODS`, options given to torch or
            whole-step, or leangraph-fused where the installed leangraph lacks it.
    """
    if name not in GRAPHED_METHODS:
        raise ValueError(f"no graphed method {name!r}; choose from {', '.join(GRAPHED_METHODS)}")
    if name not in LEANGRAPH_METHODS and (options or progress is not None):
        raise ValueError(f"the {name} method takes no options, got {sorted(options) or 'progress'}")
    why = fused_unavailable(name) if name in OPT_IN_METHODS else None
    if why is not None:
        raise ValueError(f"the {name} method {why}")
    blocks = work.copy_blocks() if blocks is None else blocks
    if name == "torch":
        captured = capture_torch(work, blocks)
    elif name == "whole-step":
        return capture_whole_step(work, blocks)
    else:
        options = {**LEANGRAPH_METHODS[name], **options}
        captured = capture_leangraph(work, blocks, progress=progress, **options)
    if work.config.grad_hooks:
        return dataclasses.replace(captured, grad_hooks=GradReadyHooks(blocks))
    return captured


def graph_methods(
    work: BenchWorkload, names: tuple[str, ...] = GRAPHED_METHODS, *, untimed_steps: int = 0
) -> dict[str, Captured]:
    """Capture each of ``names`` on its own copy of the blocks, in turn, each followed by
    ``untimed_steps`` training steps (first replays, lazy set-up) before the next capture."""
    graphed = {}
    for name in names:
        graphed[name] = captured = capture_method(work, name)
        for _ in range(untimed_steps):
            captured.step()
    return graphed


KERNEL_LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchCooperativeKernel",
    "cuLaunchKernel",
    "cuLaunchCooperativeKernel",
)
"""Name prefixes of the CUDA runtime and driver calls that launch one kernel, as
``torch.profiler`` names them (``cudaLaunchKernelExC`` and the ``_ptsz`` forms included)."""
GRAPH_LAUNCH_CALLS = ("cudaGraphLaunch", "cuGraphLaunch")
"""Name prefixes of the calls that launch a whole CUDA graph."""


def self_device_us(event: Any) -> float:
    """Self device time of a ``torch.profiler`` average or event, in µs (torch 2.4 names it
    ``self_cuda_time_total``, later versions ``self_device_time_total``)."""
    value = getattr(event, "self_device_time_total", None)
    return float(event.self_cuda_time_total if value is None else value)


def profile_steps(step: Callable[[], object], steps: int) -> Any:
    """``steps`` calls of ``step`` under ``torch.profiler`` with CPU and CUDA activity,
    synchronised before the first and after the last (CUDA only); the finished profiler, for
    its ``events()`` and ``key_averages()``."""
    from torch.profiler import ProfilerActivity, profile

    if _cuda_version() < (12, 6):
        # torch's own profiler does this with CUDA graphs in the process: re-initialising
        # CUPTI after a teardown crashed with graphs before CUDA 12.6, and the bench
        # profiles once per method.
        os.environ.setdefault("TEARDOWN_CUPTI", "0")
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        # torch 2.11 warns, once per process, that a second profiler keeps only its own
        # events, which is what each count wants.
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    return prof


def _cuda_version() -> tuple[int, ...]:
    text = torch.version.cuda or "0"
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def launch_counts(events: Iterable[Any], steps: int) -> LaunchCounts:
    """Count what ``steps`` profiled steps launched: ``events`` are ``torch.profiler``
    events (each with ``name``, ``device_type`` and ``id``, the CUPTI correlation id of a
    launch call and of the kernels it ran). Memory copies and sets are not kernels."""
    graph_calls: set[int] = set()
    device_kernels: list[int] = []
    graph_launches = kernel_launches = 0
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA:
            if not event.name.startswith(("Memcpy", "Memset")):
                device_kernels.append(event.id)
        elif event.name.startswith(GRAPH_LAUNCH_CALLS):
            graph_launches += 1
            graph_calls.add(event.id)
        elif event.name.startswith(KERNEL_LAUNCH_CALLS):
            kernel_launches += 1
    in_graphs = sum(1 for correlation in device_kernels if correlation in graph_calls)
    return LaunchCounts(
        steps=steps,
        graph_launches=graph_launches / steps,
        kernel_launches=kernel_launches / steps,
        gpu_kernels=len(device_kernels) / steps,
        gpu_kernels_in_graphs=in_graphs / steps,
    )


def count_launches(step: Callable[[], object], steps: int = 3) -> LaunchCounts:
    """Kernel and graph launches per training step over ``steps`` profiled calls of
    ``step`` (:func:`profile_steps`, :func:`launch_counts`); run it warm, after timing.

    Raises:
        ValueError: for ``steps`` below 1.
        RuntimeError: when the profiler saw kernels run but no launch call of a known name
            (counting nothing would read as a perfect graph).
    """
    if steps < 1:
        raise ValueError(f"count_launches needs at least one step, got {steps}")
    counts = launch_counts(profile_steps(step, steps).events(), steps)
    if counts.gpu_kernels and not (counts.graph_launches or counts.kernel_launches):
        raise RuntimeError(
            f"torch.profiler saw {counts.gpu_kernels:.0f} kernels per step on the GPU but no "
            f"launch call named {', '.join(KERNEL_LAUNCH_CALLS + GRAPH_LAUNCH_CALLS)}: this "
            "torch names them otherwise, so the bench cannot count them"
        )
    return counts


def _sampling_replay(
    captured: Captured, layout: Layout, points: list[TimelinePoint]
) -> LayerLookup:
    """``captured.lookup`` that appends allocated memory after each forward replay."""
    assert captured.graphed is not None  # only leangraph's graphs have labels to name

    def lookup(c: int, m: int, l: int) -> Callable[[torch.Tensor], torch.Tensor]:
        graph = captured.graphed[layout.graph_index(c, m, l)]  # type: ignore[index]

        def sampled(x: torch.Tensor) -> torch.Tensor:
            out = graph(x)
            allocated = torch.cuda.memory_allocated() if x.is_cuda else None
            points.append(TimelinePoint("replay", f"F c{c} m{m} l{l}", graph.label, allocated))
            return out

        return sampled

    return lookup


def _training_phase(
    progress: PhaseProgress | None, name: str, config: BenchConfig, measured: int
) -> Callable[[int], None] | None:
    """Show phase ``name``: ``measured`` steps read for memory, then :meth:`timed_steps`'
    untimed and timed ones; the callback it returns counts those of ``timed_steps``."""
    if progress is None:
        return None
    progress.begin(name, measured + 1 + config.steps, "steps")
    return lambda done: progress.advance(measured + done)


def _count_all_launches(
    work: BenchWorkload, methods: dict[str, MethodResult], progress: PhaseProgress | None
) -> None:
    """Each method's launch counts over ``config.launch_steps`` profiled steps, once all
    timing is done: steps timed after a profile can be slower (on an H200, torch's 16-
    microbatch steps took 76 ms before a profile of eager's steps and 90-92 ms after it). A
    graphed method is captured afresh for it, from the same initial blocks, and stepped once
    untimed before the profile; what a step launches is the same at every capture."""
    steps = work.config.launch_steps
    for name, result in methods.items():
        if progress is not None:
            progress.begin(f"launch counts: {name} (torch.profiler over {plural(steps, 'step')})")
        result.launches = _method_launches(work, name, steps)


def _method_launches(work: BenchWorkload, name: str, steps: int) -> LaunchCounts:
    """:func:`count_launches` of ``name`` on fresh blocks, after one untimed step."""
    if name == "eager":
        blocks = work.copy_blocks()
        lookup = work.eager_lookup(blocks)
        work.step(lookup, blocks)
        return count_launches(lambda: work.step(lookup, blocks), steps)
    _Meter(work.config.device)  # collect, synchronise and empty the cache first
    captured = capture_method(work, name)
    try:
        captured.step()
        return count_launches(captured.step, steps)
    finally:
        captured.release()


def _bench_eager(work: BenchWorkload, progress: PhaseProgress | None) -> MethodResult:
    blocks = work.copy_blocks()
    on_step = _training_phase(progress, "eager: training", work.config, measured=1)
    meter = _Meter(work.config.device)
    lookup = work.eager_lookup(blocks)
    hooks = GradReadyHooks(blocks) if work.config.grad_hooks else None
    losses = work.step(lookup, blocks)
    result = MethodResult(
        "eager",
        step_peak_bytes=meter.peak_allocated(),
        start_allocated_bytes=meter.allocated,
        losses=losses,
    )
    result.step_seconds, result.grad_hook_calls_per_step = _timed_with_hooks(
        work, lambda: work.step(lookup, blocks), on_step, hooks
    )
    return result


def _timed_with_hooks(
    work: BenchWorkload,
    step: Callable[[], list[float]],
    on_step: Callable[[int], None] | None,
    hooks: GradReadyHooks | None,
) -> tuple[float, float | None]:
    """:meth:`BenchWorkload.timed_steps`' median step time, and the gradient-ready hook
    calls per step over those steps (None without hooks)."""
    if hooks is not None:
        hooks.calls = 0
    _, seconds = work.timed_steps(step, on_step)
    if hooks is None:
        return seconds, None
    return seconds, hooks.calls / (work.config.steps + 1)  # timed_steps' untimed one too


def _leangraph_figures(result: MethodResult, report: MemoryReport, meter: _Meter) -> None:
    """Peak and memory-check time from leangraph's own record (it restarts the allocator's
    peak counter per phase, so the meter's peak would miss warm-up)."""
    record = report.record
    if record.warmup_peak_bytes is not None and meter.allocated is not None:
        peak = max(record.warmup_peak_bytes, record.capture_peak_bytes or 0)
        result.capture_peak_bytes = peak - meter.allocated
    result.memory_check_seconds = (result.capture_seconds or 0.0) - (
        record.warmup_seconds + record.capture_seconds
    )


def _announce_capture(work: BenchWorkload, name: str, progress: PhaseProgress | None) -> None:
    """Show the capture phase of ``name`` before it starts (leangraph's then counts steps)."""
    if progress is None:
        return
    if name == "torch":
        progress.begin("torch: capture (torch.cuda.make_graphed_callables, warm-up included)")
    elif name == "whole-step":
        progress.begin("whole-step: capture (one torch.cuda.CUDAGraph, warm-up included)")
    else:
        progress.expect_capture(
            prefix=f"{name}: ",
            warmup_passes=work.config.warmup_iters,
            memory_check=work.config.device.startswith("cuda"),
        )


def _bench_graphed(
    work: BenchWorkload, name: str, progress: PhaseProgress | None
) -> tuple[MethodResult, MemoryReport | None]:
    blocks = work.copy_blocks()
    _announce_capture(work, name, progress)
    meter = _Meter(work.config.device)
    start = time.perf_counter()
    captured = capture_method(
        work, name, blocks, progress=progress if name in LEANGRAPH_METHODS else None
    )
    _sync(work.config.device)
    result = MethodResult(
        name,
        capture_seconds=time.perf_counter() - start,
        capture_peak_bytes=meter.peak_allocated(),
        held_bytes=meter.held(),
        start_allocated_bytes=meter.allocated,
    )
    report = None if captured.graphed is None else memory_report(captured.graphed)
    if report is not None:
        _leangraph_figures(result, report, meter)
    on_step = _training_phase(progress, f"{name}: training", work.config, measured=1)
    meter.restart_peak()
    replay: list[TimelinePoint] = []
    if report is None:
        result.losses = captured.step()
    else:
        result.losses = work.step(_sampling_replay(captured, work.layout, replay), blocks)
    result.step_peak_bytes = meter.peak_reserved()
    result.step_seconds, result.grad_hook_calls_per_step = _timed_with_hooks(
        work, captured.step, on_step, captured.grad_hooks
    )
    captured.release()
    return result, None if report is None else report.with_points(replay)


def _agree(reference: list[float], losses: list[float], dtype: torch.dtype) -> bool:
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    return len(reference) == len(losses) and all(
        abs(a - b) <= tolerance * max(1.0, abs(a)) for a, b in zip(reference, losses)
    )


def run_bench(config: BenchConfig, progress: PhaseProgress | None = None) -> BenchResult:
    """Run the configured methods one after the other; see the module docstring.

    ``progress`` hears of each phase (a method's capture, leangraph's memory check, warm-up
    passes and capture step by step, each method's training steps, the timing rounds).

    A method that runs out of device memory (``torch.cuda.OutOfMemoryError``, or leangraph's
    ``CaptureMemoryError`` before warm-up) is a result: its row says so, its memory is freed,
    the next method runs, and it joins no timing round and no launch count.
    """
    work = BenchWorkload(config)
    methods: dict[str, MethodResult] = {}
    report: MemoryReport | None = None
    for name in config.methods:
        reports: list[MemoryReport] = []
        bench = functools.partial(_bench_one, work, name, progress, reports)
        methods[name] = run_guarded(name, config.device, bench)
        if name == "leangraph" and reports:
            report = reports[0]
        _sync(config.device)
    reference = methods["eager"].losses if "eager" in methods else []
    agree = {
        name: _agree(reference, m.losses, config.shape.dtype)
        for name, m in methods.items()
        if name != "eager" and reference and m.failure is None
    }
    settings = asdict(config)
    settings["shape"] = {
        "block": type(config.shape).__name__,
        **asdict(config.shape),
        "dtype": str(config.shape.dtype),
    }
    ran = tuple(name for name, m in methods.items() if m.failure is None)
    rounds = _run_rounds(work, progress, ran) if config.rounds else {}
    if config.launch_steps:
        _count_all_launches(work, {n: m for n, m in methods.items() if n in ran}, progress)
    unavailable = {
        name: why
        for name in METHODS
        if name not in config.methods and (why := method_unavailable(name, config.device))
    }
    return BenchResult(
        settings, methods, agree, report=report, rounds=rounds, unavailable=unavailable
    )


def _bench_one(
    work: BenchWorkload, name: str, progress: PhaseProgress | None, reports: list[MemoryReport]
) -> MethodResult:
    """Method ``name``'s figures; a leangraph method's memory report goes to ``reports``."""
    if name == "eager":
        return _bench_eager(work, progress)
    result, report = _bench_graphed(work, name, progress)
    if report is not None:
        reports.append(report)
    return result


def _memory_failure(exc: BaseException) -> BaseException | None:
    """The out-of-memory error in ``exc``'s chain (itself, its cause or context), or None.

    A CUDA graph capture that runs out of memory may end in another error raised on the way
    out (``capture_end`` of the abandoned capture), with the out-of-memory one as its context.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (torch.cuda.OutOfMemoryError, CaptureMemoryError)):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _describe_failure(exc: BaseException) -> str | None:
    """``out of memory: <type>: <first line>`` for a memory failure in ``exc``, else None."""
    cause = _memory_failure(exc)
    if cause is None:
        return None
    lines = str(cause).strip().splitlines()
    return f"out of memory: {type(cause).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def run_guarded(name: str, device: str, run: Callable[[], MethodResult]) -> MethodResult:
    """``run()``, or, when it runs out of device memory, a result that says so.

    The out-of-memory error (:func:`torch.cuda.OutOfMemoryError` anywhere in the chain of what
    ``run`` raised, or leangraph's ``CaptureMemoryError``) becomes ``MethodResult.failure``, with
    the peak allocated until then in ``failure_peak_bytes``; the error and its traceback, which
    hold the method's tensors and graphs, are dropped, and the memory is collected and the
    cache emptied, so that the next method starts from where this one did. Any other error
    propagates.
    """
    cuda = device.startswith("cuda")
    start = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    try:
        return run()
    except Exception as exc:
        failure = _describe_failure(exc)
        if failure is None:
            raise
    # Out of the except clause: the error, its traceback and their frames are gone.
    peak = torch.cuda.max_memory_allocated() - start if start is not None else None
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return MethodResult(name, failure=failure, failure_peak_bytes=peak, start_allocated_bytes=start)


def _run_rounds(
    work: BenchWorkload, progress: PhaseProgress | None, ran: tuple[str, ...]
) -> dict[str, RoundTimes]:
    """``config.rounds`` rounds of capture plus timed steps per graphed method of ``ran``; see
    :class:`RoundTimes`. Progress names each round's captures but does not count their steps:
    those captures are timed."""
    config = work.config
    names = [name for name in ran if name in GRAPHED_METHODS]
    times = {name: RoundTimes() for name in names}
    for round_index in range(config.rounds):
        first = round_index % len(names) if names else 0
        for name in names[first:] + names[:first]:
            where = f"timing round {round_index + 1} of {config.rounds}: {name}"
            if progress is not None:
                progress.begin(f"{where} capture")
            blocks = work.copy_blocks()
            _Meter(config.device)  # collect, synchronise and empty the cache first
            start = time.perf_counter()
            captured = capture_method(work, name, blocks)
            _sync(config.device)
            times[name].capture_seconds.append(time.perf_counter() - start)
            on_step = _training_phase(progress, f"{where} training", config, measured=0)
            times[name].step_seconds.append(work.timed_steps(captured.step, on_step)[1])
            captured.release()
            del captured, blocks
    return times


_Cell = Callable[[str, MethodResult], str]


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _per_step(launches: LaunchCounts | None, figure: str) -> str:
    if launches is None:
        return "-"
    value = float(getattr(launches, figure))
    return f"{value:.0f}" if value == round(value) else f"{value:.1f}"


def _table_columns(result: BenchResult) -> list[tuple[str, int, _Cell]]:
    """The first table's columns after the method's name: (header, width, cell); ``x limit``
    when whole-step ran, the launch counts when they were taken, the loss verdict last."""

    def memory(figure: str) -> _Cell:
        def cell(name: str, m: MethodResult) -> str:
            value, ratio = getattr(m, figure), result.ratio(name, figure)
            text = "-" if value is None else f"{value / MIB:.0f}"
            return text if ratio is None else f"{text} ({ratio:.2f}x)"

        return cell

    def loss(name: str, _: MethodResult) -> str:
        if name == "eager":
            return "ref"
        verdict = result.losses_agree.get(name)  # none without eager, or for a failed method
        return "-" if verdict is None else ("ok" if verdict else "DIFF")

    columns: list[tuple[str, int, _Cell]] = [
        ("step peak MiB", 20, memory("step_peak_bytes")),
        ("warm-up+capture peak MiB", 26, memory("capture_peak_bytes")),
        ("held after capture MiB", 24, memory("held_bytes")),
        (
            "capture s",
            9,
            lambda _, m: "-" if m.capture_seconds is None else f"{m.capture_seconds:.2f}",
        ),
        (
            "step ms",
            8,
            lambda _, m: "-" if m.step_seconds is None else f"{m.step_seconds * 1000:.1f}",
        ),
    ]
    if LIMIT in result.methods:
        columns.append(("x limit", 7, lambda name, _: _times(result.limit_ratio(name))))
    if any(m.grad_hook_calls_per_step is not None for m in result.methods.values()):
        columns.append(
            (
                "grad hooks/step",
                15,
                lambda _, m: (
                    "-"
                    if m.grad_hook_calls_per_step is None
                    else f"{m.grad_hook_calls_per_step:.0f}"
                ),
            )
        )
    if any(m.launches is not None for m in result.methods.values()):
        columns += [
            ("graph launches/step", 19, lambda _, m: _per_step(m.launches, "graph_launches")),
            (
                "kernels outside graphs/step",
                27,
                lambda _, m: _per_step(m.launches, "kernel_launches"),
            ),
        ]
    return [*columns, ("loss", 6, loss)]


def _launch_notes(result: BenchResult) -> list[str]:
    """A line per method whose launch calls and GPU-side count of kernels outside graphs
    differ: the profiler then named a launch call this bench does not know, or lost events."""
    notes = []
    for name, m in result.methods.items():
        counts = m.launches
        if (
            counts is not None
            and abs(counts.kernel_launches - counts.gpu_kernels_outside_graphs) > 0.5
        ):
            notes.append(
                f"note: {name}: {counts.kernel_launches:.0f} kernel launch calls per step, but "
                f"the GPU ran {counts.gpu_kernels_outside_graphs:.0f} kernels outside graphs"
            )
    return notes


def _rounds_lines(result: BenchResult, named: int) -> list[str]:
    count = len(next(iter(result.rounds.values())).capture_seconds)
    limit = LIMIT in result.rounds
    lines = [
        "",
        f"{count} rounds, median [min-max]{' (x limit: of the medians)' if limit else ''}:",
        f"{'method':<{named}} {'capture s':>24} {'step ms':>24}"
        + (f" {'x limit':>7}" if limit else ""),
    ]
    for name, t in result.rounds.items():
        ratio = f" {_times(result.limit_ratio(name, rounds=True)):>7}" if limit else ""
        lines.append(
            f"{name:<{named}} {RoundTimes.spread(t.capture_seconds):>24} "
            f"{RoundTimes.spread(t.step_seconds, 1000):>24}{ratio}"
        )
    return lines


def _failure_cell(m: MethodResult) -> str:
    """A failed method's row after its name: why, and how far its memory got."""
    text = m.failure or ""
    if m.failure_peak_bytes is not None:
        text += f" (peak {m.failure_peak_bytes / MIB:.0f} MiB above its start before that)"
    return text


def format_table(result: BenchResult) -> str:
    """The result as a fixed-width table: MiB and ratios to the eager step peak, times, step
    times as ratios to the whole-step graph's (``x limit``), launches per step, the rounds.
    A method that ran out of memory has a row saying so; one that could not run here, a
    ``not run`` row with the reason."""
    columns = _table_columns(result)
    named = max(10, *(len(name) for name in [*result.methods, *result.unavailable]))
    header = " ".join(
        [f"{'method':<{named}}"] + [f"{title:>{width}}" for title, width, _ in columns]
    )
    lines = [header, "-" * len(header)]
    for name, m in result.methods.items():
        if m.failure is not None:
            lines.append(f"{name:<{named}} {_failure_cell(m)}")
            continue
        cells = [f"{cell(name, m):>{width}}" for _, width, cell in columns]
        lines.append(" ".join([f"{name:<{named}}", *cells]))
    lines += [f"{name:<{named}} not run: {why}" for name, why in result.unavailable.items()]
    lines += _launch_notes(result)
    if result.rounds:
        lines += _rounds_lines(result, named)
    return "\n".join(lines)


REPLAY_NOTE = (
    "forwards of the first graphed step;\n"
    "the rise is gradients and losses\n"
    "allocated outside the graphs"
)
"""What the replay part of the bench's timeline shows: replays allocate nothing, so the
rise is the step's own tensors (parameter gradients, losses, chunk-1 input gradients)."""


def _workload_title(result: BenchResult) -> str:
    c = result.config
    shape = c["shape"]
    dtype = str(shape["dtype"]).replace("torch.", "")
    chunks = f"{plural(c['vp_size'], 'chunk')} x {plural(c['layers_per_chunk'], 'block')}"
    return (
        f"rank {c['rank']} of PP{c['pp_size']}/VP{c['vp_size']}, "
        f"{plural(c['num_microbatches'], 'microbatch', 'microbatches')}, {chunks}, hidden "
        f"{shape['hidden']}, sequence {shape['sequence']}, {dtype}"
    )


def timeline_references(result: BenchResult) -> dict[str, int]:
    """The other methods' peaks on leangraph's timeline scale (absolute allocated bytes).

    Each method's figures are above the memory held when it started (the same weights and
    data for all), so leangraph's start plus eager's step peak is where an eager step would
    reach on leangraph's timeline; likewise torch's warm-up+capture peak.
    """
    leangraph_start = getattr(result.methods.get("leangraph"), "start_allocated_bytes", None)
    if leangraph_start is None:
        return {}
    levels = {
        "eager step peak (the limit)": ("eager", "step_peak_bytes"),
        "torch warm-up+capture peak": ("torch", "capture_peak_bytes"),
    }
    references = {}
    for label, (method, figure) in levels.items():
        value = getattr(result.methods.get(method), figure, None)
        if value is not None:
            references[label] = leangraph_start + value
    return references


def plot_timeline(result: BenchResult, path: str | Path) -> Path:
    """leangraph's memory timeline (warm-up, capture, the first graphed step) with eager's
    step peak and torch's capture peak drawn across it; see :func:`leangraph.plot_memory`.

    Raises:
        ValueError: when leangraph did not run, or nothing was measured (the CPU backend).
    """
    if result.report is None:
        raise ValueError("the bench has no leangraph timeline: leangraph was not among its methods")
    return plot_memory(
        result.report,
        path,
        title=f"leangraph memory timeline\n{_workload_title(result)}",
        references=timeline_references(result),
        phase_notes={"replay": REPLAY_NOTE},
    )


_BAR_FIGURES = (
    ("step peak", "step_peak_bytes", "#4d9de0"),
    ("warm-up+capture peak", "capture_peak_bytes", "#f2c14e"),
    ("held after capture", "held_bytes", "#5fad56"),
)


def _bar_labels(result: BenchResult, names: list[str], figure: str) -> tuple[list[str], list[str]]:
    """Per method, the label inside its bar (MiB, and the ratio to eager's step peak under it)
    and the one above it (``n/a`` where the method has no such figure, as eager's capture)."""
    inside, above = [], []
    for name in names:
        value = getattr(result.methods[name], figure)
        ratio = result.ratio(name, figure)
        text = "" if value is None else f"{value / MIB:.0f}"
        inside.append(text if ratio is None or value is None else f"{text}\n{ratio:.2f}x")
        above.append("n/a" if value is None else "")
    return inside, above


def plot_bars(result: BenchResult, path: str | Path) -> Path:
    """Bar chart of each method's step peak, warm-up+capture peak and memory held after
    capture, in MiB above the weights and data, each bar labelled with its value and its
    ratio to eager's step peak (needs matplotlib).

    Raises:
        ValueError: when no method has a memory figure (a CPU run measures none).
    """
    names = list(result.methods)
    if all(getattr(result.methods[n], f[1]) is None for n in names for f in _BAR_FIGURES):
        raise ValueError("no method has a memory figure (a CPU run measures none): nothing to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(_BAR_FIGURES)
    tallest = 0.0
    for i, (title, figure, colour) in enumerate(_BAR_FIGURES):
        heights = [(getattr(result.methods[n], figure) or 0) / MIB for n in names]
        tallest = max(tallest, *heights)
        bars = ax.bar(
            [x + i * width for x in range(len(names))], heights, width, label=title, color=colour
        )
        inside, above = _bar_labels(result, names, figure)
        ax.bar_label(bars, labels=inside, label_type="center", fontsize=8)
        ax.bar_label(bars, labels=above, padding=2, fontsize=8)
    eager = result.methods.get("eager")
    if eager is not None and eager.step_peak_bytes:
        ax.axhline(
            eager.step_peak_bytes / MIB,
            color="#c0392b",
            linestyle=":",
            label="eager step peak (the limit)",
        )
    ax.set_xticks([x + width for x in range(len(names))], names)
    ax.set_ylim(0, 1.1 * tallest)
    ax.set_ylabel("MiB above weights and data")
    ax.set_title(
        f"Memory per method (ratios to eager's step peak)\n{_workload_title(result)}", fontsize=10
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=4, frameon=False, fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
