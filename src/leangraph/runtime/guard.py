"""Debug mode: graph outputs that refuse to be read once their buffer may be reused.

With ``make_graphed_callables(..., debug_outputs=True)`` each replay's outputs are
:class:`GuardedOutput` tensors sharing one :class:`OutputGuard`; the graphed callable
invalidates the guard when the outputs' validity window ends (its backward, its next forward
replay, or its reset), after which any torch operation on them, or on the tensors over their
memory made from them (``detach()``, slices, views), raises ``RuntimeError``.
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
    """A graph output that refuses to be used once its guard is invalid (debug mode); so do
    the tensors over its memory made from it (``detach()``, ``y[0]``, ``view``, ``split``,
    ...), which would read the reused buffer just the same, where one with memory of its own
    (``clone()``, ``y + 1``) is a plain tensor."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        guards: list[tuple[torch.Tensor, OutputGuard]] = []
        for leaf in pytree.tree_leaves((args, kwargs or {})):
            guard = getattr(leaf, "_leangraph_guard", None)
            if guard is not None:
                guard.check()
                guards.append((leaf, guard))
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
            return _guard_aliases(result, guards) if guards else result


def _guard_aliases(result: Any, guards: list[tuple[torch.Tensor, OutputGuard]]) -> Any:
    """``result`` (a tensor, or a tuple or list of them) with each tensor over a guarded
    output's memory guarded by that output's guard (called with subclass dispatch off)."""
    by_storage = {_storage(leaf): guard for leaf, guard in guards}
    by_storage.pop(None, None)  # memory nothing else can share

    def guarded(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, GuardedOutput):
            return value  # not a tensor, or a guarded one already (an in-place op's self)
        guard = by_storage.get(_storage(value))
        if guard is None:
            return value
        alias = value.as_subclass(GuardedOutput)  # keeps the autograd history, unlike wrap()
        alias._leangraph_guard = guard  # type: ignore[attr-defined]
        return alias

    if type(result) in (tuple, list):
        return type(result)(map(guarded, result))
    return guarded(result)


def _storage(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s memory starts, or None for one without any (sparse, or empty: every
    empty tensor's storage starts at 0, shared or not)."""
    try:
        pointer = int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None
    return pointer or None
