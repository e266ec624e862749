"""leangraph: memory-lean CUDA-graph capture for pipeline-parallel PyTorch training.

The data flows one way: an order (:mod:`leangraph.order`) becomes a liveness plan
(:mod:`leangraph.plan`), which warm-up (:mod:`leangraph.warmup`) and capture
(:mod:`leangraph.capture`) obey, producing one :class:`GraphedCallable` per graph.
"""

from __future__ import annotations

from .api import make_graphed_callables, reset_all
from .errors import CaptureMemoryError, GraphResetError, LeangraphError
from .graphed import GraphedCallable
from .memory_plan import MemoryPlan, plan_memory
from .order import GraphId, Layout
from .progress import ProgressEvent
from .report import MemoryReport, memory_report, plot_memory

__all__ = [
    "CaptureMemoryError",
    "GraphId",
    "GraphResetError",
    "GraphedCallable",
    "Layout",
    "LeangraphError",
    "MemoryPlan",
    "MemoryReport",
    "ProgressEvent",
    "make_graphed_callables",
    "memory_report",
    "plan_memory",
    "plot_memory",
    "reset_all",
]

__version__ = "0.1.0"
