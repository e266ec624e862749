"""Capture: forward and backward graphs recorded in the plan's order into one pool.

Because replay follows the same order, a block one graph frees during capture (its saved
activations, once its backward is recorded) is reused only by graphs the schedule runs after
it. Each graphed callable keeps exactly the tensors it owns; this module holds none between
steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from .backends.base import GraphBackend
from .errors import phase_note
from .graphed import GraphedCallable
from .order import StepKind
from .plan import Plan

__all__ = ["run_capture"]


def run_capture(plan: Plan, graphs: Sequence[GraphedCallable], *, backend: GraphBackend) -> None:
    """Record every graph of ``plan`` over ``graphs`` (indexed by graph)."""
    with backend.capture_session():
        for index, step in enumerate(plan.capture):
            graph = graphs[step.graph]
            with phase_note("capture", graph.label, f"capture step {index} ({step})"):
                if step.kind is StepKind.FORWARD:
                    graph._capture_forward()
                else:
                    graph._capture_backward()
