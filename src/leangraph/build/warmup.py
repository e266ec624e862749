"""Warm-up: eager passes in the plan's order, holding outputs only until their backward.

A pass runs the graphs the plan warms up: one per callable and sample layout (graphs alike run
the same kernels, which is what warm-up is for: lazy initialisation, autotuning, per-stream
state), so its cost does not grow with the microbatches.

At every point of a pass the only warm-up outputs alive are those of forwards whose backward
has not run yet (the plan's ``born``/``dies``); outputs that need no backward (eval mode,
``no_grad``) die right after their forward. Nothing survives a pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backends.base import GraphBackend
from ..errors import phase_note
from ..order import StepKind
from ..plan import Plan
from ..progress import ProgressCallback, ProgressEvent, notify
from .graph import GraphBuilder

__all__ = ["run_warmup"]


def run_warmup(
    plan: Plan,
    graphs: Sequence[GraphBuilder],
    *,
    num_iters: int,
    backend: GraphBackend,
    observers: Sequence[ProgressCallback] = (),
    total_steps: int = 0,
) -> None:
    """Run ``num_iters`` warm-up passes of ``plan`` over ``graphs`` (indexed by graph).

    ``observers`` hear of every finished step; ``total_steps`` is what they count up to.
    """
    with backend.warmup():
        for iteration in range(num_iters):
            _warmup_pass(plan, graphs, iteration, observers, total_steps)


def _warmup_pass(
    plan: Plan,
    graphs: Sequence[GraphBuilder],
    iteration: int,
    observers: Sequence[ProgressCallback],
    total_steps: int,
) -> None:
    awaiting_backward: dict[int, tuple[torch.Tensor, ...]] = {}
    for index, step in enumerate(plan.warmup):
        graph = graphs[step.graph]
        where = f"warm-up pass {iteration}, step {index} ({step})"
        with phase_note("warm-up", graph.label, where):
            if step.kind is StepKind.FORWARD:
                outputs = graph.warmup_forward()
                if outputs is not None:
                    awaiting_backward.update(dict.fromkeys(step.born, outputs))
            else:
                outputs = awaiting_backward.get(step.graph)
                if outputs is not None:
                    graph.warmup_backward(outputs, step.kind)
                for dead in step.dies:
                    awaiting_backward.pop(dead, None)
            del outputs
        if observers:
            done = iteration * len(plan.warmup) + index + 1
            event = ProgressEvent(
                "warm-up",
                done,
                total_steps,
                step,
                graph.label,
                iteration,
                pass_done=index + 1,
                pass_total=len(plan.warmup),
            )
            notify(observers, event)
    if awaiting_backward:
        raise AssertionError(f"plan left warm-up outputs alive: {sorted(awaiting_backward)}")
