"""Backwards still to come (``leangraph.runtime.pending``): a graph's latest replay awaits its
backward exactly as long as its token lives, and the running backward pass is asked whether it
reaches an awaited replay. Tokens live on real autograd nodes here, as the engine's do."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch

from leangraph.runtime.pending import BackwardToken, PendingBackwards


class Replay(torch.autograd.Function):
    """Stands for a forward replay: its autograd node holds the token, as the engine's does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, token: BackwardToken) -> torch.Tensor:
        ctx.token = token
        token.node = weakref.ref(ctx)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class Ask(torch.autograd.Function):
    """Identity whose backward calls ``ask()`` while the backward pass runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ask: Callable[[], None]) -> torch.Tensor:
        ctx.ask = ask
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.ask()
        return grad, None


def _replay(pending: PendingBackwards, graph: int, x: torch.Tensor) -> torch.Tensor:
    token = BackwardToken()
    out = Replay.apply(x, token)
    pending.note(graph, token)
    return out  # the token is now held by the output's autograd node alone


def test_nothing_awaits_before_a_replay_is_noted():
    pending = PendingBackwards(2)
    assert not pending.awaits(0) and not pending.awaits(1)
    assert not pending.reached_now([0, 1])


def test_a_replay_awaits_while_its_autograd_node_lives():
    pending = PendingBackwards(2)
    out = _replay(pending, 0, torch.randn(3, requires_grad=True))
    assert pending.awaits(0) and not pending.awaits(1)
    loss = out.sum()
    del out  # a tensor computed from the output keeps the node alive
    assert pending.awaits(0)
    del loss
    gc.collect()
    assert not pending.awaits(0)


def test_clear_ends_the_wait_while_the_token_lives():
    pending = PendingBackwards(2)
    first = _replay(pending, 0, torch.randn(3, requires_grad=True))
    second = _replay(pending, 1, torch.randn(3, requires_grad=True))
    pending.clear(0)
    assert not pending.awaits(0) and pending.awaits(1)
    assert first.grad_fn is not None and second.grad_fn is not None


def test_a_newer_note_replaces_the_older_one():
    pending = PendingBackwards(1)
    older = _replay(pending, 0, torch.randn(3, requires_grad=True))
    newer = _replay(pending, 0, torch.randn(3, requires_grad=True))
    del newer
    gc.collect()
    assert not pending.awaits(0)  # the older replay's token no longer counts
    assert older.grad_fn is not None


def test_reached_now_asks_the_running_backward_pass():
    pending = PendingBackwards(3)
    x = torch.randn(3, requires_grad=True)
    a, b = _replay(pending, 0, x), _replay(pending, 1, x)
    answers: list[tuple[bool, ...]] = []

    def ask() -> None:
        answers.append(tuple(pending.reached_now(g) for g in ([0], [1], [0, 1], [1, 0], [2], [])))

    Ask.apply(b * 2, ask).sum().backward()  # reaches graph 1's replay, not graph 0's
    assert answers == [(False, True, True, True, False, False)]
    Ask.apply(a + b, ask).sum().backward()
    assert answers[1] == (True, True, True, True, False, False)


def test_a_token_never_attached_to_a_node_awaits_but_is_never_reached():
    pending = PendingBackwards(1)
    x = torch.randn(3, requires_grad=True)
    token = BackwardToken()
    pending.note(0, token)
    answers: list[bool] = []
    Ask.apply(x * 2, lambda: answers.append(pending.reached_now([0]))).sum().backward()
    assert answers == [False] and pending.awaits(0)
