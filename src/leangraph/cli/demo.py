"""``leangraph demo``: capture a transformer stack in an interleaved order and train it.

The same blocks are trained eagerly and graphed, in the same interleaved 1F1B order of one
pipeline rank, and the per-step losses are reported side by side with a memory summary.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch

from leangraph import make_graphed_callables, memory_report, reset_all
from leangraph.order import Layout
from leangraph.progress import ProgressCallback
from leangraph.schedules import interleaved_1f1b

from .local_pipeline import LayerLookup, run_order
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


def _train(
    order: list[int],
    layers_per_chunk: list[int],
    lookup: LayerLookup,
    params: list[torch.nn.Parameter],
    data: list[list[torch.Tensor]],
    target: list[torch.Tensor],
    steps: int,
) -> list[float]:
    optim = torch.optim.SGD(params, lr=0.01)
    losses = []
    for step in range(steps):
        optim.zero_grad(set_to_none=True)
        result = run_order(
            order,
            layers_per_chunk,
            lookup,
            data[step],
            lambda out, m: torch.nn.functional.mse_loss(out, target[m]),
        )
        optim.step()
        losses.append(float(torch.stack(result.losses).mean()))
    return losses


def _demo_data(
    config: DemoConfig, device: str
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Per step, one input per microbatch; and one target per microbatch (fixed seed)."""
    gen = torch.Generator().manual_seed(1)
    count = config.num_microbatches
    data = [hidden_batches(config.shape, count, device, gen) for _ in range(config.steps)]
    return data, hidden_batches(config.shape, count, device, gen)


def run_demo(
    config: DemoConfig = DemoConfig(), progress: ProgressCallback | None = None
) -> DemoResult:
    """Train eager and graphed copies of the same blocks; see the module docstring.

    ``progress`` is handed to ``make_graphed_callables`` (a progress bar, say).
    """
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    order = interleaved_1f1b(config.pp_size, config.vp_size, config.rank, config.num_microbatches)
    chunks = [config.layers_per_chunk] * config.vp_size
    layout = Layout(tuple(chunks), config.num_microbatches)
    eager = make_blocks(layout.num_callables, config.shape, device)
    graphed_blocks = copy.deepcopy(eager)
    data, target = _demo_data(config, device)
    shape = config.shape
    result = DemoResult(device=device, order=list(order))
    result.eager_losses = _train(
        order,
        chunks,
        lambda c, m, l: eager[layout.callable_index(c, l)],
        [p for b in eager for p in b.parameters()],
        data,
        target,
        config.steps,
    )
    samples = tuple((sample_hidden(shape, device),) for _ in range(layout.num_graphs))
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        result.memory["before_capture"] = torch.cuda.memory_allocated()
    log.info("capturing %d graphs on %s", layout.num_graphs, device)
    graphed = make_graphed_callables(
        tuple(graphed_blocks), samples, order=order, num_layers_per_chunk=chunks, progress=progress
    )
    record = memory_report(graphed).record
    if record.warmup_peak_bytes is not None and record.capture_peak_bytes is not None:
        result.memory["peak_capture"] = max(record.warmup_peak_bytes, record.capture_peak_bytes)
    if device == "cuda":
        result.memory["after_capture"] = torch.cuda.memory_allocated()
        result.memory["reserved"] = torch.cuda.memory_reserved()
    result.graphed_losses = _train(
        order,
        chunks,
        lambda c, m, l: graphed[layout.graph_index(c, m, l)],
        [p for b in graphed_blocks for p in b.parameters()],
        data,
        target,
        config.steps,
    )
    reset_all(graphed)
    return result
