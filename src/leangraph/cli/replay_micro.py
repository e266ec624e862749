"""``leangraph bench --replay-micro``: the host time of one graphed layer's replay, torch's
against leangraph's (CUDA only).

One block of the workload's shape is graphed twice in one process, from the same weights:
by ``torch.cuda.make_graphed_callables`` (a tuple of one module, as the bench graphs its
layers) and by ``leangraph.make_graphed_callables`` with the order ``[1, -1]`` (one forward,
one backward; a :class:`leangraph.GraphedCallable`, called as the bench calls its leangraph
graphs). Each round times ``replays`` replays of one method with ``time.perf_counter_ns``,
synchronising only before the first and after the last; the methods take turns to go first,
and each figure is the median over the rounds.

One replay is the same for both methods: the call of the graphed layer on an input that
requires grad (the copy into its static input, the forward graph's launch, autograd's node),
then ``out.backward(grad)``: autograd's engine, the backward graph's launch, the method's
hand-over of the gradients, and autograd's accumulation of the parameter and input gradients
into ``.grad`` outside the graphs, as a pipeline step's microbatches accumulate (gradients
are set to None at the start of each round only). *Host* time runs to the last replay's
return, *wall* time to the GPU's end too. While the host is the bound, as it is for a small
block such as the launch-bound workload's, the two agree and the figure is the host's cost of
a replay; for a large block the GPU falls behind, the launch queue fills, and both tend to
the GPU's time instead (wall well above host says so).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch

from leangraph import make_graphed_callables, reset_all

from .bench import LEANGRAPH_METHODS
from .workloads import BlockShape, make_blocks, sample_hidden

__all__ = [
    "REPLAY_METHODS",
    "ReplayMicroConfig",
    "ReplayMicroResult",
    "format_replay_micro",
    "graphed_layer",
    "run_replay_micro",
    "time_replays",
]

REPLAY_METHODS = ("torch", *LEANGRAPH_METHODS)
"""The methods the microbenchmark compares (the bench's leangraph methods, with their options),
in the order of its first round
(``leangraph-fused``: with ``fuse_grad_accumulation=True``, which accumulates the parameter
gradients inside the backward graph instead of through autograd; ``-python``: also with
``accumulator_hooks="python"``, the replay calling the accumulators' Python hooks itself;
``-nohooks``: with ``accumulator_hooks=False``, so no autograd accumulator runs at all)."""

Layer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class ReplayMicroConfig:
    """One block of ``shape``; ``rounds`` rounds of ``replays`` replays per method, after
    ``warmup_replays`` untimed ones each."""

    shape: BlockShape = field(
        default_factory=lambda: BlockShape(hidden=256, heads=4, sequence=128, dtype=torch.bfloat16)
    )
    replays: int = 500
    rounds: int = 11
    warmup_replays: int = 50
    device: str = "cuda"

    def __post_init__(self) -> None:
        for name in ("replays", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.warmup_replays < 0:
            raise ValueError(f"warmup_replays must be at least 0, got {self.warmup_replays}")
        if not self.device.startswith("cuda"):
            raise ValueError(
                "the replay microbenchmark needs a CUDA device (it times "
                f"torch.cuda.make_graphed_callables' replays), got {self.device!r}"
            )


@dataclass
class ReplayMicroResult:
    """Per method, per round: host and wall µs per forward+backward replay."""

    config: dict[str, Any]
    host_us: dict[str, list[float]]
    wall_us: dict[str, list[float]]

    def median(self, method: str, *, wall: bool = False) -> float:
        """The median over rounds of ``method``'s host (or wall) µs per replay."""
        return statistics.median((self.wall_us if wall else self.host_us)[method])

    def ratio(self, method: str = "leangraph") -> float:
        """``method``'s median host time per replay over torch's."""
        return self.median(method) / self.median("torch")

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``json.dump``: the config, every round, the medians, the ratio."""
        return {
            "config": self.config,
            "host_us_per_replay": self.host_us,
            "wall_us_per_replay": self.wall_us,
            "median_host_us": {m: self.median(m) for m in self.host_us},
            "median_wall_us": {m: self.median(m, wall=True) for m in self.wall_us},
            "leangraph_over_torch_host": self.ratio(),
            "over_torch_host": {m: self.ratio(m) for m in self.host_us if m != "torch"},
        }


def graphed_layer(method: str, block: torch.nn.Module, sample: torch.Tensor) -> Layer:
    """``block`` graphed by ``method`` for one forward and one backward per replay.

    Memory aliasing: the returned layer's outputs are views of its graphs' static buffers,
    valid until its next replay (torch) or its backward (leangraph).

    Raises:
        ValueError: for a method outside :data:`REPLAY_METHODS`.
    """
    if method == "torch":
        graphed = torch.cuda.make_graphed_callables((block,), ((sample,),))
        return cast(Layer, graphed[0])  # a tuple of one module in, of one module out
    if method in LEANGRAPH_METHODS:
        graphs = make_graphed_callables(
            (block,),
            ((sample,),),
            order=[1, -1],
            num_layers_per_chunk=1,
            **LEANGRAPH_METHODS[method],
        )
        return cast(Layer, graphs[0])
    raise ValueError(f"no replay method {method!r}; choose from {', '.join(REPLAY_METHODS)}")


def time_replays(
    replay: Callable[[], object], replays: int, sync: Callable[[], None]
) -> tuple[int, int]:
    """``replays`` calls of ``replay``, ``sync`` before the first and after the last: the
    host nanoseconds to the last call's return, and the wall nanoseconds to ``sync``'s."""
    sync()
    start = time.perf_counter_ns()
    for _ in range(replays):
        replay()
    host = time.perf_counter_ns() - start
    sync()
    return host, time.perf_counter_ns() - start


def run_replay_micro(config: ReplayMicroConfig) -> ReplayMicroResult:
    """Graph one block with each method and time their replays in turn; see the module
    docstring. Both methods' graphs are freed before it returns."""
    block = make_blocks(1, config.shape, config.device)[0]
    layers: dict[str, Layer] = {}
    replays: dict[str, Callable[[], None]] = {}
    params: dict[str, list[torch.nn.Parameter]] = {}
    inputs: dict[str, torch.Tensor] = {}
    grad = torch.randn_like(sample_hidden(config.shape, config.device, requires_grad=False))
    for method in REPLAY_METHODS:
        own = copy.deepcopy(block)
        layers[method] = graphed_layer(method, own, sample_hidden(config.shape, config.device))
        params[method] = list(own.parameters())
        x = inputs[method] = sample_hidden(config.shape, config.device)
        replays[method] = _replay(layers[method], x, grad)
    host: dict[str, list[float]] = {m: [] for m in REPLAY_METHODS}
    wall: dict[str, list[float]] = {m: [] for m in REPLAY_METHODS}
    for method in REPLAY_METHODS:  # first replays and lazy set-up, untimed
        time_replays(replays[method], config.warmup_replays, torch.cuda.synchronize)
    for round_index in range(config.rounds):
        first = round_index % len(REPLAY_METHODS)
        for method in REPLAY_METHODS[first:] + REPLAY_METHODS[:first]:
            for tensor in [*params[method], inputs[method]]:
                tensor.grad = None
            host_ns, wall_ns = time_replays(replays[method], config.replays, torch.cuda.synchronize)
            host[method].append(host_ns / config.replays / 1e3)
            wall[method].append(wall_ns / config.replays / 1e3)
    for method in REPLAY_METHODS[1:]:
        reset_all(layers[method])  # torch's graphs go with the last reference to them
    settings = asdict(config)
    settings["shape"] = {**asdict(config.shape), "dtype": str(config.shape.dtype)}
    return ReplayMicroResult(settings, host, wall)


def _replay(layer: Layer, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One forward and one backward replay of ``layer`` on ``x``, seeded with ``grad``."""

    def replay() -> None:
        layer(x).backward(grad)

    return replay


def format_replay_micro(result: ReplayMicroResult) -> str:
    """Both methods' host and wall µs per replay (median [min-max] over rounds), the ratio."""

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"

    header = f"{'method':<16} {'host µs/replay':>24} {'wall µs/replay':>24}"
    lines = [header, "-" * len(header)]
    for method in result.host_us:
        lines.append(
            f"{method:<16} {spread(result.host_us[method]):>24} "
            f"{spread(result.wall_us[method]):>24}"
        )
    for method in result.host_us:
        if method != "torch":
            lines.append(f"{method} / torch, host medians: {result.ratio(method):.2f}x")
    return "\n".join(lines)
