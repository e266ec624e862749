"""Lifecycle as a state machine (hypothesis, CPU backend): random sequences of forward replays
(with and without grad), backwards, replays out of capture order, resets (repeated ones
included), ``reset_all`` and optimizer steps over three graphed callables, checked against
eager copies of the same modules.

Invariants: a reset callable rejects calls, and backwards of outputs it produced before the
reset, with :class:`GraphResetError`; every other callable produces exactly (``torch.equal``)
what its eager copy produces, outputs and gradients; parameters and their ``.grad`` always
equal the eager copies'; nothing that was not reset reports being reset.

Replays follow the capture order (forwards 0, 1, 2, then backwards 2, 1, 0) with the steps
that cannot come passed over: the backward of a forward replayed without grad, every step of
a reset callable; a pass may start over once nothing is in flight. The machine keeps its own
model of that order; a replay the model says is out of order must raise and change nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import leangraph
from leangraph import GraphedCallable, GraphResetError

WIDTH = 4
COUNT = 3
seeds = st.integers(0, 2**16 - 1)


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def _tensor(seed: int, requires_grad: bool = True) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, WIDTH, generator=generator).requires_grad_(requires_grad)


def _twins() -> tuple[list[Small], list[Small]]:
    """Two identical sets of modules (seeded CPU generator only: ``torch.manual_seed`` would
    also queue a lazy CUDA seeding, which costs more than the rest of an example)."""
    sets = []
    for _ in range(2):
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(0)
            sets.append([Small() for _ in range(COUNT)])
    return sets[0], sets[1]


class Pending:
    """A forward replay with grad whose backward has not run, and its eager twin."""

    def __init__(self, out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor,
                 x_ref: torch.Tensor) -> None:
        self.out, self.ref, self.x, self.x_ref = out, ref, x, x_ref


class Lifecycle(RuleBasedStateMachine):
    """Three callables graphed together; ``ORDER`` None (modules come back) or an order."""

    ORDER: list[int] | None = None

    def __init__(self) -> None:
        super().__init__()
        modules, self.eager = _twins()
        self.modules = modules
        samples = tuple((_tensor(i),) for i in range(COUNT))
        if self.ORDER is None:
            self.graphed: Any = leangraph.make_graphed_callables(
                tuple(modules), samples, num_warmup_iters=0)
            self.graphs: list[GraphedCallable] = [m.forward for m in self.graphed]
        else:
            self.graphed = leangraph.make_graphed_callables(
                tuple(modules), samples, order=self.ORDER, num_layers_per_chunk=1,
                num_warmup_iters=0)
            self.graphs = list(self.graphed)
        assert all(isinstance(g, GraphedCallable) for g in self.graphs)
        self.is_reset = [False] * COUNT
        self.pending: list[Pending | None] = [None] * COUNT
        self.next = 0  # position in STEPS
        self.stale: list[Pending] = []  # outputs produced before their callable's reset

    STEPS = [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]

    def expected(self) -> tuple[str, int] | None:
        """The next replay the capture order allows, steps that cannot come passed over."""
        for _ in range(len(self.STEPS)):
            kind, i = self.STEPS[self.next]
            if not self.is_reset[i] and (kind == "F" or self.pending[i] is not None):
                return kind, i
            self.next = (self.next + 1) % len(self.STEPS)
        return None  # everything was reset

    def advance(self) -> None:
        self.next = (self.next + 1) % len(self.STEPS)

    # ------------------------------------------------------------------------- rules

    @precondition(lambda self: self.expected() is not None)
    @rule(seed=seeds, grad=st.booleans())
    def replay_next(self, seed: int, grad: bool) -> None:
        step = self.expected()
        assert step is not None
        kind, i = step
        if kind == "F":
            x = _tensor(seed)  # requires grad as captured, also for replays without grad
            x_ref = x.detach().clone().requires_grad_()
            with torch.set_grad_enabled(grad):
                out = self.graphed[i](x)
                ref = self.eager[i](x_ref)
            assert torch.equal(out, ref)
            assert out.requires_grad == grad
            self.pending[i] = Pending(out, ref, x, x_ref) if grad else None
        else:
            pending, self.pending[i] = self.pending[i], None
            assert pending is not None
            grad_out = _tensor(seed, requires_grad=False)
            pending.out.backward(grad_out)
            pending.ref.backward(grad_out)
            assert torch.equal(pending.x.grad, pending.x_ref.grad)
        self.advance()

    @rule(i=st.integers(0, COUNT - 1), seed=seeds)
    def forward_out_of_order(self, i: int, seed: int) -> None:
        if self.is_reset[i] or self.expected() == ("F", i):
            return
        if self.STEPS[0] == ("F", i) and all(p is None for p in self.pending):
            return  # nothing in flight: a pass may start over, so this replay is legal
        message = "still await" if self.pending[i] is not None else "out of capture order"
        with pytest.raises(RuntimeError, match=message):
            self.graphed[i](_tensor(seed))

    @rule(i=st.integers(0, COUNT - 1))
    def reset(self, i: int) -> None:
        """Reset one callable (again, if it already was: idempotent)."""
        self.graphs[i].reset()
        self.is_reset[i] = True
        if self.pending[i] is not None:
            self.stale.append(self.pending[i])
            self.pending[i] = None

    @rule()
    def reset_all(self) -> None:
        leangraph.reset_all(self.graphed)
        for i in range(COUNT):
            self.reset(i)

    @precondition(lambda self: self.stale)
    @rule(seed=seeds)
    def backward_after_reset(self, seed: int) -> None:
        stale = self.stale.pop()
        with pytest.raises(GraphResetError, match="cannot run a backward"):
            stale.out.backward(_tensor(seed, requires_grad=False))
        assert stale.x.grad is None  # nothing flowed anywhere

    @precondition(lambda self: all(p is None for p in self.pending))
    @rule(lr=st.sampled_from([0.5, 0.1]), clear=st.booleans())
    def optimizer_step(self, lr: float, clear: bool) -> None:
        """Update parameters in place (graphs read them at replay), then maybe clear grads."""
        with torch.no_grad():
            for module in (*self.modules, *self.eager):
                for p in module.parameters():
                    if p.grad is not None:
                        p.sub_(lr * p.grad)
                    if clear:
                        p.grad = None

    # ------------------------------------------------------------------------- invariants

    @invariant()
    def reset_callables_reject_calls(self) -> None:
        for i in range(COUNT):
            assert self.graphs[i].is_reset == self.is_reset[i]
            if self.is_reset[i]:
                with pytest.raises(GraphResetError):
                    self.graphs[i](_tensor(0))

    @invariant()
    def parameters_and_grads_match_eager(self) -> None:
        for module, eager in zip(self.modules, self.eager):
            for p, q in zip(module.parameters(), eager.parameters()):
                assert torch.equal(p, q)
                assert (p.grad is None) == (q.grad is None)
                if p.grad is not None:
                    assert torch.equal(p.grad, q.grad)

    def teardown(self) -> None:
        leangraph.reset_all(self.graphed)


class UnorderedLifecycle(Lifecycle):
    ORDER = None


class OrderedLifecycle(Lifecycle):
    # Three chunks of one layer, one microbatch: graphs labelled (chunk c, microbatch 0, layer 0).
    ORDER = [1, 2, 3, -3, -2, -1]


# An example costs a capture (~2 ms) plus its steps; 500 of the unordered machine and 200 of
# the ordered one (which differs only in labels and graph assembly) take a few seconds.
TestUnorderedLifecycle = UnorderedLifecycle.TestCase
TestUnorderedLifecycle.settings = settings(
    max_examples=500, stateful_step_count=8, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestOrderedLifecycle = OrderedLifecycle.TestCase
TestOrderedLifecycle.settings = settings(
    max_examples=200, stateful_step_count=8, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
