"""Accumulators a backward pass reaches only through a replay: no hooks where eager has none.

Eager's backward runs a parameter's accumulator, and so its hooks, only where a path from the
loss leads to it: a layer with two outputs, the loss using one, leaves the parameters only the
other depends on alone (their ``.grad`` stays as it was and no hook fires). A replay is one
autograd node with an edge to every parameter it trains (or to the relay of its
accumulators), and autograd runs every node a node it ran has an edge to, with no gradient
where it returned None: their post-accumulate-grad hooks, and the hooks on the nodes, would
fire where eager's do not. Which parameters no output with a gradient reaches is known at the
backward replay only (``GraphRecord.reached_by``), after autograd fixed the nodes it will run,
so the replay has those accumulators pass over the hooks registered from Python on them,
and the parameters' tensor hooks, which autograd would call with None
(:func:`skip_hooks_in_this_pass`): each hook is swapped for a stand-in that, called in this
backward pass, puts the hook back and does nothing; called in another (the pass failed before
the accumulator ran) it puts it back and calls it. Eager code in the same pass may still reach
such a parameter (a weight tied to an eager head, an eager layer reading it): then its
accumulator gets that gradient, and eager's backward runs it with its hooks. A gate, the
first pre-hook of the accumulator, sees whether a gradient arrived, and the stand-ins call
their hooks where one did, so they fire once as eager's do (Megatron's adds the gradient into
``main_grad``). Hooks registered from C++ (torch DDP's
reducer) cannot be reached and still fire: with ``find_unused_parameters=False``, where eager
DDP raises at the next forward, the backward replay refuses first (:mod:`.ddp`, R29); with
``True`` the reducer takes an accumulator run while ``.grad`` is None as no gradient, as eager's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from ..build.accumulation import TENSOR_HOOKS, node_hook_dicts, post_accumulate_hooks

__all__ = ["skip_hooks_in_this_pass"]

_GRAPH_TASK_ID = torch._C._current_graph_task_id
_QUEUE_AT_PASS_END = torch.autograd.Variable._execution_engine.queue_callback


class _Arrival:
    """The gate: the first pre-hook of one accumulator for one backward pass, which notes
    whether a gradient reached it there (from eager code: the replay that marked it
    unreached hands it none)."""

    __slots__ = ("arrived", "task")

    def __init__(self, task: int) -> None:
        self.task, self.arrived = task, False

    def __call__(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        if _GRAPH_TASK_ID() == self.task:
            self.arrived = grads[0] is not None


class _Skipped:
    """Stands in for one hook of one accumulator for the rest of one backward pass."""

    __slots__ = ("gate", "hook", "hooks", "key")

    def __init__(self, hook: Any, hooks: dict[Any, Any], key: Any, gate: _Arrival) -> None:
        self.hook, self.hooks, self.key, self.gate = hook, hooks, key, gate

    @property
    def task(self) -> int:
        """The backward pass it stands in for."""
        return self.gate.task

    def restore(self) -> None:
        """Put the hook back, unless it was removed (its handle) or replaced since."""
        if self.hooks.get(self.key) is self:
            self.hooks[self.key] = self.hook

    def __call__(self, *args: Any) -> Any:
        self.restore()
        if _GRAPH_TASK_ID() == self.gate.task and not self.gate.arrived:
            return None  # the accumulator autograd runs with no gradient: eager runs none
        # An eager use's gradient reached it (eager runs it), or a later pass: the one it was
        # skipped for never ran it.
        return self.hook(*args)


class _SkippedTensorHook(_Skipped):
    """Stands in for one tensor hook of a parameter (``register_hook``) for the rest of one
    backward pass. Autograd calls tensor hooks before the accumulator's pre-hooks, so before
    any gate; it calls them with the gradient itself, which tells: None (the replay's), and
    eager would call none."""

    __slots__ = ("pass_task",)

    def __init__(self, hook: Any, hooks: dict[Any, Any], key: Any, task: int) -> None:
        self.hook, self.hooks, self.key, self.pass_task = hook, hooks, key, task

    @property
    def task(self) -> int:
        return self.pass_task

    def __call__(self, *args: Any) -> Any:
        self.restore()
        if _GRAPH_TASK_ID() == self.pass_task and args[0] is None:
            return None  # no gradient reached the parameter: eager calls no hook
        return self.hook(*args)


def skip_hooks_in_this_pass(params: Sequence[torch.Tensor], nodes: Sequence[Node]) -> None:
    """Have the accumulators ``nodes`` of ``params`` (which the replay calling this hands no
    gradient) call none of their Python hooks in this pass, their pre-hooks,
    post-accumulate-grad hooks and hooks, unless a gradient from elsewhere in the pass (eager
    code) reaches them. Called from a replay's backward, which the pass is running, so before
    the accumulators run; the hooks are back when the accumulator ran, or at the latest when
    the pass ends.
    """
    task = _GRAPH_TASK_ID()
    skipped: list[_Skipped] = []
    gates: list[RemovableHandle] = []
    for param, node in zip(params, nodes):
        tensor_hooks = TENSOR_HOOKS(param) or {}
        for key, hook in list(tensor_hooks.items()):
            if not (isinstance(hook, _Skipped) and hook.task == task):
                passed_over = _SkippedTensorHook(hook, tensor_hooks, key, task)
                tensor_hooks[key] = passed_over
                skipped.append(passed_over)
        pre_hooks, post_hooks = node_hook_dicts(node)
        _drop_stale_gates(pre_hooks, task)
        dicts = (post_accumulate_hooks(param), pre_hooks, post_hooks)
        hooked = [
            (hooks, key, hook)
            for hooks in dicts
            for key, hook in (hooks or {}).items()
            # Not this pass's gate, nor a hook passed over already (a second call for it).
            if not isinstance(hook, _Arrival)
            and not (isinstance(hook, _Skipped) and hook.task == task)
        ]
        if not hooked:
            continue
        gate = _Arrival(task)
        gates.append(_register_first(node, pre_hooks, gate))
        for hooks, key, hook in hooked:
            hooks[key] = stand_in = _Skipped(hook, hooks, key, gate)
            skipped.append(stand_in)
    if skipped:
        _QUEUE_AT_PASS_END(lambda: _restore_all(skipped, gates))


def _register_first(node: Node, pre_hooks: dict[Any, Any], gate: _Arrival) -> RemovableHandle:
    """Register ``gate`` as ``node``'s first Python pre-hook (``pre_hooks``: its dict, which
    autograd calls in order), so that it has seen the gradient before any stand-in runs."""
    handle = node.register_prehook(gate)
    others = [(key, hook) for key, hook in pre_hooks.items() if hook is not gate]
    for key, _ in others:
        del pre_hooks[key]
    pre_hooks.update(others)
    return handle


def _drop_stale_gates(pre_hooks: dict[Any, Any], task: int) -> None:
    """Remove the gates of earlier passes that failed before their end (no callback removed
    them; a gate outside its pass does nothing)."""
    for key in [k for k, h in pre_hooks.items() if isinstance(h, _Arrival) and h.task != task]:
        del pre_hooks[key]


def _restore_all(skipped: Sequence[_Skipped], gates: Sequence[RemovableHandle]) -> None:
    for stand_in in skipped:
        stand_in.restore()
    for handle in gates:
        handle.remove()
