"""Capture: forward and backward graphs recorded in the plan's order into one pool.

Because replay follows the same order, a block one graph frees during capture (its saved
activations, once its backward is recorded) is reused only by graphs the schedule runs after
it. Each graph builder keeps exactly the tensors it owns; this module holds none between
steps.

With ``overlap_grad_accumulation`` autograd still reads a backward's parameter gradients on
its side stream while the caller's stream replays the next backward graph, so those buffers
stay owned until the next backward is recorded: that graph never writes them, and the one
after it waits for the additions they feed (``runtime/overlap.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..backends.base import GraphBackend
from ..buffers import StaticBuffers
from ..errors import phase_note
from ..order import StepKind
from ..plan import Plan
from ..progress import ProgressCallback, ProgressEvent, notify
from .graph import GraphBuilder

__all__ = ["run_capture"]


def run_capture(
    plan: Plan,
    graphs: Sequence[GraphBuilder],
    *,
    backend: GraphBackend,
    buffers: StaticBuffers | None,
    observers: Sequence[ProgressCallback] = (),
    steps_before: int = 0,
    hold_param_grads: bool = False,
) -> None:
    """Record every graph of ``plan`` over ``graphs`` (indexed by graph).

    With ``buffers`` (schedule-driven reuse) each graph takes its static inputs and gradient
    seeds from them at its forward, and stops owning its outputs and gradient buffers at its
    backward; without, each graph keeps its samples as static inputs and owns everything.
    ``observers`` hear of every finished step, counted from ``steps_before``. With
    ``hold_param_grads`` (and ``buffers``) a backward's parameter-gradient buffers go to the
    pool only once the next backward is recorded.
    """
    total = steps_before + len(plan.capture)
    next_layers = {} if buffers is None else buffers.next_layers()
    held: GraphBuilder | None = None  # whose parameter gradients the pool may not hand out
    with backend.capture_session():
        for index, step in enumerate(plan.capture):
            graph = graphs[step.graph]
            with phase_note("capture", graph.label, f"capture step {index} ({step})"):
                if step.kind is StepKind.FORWARD:
                    _capture_forward(graphs, step.graph, buffers)
                elif step.kind is StepKind.WEIGHT:
                    graph.capture_weight(
                        backend, release=buffers is not None, chained=_chained(buffers, step.graph)
                    )
                else:
                    lender = next_layers.get(step.graph)
                    graph.capture_backward(
                        backend,
                        release=buffers is not None,
                        chained=_chained(buffers, step.graph),
                        lender=None if lender is None else graphs[lender],
                        hold_param_grads=hold_param_grads,
                    )
                    if held is not None:
                        held.release_held_param_grads(backend)
                    held = graph if hold_param_grads else None
            if observers:
                notify(
                    observers,
                    ProgressEvent(
                        "capture",
                        steps_before + index + 1,
                        total,
                        step,
                        graph.label,
                        pass_done=index + 1,
                        pass_total=len(plan.capture),
                    ),
                )
        for graph in graphs:  # a lent buffer whose borrower never came (none in plan order)
            graph.return_lent_grad(backend)
        if held is not None:
            held.release_held_param_grads(backend)


def _chained(buffers: StaticBuffers | None, graph: int) -> tuple[bool, ...]:
    return () if buffers is None else buffers.chained(graph)


def _capture_forward(
    graphs: Sequence[GraphBuilder], graph: int, buffers: StaticBuffers | None
) -> None:
    builder = graphs[graph]
    if buffers is None:
        builder.capture_forward(builder.source.samples, (), ())
        return
    sources = buffers.chain_sources(graph)
    builder.capture_forward(
        buffers.inputs_for(graph, lambda g: graphs[g].static_outputs),
        buffers.seeds_for(graph),
        [None if s is None else graphs[s].label for s in sources],
    )
