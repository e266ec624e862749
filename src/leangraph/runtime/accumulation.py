"""In-graph gradient accumulation at replay: the state checks around a backward replay.

The backward graph adds into the buffers capture chose (:mod:`leangraph.build.accumulation`);
this module keeps those buffers the parameters' gradients. Before a replay, a parameter whose
``.grad`` was set to None (``zero_grad()``'s default) gets its buffer zeroed and attached again;
one whose ``.grad`` or ``main_grad`` was replaced by another tensor is refused, since the graph
would add into memory that is no longer the parameter's gradient. After it, parameters under
Megatron-LM's protocol are told their gradient is already in ``main_grad``, and with
``accumulator_hooks="python"`` the hooks on the parameters' accumulators are called.
"""

from __future__ import annotations

import itertools
import operator
import sys
import weakref
from collections.abc import Iterable

import torch

from ..build.accumulation import (
    MEGATRON_DDP_FLAG,
    TENSOR_HOOKS,
    AccumulationTarget,
    FusedGradients,
    HookDelivery,
    accumulator_node,
    call_python_hooks,
    check_python_hooks_alone,
    describe_buffer,
    engine_runs_all,
    has_post_accumulate_hooks,
    megatron_ddp_refusal,
    node_hook_dicts,
    node_hook_refusal,
    post_accumulate_hook_refusal,
    post_accumulate_hooks,
)
from .ddp import active_torch_ddp

__all__ = ["InGraphAccumulation"]


class InGraphAccumulation:
    """The accumulation state of one graph's parameters (fused gradient accumulation)."""

    def __init__(self, label: str, fused: FusedGradients, device: torch.device) -> None:
        self._label = label
        self._targets = fused.targets
        self.relay = fused.relay
        self._python_hooks = fused.python_hooks
        # What a backward replay hands autograd besides its inputs: the relay, or else an
        # empty leaf. Either way accumulator nodes autograd runs only in a backward pass that
        # accumulates into every parameter they stand for, as eager's accumulators would.
        if fused.relay is not None:
            self.autograd_inputs: tuple[torch.Tensor, ...] = fused.relay.inputs
            watched = fused.relay.nodes
        else:
            self.autograd_inputs = (torch.empty(0, device=device, requires_grad=True),)
            with torch.enable_grad():  # the call may come under no_grad
                watched = (accumulator_node(self.autograd_inputs[0]),)
        self._watched = watched if fused.targets else ()
        # Without accumulator hooks, a post-accumulate-grad hook added since capture is refused,
        # and so is a hook on an accumulator node (the record's ``unrun_hooks`` hold the nodes,
        # so a hook registered later lands in the dicts read here).
        self._hooks = fused.delivery is not HookDelivery.NONE
        unrun = fused.unrun_hooks
        self._unrun_hook_dicts = () if unrun is None else unrun.pre_hooks + unrun.post_hooks
        self._unrun_by_param = (
            {}
            if unrun is None
            else {id(p): d for p, *d in zip(unrun.params, unrun.pre_hooks, unrun.post_hooks)}
        )
        # Why a forward replay inside torch's DDP is refused, if it is: its reducer hooks the
        # accumulators from C++, which neither mode without the relay runs.
        self._ddp_refusal: str | None = None
        if self._python_hooks is not None:
            self._ddp_refusal = _DDP_PYTHON_HOOKS.format(label=label)
        elif not self._hooks and fused.targets:
            self._ddp_refusal = _DDP_NO_HOOKS.format(label=label)
        # The common replay, every target attached as at capture, checked in C-level loops.
        grad_targets = [t for t in fused.targets if not t.into_main_grad]
        main_targets = [t for t in fused.targets if t.into_main_grad]
        self._params = tuple(t.param for t in fused.targets)
        self._grad_params = tuple(t.param for t in grad_targets)
        self._grad_buffers = tuple(t.buffer for t in grad_targets)
        self._main_params = tuple(t.param for t in main_targets)
        self._main_buffers = tuple(t.buffer for t in main_targets)
        # The memory each buffer had at capture, which the graph adds into: a buffer's data
        # swapped since (``.grad.data = t``, ``.set_(t)``) keeps its identity, not its memory.
        self._buffers = tuple(t.buffer for t in fused.targets)
        self._pointers = tuple(map(_DATA_PTR, self._buffers))
        # Megatron-core's DDP marks the parameters it manages with this flag; its gradient-ready
        # hook adds .grad into main_grad unless the flag says that happened already.
        self._megatron = tuple(
            (t.param, torch.zeros((), dtype=t.param.dtype, device=t.param.device))
            for t in fused.targets
            if t.into_main_grad and hasattr(t.param, "grad_added_to_main_grad")
        )
        if fused.relay is not None:
            # An eager use of such a parameter in the same backward pass brings autograd's
            # accumulator a gradient, which Megatron's hook must add as eager's does.
            _hand_eager_gradients_to_megatron(param for param, _ in self._megatron)

    def before_forward(self) -> None:
        """With ``accumulator_hooks="python"`` or ``False``, refuse a forward replay inside
        torch's ``DistributedDataParallel``: its reducer hooks the accumulators from C++, where
        the replays cannot see or call them (``"python"``), and which no replay runs
        (``False``), so DDP would never reduce the gradients and the ranks would diverge.

        Raises:
            RuntimeError: naming the callable.
        """
        if self._ddp_refusal is not None and active_torch_ddp() is not None:
            raise RuntimeError(self._ddp_refusal)

    def check_targets(self) -> bool:
        """Refuse, before a replay changes anything (the replay order included), a target the
        graph can no longer add into; return whether :meth:`before_replay` has work to do.

        Raises:
            RuntimeError: for a parameter frozen since capture, with a tensor hook added
                since, whose ``.grad`` or ``main_grad`` is another tensor than the one the
                graph adds into (and that something else holds), or whose buffer's memory was
                swapped (``.data = ...``, ``.set_(...)``), or, for a ``.grad`` target, that
                got a tensor ``main_grad`` since; without accumulator hooks, for one that got
                a post-accumulate-grad hook, a hook on its accumulator node or Megatron's
                ``grad_added_to_main_grad`` since.
        """
        if self._as_captured():
            return False
        for target, pointer in zip(self._targets, self._pointers):
            self._check_target(target, pointer)
        return True

    def _check_target(self, target: AccumulationTarget, pointer: int) -> None:
        param = target.param
        if target.buffer.data_ptr() != pointer:
            raise RuntimeError(self._swapped(target))
        if TENSOR_HOOKS(param):
            raise RuntimeError(
                f"{self._label} parameter {target.name!r} got a tensor hook (register_hook) "
                "since capture; with fuse_grad_accumulation=True the backward graph adds its "
                "gradient itself, so no hook could see or change it first, as eager's "
                "would. Remove the hook, or capture without fuse_grad_accumulation"
            )
        if not self._hooks and has_post_accumulate_hooks(param):
            raise RuntimeError(post_accumulate_hook_refusal(self._label, target.name))
        if not self._hooks and hasattr(param, MEGATRON_DDP_FLAG):
            raise RuntimeError(megatron_ddp_refusal(self._label, target.name, since_capture=True))
        if any(self._unrun_by_param.get(id(param), ())):
            raise RuntimeError(node_hook_refusal(self._label, target.name, since_capture=True))
        if not param.requires_grad:
            raise RuntimeError(
                f"{self._label} parameter {target.name!r} must require grad as at capture, "
                "got requires_grad=False: "
                "with fuse_grad_accumulation=True its backward graph adds its gradient "
                "whatever it requires; capture again to freeze it"
            )
        if target.into_main_grad:
            main_grad = getattr(param, "main_grad", None)
            if main_grad is None:
                raise RuntimeError(
                    f"{self._label} parameter {target.name!r}: main_grad was deleted (or set "
                    "to None) since capture; with fuse_grad_accumulation=True the backward "
                    "graph adds its gradient into the main_grad it saw then, got no main_grad. "
                    "Zero main_grad in place instead, or capture again"
                )
            if main_grad is not target.buffer:
                raise RuntimeError(self._replaced_main_grad(target, main_grad))
            return
        main_grad = getattr(param, "main_grad", None)  # tensor or not: the graph adds to .grad
        if main_grad is not None:
            raise RuntimeError(
                f"{self._label} parameter {target.name!r} got a main_grad since capture "
                f"({describe_buffer(main_grad)}; a DDP wrapper built after graphing, say), "
                "but with fuse_grad_accumulation=True its backward graph adds the gradient "
                "into the .grad buffer it chose then, so main_grad would get none. Attach "
                "main_grad before capture (wrap the model first), or delete it"
            )
        grad = param.grad
        # A new .grad is adopted by before_replay only where nothing else holds it.
        replaced = grad is not None and grad is not target.buffer
        del grad  # not a reference of its own while _adoptable counts them
        if replaced and not _adoptable(param, target.buffer):
            raise RuntimeError(self._replaced(target))

    def before_replay(self, unreached: frozenset[int] = frozenset()) -> None:
        """Make every target the parameter's gradient again (after :meth:`check_targets`
        returned True): a cleared ``.grad`` becomes its zeroed buffer, a new one nothing else
        holds gives the buffer its values and its place.

        A cleared ``.grad`` (None) of a parameter in ``unreached`` (ids of the parameters no
        output with a gradient reaches in this backward) stays None, as eager leaves it: the
        graph adds zeros for it into its detached buffer, which is zeroed again when attached.
        An optimizer then skips it as it skips eager's (AdamW would decay it, Adam and SGD
        with momentum step it, on a zero gradient).
        """
        cleared: list[AccumulationTarget] = []
        for target in self._targets:
            param = target.param
            if target.into_main_grad or param.grad is target.buffer:
                continue
            if param.grad is not None:
                target.buffer.copy_(param.grad)  # values kept: accumulation goes on from them
                param.grad = target.buffer
                continue
            if id(param) not in unreached:
                cleared.append(target)
        if cleared:
            buffers = [t.buffer for t in cleared]
            torch._foreach_zero_(buffers)
            for target, buffer in zip(cleared, buffers):
                target.param.grad = buffer

    def check_backward_pass(self) -> None:
        """Refuse, before a backward replay changes anything, a backward pass the graph
        cannot train in as eager would: one that accumulates into none or only some of the
        parameters (``torch.autograd.grad``, ``backward(inputs=...)``: the graph adds every
        gradient, where eager's would leave those ``.grad`` alone) and, with
        ``accumulator_hooks="python"``, one that reaches a parameter outside the graph too.

        Raises:
            RuntimeError: naming the callable (and the parameter).
        """
        if self._python_hooks is not None:
            check_python_hooks_alone(self._label, self._python_hooks)
        if engine_runs_all(self._watched):
            return
        if not all(map(_REQUIRES_GRAD, self._params)):
            return  # a parameter frozen since capture has no edge: check_targets names it
        raise RuntimeError(
            f"{self._label}: this backward pass accumulates no gradient into some or all of its "
            "parameters (torch.autograd.grad, or backward(inputs=...)), but with "
            "fuse_grad_accumulation=True the backward graph adds every parameter's gradient "
            "into its .grad or main_grad, which eager's would leave alone. Use backward() "
            "without inputs, or capture without fuse_grad_accumulation"
        )

    def _as_captured(self) -> bool:
        """Whether every target is its parameter's gradient as at capture, on the captured
        memory, every parameter still requires grad, none that adds into ``.grad`` got a
        ``main_grad`` since, and (without accumulator hooks) none got a hook (on it or on its
        accumulator node) or Megatron's DDP since."""
        try:
            return (
                all(map(_REQUIRES_GRAD, self._params))
                and all(map(operator.is_, map(_GRAD, self._grad_params), self._grad_buffers))
                and all(map(operator.is_, map(_MAIN_GRAD, self._main_params), self._main_buffers))
                and (self._hooks or not any(map(post_accumulate_hooks, self._params)))
                and (self._hooks or not any(map(hasattr, self._params, _DDP_FLAG_NAMES)))
                and not any(self._unrun_hook_dicts)
                and all(map(operator.is_, map(getattr, self._grad_params, *_NO_MAIN_GRAD), _NONES))
                and not any(map(TENSOR_HOOKS, self._params))
                and all(map(operator.eq, map(_DATA_PTR, self._buffers), self._pointers))
            )
        except AttributeError:  # a main_grad deleted: the full check names it
            return False

    def after_replay(self, unreached: frozenset[int] = frozenset()) -> None:
        """Tell Megatron's hooks the gradient is in ``main_grad`` (and give its
        ``overlap_grad_reduce`` check a ``.grad``: a broadcast zero, which the hook drops),
        until the backward pass ends (:meth:`megatron_hooks_ran`); not for the parameters in
        ``unreached`` (ids), whose hooks do not run in this pass, as eager's do not."""
        if not self._megatron:
            return
        for param, zero in self._megatron:
            if unreached and id(param) in unreached:
                continue
            param.grad_added_to_main_grad = True
            if param.grad is None:
                param.grad = zero.expand(param.shape)
        if _in_backward_pass():
            # The relay's accumulators, whose hooks read the flag, run later in this pass.
            _QUEUE_AT_PASS_END(self.megatron_hooks_ran)

    def megatron_hooks_ran(self) -> None:
        """Clear Megatron's flag again once its hooks saw this replay's gradients: an eager
        backward later (a reset, an eval-mode step, a layer Megatron runs eagerly) adds into
        ``main_grad`` through those hooks, which skip a parameter whose flag is still set.
        Megatron's DDP does not clear it itself while CUDA graphs are on."""
        for param, _ in self._megatron:
            param.grad_added_to_main_grad = False

    def call_hooks(self, unreached: frozenset[int] = frozenset()) -> None:
        """With ``accumulator_hooks="python"``, call the hooks registered from Python on the
        parameters' accumulators (after :meth:`after_replay`, outside the callable's lock, as
        autograd runs the relay's after the replay's node), but not those of the parameters in
        ``unreached`` (ids), whose accumulators eager's backward never reaches; else nothing.

        Raises:
            RuntimeError: for a hook that returns a value; whatever a hook raises.
        """
        if self._python_hooks is not None:
            call_python_hooks(self._label, self._python_hooks, skip=unreached)

    def _swapped(self, target: AccumulationTarget) -> str:
        what = "main_grad" if target.into_main_grad else ".grad"
        return (
            f"{self._label} parameter {target.name!r}: the {what} tensor the backward graph "
            f"adds into holds other memory than at capture ({what}.data = ... or "
            f"{what}.set_(...) swapped it); with fuse_grad_accumulation=True the graph adds "
            "into the captured memory, so the new memory would get no gradient and this "
            f"replay would train wrongly. Change the {what} in place (copy_, zero_, mul_), or "
            "capture again"
        )

    def _replaced(self, target: AccumulationTarget) -> str:
        return (
            f"{self._label} parameter {target.name!r}: .grad is another tensor than at "
            "capture, which something else holds too (your reference, a view into a bucket, "
            "a shared storage); with fuse_grad_accumulation=True the backward graph adds into "
            "the .grad it saw then, so this replay would train wrongly. Clear gradients with "
            "zero_grad() (set_to_none=True or False) instead of assigning a tensor you keep, "
            "or capture again"
        )

    def _replaced_main_grad(self, target: AccumulationTarget, main_grad: object) -> str:
        return (
            f"{self._label} parameter {target.name!r}: main_grad is another tensor than at "
            f"capture; with fuse_grad_accumulation=True the backward graph adds into the "
            f"main_grad it saw then ({describe_buffer(target.buffer)}), got "
            f"{describe_buffer(main_grad)}, "
            "so this replay would train wrongly. Zero main_grad in place (main_grad.zero_(), "
            "as Megatron's zero_grad_buffer() does) instead of assigning one, or capture again"
        )


class _EagerGradientToMainGrad:
    """A pre-hook on the accumulator of a parameter under Megatron-LM's protocol whose
    graphs hand autograd the relay. The relay brings the accumulator no gradient; one that
    arrives all the same comes from an eager use of the parameter in the same backward pass
    (a weight tied to eager code, an eager layer reading it), and autograd adds it into
    ``.grad``. Where a replay has set ``grad_added_to_main_grad`` (its gradient is in
    ``main_grad`` already), Megatron's hook would drop that ``.grad``, and autograd could not
    add into the broadcast zero standing in as ``.grad``: clear the flag and the stand-in, so
    that autograd makes ``.grad`` the eager gradient and the hook adds it into ``main_grad``,
    as eager's hook adds the sum of both."""

    __slots__ = ("param",)

    def __init__(self, param: torch.nn.Parameter) -> None:
        self.param = weakref.ref(param)

    def __call__(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        param = self.param()
        if param is None or grads[0] is None or not getattr(param, MEGATRON_DDP_FLAG, False):
            return
        setattr(param, MEGATRON_DDP_FLAG, False)
        grad = param.grad
        if grad is not None and _is_stand_in(grad):
            param.grad = None


def _hand_eager_gradients_to_megatron(params: Iterable[torch.nn.Parameter]) -> None:
    """Give each of ``params``' accumulator nodes (held by the relay) one
    :class:`_EagerGradientToMainGrad` pre-hook (another graph of the parameter may have given
    it one already)."""
    with torch.enable_grad():
        for param in params:
            node = accumulator_node(param)
            pre_hooks, _ = node_hook_dicts(node)
            if not any(isinstance(h, _EagerGradientToMainGrad) for h in pre_hooks.values()):
                node.register_prehook(_EagerGradientToMainGrad(param))


def _is_stand_in(grad: torch.Tensor) -> bool:
    """Whether ``grad`` is a stand-in ``.grad`` of :meth:`InGraphAccumulation.after_replay`:
    a 0-dim zero broadcast to the parameter's shape (autograd makes no such ``.grad``)."""
    base = grad._base
    return base is not None and base.dim() == 0 and not any(grad.stride())


def _adoptable(param: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``param``'s ``.grad``, another tensor than ``buffer``, is one nothing but the
    parameter refers to (as autograd makes one when a backward outside the graphs, an eager
    forward in eval mode say, reaches a parameter whose ``.grad`` is None, or one assigned and
    not kept), dense, of the buffer's shape, dtype and device: the buffer may then take its
    values and its place, as capture adopts a ``.grad`` of another layout (its strides are
    the buffer's after; values are all the optimizer reads). So may a view of a tensor
    nothing else holds (``g.t().contiguous().t()``). One held elsewhere (a user's reference
    to it or its base, a view into a bucket, a shared storage) may not."""
    # Python references: the argument and the getter's own (nothing else holds it).
    if sys.getrefcount(param.grad) > 2 or _STORAGE_USE_COUNT is None:
        return False
    grad = param.grad
    assert grad is not None
    base = grad._base
    # A view (x.t().contiguous().t() makes one) keeps its base alive from C++: it is held
    # elsewhere only if Python holds the base too (beyond this local, the argument and the
    # reference the base's own tensor keeps), or another tensor shares the storage.
    if base is not None and sys.getrefcount(base) > 3:
        return False
    return (
        grad.layout is torch.strided
        and grad.shape == buffer.shape
        and grad.dtype == buffer.dtype
        and grad.device == buffer.device
        # The tensor's own reference, its base's (a view's) and the Python storage
        # object's (made here).
        and _STORAGE_USE_COUNT(grad.untyped_storage()._cdata) <= (2 if base is None else 3)
    )


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
_QUEUE_AT_PASS_END = torch.autograd.Variable._execution_engine.queue_callback


def _in_backward_pass() -> bool:
    """Whether autograd's engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


_DDP_PYTHON_HOOKS = (
    "{label} runs inside torch's DistributedDataParallel, whose gradient-ready hooks are "
    "registered from C++ on the parameters' accumulators; accumulator_hooks='python' calls "
    "only hooks registered from Python, so DDP would never reduce the gradients. Capture with "
    "accumulator_hooks=True"
)
_DDP_NO_HOOKS = (
    "{label} runs inside torch's DistributedDataParallel, whose reducer hooks the parameters' "
    "accumulators (from C++) to all-reduce their gradients; with accumulator_hooks=False no "
    "replay runs an accumulator, so DDP would never see the gradients, nothing would be "
    "reduced, and the ranks would silently diverge. Capture with accumulator_hooks=True under "
    "DDP"
)


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
# Arguments of C-level getattr and hasattr loops over many parameters: a main_grad set to
# None counts as none, as the full check has it.
_NONES = itertools.repeat(None)
_NO_MAIN_GRAD = (itertools.repeat("main_grad"), _NONES)
_DDP_FLAG_NAMES = itertools.repeat(MEGATRON_DDP_FLAG)
_GRAD = operator.attrgetter("grad")
_MAIN_GRAD = operator.attrgetter("main_grad")
_DATA_PTR = torch.Tensor.data_ptr
