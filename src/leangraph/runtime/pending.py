"""Backwards still to come, per call: which graphs' latest replays await their backward.

One :class:`PendingBackwards` serves all graphs of one ``make_graphed_callables`` call. A
forward replay that needs a backward notes its :class:`BackwardToken`, which lives exactly as
long as the replay's autograd node; the graph's own next forward replay asks whether it is
still awaited (it would overwrite the activations that backward needs), and a graph whose
parameters other graphs also train asks whether one of those will run in this backward pass.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["BackwardToken", "PendingBackwards"]

# Whether the running backward pass reaches an autograd node (torch's own helper; without it
# every shared parameter's gradient is copied, which is always correct).
_WILL_ENGINE_EXECUTE_NODE = getattr(torch._C, "_will_engine_execute_node", None)
_GRAPH_TASK_ID = torch._C._current_graph_task_id


class BackwardToken:
    """Lives exactly as long as one forward replay's autograd node (its ctx holds it)."""

    __slots__ = ("__weakref__", "node")

    def __init__(self) -> None:
        self.node: weakref.ref[Any] | None = None  # the replay's autograd node, once made


class PendingBackwards:
    """Per graph of one call, a weak reference to the token of its replay awaiting a backward."""

    def __init__(self, num_graphs: int) -> None:
        self._tokens: list[weakref.ref[BackwardToken] | None] = [None] * num_graphs
        # Per graph, the backward pass (autograd's graph task id) its last backward ran in.
        self._ran_in: list[int] = [-1] * num_graphs

    def note(self, graph: int, token: BackwardToken) -> None:
        """Graph ``graph``'s latest replay awaits its backward."""
        self._tokens[graph] = weakref.ref(token)

    def clear(self, graph: int) -> None:
        """Graph ``graph``'s backward ran (or it was reset)."""
        self._tokens[graph] = None

    def ran(self, graph: int) -> None:
        """Graph ``graph``'s backward ran, in the running backward pass."""
        self._tokens[graph] = None
        self._ran_in[graph] = _GRAPH_TASK_ID()

    def ran_in_this_pass(self, graphs: Iterable[int]) -> bool:
        """Whether the backward of one of ``graphs`` ran in the running backward pass."""
        task = _GRAPH_TASK_ID()
        return task != -1 and any(self._ran_in[g] == task for g in graphs)

    def awaits(self, graph: int) -> bool:
        """Whether a backward through graph ``graph``'s latest replay may still come."""
        ref = self._tokens[graph]
        return ref is not None and ref() is not None

    def reached_now(self, graphs: Iterable[int]) -> bool:
        """Whether the running backward pass will reach an awaited replay of one of
        ``graphs`` (always true where torch cannot tell)."""
        for graph in graphs:
            ref = self._tokens[graph]
            token = ref() if ref is not None else None
            node = token.node() if token is not None and token.node is not None else None
            if node is not None and (
                _WILL_ENGINE_EXECUTE_NODE is None or _WILL_ENGINE_EXECUTE_NODE(node)
            ):
                return True
        return False
