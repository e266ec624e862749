"""leangraph: memory-lean CUDA-graph capture for pipeline-parallel PyTorch training.

The data flows one way (see docs/architecture.md): a call is validated once
(:mod:`leangraph._call`), its order becomes a liveness plan (:mod:`leangraph.plan`), one
forward per distinct callable is probed (:mod:`leangraph.probe`), the buffer plan follows
(:mod:`leangraph.buffers`), warm-up and capture build one frozen record per graph
(:mod:`leangraph.build`), and each record becomes a :class:`GraphedCallable`
(:mod:`leangraph.runtime`) in the call's :class:`GraphedSet` (:mod:`leangraph.result`).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import make_graphed_callables
    from .errors import CaptureMemoryError, GraphResetError, LeangraphError
    from .memory import MemoryPlan, plan_memory
    from .order import GraphId, Layout, Step, StepKind
    from .progress import ProgressEvent
    from .report import CaptureRecord, MemoryReport, TimelinePoint, plot_memory
    from .result import GraphedSet, memory_report, reset_all
    from .runtime.graphed import GraphedCallable

# Each public name by the module that defines it, imported at its first use (PEP 562): the
# modules import torch, which takes seconds, and ``python -m leangraph`` imports this package
# before its ``__main__`` can answer a Ctrl-C in one line.
_DEFINED_IN = {
    "make_graphed_callables": ".api",
    "CaptureMemoryError": ".errors",
    "GraphResetError": ".errors",
    "LeangraphError": ".errors",
    "MemoryPlan": ".memory",
    "plan_memory": ".memory",
    "GraphId": ".order",
    "Layout": ".order",
    "Step": ".order",
    "StepKind": ".order",
    "ProgressEvent": ".progress",
    "CaptureRecord": ".report",
    "MemoryReport": ".report",
    "TimelinePoint": ".report",
    "plot_memory": ".report",
    "GraphedSet": ".result",
    "memory_report": ".result",
    "reset_all": ".result",
    "GraphedCallable": ".runtime.graphed",
}


def __getattr__(name: str) -> Any:
    """A public name (imported from its module once), or a submodule, as ``leangraph.order``
    was reachable when this package imported its modules eagerly."""
    module = _DEFINED_IN.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}"):
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
