"""One object per graphed callable: the replay and lifecycle of one captured graph.

A :class:`GraphedCallable` is made from the frozen :class:`~leangraph.build.record.GraphRecord`
that capture produced; it replays, and :meth:`GraphedCallable.reset` releases its graphs and
static buffers. Nothing here is shared with any other callable except the backend's memory
pool and the call's :class:`~leangraph.runtime.pending.PendingBackwards`, so a reset touches
this callable alone.
"""

from __future__ import annotations

import enum
import itertools
import operator
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..buffers import same_buffer
from ..build.accumulation import accumulator_node
from ..build.record import GraphRecord
from ..errors import GraphResetError
from ..order import GraphId, StepKind
from ..probe import OutputView
from ..result import GraphedSet
from .accumulation import InGraphAccumulation
from .ddp import refuse_unreached_in_ddp, strict_ddp
from .grads import (
    NO_LEAVES,
    GradRouting,
    accumulating_leaves,
    returns_gradients,
    settle_lent_gradients,
    trained_elsewhere_in_pass,
)
from .guard import OutputGuard
from .kernels import KernelSettings
from .modules import ModuleWatch
from .overlap import AdditionFence, side_stream_accumulators
from .pending import BackwardToken, PendingBackwards
from .sequence import ReplaySequence
from .unreached import skip_hooks_in_this_pass
from .versions import SavedReads
from .weight import WeightStep

__all__ = ["GraphedCallable", "autocast_state", "install_forward", "remove_forward"]


class _State(enum.Enum):
    READY = "ready"
    RESET = "reset"


class GraphedCallable:
    """A callable replayed from a captured forward graph, differentiable through a backward graph.

    Calling it copies the arguments into the static input buffers (skipping tensors that
    already are those buffers), replays the forward graph and returns the outputs wired into
    autograd; their backward replays the backward graph.

    Memory aliasing: the returned outputs are views of graph-owned static buffers. With buffer
    sharing (the default) they stay valid until this callable's backward replay (its weight
    step, for split backwards), or its next forward replay when it has no backward; without
    sharing, until its next forward replay. Never after :meth:`reset`. Clone them to keep
    them longer. Gradients are fresh tensors wherever autograd or other code may keep them:
    parameters' and leaf inputs' ``.grad``, and input gradients flowing into earlier autograd
    nodes (hooks, ``torch.autograd.grad``). Two alias graph-owned buffers, valid only until
    the call's next replays reuse them: the gradient of a chained layer's input (the previous
    layer's seed, read in place by that layer's backward replay), and that of a parameter
    whose ``.grad`` already exists (autograd adds it in at once; ``torch.autograd.grad`` with
    respect to such a parameter returns the buffer; a tensor hook on it gets a copy). With
    ``fuse_grad_accumulation`` the parameters' ``.grad`` or ``main_grad`` are buffers the
    backward graphs add into, until :meth:`reset` (docs/concepts.md: static buffers and how
    long outputs stay valid).
    """

    def __init__(
        self,
        record: GraphRecord,
        graphed_set: GraphedSet,
        pending: PendingBackwards,
        sequence: ReplaySequence,
        *,
        debug_outputs: bool,
        overlap_grad_accumulation: bool = False,
        addition_fence: AdditionFence | None = None,
        captured_under_no_grad: bool = False,
        autocast_at_capture: tuple[bool, torch.dtype | None] | None = None,
        kernel_settings: KernelSettings | None = None,
    ) -> None:
        self._guard: OutputGuard | None = None  # first: __del__ may run after a failed init
        self._record: GraphRecord | None = record
        self._label = record.label
        self._graph_id = record.graph_id
        self._index = record.index
        self._set = graphed_set
        self._pending = pending
        self._sequence = sequence
        self._lock = threading.RLock()
        self._state = _State.READY
        self._signature = record.signature
        self._specs = record.signature.specs
        self._warned: set[str] = set()  # inputs already warned about, by name
        self._single_output = record.output_tree.is_leaf()
        # ``return y, y`` comes back as one tensor, as in eager (its gradients add up in order).
        self._repeats = record.output_repeats
        # ``return y, y[:, 0]`` comes back as an output and a view of it, as in eager (a write
        # into one shows in the other).
        self._views = record.output_views
        # Outputs and parameters the backward graph reads (R24, R28).
        self._saved_reads = SavedReads.of(record.label, record)
        # Facts of the capture the hot path would otherwise derive at every replay.
        self._has_backward = record.has_backward
        # The first output that needs a gradient: with one only, whether it got one tells
        # what the backward reaches (_check_backward).
        self._graded_output = record.output_requires_grad.index(True) if self._has_backward else 0
        self._ungraded_inputs = not all(s.requires_grad for s in self._specs)
        self._frozen_outputs = tuple(
            i for i, rg in enumerate(record.output_requires_grad) if not rg
        )
        self._frozen_params, self._flag_read_params = _requires_grad_watch(record)
        self._grads: GradRouting | None = GradRouting(record, pending)
        self._fused = (
            None
            if record.fused is None
            else InGraphAccumulation(record.label, record.fused, _device_of(record))
        )
        self._weight = WeightStep(record, self._fused) if record.split_backward else None
        # A stand-in only makes the outputs require grad: not needed when an input does.
        self._autograd_params, self._stand_in = _params_for_autograd(record, self._fused)
        # Held for life: autograd adds replays' gradients on their side stream (overlap).
        self._side_accumulators = (
            side_stream_accumulators(record.trained_params(), _device_of(record))
            if overlap_grad_accumulation and record.delivers_param_grads()
            else ()
        )
        self._modules = _module_watch(record)
        self._debug_outputs = debug_outputs
        # Captured under no_grad: forward graphs only, never outputs that need a gradient.
        self._forward_only = captured_under_no_grad and not record.has_backward
        self._forward_generation = 0
        self._backward_generation = -1
        # The autocast (of the device's type) the graphs' kernels were chosen under.
        self._autocast, self._device_type = autocast_at_capture, _device_of(record).type
        self._on_cuda = self._device_type == "cuda"
        self._fence = addition_fence  # overlap: waits for additions whose blocks it may write
        # The process-wide settings that chose those kernels (TF32, determinism, ...).
        self._kernels = kernel_settings

    # ----------------------------------------------------------------------------- public

    @property
    def label(self) -> str:
        """How errors name this callable, e.g. ``graph (chunk 1, microbatch 0, layer 2)``."""
        return self._label

    @property
    def graph_id(self) -> GraphId | None:
        """Chunk, microbatch and layer when captured with an order, else ``None``."""
        return self._graph_id

    @property
    def is_reset(self) -> bool:
        """Whether :meth:`reset` has run; a reset callable never replays again."""
        return self._state is _State.RESET

    @property
    def graphed_set(self) -> GraphedSet:
        """The result of the ``make_graphed_callables`` call this callable came from."""
        return self._set

    def static_tensors(self) -> list[torch.Tensor]:
        """The static buffers this callable keeps allocated (buffers it shares with other
        callables included); empty after :meth:`reset`. They are graph-owned: replays
        overwrite them."""
        record = self._record
        return [] if record is None else record.owned_tensors()

    def __repr__(self) -> str:
        return f"<GraphedCallable {self._label} ({self._state.value})>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Replay the forward graph on ``args``/``kwargs``; see the class docstring.

        Raises:
            GraphResetError: if the callable was reset.
            TypeError, ValueError: if the arguments differ from the captured ones in
                count, keyword names, structure, constants, dtype, shape or device (an input
                that requires grad only now is no error: it gets no gradient, with a
                ``UserWarning``), a chained layer's input is not the previous layer's output
                itself, or a parameter frozen at capture requires grad now.
            RuntimeError: out of the capture order, or while the outputs of the previous
                replay still await their backward; under another autocast than capture's, or
                other kernel settings (TF32 and reduced precision, deterministic algorithms,
                cuDNN or oneDNN on or off, the attention kernels enabled);
                for a parameter whose ``requires_grad`` the forward read, frozen since; under
                a ``torch.func`` transform; for a module changed since
                capture (a submodule replaced, a module hook added inside it, a parameter or
                buffer replaced or moved; captured with an order, a training mode switched);
                with ``accumulator_hooks="python"`` or ``False``, inside torch's
                ``DistributedDataParallel``; captured under ``torch.no_grad()``, with grad
                mode on where eager's outputs would require grad.
        """
        if _COMPILING():
            return _call_uncompiled(self, *args, **kwargs)
        record = self._record
        if record is not None and self._modules is not None:
            if not self._modules.modes_as_captured():
                eager = _eager_in_another_mode(self._label, record, self._modules)
                if eager is not None:
                    # The graphs sit this pass out: the others' replays must not wait for them.
                    self._sequence.ran_eagerly(self._index)
                    return eager(*args, **kwargs)
            self._modules.check_replayable()
        record = _ready_record(self, "call")
        if self._autocast is not None and autocast_state(self._device_type) != self._autocast:
            _refuse_other_autocast(self._label, self._autocast, self._device_type)
        if self._kernels is not None and self._kernels.read() != self._kernels.captured:
            self._kernels.check(self._label)
        if _TRANSFORMS_ACTIVE():
            _refuse_under_transform(self._label)
        fused = self._fused  # read once: a reset in another thread may clear it
        if fused is not None:
            fused.before_forward()
        leaves = [_UNWRAP_IF_DEAD(t) for t in self._signature.bind(args, kwargs)]
        if self._forward_only and torch.is_grad_enabled():
            _refuse_grad_replay(self._label, record, leaves)
        if self._frozen_params:
            _check_frozen_params(self._label, self._frozen_params)
        if self._flag_read_params and not all(map(_REQUIRES_GRAD, self._flag_read_params)):
            _refuse_frozen_read(self._label, record)
        if self._ungraded_inputs and any(
            t.requires_grad and not s.requires_grad for t, s in zip(leaves, self._specs)
        ):
            _warn_ungraded(self._label, leaves, self._specs, self._warned)
        token = BackwardToken()
        extra = self._autograd_params
        if self._stand_in and any(t.requires_grad for t in leaves):
            extra = ()
        outputs = _C_APPLY(self, len(leaves), token, *leaves, *extra)
        del token  # from here on only the replay's autograd node (if any) keeps it alive
        if self._has_backward and not any(map(_REQUIRES_GRAD, outputs)):
            self._sequence.without_backward(self._index)  # grad mode off: no backward comes
        if self._single_output:
            return outputs[0]
        if self._views or self._repeats:
            outputs = _as_eager_returned(outputs, self._views, self._repeats)
        return pytree.tree_unflatten(record.output_template.fill(outputs), record.output_tree)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NOT_COPIED.format(label=self._label))

    def reset(self) -> None:
        """Release this callable's graphs and static buffers, for good.

        Terminal (the callable never replays again: calls and backwards through outputs it
        produced earlier raise :class:`GraphResetError`), isolated (no other callable or pool
        user is affected) and idempotent (later calls do nothing). Memory is returned to the
        pool once no user tensor refers to the released buffers. Waits for a replay running in
        another thread to finish first.
        """
        with self._lock:
            if self._state is _State.RESET:
                return
            self._state = _State.RESET
            self._release()

    def backward_dw(self) -> None:
        """Run the deferred weight-gradient step of the last backward (zero-bubble orders).

        Replays the weight-gradient graph and accumulates into each parameter's ``.grad``
        through autograd (``.grad`` set to a fresh tensor when None, else added to in place),
        so parameter ``post_accumulate_grad`` hooks run once each, as in eager's weight step
        (DDP-style gradient-ready hooks among them); with ``fuse_grad_accumulation`` the graph
        adds them into ``main_grad`` or ``.grad`` itself, and the hooks run as after a fused
        backward replay. The ``.grad`` it sets is a fresh tensor, not graph-owned memory
        (with ``fuse_grad_accumulation``, the buffer the graphs add into until reset). Call
        it at the schedule's W step, after the backward through this callable's outputs
        (which computed input gradients only) and before its next forward replay.

        Raises:
            GraphResetError: if the callable was reset.
            RuntimeError: if it was captured without weight steps, or no backward awaits its
                weight step.
        """
        with self._lock:
            _ready_record(self, "run its weight step")
            if self._weight is None:
                raise RuntimeError(
                    f"{self._label}: backward_dw() needs an order with -(c + 0.5) weight "
                    "steps; this callable's backward computes weight gradients itself"
                )
            attach = self._weight.check()  # before the order moves past this step
            self._sequence.expect(self._index, StepKind.WEIGHT)
            settle_lent_gradients()
            self._weight.run(attach=attach)
            if self._guard is not None:
                self._guard.invalidate(f"the weight step of {self._label} ran")

    # ----------------------------------------------------------------------------- internals

    def _release(self) -> None:
        settle_lent_gradients()  # the released memory may be captured over next
        record, self._record = self._record, None
        if record is not None:
            record.pair.reset()
            self._pending.clear(self._index)
            self._sequence.drop(self._index)
        self._grads = None
        self._weight = None
        self._fused = None  # its relay holds the parameters' accumulator nodes
        self._side_accumulators = ()
        self._autograd_params = ()
        self._frozen_params = ()
        self._flag_read_params = ()
        self._saved_reads = None
        if self._guard is not None:
            self._guard.invalidate("its callable was reset")

    def __del__(self) -> None:
        if getattr(self, "_record", None) is not None:
            self._release()

    def _replay_forward(
        self, inputs: Sequence[torch.Tensor], token: BackwardToken
    ) -> tuple[torch.Tensor, ...]:
        with self._lock:
            record = _ready_record(self, "replay its forward graph")
            if self._on_cuda and _STREAM_CAPTURING():
                _refuse_inside_capture(self._label, "forward")
            _check_no_pending_backward(self, record)
            copies = _inputs_to_copy(self._label, record, inputs)
            # Checked before anything is copied: static inputs may be shared with other graphs.
            self._sequence.expect(self._index, StepKind.FORWARD, may_repeat=record.retain_graph)
            settle_lent_gradients()  # before graph memory is written: see grads.py
            for static, value in copies:
                static.copy_(value)
            record.pair.replay_forward()
            self._forward_generation += 1
            if self._saved_reads is not None:
                self._saved_reads.note(inputs)
            if self._has_backward:
                self._pending.note(self._index, token)
            if self._guard is not None:
                self._guard.invalidate(f"{self._label} was replayed again")
            buffers = record.static_outputs
            # New tensors over the buffers, never the buffers themselves: a caller may swap an
            # output's .data (Megatron's deallocate_pipeline_outputs empties each sent stage
            # output), which must leave the buffer the backward and later replays use alone.
            outputs = (
                (buffers[0].detach(),) if len(buffers) == 1 else tuple(o.detach() for o in buffers)
            )
            if self._debug_outputs:
                self._guard = OutputGuard(self._label, self._forward_generation)
                outputs = tuple(self._guard.wrap(o) for o in outputs)
            return outputs

    def _replay_backward(
        self,
        grads: Sequence[torch.Tensor],
        generation: int,
        ddp: weakref.ref[Any] | None = None,
        accumulating: Mapping[int, torch.Tensor] = NO_LEAVES,
        returned: bool = False,
    ) -> tuple[tuple[torch.Tensor | None, ...], frozenset[int]]:
        """The gradients to hand autograd, and the ids of the trained parameters no output
        with a gradient reached (whose hooks ``_call_accumulator_hooks`` leaves out); ``ddp``:
        the torch DDP the forward replay ran inside (``strict_ddp``), if any (R29); for
        ``accumulating`` and ``returned``, see ``GradRouting.hand``."""
        with self._lock:
            record = _ready_record(self, "run a backward")
            if self._on_cuda and _STREAM_CAPTURING():
                _refuse_inside_capture(self._label, "backward")
            _refuse_stale_backward(
                self._label, record, generation, self._forward_generation, self._backward_generation
            )
            fused = self._fused if self._weight is None else None  # else: at the weight step
            # Every refusal comes before the replay order moves past this step: a refused
            # backward has not run, and may run once its cause is fixed.
            attach, reached, unreached = _check_backward(self, record, fused, grads, ddp)
            self._sequence.expect(self._index, StepKind.BACKWARD, may_repeat=record.retain_graph)
            settle_lent_gradients(grads)  # the next layer's gradient lent as a seed: see there
            if self._fence is not None:
                self._fence.before_backward(self._index)
            _fill_seeds(record.static_grad_outputs, grads)
            if attach:
                assert fused is not None
                fused.before_replay(unreached)
            if record.static_grads:
                record.pair.replay_backward()
            if fused is not None:
                fused.after_replay(unreached)
            self._backward_generation = generation
            self._pending.ran(self._index)
            if self._weight is not None:
                self._weight.defer(generation, unreached)
            elif self._guard is not None:
                self._guard.invalidate(f"the backward of {self._label} ran")
            assert self._grads is not None
            return self._grads.hand(reached, accumulating, returned=returned), unreached


def install_forward(module: torch.nn.Module, graphed: GraphedCallable) -> None:
    """Make ``graphed`` the module's forward: its ``__call__`` runs the module's hooks, then
    the replay. Copying or pickling the module is refused from then on."""
    module.forward = graphed
    # copy.copy(module) would share this forward with a copy whose training mode the graphs
    # never see (eval() on the copy would still replay the training graph). deepcopy and
    # pickle reach the callable's own refusal; a shallow copy only asks the module, whose
    # instance attribute wins over object.__reduce_ex__.
    vars(module)["__reduce_ex__"] = graphed.__reduce_ex__


def remove_forward(module: torch.nn.Module) -> None:
    """Give a module graphed in place by :func:`install_forward` its eager forward back."""
    if isinstance(vars(module).get("forward"), GraphedCallable):
        del vars(module)["forward"]
        vars(module).pop("__reduce_ex__", None)


_NOT_COPIED = (
    "{label}: a graphed callable cannot be copied or pickled (its graphs and static buffers "
    "belong to one capture); copy the module before graphing it, and save a model holding "
    "graphed modules (torch.save) by its state_dict()"
)


def _refuse_inside_capture(label: str, graph: str) -> None:
    """R31: the current stream is capturing a CUDA graph of the caller's own (a whole step
    around graphed layers, or the layer's own graph captured again). Launching a graph into a
    capture fails inside torch without naming the callable, after the static inputs were
    copied, so this comes first: nothing was copied and the replay order has not moved."""
    raise RuntimeError(
        f"{label}: cannot replay its {graph} graph while the current CUDA stream is capturing "
        "a graph of its own (torch.cuda.graph or CUDAGraph.capture_begin around the call): "
        "its graphs are launched at every replay, and a capture cannot take them in. Call "
        "it outside the capture, or capture the eager callable in your graph instead"
    )


def _ready_record(owner: GraphedCallable, what: str) -> GraphRecord:
    """The callable's record, for a replay or step about to ``what``; refused once reset."""
    record = owner._record
    if owner._state is _State.RESET or record is None:
        raise GraphResetError(f"{owner._label}: cannot {what}: this graphed callable was reset")
    return record


def _check_no_pending_backward(owner: GraphedCallable, record: GraphRecord) -> None:
    """Refuse a forward replay that would overwrite activations a backward still needs."""
    if owner._weight is not None:
        owner._weight.check_not_due()
    if record.retain_graph or owner._backward_generation == owner._forward_generation:
        return
    if owner._pending.awaits(owner._index):
        raise RuntimeError(
            f"{owner._label}: forward replayed while the outputs of its previous replay "
            f"({owner._forward_generation}) still await their backward; the new replay "
            "would overwrite the activations that backward needs. Run the backward first "
            "or drop those outputs and everything computed from them"
        )


def _call_accumulator_hooks(
    record: GraphRecord | None, fused: InGraphAccumulation | None, unreached: frozenset[int]
) -> None:
    """After a backward replay, outside the callable's lock: the Python hooks the replay calls
    itself (``accumulator_hooks="python"``; at the weight step for a split backward), but not
    those of the parameters in ``unreached`` (ids), which no output with a gradient reached.
    ``record`` and ``fused``: the callable's, read before the replay (:func:`_replay_backward`)."""
    if fused is not None and record is not None and not record.split_backward:
        fused.call_hooks(unreached)


def _skip_unreached_hooks(
    owner: GraphedCallable,
    record: GraphRecord | None,
    fused: InGraphAccumulation | None,
    unreached: frozenset[int],
) -> None:
    """After a backward replay that reached not every trained parameter: the accumulators of
    those in ``unreached`` (ids), which autograd runs with no gradient because the replay's
    node has an edge to them (the parameters, or the relay's), skip their Python hooks in this
    pass, as eager's backward runs no accumulator for them (:mod:`.unreached`). Not where
    another graph may hand one of them a gradient in this pass (its hooks then fire once, as
    eager's), nor where no accumulator of theirs runs: a split backward (its weight step leaves
    them out), ``accumulator_hooks="python"`` (its call leaves them out) and ``False``."""
    if record is None or record.split_backward:
        return
    params: list[torch.Tensor]
    if fused is None:
        params = [p for p in record.params if id(p) in unreached]
        with torch.enable_grad():  # a backward runs with grad mode off
            nodes = [accumulator_node(p) for p in params]
    elif fused.relay is not None and fused.relay.nodes:
        pairs = [
            (p, n) for p, n in zip(fused.relay.inputs, fused.relay.nodes) if id(p) in unreached
        ]
        params, nodes = [p for p, _ in pairs], [n for _, n in pairs]
    else:
        return
    elsewhere = trained_elsewhere_in_pass(record, owner._pending)
    kept = [(p, n) for p, n in zip(params, nodes) if id(p) not in elsewhere]
    skip_hooks_in_this_pass([p for p, _ in kept], [n for _, n in kept])


def _check_backward(
    owner: GraphedCallable,
    record: GraphRecord,
    fused: InGraphAccumulation | None,
    grads: Sequence[torch.Tensor | None],
    ddp: weakref.ref[Any] | None,
) -> tuple[bool, frozenset[int] | None, frozenset[int]]:
    """The refusals of a backward replay that read its gradients and accumulation state
    (R14's targets, R24 and R28's saved reads, R29); returns whether the fused targets need
    attaching, the positions the outputs with a gradient reach (None: every one has one), and
    the ids of the trained parameters they leave unreached."""
    attach = False
    if fused is not None:
        fused.check_backward_pass()
        attach = fused.check_targets()
    if owner._saved_reads is not None:
        owner._saved_reads.check()
    lacking = any(map(operator.is_, grads, _NONES))  # a backward replay's graph has one
    if lacking and not record.output_reach:  # one output needs a gradient: it got one or none
        reached = _NOTHING if grads[owner._graded_output] is None else None
    else:
        reached = record.reached_by([g is not None for g in grads]) if lacking else None
    unreached = _NOTHING if reached is None else _unreached_params(record, reached)
    if unreached and ddp is not None:
        refuse_unreached_in_ddp(owner._label, record, unreached, owner._pending, ddp)
    return attach, reached, unreached


def _refuse_stale_backward(
    label: str, record: GraphRecord, generation: int, forward: int, backward: int
) -> None:
    """Refuse the backward of forward replay ``generation`` once the graph replayed its
    forward again (``forward``: the latest), or a second one (``backward``: the latest run)."""
    if generation != forward:
        raise RuntimeError(
            f"{label}: backward of forward replay {generation} requested, but the graph was "
            f"replayed again since (replay {forward}) and its saved activations were "
            "overwritten; run each backward before the next forward replay of the same graph"
        )
    if generation == backward and not record.retain_graph:
        raise RuntimeError(
            f"{label}: second backward through forward replay {generation}: each forward "
            "replay's backward runs once, even where eager's would run again "
            "(backward(retain_graph=True) asks that of autograd, not of the graph); to replay "
            "a backward again right after itself (not after other graphs' backwards), capture "
            "with retain_graph_in_backward=True"
        )
    if generation == backward and record.split_backward:
        # Eager's second backward adds a second weight gradient; the weight step replays one.
        raise RuntimeError(
            f"{label}: second backward through forward replay {generation}: with weight steps "
            "(an order with -(c + 0.5) entries) the backward computes input gradients only and "
            "its weight step (backward_dw()) the weight gradients of one backward, so a second "
            "backward's would be lost, where eager's would add them; run one backward per "
            "forward replay (retain_graph_in_backward=True does not lift this)"
        )


def _unreached_params(record: GraphRecord, reached: frozenset[int]) -> frozenset[int]:
    """The ids of the trained parameters outside ``reached`` (the positions the outputs with
    a gradient reach): eager's backward gives them no gradient and runs no accumulator."""
    return frozenset(id(record.params[i]) for i in record.params_unreached(reached))


def _eager_in_another_mode(
    label: str, record: GraphRecord, modules: ModuleWatch
) -> Callable[..., Any] | None:
    """A drop-in module's eager forward, for a call in another training mode than capture's
    (None once the module is gone); with an order, a refusal."""
    if record.module is None:
        raise RuntimeError(
            f"{label}: {modules.changed_mode()}; its graphs replay the kernels of the captured "
            "modes (dropout, batch norm, anything reading self.training). Call the eager "
            "module in this mode, or capture again"
        )
    return record.module.eager_forward()


def _module_watch(record: GraphRecord) -> ModuleWatch | None:
    """What a replay checks of a graphed module (None for a function); hooks on the module
    itself run around a drop-in module's replay, as eager runs them around ``forward``."""
    if record.modules is None:
        return None
    params = tuple(zip(record.param_names, record.params))
    return ModuleWatch(
        record.label, record.modules, params, root_hooks_run=record.module is not None
    )


def autocast_state(device_type: str) -> tuple[bool, torch.dtype | None] | None:
    """Whether autocast is on for ``device_type``, and its dtype when it is (None where torch
    cannot say, a meta device's)."""
    if device_type not in ("cpu", "cuda"):
        return None
    enabled = torch.is_autocast_enabled(device_type)
    return enabled, torch.get_autocast_dtype(device_type) if enabled else None


def _refuse_under_transform(label: str) -> None:
    raise RuntimeError(
        f"{label} cannot run under a torch.func transform (vmap, grad, jvp, ...): its graphs "
        "replay fixed kernels on fixed buffers; call it outside the transform, or transform "
        "the eager callable"
    )


def _refuse_other_autocast(
    label: str, captured: tuple[bool, torch.dtype | None], device_type: str
) -> None:
    """A replay under another autocast than capture's: the graphs run the kernels (and
    precision) capture chose, where eager's would follow the autocast around them."""

    def said(state: tuple[bool, torch.dtype | None] | None) -> str:
        return f"on ({state[1]})" if state and state[0] else "off"

    raise RuntimeError(
        f"{label} was captured with autocast {said(captured)} for {device_type} but is "
        f"replayed with it {said(autocast_state(device_type))}: its graphs run the kernels "
        "and precision chosen at capture, where eager's would follow the autocast around "
        "them. Replay under the autocast of capture, or capture again"
    )


def _fill_seeds(seeds: Sequence[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    """Copy the outputs' incoming gradients into the seeds the backward graph reads (none
    where a gradient is its seed already, the next layer's buffer; zeros for an output that
    got no gradient)."""
    for static, grad in zip(seeds, grads):
        if static is None:
            continue
        if grad is None:
            static.zero_()
        elif not same_buffer(static, grad):
            static.copy_(grad)


def _requires_grad_watch(
    record: GraphRecord,
) -> tuple[tuple[tuple[str, torch.nn.Parameter], ...], tuple[torch.nn.Parameter, ...]]:
    """The parameters frozen at capture, with their names (R10: refused once they require
    grad), and the trained ones whose ``requires_grad`` the forward read (R26: refused once
    frozen, since freezing may change eager's path, another autograd function, not the
    captured one)."""
    frozen = tuple(
        (name, p)
        for name, p, trains in zip(record.param_names, record.params, record.param_trains)
        if not trains
    )
    read = tuple(record.params[i] for i in record.reads_requires_grad if record.param_trains[i])
    return frozen, read


def _check_frozen_params(label: str, frozen: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
    """A parameter frozen at capture has no gradient in the backward graph: refuse to
    replay once it requires grad, rather than leave its ``.grad`` silently unset."""
    for name, param in frozen:
        if param.requires_grad:
            raise ValueError(
                f"{label} parameter {name!r} must have requires_grad=False as at "
                "capture (the backward graph computes no gradient for it), got "
                "requires_grad=True; capture again to train it"
            )


def _refuse_frozen_read(label: str, record: GraphRecord) -> None:
    """A parameter frozen since capture whose ``requires_grad`` the forward reads (Megatron-
    core's linear layers switch to another autograd function for a frozen weight): eager's
    forward could take another path, with other gradients, than the one the graphs replay."""
    for i in record.reads_requires_grad:
        param = record.params[i]
        if record.param_trains[i] and not param.requires_grad:
            raise RuntimeError(
                f"{label} parameter {record.param_names[i]!r} must require grad as at "
                "capture, got requires_grad=False: its forward reads the parameter's "
                "requires_grad, so eager's would take another path for it (another autograd "
                "function, other gradients) than the captured one the graphs replay. Freeze "
                "it before capture, or capture again after freezing it"
            )


def _as_eager_returned(
    outputs: Sequence[torch.Tensor], views: Sequence[OutputView], repeats: Sequence[int]
) -> tuple[Any, ...]:
    """``outputs`` aliased as eager returned them: those that were views of another output
    made views of that output's replayed tensor (a write into one shows in the other, and
    autograd takes their gradients through the view, as eager's did; their own slots get
    no gradient; a detached view none at all, as eager's), then each repeated output the
    one tensor it repeats."""
    rebuilt = list(outputs)
    for view in views:
        base = outputs[view.base].detach() if view.detached else outputs[view.base]
        rebuilt[view.position] = base.as_strided(
            view.size, view.stride, base.storage_offset() + view.offset
        )
    return tuple(rebuilt[i] for i in repeats) if repeats else tuple(rebuilt)


def _warn_ungraded(
    label: str, leaves: Sequence[torch.Tensor], specs: Sequence[Any], warned: set[str]
) -> None:
    """An input that requires grad only at replay gets no gradient from the backward
    graph (torch's drop-in accepts it the same way): say so once per input (``warned``:
    the inputs' names said so far)."""
    for leaf, spec in zip(leaves, specs):
        if leaf.requires_grad and not spec.requires_grad and spec.name not in warned:
            warned.add(spec.name)
            warnings.warn(
                f"{label} {spec.name} requires grad at replay but did not at capture: "
                "the backward graph computes no gradient for it, so it gets none; capture "
                "with a sample that requires grad to train through it",
                stacklevel=3,
            )


def _refuse_grad_replay(label: str, record: GraphRecord, leaves: Sequence[torch.Tensor]) -> None:
    """A forward-only graph (captured under no_grad) replayed with grad mode on: refuse where
    eager's outputs would require grad, rather than hand back outputs that silently do not."""
    if any(t.requires_grad for t in leaves) or any(p.requires_grad for p in record.params):
        raise RuntimeError(
            f"{label} was captured under torch.no_grad(), so it has forward graphs only, but "
            "is called with grad mode on and inputs or parameters that require grad: eager's "
            "outputs would require grad, and this replay's cannot. Call it under "
            "torch.no_grad() (or inference_mode), or capture it with grad enabled to train "
            "through it"
        )


def _device_of(record: GraphRecord) -> torch.device:
    return record.static_outputs[0].device


def _params_for_autograd(
    record: GraphRecord, fused: InGraphAccumulation | None
) -> tuple[tuple[torch.Tensor, ...], bool]:
    """What a replay's autograd node takes besides the inputs, and whether that is only a
    stand-in: the parameters, whose gradients it returns. With in-graph accumulation, what
    the accumulation hands autograd instead (the relay, or an empty leaf: the gradients are
    in place already, and its accumulator nodes tell the replay whether the backward pass
    accumulates). A split backward returns none (the weight step delivers them), and
    autograd would still run their accumulators, and their post-accumulate-grad hooks, with
    no gradient. There an empty leaf that requires grad stands in for the parameters, so the
    outputs require grad exactly when eager's would."""
    if fused is not None and not record.split_backward:
        return fused.autograd_inputs, False
    if record.delivers_param_grads():
        return record.params, False
    if not record.trained_params():
        return (), False
    return (torch.empty(0, device=_device_of(record), requires_grad=True),), True


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_NONES = itertools.repeat(None)
_NOTHING: frozenset[int] = frozenset()


def _inputs_to_copy(
    label: str, record: GraphRecord, inputs: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (static buffer, value) pairs a forward replay copies: every input that is not
    its buffer already. A chained input must be the previous layer's output itself."""
    copies = []
    try:
        for index, (static, value) in enumerate(zip(record.static_inputs, inputs)):
            if same_buffer(static, value):
                continue
            source = record.chained_from[index]
            if source is not None:
                raise ValueError(
                    f"{label} input {index} is the output buffer of {source} "
                    "(chained layers share it); pass that graph's output itself, got another "
                    "tensor (once that graph is reset, reset this one too: nothing else can "
                    "feed it). Capture with share_buffers=False to feed layers anything"
                )
            copies.append((static, value))
        if copies and not record.released:
            copies = _read_before_written(copies)
    except RuntimeError:
        # A sparse or mkldnn argument has the captured dtype, shape and device, so only its
        # missing storage (data_ptr) stops it: named here, off the path of every replay.
        for spec, value in zip(record.signature.specs, inputs):
            spec.check_dense(label, value)
        raise
    return copies


def _read_before_written(
    copies: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``copies`` with each value in the memory of a static input they write cloned first.
    Without buffer sharing the samples are the static inputs, which the caller holds: an
    argument in their memory (the samples swapped, a transposed view of one) would be
    overwritten by an earlier copy, or overlap its own (torch refuses that copy), where
    eager reads every argument as given."""
    written = {static.untyped_storage().data_ptr() for static, _ in copies}
    return [
        (static, value.clone() if value.untyped_storage().data_ptr() in written else value)
        for static, value in copies
    ]


class _Replay(torch.autograd.Function):
    """Autograd node of one forward replay; its backward replays the backward graph."""

    @staticmethod
    def forward(
        ctx: Any,
        owner: GraphedCallable,
        num_inputs: int,
        token: BackwardToken,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        outputs = owner._replay_forward(tensors[:num_inputs], token)
        ctx.owner = owner
        ctx.generation = owner._forward_generation
        ctx.num_tensors = len(tensors)
        ctx.token = token
        token.node = weakref.ref(ctx)
        if owner._frozen_outputs:
            ctx.mark_non_differentiable(*(outputs[i] for i in owner._frozen_outputs))
        ctx.ddp = None
        if owner._has_backward:
            # A backward may give an output no gradient (a loss leaving one of several out,
            # the next graph handing this one's none): autograd hands None then, not zeros,
            # and the replay leaves what only such outputs reach without one, as eager does.
            ctx.set_materialize_grads(False)
            # A backward may leave parameters without a gradient: which DDP expects one (R29).
            ctx.ddp = strict_ddp()
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: refuse a second backward through it
            return _backward_once(ctx, *grads)
        return _replay_backward(ctx, *grads)  # the usual backward, with grad mode off


def _replay_backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    owner: GraphedCallable = ctx.owner
    # Read before the replay: a reset() in another thread may run once the replay returned
    # (the callable's lock is free again) and before its hooks, and must not take the hooks
    # its gradients owe.
    record, fused, routing = owner._record, owner._fused, owner._grads
    accumulating, returned = _what_the_pass_does(ctx, routing, lend_inputs=True)
    grad_inputs, unreached = owner._replay_backward(
        grads, ctx.generation, ctx.ddp, accumulating, returned
    )
    if unreached:
        _skip_unreached_hooks(owner, record, fused, unreached)
    _call_accumulator_hooks(record, fused, unreached)
    return _node_grads(ctx, grad_inputs)


def _what_the_pass_does(
    ctx: Any, routing: GradRouting | None, *, lend_inputs: bool
) -> tuple[Mapping[int, torch.Tensor], bool]:
    """From the replay node's edges (read once): the leaf inputs whose gradients the running
    pass accumulates in place (:func:`accumulating_leaves`; only where ``lend_inputs``), and
    whether it returns the parameters' gradients (:func:`returns_gradients`)."""
    copied = routing.inputs_copied if routing is not None and lend_inputs else ()
    lent = routing.lent_params if routing is not None else ()
    if not (copied or lent):
        return NO_LEAVES, False
    edges = ctx.next_functions  # one per tensor passed to the replay, inputs first
    accumulating = accumulating_leaves(edges, copied) if copied else NO_LEAVES
    return accumulating, bool(lent) and returns_gradients(edges, lent)


def _node_grads(
    ctx: Any, grad_inputs: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor | None, ...]:
    """The replay node's gradients: none for its three non-tensor arguments, and none for the
    relay or stand-in, if given: a relay's accumulators then run their hooks without
    accumulating, the gradients being in place already."""
    return (None, None, None, *grad_inputs) + (None,) * (ctx.num_tensors - len(grad_inputs))


def _backward_once(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The backward under ``create_graph=True``: the replay's gradients, whose own backward
    raises, naming the callable (a graph's backward is fixed kernels, not differentiable;
    torch's ``once_differentiable`` would raise without the name). The usual backward, with
    grad mode off, goes around this."""
    owner: GraphedCallable = ctx.owner
    record, fused, routing = owner._record, owner._fused, owner._grads  # see _replay_backward
    _, returned = _what_the_pass_does(ctx, routing, lend_inputs=False)
    with torch.no_grad():
        grad_inputs, unreached = owner._replay_backward(
            grads, ctx.generation, ctx.ddp, returned=returned
        )
    if unreached:
        _skip_unreached_hooks(owner, record, fused, unreached)
    # In the pass's grad mode, as autograd runs them.
    _call_accumulator_hooks(record, fused, unreached)
    outputs = _node_grads(ctx, grad_inputs)
    if not any(g is not None and g.requires_grad for g in grads):
        return outputs
    refusal = torch._C._functions.DelayedError(
        f"{owner.label}: cannot differentiate its backward (a second-order gradient): the "
        "backward graph replays fixed kernels; differentiate the eager callable instead",
        len(outputs),
    )
    return refusal(*[None if o is None else o.detach().requires_grad_() for o in outputs])  # type: ignore[arg-type]


def _call_uncompiled(owner: GraphedCallable, *args: Any, **kwargs: Any) -> Any:
    """:meth:`GraphedCallable.__call__` as torch.compile must see it: a graph break, then the
    call run eagerly with every frame it runs. Otherwise dynamo compiles the frames the call
    runs after its graph breaks: the replay's checks and bookkeeping, and the CPU backend's
    replay of recorded ops (whose compiled kernels compute other values than capture's).
    Reached only while dynamo traces, so the wrapper is made at the first such call, never at
    import or capture: ``torch.compiler.disable`` imports dynamo, a second or more of a first
    capture otherwise. Making it there is itself a graph break."""
    if not _UNCOMPILED_CALL:
        _make_uncompiled_call()
    return _UNCOMPILED_CALL[0](owner, *args, **kwargs)


def _make_uncompiled_call() -> None:
    # Its own frame: dynamo, tracing _call_uncompiled, breaks the graph at this call and runs
    # it as plain Python.
    _UNCOMPILED_CALL.append(torch.compiler.disable(GraphedCallable.__call__))


_UNCOMPILED_CALL: list[Callable[..., Any]] = []


# ``Function.apply`` is a Python wrapper around autograd's C implementation that, outside
# torch.func transforms (which a replay refuses), only unwraps dead functorch wrappers among the
# arguments before calling it; that walk over every parameter costs about as much as the node
# itself. A replay unwraps its inputs (a captured parameter is never a wrapper) and calls the C
# implementation directly.
_C_APPLY = super(torch.autograd.Function, _Replay).apply
# Whether the current CUDA stream is capturing: the C call torch.cuda.is_current_stream_capturing
# makes (a CPU-only torch has none; only CUDA replays ask).
_STREAM_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
# True only while dynamo traces (torch >= 2.3; before, nothing is told apart).
_COMPILING = getattr(torch.compiler, "is_compiling", lambda: False)
# Both have been there since torch 2.0; looked up defensively all the same.
_TRANSFORMS_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_UNWRAP_IF_DEAD = getattr(torch._C._functorch, "unwrap_if_dead", lambda tensor: tensor)
