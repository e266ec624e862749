"""Accumulators a backward pass reaches only through a replay: no hooks where eager has none.

Eager's backward runs a parameter's accumulator, and so its hooks, only where a path from the
loss leads to it: a layer with two outputs, the loss using one, leaves the parameters only the
other depends on alone (their ``.grad`` stays as it was and no hook fires). A replay is one
autograd node with an edge to every parameter it trains (or to the relay of its
accumulators), and autograd runs every node a node it ran has an edge to, with no gradient
where it returned None: their post-accumulate-grad hooks, and the hooks on the nodes, would
fire where eager's do not. Which parameters no output with a gradient reaches is known at the
backward replay only (``GraphRecord.reached_by``), after autograd fixed the nodes it will run,
so the replay has those accumulators pass over the hooks registered from Python on them
(:func:`skip_hooks_in_this_pass`): each hook is swapped for a stand-in that, called in this
backward pass, puts the hook back and does nothing; called in another (the pass failed before
the accumulator ran) it puts it back and calls it. Hooks registered from C++ (torch DDP's
reducer) cannot be reached and still fire: with ``find_unused_parameters=False``, where eager
DDP raises at the next forward, the backward replay refuses first (:mod:`.ddp`, R29); with
``True`` the reducer takes an accumulator run while ``.grad`` is None as no gradient, as eager's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import Node

from ..build.accumulation import node_hook_dicts, post_accumulate_hooks

__all__ = ["skip_hooks_in_this_pass"]

_GRAPH_TASK_ID = torch._C._current_graph_task_id
_QUEUE_AT_PASS_END = torch.autograd.Variable._execution_engine.queue_callback


class _Skipped:
    """Stands in for one hook of one accumulator for the rest of one backward pass."""

    __slots__ = ("hook", "hooks", "key", "task")

    def __init__(self, hook: Any, hooks: dict[Any, Any], key: Any, task: int) -> None:
        self.hook, self.hooks, self.key, self.task = hook, hooks, key, task

    def restore(self) -> None:
        """Put the hook back, unless it was removed (its handle) or replaced since."""
        if self.hooks.get(self.key) is self:
            self.hooks[self.key] = self.hook

    def __call__(self, *args: Any) -> Any:
        self.restore()
        if _GRAPH_TASK_ID() == self.task:
            return None  # the accumulator autograd runs with no gradient: eager runs none
        return self.hook(*args)  # a later pass: the one it was skipped for never ran it


def skip_hooks_in_this_pass(params: Sequence[torch.Tensor], nodes: Sequence[Node]) -> None:
    """Have the accumulators ``nodes`` of ``params`` (which the running backward pass runs
    with no gradient) call none of their Python hooks in this pass: their pre-hooks,
    post-accumulate-grad hooks and hooks. Called from a replay's backward, which the pass is
    running; the hooks are back when the accumulator ran, or at the latest when the pass ends.
    """
    task = _GRAPH_TASK_ID()
    skipped: list[_Skipped] = []
    for param, node in zip(params, nodes):
        dicts = [post_accumulate_hooks(param), *node_hook_dicts(node)]
        for hooks in dicts:
            for key, hook in list((hooks or {}).items()):
                if not (isinstance(hook, _Skipped) and hook.task == task):
                    hooks[key] = stand_in = _Skipped(hook, hooks, key, task)
                    skipped.append(stand_in)
    if skipped:
        _QUEUE_AT_PASS_END(lambda: _restore_all(skipped))


def _restore_all(skipped: Sequence[_Skipped]) -> None:
    for stand_in in skipped:
        stand_in.restore()
