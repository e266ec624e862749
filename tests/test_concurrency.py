"""``reset()`` from another thread while the owner replays (CPU backend).

A :class:`GraphedCallable` holds a lock around each forward replay, each backward replay and
``reset()``, so a reset either completes before a replay (which then raises GraphResetError
before touching a buffer) or waits until the replay has returned complete results; never in
between. The CPU backend replays the aten calls recorded at capture, custom operators
included (not the module's Python code), so a module calling an operator that blocks on an event
the test controls holds a replay open mid-way, and an argument that blocks while its metadata
is checked holds a call before its replay begins. Only public behaviour orders the threads (no
test touches the callable's lock).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import TwoOutputs

import leangraph
from leangraph import GraphResetError

TIMEOUT = 10.0  # only reached if something deadlocks
WAIT = 0.05  # how long a reset must demonstrably keep waiting


# An operator whose kernel passes its module's gate: the trace records and replays it.
_GATES: weakref.WeakValueDictionary[int, Gated] = weakref.WeakValueDictionary()
_LIBRARY = torch.library.Library("leangraph_tests", "FRAGMENT")
_LIBRARY.define("gate(Tensor x, int owner, str where) -> Tensor")


def _gate_kernel(x: torch.Tensor, owner: int, where: str) -> torch.Tensor:
    _GATES[owner].pass_gate(where)
    return x.clone()


_LIBRARY.impl("gate", _gate_kernel, "CPU")


class _Hold(torch.autograd.Function):
    """Identity whose forward and backward pass the owner's gate (each blocks when armed)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, owner: Gated) -> torch.Tensor:
        ctx.owner = id(owner)
        return torch.ops.leangraph_tests.gate(x, id(owner), "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.ops.leangraph_tests.gate(grad, ctx.owner, "backward"), None


class Gated(torch.nn.Module):
    """``tanh(linear(x))`` whose forward (or backward) can be made to block mid-way."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.armed: str | None = None  # "forward" or "backward": block there once
        self.entered = threading.Event()
        self.release = threading.Event()
        self.passed: list[str] = []  # where the gate was passed, in order
        _GATES[id(self)] = self

    def pass_gate(self, where: str) -> None:
        self.passed.append(where)
        if self.armed == where:
            self.armed = None
            self.entered.set()
            assert self.release.wait(TIMEOUT), "the test never released the gate"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(_Hold.apply(self.linear(x), self))  # tanh: after the gate


def _graphed() -> tuple[Gated, Gated]:
    torch.manual_seed(0)
    module, reference = Gated(), Gated()  # (events cannot be deep-copied)
    reference.load_state_dict(module.state_dict())
    leangraph.make_graphed_callables(module, (torch.randn(2, 4, requires_grad=True),))
    return module, reference


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _reset_waits_for(module: Gated) -> threading.Thread:
    """Start a reset in another thread once the replay is inside the gate; check it waits;
    then let the replay go on."""
    try:
        assert module.entered.wait(TIMEOUT), "the replay never reached the gate"
        resetter, outcome = _in_thread(module.forward.reset)
        resetter.join(WAIT)
        assert resetter.is_alive(), f"reset did not wait for the replay: {outcome}"
        assert not module.forward.is_reset
    finally:
        module.release.set()
    return resetter


def test_reset_waits_for_a_forward_replay():
    module, reference = _graphed()
    x = torch.randn(2, 4, requires_grad=True)
    module.armed = "forward"
    owner, replay = _in_thread(lambda: module(x))
    resetter = _reset_waits_for(module)
    owner.join(TIMEOUT)
    resetter.join(TIMEOUT)
    assert not owner.is_alive() and not resetter.is_alive()
    assert "error" not in replay, replay
    out = replay["value"]
    assert torch.equal(out, reference(x))  # the replay's outputs are complete
    assert module.forward.is_reset
    with pytest.raises(GraphResetError, match=r"callable 0 \(Gated\): cannot call"):
        module(x)
    with pytest.raises(GraphResetError, match="cannot run a backward"):
        out.sum().backward()


def test_reset_waits_for_a_backward_replay():
    module, reference = _graphed()
    x = torch.randn(2, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = module(x), reference(x_ref)
    assert torch.equal(out, ref)
    module.armed = "backward"
    grad = torch.randn(2, 4)
    owner, replay = _in_thread(lambda: out.backward(grad))
    resetter = _reset_waits_for(module)
    owner.join(TIMEOUT)
    resetter.join(TIMEOUT)
    assert not owner.is_alive() and not resetter.is_alive()
    assert "error" not in replay, replay
    ref.backward(grad)
    assert torch.equal(x.grad, x_ref.grad)  # the backward's gradients are complete
    for p, q in zip(module.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert module.forward.is_reset
    with pytest.raises(GraphResetError):
        module(x)


class Paused(torch.Tensor):
    """A replay argument that holds the replay inside its argument checks (the first time its
    dtype is read), before the replay takes the callable's lock. Its ops are a plain
    tensor's (``__torch_function__`` disabled, as ``nn.Parameter``'s), so the replay takes it."""

    gate: tuple[threading.Event, threading.Event] | None = None  # (entered, release)
    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        gate = type(self).gate
        if gate is not None:
            type(self).gate = None
            gate[0].set()
            assert gate[1].wait(TIMEOUT), "the test never released the gate"
        return torch.Tensor.dtype.__get__(self)


def test_a_reset_that_wins_the_race_makes_the_replay_raise():
    """A reset that completes after a call began but before its replay took the lock: the
    replay raises GraphResetError and runs nothing."""
    module, _ = _graphed()
    module.passed.clear()
    module(torch.randn(2, 4, requires_grad=True))  # a replay runs the recorded gate: it is seen
    assert module.passed == ["forward"]
    module.passed.clear()
    x = torch.Tensor._make_subclass(Paused, torch.randn(2, 4), True)
    entered, release = threading.Event(), threading.Event()
    Paused.gate = (entered, release)
    try:
        owner, replay = _in_thread(lambda: module(x))
        assert entered.wait(TIMEOUT), "the call never checked its argument"
        module.forward.reset()  # does not wait: the call holds no lock yet
        assert module.forward.is_reset
    finally:
        Paused.gate = None
        release.set()
    owner.join(TIMEOUT)
    assert not owner.is_alive()
    assert isinstance(replay.get("error"), GraphResetError), replay
    assert "cannot replay its forward graph" in str(replay["error"])
    assert module.passed == []  # the replay ran none of its recorded operators


@pytest.mark.parametrize("delay", [0.0, 0.0005, 0.002])
def test_reset_racing_a_replay_loop(delay):
    """Replays either complete correctly or raise GraphResetError; nothing else happens."""
    module, reference = _graphed()
    torch.manual_seed(1)
    inputs = [torch.randn(2, 4) for _ in range(200)]
    done = []

    def loop() -> None:
        for x in inputs:
            x = x.clone().requires_grad_()
            x_ref = x.detach().clone().requires_grad_()
            try:
                out = module(x)
            except GraphResetError:
                return
            assert torch.equal(out, reference(x_ref))
            try:
                out.backward(torch.ones_like(out))
            except GraphResetError:
                return  # reset between this forward and its backward (docs: L2)
            reference(x_ref).backward(torch.ones_like(out))
            assert torch.equal(x.grad, x_ref.grad)
            done.append(None)

    owner, outcome = _in_thread(loop)
    threading.Event().wait(delay)
    module.forward.reset()
    owner.join(TIMEOUT)
    assert not owner.is_alive() and "error" not in outcome, outcome
    with pytest.raises(GraphResetError):
        module(torch.randn(2, 4, requires_grad=True))


def _reset_once_the_backward_replay_returns(member: leangraph.GraphedCallable) -> Any:
    """A profiler that, the moment ``member``'s backward replay returns (its lock free again,
    the gradient hooks still to run), resets it from another thread and waits for the reset:
    the thread switch that lands there by chance (2 runs in 100 with a short switch
    interval), made certain."""
    fired: list[bool] = []

    def profile(frame: Any, event: str, _: Any) -> None:
        if (
            not fired
            and event == "return"
            and frame.f_code.co_name == "_replay_backward"
            and frame.f_locals.get("self") is member
        ):
            fired.append(True)
            resetter, outcome = _in_thread(member.reset)
            resetter.join(TIMEOUT)
            assert not resetter.is_alive() and "error" not in outcome, outcome

    return profile, fired


@pytest.mark.parametrize(
    "options, loss_of",
    [
        ({"fuse_grad_accumulation": True, "accumulator_hooks": "python"}, lambda y, head: y + head),
        ({}, lambda y, head: y),  # head gets no gradient: eager runs no hook of it
        ({"overlap_grad_accumulation": True}, lambda y, head: y),
    ],
    ids=["python-hooks", "unreached", "unreached-overlap"],
)
def test_a_reset_right_after_a_backward_replay_leaves_its_gradient_hooks_as_eagers(
    options, loss_of
):
    """The replay's gradients are complete when a reset from another thread gets the lock;
    their hooks must still fire as eager's do. The replay called ``accumulator_hooks="python"``
    hooks, and passed over those of parameters no output reached, only if the callable was
    not reset by then: so the python hooks never fired, and unreached ones fired."""
    torch.manual_seed(0)
    module, reference = TwoOutputs(), TwoOutputs()
    reference.load_state_dict(module.state_dict())
    logs: dict[str, list[str]] = {"graphed": [], "eager": []}
    for key, owner in (("graphed", module), ("eager", reference)):
        for name, param in owner.named_parameters():
            param.register_post_accumulate_grad_hook(
                lambda _, name=name, log=logs[key]: log.append(name)
            )
    leangraph.make_graphed_callables(module, (torch.randn(2, 8, requires_grad=True),), **options)
    x = torch.randn(2, 8, requires_grad=True)
    loss = loss_of(*module(x)).sum()
    profile, fired = _reset_once_the_backward_replay_returns(module.forward)
    sys.setprofile(profile)  # a CPU backward runs on this thread
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
    assert fired and module.forward.is_reset
    loss_of(*reference(x.detach().clone().requires_grad_())).sum().backward()
    assert sorted(logs["graphed"]) == sorted(logs["eager"]), logs
    for p, q in zip(module.parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None)
        assert p.grad is None or torch.equal(p.grad, q.grad)
