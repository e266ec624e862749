"""Run a pipeline order in one process: chunk ``c + 1`` consumes chunk ``c``'s output.

This is the single-rank view of a pipeline with the other ranks folded away: the driver the
demo, the benchmark and the tests use to train the same layers eagerly and graphed in exactly
the same order. A real multi-rank pipeline replaces the hand-over between chunks with
point-to-point sends and receives (see ``examples/pipeline.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from leangraph.order import OrderEntry, Step, StepKind, parse_order

__all__ = ["LayerLookup", "LossFn", "StepResult", "order_steps", "run_order", "run_steps"]

LayerLookup = Callable[[int, int, int], Callable[[torch.Tensor], torch.Tensor]]
"""``(chunk, microbatch, layer) -> callable``; chunk 1-based, the others 0-based."""

LossFn = Callable[[torch.Tensor, int], torch.Tensor]
"""``(last chunk's output, microbatch) -> scalar loss``."""


@dataclass
class StepResult:
    """What one pass over the order produced (losses detached, one per microbatch)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    input_grads: list[torch.Tensor] = field(default_factory=list)


def order_steps(
    order: Sequence[OrderEntry], layers_per_chunk: Sequence[int], num_microbatches: int
) -> tuple[Step, ...]:
    """``order`` validated and expanded into its steps, for :func:`run_steps` (a training
    loop parses its schedule once, not at every step).

    Raises:
        ValueError: for a malformed order, or one whose counts do not match the layout (its
            microbatches, ``num_microbatches``).
    """
    layout, steps = parse_order(
        order,
        num_callables=sum(layers_per_chunk),
        num_samples=None,
        num_layers_per_chunk=list(layers_per_chunk),
    )
    if layout.num_microbatches != num_microbatches:
        raise ValueError(
            f"the order runs {layout.num_microbatches} microbatches, but inputs holds "
            f"{num_microbatches} (one per microbatch)"
        )
    return steps


def run_order(
    order: Sequence[OrderEntry],
    layers_per_chunk: Sequence[int],
    layer: LayerLookup,
    inputs: Sequence[torch.Tensor],
    loss_fn: LossFn,
) -> StepResult:
    """Run one training step's forwards and backwards in ``order``.

    Args:
        order: The pipeline order (``+c`` / ``-c``, chunks 1-based; ``-(c + 0.5)`` weight
            steps call ``backward_dw()`` on what ``layer`` returns, where it has one; or
            :class:`leangraph.Step` records).
        layers_per_chunk: Number of layers of each chunk.
        layer: Returns the callable to run for (chunk, microbatch, layer).
        inputs: One input per microbatch for chunk 1.
        loss_fn: Turns the last chunk's output of a microbatch into a scalar loss.

    Returns:
        Per-microbatch losses (detached) and gradients of the chunk-1 inputs.

    Raises:
        ValueError: for a malformed order, or one whose chunk ``c + 1`` forward of a
            microbatch comes before chunk ``c``'s (the hand-over would not exist yet).
    """
    steps = order_steps(order, layers_per_chunk, len(inputs))
    return run_steps(steps, layers_per_chunk, layer, inputs, loss_fn)


def run_steps(
    steps: Sequence[Step],
    layers_per_chunk: Sequence[int],
    layer: LayerLookup,
    inputs: Sequence[torch.Tensor],
    loss_fn: LossFn,
) -> StepResult:
    """:func:`run_order` over steps :func:`order_steps` gave for ``len(inputs)`` microbatches.

    Raises:
        ValueError: for a chunk ``c + 1`` forward of a microbatch before chunk ``c``'s.
    """
    num_chunks = len(layers_per_chunk)
    chunk_inputs: dict[tuple[int, int], torch.Tensor] = {}
    chunk_outputs: dict[tuple[int, int], torch.Tensor] = {}
    losses: dict[int, torch.Tensor] = {}
    input_grads: dict[int, torch.Tensor] = {}
    for step in steps:
        c, m = step.chunk, step.microbatch
        if step.kind is StepKind.FORWARD:
            if c == 1:
                source = inputs[m]
            elif (c - 1, m) in chunk_outputs:
                source = chunk_outputs[(c - 1, m)]
            else:
                raise ValueError(
                    f"order[{step.position}]: chunk {c} forward of microbatch {m} "
                    f"runs before chunk {c - 1} produced it"
                )
            hidden = chunk_inputs[(c, m)] = source.detach().requires_grad_(True)
            for index in range(layers_per_chunk[c - 1]):
                hidden = layer(c, m, index)(hidden)
            chunk_outputs[(c, m)] = hidden
            if c == num_chunks:
                losses[m] = loss_fn(hidden, m)
        elif step.kind is StepKind.WEIGHT:
            # Zero-bubble weight step: graphed layers replay their weight-gradient graphs;
            # eager layers computed weight gradients in their backward already.
            for index in reversed(range(layers_per_chunk[c - 1])):
                weight_step = getattr(layer(c, m, index), "backward_dw", None)
                if weight_step is not None:
                    weight_step()
        else:
            if c == num_chunks:
                losses[m].backward()
            else:
                chunk_outputs[(c, m)].backward(chunk_inputs.pop((c + 1, m)).grad)
            del chunk_outputs[(c, m)]
            if c == 1:
                input_grads[m] = chunk_inputs[(1, m)].grad.clone()  # type: ignore[union-attr]
                del chunk_inputs[(1, m)]
    count = len(inputs)
    return StepResult(
        losses=[losses[m].detach() for m in range(count)],
        input_grads=[input_grads[m] for m in range(count)],
    )
