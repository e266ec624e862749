"""In-graph gradient accumulation (``fuse_grad_accumulation=True``), as capture sets it up.

Eager autograd adds every parameter's gradient into its ``.grad`` with one kernel per
parameter per microbatch, launched from Python-free C++ but outside any graph. Fused, each
backward graph adds its parameters' gradients into their accumulation buffers itself, so a
replay launches nothing per parameter. The buffer is ``param.main_grad`` where the parameter
has one (Megatron-LM's convention: a buffer its DDP zeroes in place), else a tensor leangraph
attaches as ``param.grad`` (the caller's ``.grad`` itself when it already has one of the
parameter's layout). Every graph training a parameter adds into the same buffer.

Autograd's accumulators must still run: post-accumulate-grad hooks and the hooks DDP and
Megatron-core register on the accumulator nodes are how frameworks learn a gradient is ready.
A replay therefore hands autograd a *relay*: the parameters themselves, whose accumulator
nodes are given sequence numbers (the engine's priority among ready nodes) in the order
eager's backward reached the parameters, recorded during capture. The replay returns no
gradient to them, so the accumulators run without accumulating, right after the replay's
node as in eager, and their hooks fire once per parameter per backward pass, in eager's
order. (On a torch whose nodes cannot be renumbered, the relay is a zero-element tensor that
reaches each accumulator through a view of its own, made so that the views' nodes order them,
and that fires after the rest of the backward pass.)

Each accumulator autograd visits costs the host several microseconds, hooked or not. With
``accumulator_hooks="python"`` a replay visits none: it calls the hooks registered from Python
itself (:class:`PythonHooks`), in the same order and with the same arguments autograd would.
Hooks registered from C++ (torch DDP's reducer) cannot be seen from Python, so that mode is
for loops that have none.
"""

from __future__ import annotations

import collections
import enum
import functools
import itertools
import operator
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import Node
from torch.utils.weak import WeakIdKeyDictionary

from ..buffers import same_layout

# A tensor's Tensor.register_hook hooks (torch keeps them there, publicly unlisted): None or a
# dict, empty once every hook was removed.
TENSOR_HOOKS = operator.attrgetter("_backward_hooks")

__all__ = [
    "MEGATRON_DDP_FLAG",
    "TENSOR_HOOKS",
    "AccumulationTarget",
    "FusedGradients",
    "HookDelivery",
    "PythonHooks",
    "Relay",
    "accumulator_node",
    "add_into",
    "allocate_targets",
    "call_python_hooks",
    "check_fusable",
    "check_python_hooks_alone",
    "deliver_gradients",
    "describe_buffer",
    "engine_runs_all",
    "engine_runs_any",
    "fire_relay",
    "fused_parameters",
    "has_post_accumulate_hooks",
    "hook_relay",
    "main_grad_of",
    "megatron_ddp_refusal",
    "new_buffer_bytes",
    "node_hook_dicts",
    "node_hook_refusal",
    "post_accumulate_hook_refusal",
    "post_accumulate_hooks",
    "python_hooks",
    "trained_parameters",
]


class HookDelivery(enum.Enum):
    """How the hooks on a fused graph's parameters' accumulators fire (``accumulator_hooks``)."""

    AUTOGRAD = True
    """Autograd runs each accumulator after the backward replay (the relay): every hook fires,
    those registered from C++ included."""
    PYTHON = "python"
    """The replay calls the hooks registered from Python itself; autograd visits none."""
    NONE = False
    """No accumulator runs; a post-accumulate-grad hook is refused."""


@dataclass(frozen=True, eq=False)
class AccumulationTarget:
    """Where one parameter's gradient is added inside the backward graphs.

    ``buffer`` is ``param.main_grad`` (``into_main_grad``) or the tensor attached as
    ``param.grad``. It is the caller's gradient memory, not a graph-owned buffer: replays add
    into it until the graphs are reset.
    """

    param: torch.nn.Parameter
    name: str
    buffer: torch.Tensor
    into_main_grad: bool


@dataclass(frozen=True, eq=False)
class Relay:
    """What a replay hands autograd besides its inputs so that the parameters' accumulators
    run, in eager's order, with no gradient: ``inputs`` (the replay's node returns None for
    each). ``nodes`` are the accumulator nodes renumbered for that order, kept alive with it
    (a parameter's accumulator lives only while something holds it)."""

    inputs: tuple[torch.Tensor, ...]
    nodes: tuple[Node, ...]


@dataclass(frozen=True, eq=False)
class PythonHooks:
    """The hooks registered from Python on the accumulators of one graph's parameters, which
    its replays call themselves (``accumulator_hooks="python"``), parameters in eager's order.

    ``pre_hooks`` and ``post_hooks`` are each accumulator node's own dicts of Python hooks
    (``node.register_prehook``, ``node.register_hook``: Megatron-core's DDP registers its
    gradient-ready hooks so), live: hooks registered after capture land in them too. A
    parameter's post-accumulate-grad hooks are read from it at each call. ``nodes`` keep the
    accumulators, and so their dicts, alive until reset.
    """

    names: tuple[str, ...]
    params: tuple[torch.nn.Parameter, ...]
    pre_hooks: tuple[dict[int, Any], ...]
    post_hooks: tuple[dict[int, Any], ...]
    nodes: tuple[Node, ...]


@dataclass(frozen=True, eq=False)
class FusedGradients:
    """One graph's share of the accumulation: its targets in gradient order, how the hooks on
    its parameters' accumulators fire, and what that needs: the relay its replays hand
    autograd (``AUTOGRAD``), or the hooks they call (``PYTHON``); both None when it trains no
    parameter. With ``NONE`` no accumulator runs, and no hook may wait for one."""

    targets: tuple[AccumulationTarget, ...]
    relay: Relay | None
    delivery: HookDelivery = HookDelivery.AUTOGRAD
    python_hooks: PythonHooks | None = None
    # With NONE: the accumulators' hook dicts, which must stay empty (no replay runs them);
    # the nodes are held, so that a hook registered after capture lands in these dicts.
    unrun_hooks: PythonHooks | None = None


def main_grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    """``param.main_grad`` where it is a tensor (Megatron-LM's gradient buffer), else None."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if isinstance(main_grad, torch.Tensor) else None


def check_fusable(
    label: str, params: Sequence[tuple[str, torch.nn.Parameter]], *, delivery: HookDelivery
) -> None:
    """Refuse, before warm-up, parameters whose gradient cannot be added into a buffer, and
    (with ``NONE``) parameters with a hook that would never fire: a post-accumulate-grad
    hook, a Python hook on their accumulator node, or Megatron-core DDP's on it
    (:data:`MEGATRON_DDP_FLAG`).

    Raises:
        ValueError: for a ``main_grad`` (other than None) that is not a floating-point
            tensor of the parameter's shape on its device;
            for a post-accumulate-grad hook, an accumulator-node hook or a Megatron-DDP
            parameter with ``NONE``.
        RuntimeError: for ``AUTOGRAD``, if this torch's accumulators skip hooks for a
            missing gradient.
    """
    if delivery is HookDelivery.NONE:
        for name, param in params:
            if has_post_accumulate_hooks(param):
                raise ValueError(post_accumulate_hook_refusal(label, name))
            if hasattr(param, MEGATRON_DDP_FLAG):
                raise ValueError(megatron_ddp_refusal(label, name))
            with torch.enable_grad():  # the call may come under no_grad
                node = accumulator_node(param)
            if any(node_hook_dicts(node)):
                raise ValueError(node_hook_refusal(label, name))
    elif (
        delivery is HookDelivery.AUTOGRAD
        and params
        and not _accumulators_run_hooks_without_gradient()
    ):
        raise RuntimeError(
            f"{label}: fuse_grad_accumulation=True needs a torch whose autograd runs "
            "post-accumulate-grad hooks for a parameter that got no gradient; torch "
            f"{torch.__version__} does not, so the hooks would not fire; use the default "
            "fuse_grad_accumulation=False, or accumulator_hooks='python'"
        )
    for name, param in params:
        main_grad = getattr(param, "main_grad", None)  # None: no main_grad, the .grad's turn
        if main_grad is None:
            continue
        if (
            not isinstance(main_grad, torch.Tensor)
            or main_grad.shape != param.shape
            or main_grad.device != param.device
            or not main_grad.is_floating_point()
        ):
            raise ValueError(
                f"{label} parameter {name!r}: fuse_grad_accumulation=True adds its gradient "
                f"into main_grad, which must be a floating-point tensor of shape "
                f"{tuple(param.shape)} on {param.device}; got {describe_buffer(main_grad)}"
            )


def describe_buffer(value: object) -> str:
    """A gradient buffer as messages name it: its dtype, shape and device, or its type."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} of shape {tuple(value.shape)} on {value.device}"
    return type(value).__name__


MEGATRON_DDP_FLAG = "grad_added_to_main_grad"
"""The attribute Megatron-core's ``DistributedDataParallel`` sets on every parameter it
manages (its gradient-ready hooks, on the accumulators, read it)."""

post_accumulate_hooks = operator.attrgetter("_post_accumulate_grad_hooks")
"""A tensor's ``register_post_accumulate_grad_hook`` hooks: None or a dict (torch keeps them in
this attribute, publicly unlisted); a C-level getter, for loops over many parameters."""


def has_post_accumulate_hooks(param: torch.Tensor) -> bool:
    """Whether ``param`` has a ``register_post_accumulate_grad_hook`` hook."""
    return bool(post_accumulate_hooks(param))


def post_accumulate_hook_refusal(label: str, name: str) -> str:
    """Why a parameter with a post-accumulate-grad hook is refused without accumulator hooks."""
    return (
        f"{label} parameter {name!r} has a post-accumulate-grad hook, which "
        "accumulator_hooks=False would never run (its backward replays run no autograd "
        "accumulator); remove the hook, or capture with accumulator_hooks=True (the default)"
    )


def node_hook_refusal(label: str, name: str, *, since_capture: bool = False) -> str:
    """Why a parameter whose accumulator node has a hook is refused without accumulator
    hooks (``since_capture``: registered after the capture, and the replay finds it)."""
    when = " since capture" if since_capture else ""
    return (
        f"{label} parameter {name!r} has a hook on its gradient accumulator node{when} "
        "(node.register_hook or register_prehook, as DDP wrappers register gradient-ready "
        "hooks), which accumulator_hooks=False would never run (its backward replays run "
        "no autograd accumulator); capture with accumulator_hooks=True or 'python'"
    )


def megatron_ddp_refusal(label: str, name: str, *, since_capture: bool = False) -> str:
    """Why a parameter Megatron-core's DDP manages is refused without accumulator hooks
    (``since_capture``: DDP was built after the capture, and the replay finds it)."""
    when = " since capture" if since_capture else ""
    return (
        f"{label} parameter {name!r} is managed by Megatron-core's DistributedDataParallel "
        f"(it has {MEGATRON_DDP_FLAG}{when}), whose gradient-ready hooks are registered on "
        "the parameters' accumulators; accumulator_hooks=False would never run them (its "
        "backward replays run no autograd accumulator), so DDP would never see the gradients. "
        "Capture with accumulator_hooks=True or 'python'"
        + (", after wrapping the model in DDP" if since_capture else "")
    )


@functools.lru_cache(maxsize=1)
def _accumulators_run_hooks_without_gradient() -> bool:
    """Whether an accumulator reached with no gradient runs its post-accumulate-grad hooks
    (the relay relies on it; ``accumulator_hooks="python"`` does not): tried once on the
    CPU."""
    param = torch.nn.Parameter(torch.zeros(1))
    fired: list[bool] = []
    param.register_post_accumulate_grad_hook(lambda _: fired.append(True))
    fire_relay(hook_relay([param]))
    return bool(fired) and param.grad is None


class _Deliver(torch.autograd.Function):
    """A node whose backward hands given gradients (None: none) to its inputs' nodes."""

    @staticmethod
    def forward(
        ctx: Any, grads: tuple[torch.Tensor | None, ...], *inputs: torch.Tensor
    ) -> torch.Tensor:
        ctx.grads = grads
        return torch.zeros((), device=inputs[0].device)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads, ctx.grads = ctx.grads, ()
        return (None, *grads)


def deliver_gradients(
    inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None = None
) -> None:
    """Run autograd from a node that hands ``grads`` (default: none) to ``inputs``, outside any
    other backward: their accumulators add what they get (into ``.grad``, as eager's do) and
    run their hooks once each, also when they get nothing."""
    given = tuple(grads) if grads is not None else (None,) * len(inputs)
    with torch.enable_grad():
        root = _Deliver.apply(given, *inputs)
    torch.autograd.backward(root)


def fire_relay(relay: Relay, *, skip: frozenset[int] = frozenset()) -> None:
    """Run the accumulators ``relay`` reaches (their hooks), outside any other backward, but
    those of the parameters whose ids are in ``skip`` (a renumbered relay's inputs are the
    parameters; the view relay of an older torch reaches them all)."""
    inputs = [t for t in relay.inputs if id(t) not in skip] if skip else relay.inputs
    if inputs:
        deliver_gradients(inputs)


# Accumulator nodes come with the highest sequence number there is, so that the engine runs
# each as soon as it is ready; renumbered ones stay just below it, each relay's below the
# ones made before it, in eager's order within a relay.
_TOP_SEQUENCE_NR = 2**64 - 1
_renumbered = itertools.count(1)


def hook_relay(params_in_eager_order: Sequence[torch.nn.Parameter]) -> Relay:
    """The relay of ``params_in_eager_order``: the parameters, their accumulators renumbered
    so that the engine runs them in that order when they are ready together.

    Where this torch cannot renumber a node, a zero-element tensor whose backward reaches each
    accumulator through a zero-element view of its parameter: the views are made last
    parameter first, so the first one's node is the newest and runs first, and at once its
    accumulator; a view's node is fixed when the concatenation takes it.
    """
    with torch.enable_grad():
        nodes = [accumulator_node(p) for p in params_in_eager_order]
        if _can_renumber(nodes):
            for node in nodes:
                node._set_sequence_nr(_TOP_SEQUENCE_NR - next(_renumbered))  # type: ignore[attr-defined]
            return Relay(tuple(params_in_eager_order), tuple(nodes))
        views = [torch.as_strided(p, (0,), (1,)) for p in reversed(params_in_eager_order)]
        return Relay((torch.cat(views),), ())


def _can_renumber(nodes: Sequence[Node]) -> bool:
    """Whether this torch lets Python set a node's sequence number (torch >= 2.2 does)."""
    return all(hasattr(node, "_set_sequence_nr") for node in nodes)


def python_hooks(
    names: Sequence[str], params_in_eager_order: Sequence[torch.nn.Parameter]
) -> PythonHooks:
    """The :class:`PythonHooks` of ``params_in_eager_order`` (named ``names``)."""
    with torch.enable_grad():
        nodes = tuple(accumulator_node(p) for p in params_in_eager_order)
    dicts = [node_hook_dicts(node) for node in nodes]
    return PythonHooks(
        names=tuple(names),
        params=tuple(params_in_eager_order),
        pre_hooks=tuple(pre for pre, _ in dicts),
        post_hooks=tuple(post for _, post in dicts),
        nodes=nodes,
    )


def node_hook_dicts(node: Node) -> tuple[dict[int, Any], dict[int, Any]]:
    """``node``'s dicts of Python pre-hooks and hooks (made empty where it has none yet)."""
    return _hook_dict(node.register_prehook), _hook_dict(node.register_hook)


def _hook_dict(register: Any) -> dict[int, Any]:
    """A node's dict of Python hooks of one kind. torch keeps one per node and kind, made at
    the first registration and not listed publicly; a registration's handle refers to it."""
    handle = register(_no_hook)
    try:
        hooks = handle.hooks_dict_ref()
    finally:
        handle.remove()
    assert isinstance(hooks, dict)
    return hooks


def _no_hook(*_: Any) -> None:
    return None


def check_python_hooks_alone(label: str, hooks: PythonHooks) -> None:
    """Refuse a backward pass (the one running) that will run one of ``hooks``'
    accumulators itself: it reaches the parameter outside the graph too (an eager use in
    the same pass), so autograd would call its hooks, maybe before the graph adds its
    gradient, and the replay again.

    Raises:
        RuntimeError: naming the parameter.
    """
    if not engine_runs_any(hooks.nodes):
        return
    name = next(n for n, node in zip(hooks.names, hooks.nodes) if engine_runs_any((node,)))
    raise RuntimeError(
        f"{label} parameter {name!r}: this backward pass reaches its gradient outside the "
        "graph too (the parameter is used outside it as well), so autograd runs its "
        "accumulator and hooks itself; with accumulator_hooks='python' the replay would call "
        "them as well, maybe first. Capture with accumulator_hooks=True"
    )


_WILL_ENGINE_EXECUTE = torch._C._will_engine_execute_node


def engine_runs_all(nodes: Sequence[Node]) -> bool:
    """Whether the running backward pass runs every one of the accumulator ``nodes``.

    In ``torch.autograd.grad`` asked for a parameter itself, autograd captures that gradient
    instead of running its accumulator, and torch's helper raises for such a leaf rather than
    say so: it is not run."""
    try:
        return all(map(_WILL_ENGINE_EXECUTE, nodes))
    except RuntimeError:  # a leaf torch.autograd.grad captures: its accumulator does not run
        return all(map(_engine_runs, nodes))


def engine_runs_any(nodes: Sequence[Node]) -> bool:
    """Whether the running backward pass runs one of the accumulator ``nodes`` (a leaf that
    ``torch.autograd.grad`` captures is not run: :func:`engine_runs_all`)."""
    try:
        return any(map(_WILL_ENGINE_EXECUTE, nodes))
    except RuntimeError:
        return any(map(_engine_runs, nodes))


def _engine_runs(node: Node) -> bool:
    try:
        return bool(_WILL_ENGINE_EXECUTE(node))
    except RuntimeError:
        return False


def call_python_hooks(
    label: str, hooks: PythonHooks, *, skip: frozenset[int] = frozenset()
) -> None:
    """Call the hooks of ``hooks``' parameters' accumulators as autograd calls them when an
    accumulator gets no gradient: per parameter, in eager's order, its node's pre-hooks with
    ``(None,)``, its post-accumulate-grad hooks with the parameter, its node's hooks with
    ``((), (None,))``; in the caller's grad mode. Parameters whose ids are in ``skip`` (no
    output with a gradient reaches them: eager's backward runs no accumulator for them) are
    passed over.

    Raises:
        RuntimeError: naming the parameter, for a hook that returns something (a gradient
            the graph has added already cannot be replaced), or whose hooks another graph's
            replay called in this backward pass already.
    """
    if not (
        any(hooks.pre_hooks)
        or any(hooks.post_hooks)
        or any(map(post_accumulate_hooks, hooks.params))
    ):
        return  # checked in C-level loops: the common case, no hook at all
    task = _GRAPH_TASK_ID()
    if task != -1:
        _claim_pass(label, hooks, task, skip)
    for name, param, pre_hooks, post_hooks in zip(
        hooks.names, hooks.params, hooks.pre_hooks, hooks.post_hooks
    ):
        if skip and id(param) in skip:
            continue
        if pre_hooks:
            _call_each(label, name, "accumulator pre-hook", pre_hooks.values(), (None,))
        accumulate_hooks = post_accumulate_hooks(param)
        if accumulate_hooks:
            _call_each(label, name, "post-accumulate-grad hook", accumulate_hooks.values(), param)
        if post_hooks:
            _call_each(label, name, "accumulator hook", post_hooks.values(), (), (None,))


# Per parameter, the backward pass (graph task) in which replays last called its hooks, and
# whose PythonHooks did: two graphs (of two calls, or two microbatches of one layer) must not
# both call its hooks in one pass. Keyed by identity: a tensor's == is elementwise.
_CALLED_IN: WeakIdKeyDictionary = WeakIdKeyDictionary()
_GRAPH_TASK_ID = torch._C._current_graph_task_id


def _claim_pass(label: str, hooks: PythonHooks, task: int, skip: frozenset[int]) -> None:
    """Note that ``hooks`` call their parameters' hooks (but those in ``skip``) in backward
    pass ``task``.

    Raises:
        RuntimeError: naming the parameter, if another graph's replay called its hooks in
            this pass already (autograd alone knows when all its gradients arrived).
    """
    mine = (task, id(hooks))
    for name, param in zip(hooks.names, hooks.params):
        if skip and id(param) in skip:
            continue
        called = _CALLED_IN.get(param)
        if called is not None and called[0] == task and called != mine:
            raise RuntimeError(
                f"{label} parameter {name!r}: the replay of another graph (another "
                "microbatch's, or another make_graphed_callables call's) called its hooks in "
                "this backward pass already; with accumulator_hooks='python' a parameter's "
                "gradient must come from one graph per backward pass (only autograd knows "
                "when all of them arrived). Capture with accumulator_hooks=True"
            )
    for param in hooks.params:
        if not (skip and id(param) in skip):
            _CALLED_IN[param] = mine


def _call_each(label: str, name: str, kind: str, hooks: Any, *args: Any) -> None:
    for hook in tuple(hooks):  # a hook may remove itself
        if hook(*args) is not None:
            raise RuntimeError(
                f"{label} parameter {name!r}: a {kind} returned a value; with "
                "fuse_grad_accumulation=True the backward graph has added the gradient "
                "already, so a hook can only observe it: return None"
            )


def accumulator_node(param: torch.Tensor) -> Node:
    """``param``'s autograd accumulator node (made now, on the current stream, if nothing
    holds one)."""
    grad_fn = param.view_as(param).grad_fn
    assert grad_fn is not None  # a parameter that requires grad
    node = grad_fn.next_functions[0][0]
    assert node is not None
    return node


def allocate_targets(
    params_of: Sequence[Sequence[tuple[str, torch.nn.Parameter]]],
) -> list[tuple[AccumulationTarget, ...]]:
    """The targets of each graph's trained parameters (``params_of[g]``: names and
    parameters, in gradient order), one per parameter shared by every graph training it.
    Made after warm-up, outside any capture.

    A parameter's existing ``.grad`` is adopted when it has the parameter's layout (values
    kept: accumulation continues from them); otherwise a buffer is allocated (zero) and, where
    a ``.grad`` of another layout exists, it is copied in and the buffer attached instead.
    """
    made: dict[int, AccumulationTarget] = {}
    result = []
    for params in params_of:
        targets = []
        for name, param in params:
            target = made.get(id(param))
            if target is None:
                target = made[id(param)] = _make_target(name, param)
            targets.append(target)
        result.append(tuple(targets))
    return result


def fused_parameters(
    params_of: Sequence[Sequence[tuple[str, torch.nn.Parameter]]],
    callable_of: Sequence[int],
) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The parameters each graph adds into their buffers itself (``params_of[g]``: the ones
    it trains, named; ``callable_of[g]``: its callable): all of them, except in a graph
    training a parameter that another callable trains too (tied weights), which fuses none
    and hands autograd its gradients as unfused graphs do.

    One backward pass reaches a tied parameter through several graphs. Eager sums their
    gradients first, in the gradients' dtype, and accumulates the sum once; graphs adding
    one after another round each gradient into the buffer on its own, which differs from
    eager's wherever the buffer holds values already or is wider than the gradients (an
    fp32 ``main_grad`` of a bf16 parameter). Autograd's input buffer makes eager's sum, and
    only autograd knows when a pass has brought every contribution, so its accumulator
    fires the hooks once, after the last. (The graphs of one callable, one per microbatch,
    have their backward passes one by one.)"""
    callables_training: dict[int, set[int]] = collections.defaultdict(set)
    for params, index in zip(params_of, callable_of):
        for _, param in params:
            callables_training[id(param)].add(index)
    return [
        [] if any(len(callables_training[id(p)]) > 1 for _, p in params) else list(params)
        for params in params_of
    ]


def add_into(targets: Sequence[AccumulationTarget], grads: Sequence[torch.Tensor]) -> None:
    """Add ``grads`` into ``targets`` (inside a capture: the graph does it at every replay),
    one multi-tensor kernel per pair of dtypes; each sum rounds as ``buffer.add_(grad)``."""
    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], ...]] = {}
    for target, grad in zip(targets, grads):
        buffers, values = groups.setdefault((target.buffer.dtype, grad.dtype), ([], []))
        buffers.append(target.buffer)
        values.append(grad)
    with torch.no_grad():
        for buffers, values in groups.values():
            torch._foreach_add_(buffers, values)


def _make_target(name: str, param: torch.nn.Parameter) -> AccumulationTarget:
    main_grad = main_grad_of(param)
    if main_grad is not None:
        return AccumulationTarget(param, name, main_grad, into_main_grad=True)
    grad = param.grad
    buffer = _reusable_buffer(param)
    if buffer is None:
        buffer = torch.zeros_like(param, memory_format=torch.preserve_format)
    _BUFFERS[param] = weakref.ref(buffer)
    if grad is not None and grad is not buffer:
        with torch.no_grad():
            buffer.copy_(grad)
        param.grad = buffer
    return AccumulationTarget(param, name, buffer, into_main_grad=False)


def _reusable_buffer(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The buffer a parameter without ``main_grad`` accumulates into that exists already:
    the one another call's graphs add into (it need not be attached: ``.grad`` is None until
    their first replay, or a ``.grad`` autograd made in an eager backward since, which their
    replay would adopt), else its ``.grad`` where that has the parameter's layout; None
    where one must be allocated."""
    earlier = _BUFFERS.get(param)
    buffer = None if earlier is None else earlier()
    if buffer is not None:
        return buffer
    grad = param.grad
    return grad if grad is not None and _has_layout_of(grad, param) else None


def new_buffer_bytes(params: Iterable[torch.nn.Parameter]) -> int:
    """The bytes :func:`allocate_targets` allocates for ``params`` (each counted once):
    those with neither a ``main_grad`` nor a reusable buffer. Read before warm-up, so that
    the memory check counts them (warm-up gives no parameter a ``.grad`` it did not have)."""
    distinct = {id(p): p for p in params}.values()
    return sum(
        p.numel() * p.element_size()
        for p in distinct
        if main_grad_of(p) is None and _reusable_buffer(p) is None
    )


def trained_parameters(
    named: Sequence[tuple[str, torch.nn.Parameter]],
    facts_trains: Sequence[bool],
    *,
    has_backward: bool,
) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a graph trains (``named``: its callable's, in gradient order;
    ``facts_trains``: the probe's flag of each), with their names: none for a graph without
    a backward (captured under no_grad), which gets no gradient buffer either."""
    if not has_backward:
        return []
    return [item for item, trains in zip(named, facts_trains) if trains]


# The buffer the graphs of the latest call add a parameter's gradient into (allocated, or
# the .grad adopted), while anything holds it (a call's targets, or the parameter as .grad):
# keyed by identity, as a tensor's == is elementwise.
_BUFFERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _has_layout_of(grad: torch.Tensor, param: torch.Tensor) -> bool:
    return same_layout(grad, param) and grad.layout == torch.strided and not grad.requires_grad
