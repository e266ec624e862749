"""Progress of warm-up and capture, reported step by step to observers.

``make_graphed_callables(progress=...)`` takes a callable that receives a
:class:`ProgressEvent` after every step of every warm-up pass and of the capture pass; the
memory timeline of :mod:`leangraph.report` is recorded through the same channel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .plan import GraphStep

__all__ = ["ProgressCallback", "ProgressEvent", "notify"]


@dataclass(frozen=True, slots=True)
class ProgressEvent:
    """One finished step: ``phase`` is ``"warm-up"`` or ``"capture"``.

    ``done``/``total`` count steps over the whole call (all warm-up passes, then capture), so
    a progress bar can use them directly; ``pass_done``/``pass_total`` count them within this
    warm-up pass or the capture (a warm-up pass runs one graph per callable and sample
    layout, the capture every graph, so the two differ). ``step`` is the plan step that just
    ran, ``label`` the graph it ran (as errors name it) and ``iteration`` the warm-up pass
    (0-based; 0 in capture).
    """

    phase: str
    done: int
    total: int
    step: GraphStep
    label: str
    iteration: int = 0
    pass_done: int = field(kw_only=True)
    pass_total: int = field(kw_only=True)


ProgressCallback = Callable[[ProgressEvent], None]


def notify(observers: Sequence[ProgressCallback], event: ProgressEvent) -> None:
    """Hand ``event`` to every observer, in order."""
    for observer in observers:
        observer(event)
