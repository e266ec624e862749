"""leangraph: memory-lean CUDA-graph capture for pipeline-parallel PyTorch training.

The data flows one way (see docs/architecture.md): a call is validated once
(:mod:`leangraph._call`), its order becomes a liveness plan (:mod:`leangraph.plan`), one
forward per distinct callable is probed (:mod:`leangraph.probe`), the buffer plan follows
(:mod:`leangraph.buffers`), warm-up and capture build one frozen record per graph
(:mod:`leangraph.build`), and each record becomes a :class:`GraphedCallable`
(:mod:`leangraph.runtime`) in the call's :class:`GraphedSet` (:mod:`leangraph.result`).
"""

from __future__ import annotations

from .api import make_graphed_callables
from .errors import CaptureMemoryError, GraphResetError, LeangraphError
from .memory import MemoryPlan, plan_memory
from .order import GraphId, Layout, Step, StepKind
from .progress import ProgressEvent
from .report import CaptureRecord, MemoryReport, TimelinePoint, plot_memory
from .result import GraphedSet, memory_report, reset_all
from .runtime.graphed import GraphedCallable

__all__ = [
    "CaptureMemoryError",
    "CaptureRecord",
    "GraphId",
    "GraphResetError",
    "GraphedCallable",
    "GraphedSet",
    "Layout",
    "LeangraphError",
    "MemoryPlan",
    "MemoryReport",
    "ProgressEvent",
    "Step",
    "StepKind",
    "TimelinePoint",
    "make_graphed_callables",
    "memory_report",
    "plan_memory",
    "plot_memory",
    "reset_all",
]

__version__ = "0.1.0"
