"""Debug mode: graph outputs that refuse to be read once their buffer may be reused.

With ``make_graphed_callables(..., debug_outputs=True)`` each replay's outputs are
:class:`GuardedOutput` tensors sharing one :class:`OutputGuard`; the graphed callable
invalidates the guard when the outputs' validity window ends (its backward, its next forward
replay, or its reset), after which any torch operation on them raises ``RuntimeError``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["GuardedOutput", "OutputGuard"]


class OutputGuard:
    """Debug mode: marks one replay's outputs invalid once their buffers may be reused."""

    def __init__(self, label: str, generation: int) -> None:
        self.label = label
        self.generation = generation
        self.reason: str | None = None

    def invalidate(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def wrap(self, tensor: torch.Tensor) -> torch.Tensor:
        # Not as_subclass: that makes a view, and an in-place write into a custom Function's
        # view output is refused by autograd, where eager's output (and the unguarded
        # replay's) takes it.
        guarded = torch.Tensor._make_subclass(GuardedOutput, tensor)
        guarded._leangraph_guard = self  # type: ignore[attr-defined]
        return guarded

    def check(self) -> None:
        if self.reason is not None:
            raise RuntimeError(
                f"an output of {self.label} (replay {self.generation}) was read after "
                f"{self.reason}; its graph-owned buffer may have been reused. Outputs stay "
                "valid until their graph's backward or next forward replay; clone them to "
                "keep them longer"
            )


class GuardedOutput(torch.Tensor):
    """A graph output that refuses to be used once its guard is invalid (debug mode)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for leaf in pytree.tree_leaves((args, kwargs or {})):
            guard = getattr(leaf, "_leangraph_guard", None)
            if guard is not None:
                guard.check()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
