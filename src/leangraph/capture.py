"""Capture: forward and backward graphs recorded in the plan's order into one pool.

Because replay follows the same order, a block one graph frees during capture (its saved
activations, once its backward is recorded) is reused only by graphs the schedule runs after
it. Each graphed callable keeps exactly the tensors it owns; this module holds none between
steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from .backends.base import GraphBackend
from .buffers import StaticBuffers
from .errors import phase_note
from .graphed import GraphedCallable
from .order import StepKind
from .plan import Plan
from .progress import ProgressCallback, ProgressEvent, notify

__all__ = ["run_capture"]


def run_capture(
    plan: Plan,
    graphs: Sequence[GraphedCallable],
    *,
    backend: GraphBackend,
    buffers: StaticBuffers | None,
    observers: Sequence[ProgressCallback] = (),
    steps_before: int = 0,
) -> None:
    """Record every graph of ``plan`` over ``graphs`` (indexed by graph).

    With ``buffers`` (schedule-driven reuse) each graph takes its static inputs and gradient
    seeds from them at its forward, and stops owning its outputs and gradient buffers at its
    backward; without, each graph keeps its samples as static inputs and owns everything.
    ``observers`` hear of every finished step, counted from ``steps_before``.
    """
    total = steps_before + len(plan.capture)
    with backend.capture_session():
        for index, step in enumerate(plan.capture):
            graph = graphs[step.graph]
            with phase_note("capture", graph.label, f"capture step {index} ({step})"):
                if step.kind is StepKind.FORWARD:
                    _assign(graphs, step.graph, buffers)
                    graph._capture_forward()
                else:
                    record = (
                        graph._capture_weight
                        if step.kind is StepKind.WEIGHT
                        else graph._capture_backward
                    )
                    chained = () if buffers is None else buffers.chained(step.graph)
                    record(backend, release=buffers is not None, chained=chained)
            if observers:
                notify(
                    observers,
                    ProgressEvent("capture", steps_before + index + 1, total, step, graph.label),
                )


def _assign(graphs: Sequence[GraphedCallable], graph: int, buffers: StaticBuffers | None) -> None:
    callable_ = graphs[graph]
    if buffers is None:
        callable_._assign_buffers(callable_._samples, ())
    else:
        sources = buffers.chain_sources(graph)
        callable_._assign_buffers(
            buffers.inputs_for(graph, lambda g: graphs[g]._static_outputs),
            buffers.seeds_for(graph),
            [None if s is None else graphs[s].label for s in sources],
        )
