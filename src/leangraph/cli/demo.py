"""``leangraph demo``: capture a transformer stack in an interleaved order and train it.

The same blocks are trained eagerly and graphed, in the same interleaved 1F1B order of one
pipeline rank, and the per-step losses are reported side by side with a memory summary.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch

from leangraph import GraphedCallable, make_graphed_callables, memory_report, reset_all
from leangraph.order import Layout
from leangraph.schedules import interleaved_1f1b

from .local_pipeline import LayerLookup, run_order
from .phases import PhaseProgress
from .workloads import BlockShape, hidden_batches, make_blocks, sample_hidden

__all__ = ["DemoConfig", "DemoResult", "run_demo"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What the demo trains: one rank of a pp x vp interleaved pipeline."""

    pp_size: int = 2
    vp_size: int = 2
    rank: int = 0
    num_microbatches: int = 4
    layers_per_chunk: int = 2
    steps: int = 5
    warmup_iters: int = 3
    shape: BlockShape = field(default_factory=BlockShape)
    device: str | None = None  # None: cuda when available


@dataclass
class DemoResult:
    """Per-step losses (mean over microbatches) and memory figures in bytes (CUDA only)."""

    device: str
    order: list[int]
    eager_losses: list[float] = field(default_factory=list)
    graphed_losses: list[float] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Training:
    """What the eager and the graphed training share: the order, data, targets and steps."""

    order: list[int]
    layers_per_chunk: list[int]
    data: list[list[torch.Tensor]]
    target: list[torch.Tensor]
    steps: int

    def run(
        self,
        name: str,
        lookup: LayerLookup,
        params: list[torch.nn.Parameter],
        progress: PhaseProgress | None,
    ) -> list[float]:
        """Train ``params`` for ``steps`` steps through ``lookup``; the mean loss per step."""
        if progress is not None:
            progress.begin(name, self.steps, "steps")
        optim = torch.optim.SGD(params, lr=0.01)
        losses = []
        for step in range(self.steps):
            optim.zero_grad(set_to_none=True)
            result = run_order(
                self.order,
                self.layers_per_chunk,
                lookup,
                self.data[step],
                lambda out, m: torch.nn.functional.mse_loss(out, self.target[m]),
            )
            optim.step()
            losses.append(float(torch.stack(result.losses).mean()))
            if progress is not None:
                progress.advance(step + 1)
        return losses


def _demo_data(
    config: DemoConfig, device: str
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Per step, one input per microbatch; and one target per microbatch (fixed seed)."""
    gen = torch.Generator().manual_seed(1)
    count = config.num_microbatches
    data = [hidden_batches(config.shape, count, device, gen) for _ in range(config.steps)]
    return data, hidden_batches(config.shape, count, device, gen)


def _capture(
    config: DemoConfig,
    training: _Training,
    blocks: list[torch.nn.Module],
    device: str,
    progress: PhaseProgress | None,
) -> tuple[tuple[GraphedCallable, ...], dict[str, int]]:
    """Graph ``blocks`` in the training's order; the graphs and the memory figures (CUDA)."""
    layout = Layout(tuple(training.layers_per_chunk), config.num_microbatches)
    samples = tuple((sample_hidden(config.shape, device),) for _ in range(layout.num_graphs))
    memory: dict[str, int] = {}
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        memory["before_capture"] = torch.cuda.memory_allocated()
    log.info("capturing %d graphs on %s", layout.num_graphs, device)
    if progress is not None:
        progress.expect_capture(
            warmup_passes=config.warmup_iters,
            memory_check=device == "cuda",
        )
    graphed = make_graphed_callables(
        tuple(blocks),
        samples,
        order=training.order,
        num_layers_per_chunk=training.layers_per_chunk,
        num_warmup_iters=config.warmup_iters,
        progress=progress,
    )
    record = memory_report(graphed).record
    if record.warmup_peak_bytes is not None and record.capture_peak_bytes is not None:
        memory["peak_capture"] = max(record.warmup_peak_bytes, record.capture_peak_bytes)
    if device == "cuda":
        memory["after_capture"] = torch.cuda.memory_allocated()
        memory["reserved"] = torch.cuda.memory_reserved()
    return graphed, memory


def run_demo(
    config: DemoConfig = DemoConfig(), progress: PhaseProgress | None = None
) -> DemoResult:
    """Train eager and graphed copies of the same blocks; see the module docstring.

    ``progress`` hears of each phase (eager training, the memory check on CUDA, every
    warm-up pass, capture, graphed training) as it starts, with its size.
    """
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    order = interleaved_1f1b(config.pp_size, config.vp_size, config.rank, config.num_microbatches)
    chunks = [config.layers_per_chunk] * config.vp_size
    layout = Layout(tuple(chunks), config.num_microbatches)
    training = _Training(order, chunks, *_demo_data(config, device), config.steps)
    eager = make_blocks(layout.num_callables, config.shape, device)
    graphed_blocks = copy.deepcopy(eager)
    result = DemoResult(device=device, order=list(order))
    result.eager_losses = training.run(
        "eager reference training",
        lambda c, m, l: eager[layout.callable_index(c, l)],
        [p for b in eager for p in b.parameters()],
        progress,
    )
    graphed, result.memory = _capture(config, training, list(graphed_blocks), device, progress)
    result.graphed_losses = training.run(
        "graphed training",
        lambda c, m, l: graphed[layout.graph_index(c, m, l)],
        [p for b in graphed_blocks for p in b.parameters()],
        progress,
    )
    reset_all(graphed)
    return result
