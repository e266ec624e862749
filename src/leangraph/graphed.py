"""One object per graphed callable: its graphs, static buffers and lifecycle.

A :class:`GraphedCallable` is built by :func:`leangraph.make_graphed_callables`; warm-up and
capture drive it through its private ``_warmup_*`` and ``_capture_*`` methods in the plan's
order, after which it replays. Nothing here is shared with any other callable except the
backend's memory pool, so :meth:`GraphedCallable.reset` touches this callable alone.
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .backends.base import GraphBackend, GraphPair
from .buffers import BufferKey
from .errors import GraphResetError
from .guard import OutputGuard
from .hooks import CaptureHooks
from .order import GraphId, StepKind
from .report import CaptureRecord
from .signature import CallSignature

__all__ = ["GraphedCallable"]


# Whether the running backward pass reaches an autograd node (torch's own helper; without it
# every shared parameter's gradient is copied, which is always correct).
_WILL_ENGINE_EXECUTE_NODE = getattr(torch._C, "_will_engine_execute_node", None)


class _State(enum.Enum):
    CAPTURING = "capturing"
    READY = "ready"
    RESET = "reset"


def _same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape
    )


@dataclass(frozen=True, slots=True)
class _ModuleBinding:
    """How a module's graphed ``forward`` falls back to eager outside its training mode."""

    module: weakref.ref[torch.nn.Module]
    eager_forward: weakref.WeakMethod[Callable[..., Any]]
    training: bool


class GraphedCallable:
    """A callable replayed from a captured forward graph, differentiable through a backward graph.

    Calling it copies the arguments into the static input buffers (skipping tensors that
    already are those buffers), replays the forward graph and returns the outputs wired into
    autograd; their backward replays the backward graph.

    Memory aliasing: the returned outputs are views of graph-owned static buffers. With buffer
    sharing (the default) they stay valid until this callable's backward replay (its weight
    step, for split backwards), or its next forward replay when it has no backward; without
    sharing, until its next forward replay. Never after :meth:`reset`. Clone them to keep
    them longer. Gradients stored by autograd (parameters' and leaf inputs' ``.grad``) are
    fresh tensors; gradients flowing into earlier autograd nodes alias static gradient
    buffers and are consumed by those nodes at once.
    """

    def __init__(
        self,
        *,
        fn: Callable[..., Any],
        label: str,
        graph_id: GraphId | None,
        samples: Sequence[torch.Tensor],
        input_tree: pytree.TreeSpec,
        params: Sequence[torch.nn.Parameter],
        param_names: Sequence[str] = (),
        pair: GraphPair,
        allow_unused_input: bool,
        retain_graph_in_backward: bool,
        split_backward: bool = False,
        hooks: CaptureHooks | None = None,
    ) -> None:
        self._label = label
        self._graph_id = graph_id
        self._lock = threading.RLock()
        self._state = _State.CAPTURING
        self._fn: Callable[..., Any] | None = fn
        self._pair: GraphPair | None = pair
        # Warm-up runs on the samples; capture and replay on the static inputs the engine
        # assigns from the buffer plan. The samples are dropped once capture is done.
        self._samples: tuple[torch.Tensor, ...] = tuple(samples)
        self._static_inputs: tuple[torch.Tensor, ...] = ()
        self._signature = CallSignature(label, samples, input_tree)
        self._params = tuple(params)
        self._param_names = tuple(param_names) or tuple(str(i) for i in range(len(params)))
        # Which parameters the graphs differentiate, fixed now: the static gradient buffers
        # follow this layout whatever a parameter's requires_grad is at replay.
        self._param_trains = tuple(p.requires_grad for p in self._params)
        self._frozen_params = tuple(
            (name, p) for name, p in zip(self._param_names, self._params) if not p.requires_grad
        )
        self._allow_unused_input = allow_unused_input
        self._retain_graph = retain_graph_in_backward
        self._output_tree: pytree.TreeSpec | None = None
        self._single_output = False  # the callable returns one tensor, not a container
        self._static_outputs: tuple[torch.Tensor, ...] = ()
        self._output_requires_grad: tuple[bool, ...] = ()
        self._static_grad_outputs: tuple[torch.Tensor | None, ...] = ()
        self._static_grads: tuple[torch.Tensor | None, ...] = ()
        self._output_keys: tuple[BufferKey, ...] = ()
        self._chained_from: tuple[str | None, ...] = ()
        self._released = False
        self._record: CaptureRecord | None = None
        self._split_backward = split_backward
        self._hooks = hooks if hooks is not None else CaptureHooks()
        self._static_weight_grads: tuple[torch.Tensor | None, ...] = ()
        self._weight_pending: int | None = None
        self._has_backward = False
        self._forward_generation = 0
        self._backward_generation = -1
        self._awaiting_backward: weakref.ref[_BackwardToken] | None = None
        # Other graphs of the same call that train one of this graph's parameters (the same
        # layer's other microbatches, tied weights), and those parameters' ids.
        self._param_peers: tuple[weakref.ref[GraphedCallable], ...] = ()
        self._shared_param_ids: frozenset[int] = frozenset()
        self._guard: OutputGuard | None = None
        self._debug_outputs = False
        self._module_binding: _ModuleBinding | None = None

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

    def __repr__(self) -> str:
        return f"<GraphedCallable {self._label} ({self._state.value})>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Replay the forward graph on ``args``/``kwargs``; see the class docstring.

        Raises:
            GraphResetError: if the callable was reset.
            TypeError, ValueError: if the arguments differ from the captured ones in
                structure, keys, dtype, shape, device or ``requires_grad``.
        """
        binding = self._module_binding
        if binding is not None and self._state is not _State.RESET:
            module = binding.module()
            if module is not None and module.training != binding.training:
                eager = binding.eager_forward()
                if eager is not None:
                    return eager(*args, **kwargs)
        self._require_ready("call")
        leaves = self._signature.bind(args, kwargs)
        self._check_frozen_params()
        clone_grads = tuple(t.requires_grad and t.grad_fn is None for t in leaves)
        token = _BackwardToken()
        outputs = _Replay.apply(self, clone_grads, token, *leaves, *self._params)
        del token  # from here on only the replay's autograd node (if any) keeps it alive
        if self._single_output:
            return outputs[0]
        assert self._output_tree is not None
        return pytree.tree_unflatten(list(outputs), self._output_tree)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"{self._label}: a graphed callable cannot be copied or pickled (its graphs and "
            "static buffers belong to one capture); copy the module before graphing it"
        )

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

    # ----------------------------------------------------------------------------- internals

    def _release(self) -> None:
        pair, self._pair = self._pair, None
        if pair is not None:
            pair.reset()
        self._fn = None
        self._hooks = CaptureHooks()
        self._samples = ()
        self._static_inputs = ()
        self._params = ()
        self._frozen_params = ()
        self._awaiting_backward = None
        self._param_peers = ()
        self._shared_param_ids = frozenset()
        if self._guard is not None:
            self._guard.invalidate("its callable was reset")
        self._static_outputs = ()
        self._static_grad_outputs = ()
        self._static_grads = ()
        self._static_weight_grads = ()
        self._weight_pending = None

    def __del__(self) -> None:
        if getattr(self, "_pair", None) is not None:
            self._release()

    def _require_ready(self, what: str) -> None:
        if self._state is _State.RESET:
            raise GraphResetError(f"{self._label}: cannot {what}: this graphed callable was reset")
        if self._state is not _State.READY:
            raise RuntimeError(f"{self._label}: cannot {what} before capture has finished")

    def _check_frozen_params(self) -> None:
        """A parameter frozen at capture has no gradient in the backward graph: refuse to
        replay once it requires grad, rather than leave its ``.grad`` silently unset."""
        for name, param in self._frozen_params:
            if param.requires_grad:
                raise ValueError(
                    f"{self._label} parameter {name!r} must have requires_grad=False as at "
                    "capture (the backward graph computes no gradient for it), got "
                    "requires_grad=True; capture again to train it"
                )

    def _run_on_static(self) -> tuple[torch.Tensor, ...]:
        return self._run_user_fn(self._static_inputs)

    def _run_user_fn(self, leaves: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run the user callable on ``leaves`` and flatten what it returns."""
        assert self._fn is not None
        args, kwargs = self._signature.unflatten(leaves)
        leaves, tree = pytree.tree_flatten(self._fn(*args, **kwargs))
        for index, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"{self._label}: output {index} must be a tensor, got {type(leaf).__name__}"
                )
        if self._output_tree is None:
            self._output_tree = tree
            self._single_output = tree.is_leaf()
        elif tree != self._output_tree:
            raise RuntimeError(
                f"{self._label}: outputs changed structure between runs: {self._output_tree} "
                f"then {tree}"
            )
        return tuple(leaves)

    def _input_targets(self, leaves: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in leaves if t.requires_grad)

    def _param_targets(self) -> tuple[torch.Tensor, ...]:
        return tuple(p for p, trains in zip(self._params, self._param_trains) if trains)

    def _grad_targets(self, leaves: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return self._input_targets(leaves) + self._param_targets()

    def _target_names(self) -> list[str]:
        names = [s.name for s in self._signature.specs if s.requires_grad]
        return names + [
            f"parameter {name!r}"
            for name, trains in zip(self._param_names, self._param_trains)
            if trains
        ]

    def _check_unused(self, grads: Sequence[torch.Tensor | None]) -> None:
        if self._allow_unused_input or all(g is not None for g in grads):
            return
        unused = [name for name, g in zip(self._target_names(), grads) if g is None]
        if unused:
            raise ValueError(
                f"{self._label}: outputs do not depend on {', '.join(unused)}, which "
                "require grad; pass allow_unused_input=True to allow it"
            )

    def _differentiable(self, outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        differentiable = tuple(o for o in outputs if o.requires_grad)
        if differentiable and not self._grad_targets(self._samples or self._static_inputs):
            raise ValueError(
                f"{self._label}: outputs require grad only through tensors that are neither "
                "inputs nor module parameters; graph an nn.Module so its parameters are known"
            )
        return differentiable

    # Warm-up: eager passes whose outputs the caller holds only until their backward.

    def _with_forward_hooks(
        self, leaves: Sequence[torch.Tensor], run: Callable[[], tuple[torch.Tensor, ...]]
    ) -> tuple[torch.Tensor, ...]:
        """``run()`` between the callable's forward_pre and forward capture-time hooks."""
        if not (self._hooks.forward_pre or self._hooks.forward):
            return run()  # once per step of every pass: skip rebuilding the arguments
        args, kwargs = self._signature.unflatten(leaves)
        self._hooks.run("forward_pre", args, kwargs)
        outputs = run()
        assert self._output_tree is not None
        self._hooks.run(
            "forward", args, kwargs, pytree.tree_unflatten(list(outputs), self._output_tree)
        )
        return outputs

    def _warmup_forward(self) -> tuple[torch.Tensor, ...] | None:
        """One eager forward on the samples; returns the outputs awaiting a backward, or None."""
        outputs = self._with_forward_hooks(self._samples, lambda: self._run_user_fn(self._samples))
        self._output_keys = tuple(BufferKey.of(o) for o in outputs)
        return self._differentiable(outputs) or None

    def _warmup_backward(self, outputs: tuple[torch.Tensor, ...], kind: StepKind) -> None:
        """One eager backward (full, input-gradient or weight-gradient part) on ``outputs``."""
        if kind is StepKind.BACKWARD and self._split_backward:
            targets, retain = self._input_targets(self._samples), True
        elif kind is StepKind.WEIGHT:
            targets, retain = self._param_targets(), False
        else:
            targets, retain = self._grad_targets(self._samples), False
        self._hooks.run("backward_pre")
        if targets:
            grads = torch.autograd.grad(
                outputs,
                targets,
                retain_graph=retain,
                allow_unused=True,
                grad_outputs=[torch.zeros_like(o) for o in outputs],
            )
            if not self._split_backward:
                self._check_unused(grads)
        self._hooks.run("backward")

    # Capture.

    def _assign_buffers(
        self,
        static_inputs: Sequence[torch.Tensor],
        seeds: Sequence[torch.Tensor | None],
        chained_from: Sequence[str | None] = (),
    ) -> None:
        """Take the static inputs and gradient seeds the buffer plan gave this graph.

        ``chained_from[i]`` names the graph whose output buffer input ``i`` is, if any.
        """
        self._static_inputs = tuple(static_inputs)
        self._static_grad_outputs = tuple(seeds)
        self._chained_from = tuple(chained_from) or (None,) * len(static_inputs)

    def _capture_forward(self) -> None:
        pair = self._pair
        assert pair is not None
        with torch.no_grad():
            for static, sample in zip(self._static_inputs, self._samples):
                if not _same_buffer(static, sample):
                    static.copy_(sample)  # values do not matter on CUDA; keeps CPU runs exact
        captured_box: list[Any] = []

        def capture() -> tuple[torch.Tensor, ...]:
            captured_box.append(pair.capture_forward(self._run_on_static))
            return captured_box[0].outputs

        self._with_forward_hooks(self._static_inputs, capture)
        captured = captured_box.pop()
        self._static_outputs = captured.outputs
        self._output_requires_grad = captured.requires_grad
        self._has_backward = any(captured.requires_grad)

    def _grad_body(
        self, targets: Callable[[], tuple[torch.Tensor, ...]], retain: bool
    ) -> Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor | None]]:
        """A backward body differentiating the outputs w.r.t. ``targets()``.

        Targets are looked up at run time: the CPU backend reruns the body against forward
        replays made on the static inputs as they are then, where a parameter frozen since
        capture gets None (a CUDA graph still computes its gradient; autograd drops it).
        """
        seeds = [g for g in self._static_grad_outputs if g is not None]

        def body(outputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor | None]:
            wanted = targets()
            live = [t for t in wanted if t.requires_grad]
            if not live:
                return (None,) * len(wanted)
            grads = iter(
                torch.autograd.grad(
                    self._differentiable(outputs),
                    live,
                    grad_outputs=seeds,
                    allow_unused=True,
                    retain_graph=retain,
                )
            )
            return tuple(next(grads) if t.requires_grad else None for t in wanted)

        return body

    def _capture_backward(
        self, backend: GraphBackend, *, release: bool, chained: Sequence[bool]
    ) -> None:
        """Record the backward graph (input gradients only when the backward is split).

        With ``release`` (and no weight step to come), stop owning what dies here: the plan
        has no further use for this graph's outputs, its gradient buffers or (for chained
        inputs) the previous layer's output, so they are kept only as non-owning views and
        the pool hands their blocks to graphs captured later.
        """
        pair = self._pair
        assert pair is not None
        if not self._has_backward:
            return
        if not self._static_grad_outputs:
            self._static_grad_outputs = tuple(
                torch.empty_like(o) if rg else None
                for o, rg in zip(self._static_outputs, self._output_requires_grad)
            )
        self._hooks.run("backward_pre")
        if self._split_backward:  # the weight step still needs the saved activations
            if self._input_targets(self._static_inputs):  # none: there is no graph to record
                self._static_grads = pair.capture_backward(
                    self._grad_body(lambda: self._input_targets(self._static_inputs), True),
                    retain_graph=True,
                )
            self._hooks.run("backward")
            return
        body = self._grad_body(lambda: self._grad_targets(self._static_inputs), self._retain_graph)
        self._static_grads = pair.capture_backward(body, retain_graph=self._retain_graph)
        self._hooks.run("backward")
        self._check_unused(self._static_grads)
        if release:
            self._release_buffers(backend, chained)

    def _capture_weight(
        self, backend: GraphBackend, *, release: bool, chained: Sequence[bool]
    ) -> None:
        """Record the deferred weight-gradient graph of a split backward."""
        pair = self._pair
        assert pair is not None
        if not self._has_backward:
            return
        body = self._grad_body(self._param_targets, self._retain_graph)
        self._hooks.run("backward_pre")
        if self._param_targets():
            self._static_weight_grads = pair.capture_weight(body, retain_graph=self._retain_graph)
        elif not self._retain_graph:  # nothing to record: just let the activations go
            pair.release_saved()
        self._hooks.run("backward")
        self._check_unused(self._static_grads + self._static_weight_grads)
        if release:
            self._release_buffers(backend, chained)

    def _release_buffers(self, backend: GraphBackend, chained: Sequence[bool]) -> None:
        self._released = True
        self._static_outputs = tuple(backend.disown(o) for o in self._static_outputs)
        self._static_grads = tuple(
            None if g is None else backend.disown(g) for g in self._static_grads
        )
        self._static_weight_grads = tuple(
            None if g is None else backend.disown(g) for g in self._static_weight_grads
        )
        self._static_inputs = tuple(
            backend.alias(t).requires_grad_(t.requires_grad) if link else t
            for t, link in zip(self._static_inputs, chained)
        )

    def _owned_tensors(self) -> list[torch.Tensor]:
        """The static tensors this callable keeps allocated (shared ones included)."""
        owned = [
            t
            for t, chained in zip(
                self._static_inputs, self._chained_from or (None,) * len(self._static_inputs)
            )
            if chained is None
        ]
        owned += [g for g in self._static_grad_outputs if g is not None]
        if not self._released:
            owned += list(self._static_outputs)
            owned += [g for g in (*self._static_grads, *self._static_weight_grads) if g is not None]
        return owned

    def _finish_capture(
        self,
        module_binding: _ModuleBinding | None = None,
        *,
        debug_outputs: bool = False,
        record: CaptureRecord | None = None,
    ) -> None:
        self._record = record
        self._module_binding = module_binding
        self._debug_outputs = debug_outputs
        self._samples = ()
        # Hooks never run at replay; keeping them would keep the user's closures alive.
        self._hooks = CaptureHooks()
        self._state = _State.READY

    # Replay.

    def _check_no_pending_backward(self) -> None:
        """Refuse a forward replay that would overwrite activations a backward still needs."""
        if self._weight_pending is not None:
            raise RuntimeError(
                f"{self._label}: forward replayed while the weight step of replay "
                f"{self._weight_pending} has not run; call backward_dw() first, it needs "
                "the activations this replay would overwrite"
            )
        if self._retain_graph or self._backward_generation == self._forward_generation:
            return
        if self._awaiting_backward is not None and self._awaiting_backward() is not None:
            raise RuntimeError(
                f"{self._label}: forward replayed while the outputs of its previous replay "
                f"({self._forward_generation}) still await their backward; the new replay "
                "would overwrite the activations that backward needs. Run the backward first "
                "or drop those outputs and everything computed from them"
            )

    def _replay_forward(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        with self._lock:
            self._require_ready("replay its forward graph")
            assert self._pair is not None
            self._check_no_pending_backward()
            for index, (static, value) in enumerate(zip(self._static_inputs, inputs)):
                if _same_buffer(static, value):
                    continue
                source = self._chained_from[index]
                if source is not None:
                    raise ValueError(
                        f"{self._label} input {index} is the output buffer of {source} "
                        "(chained layers share it); pass that graph's output itself, got another "
                        "tensor. Capture with share_buffers=False to feed layers anything"
                    )
                static.copy_(value)
            self._pair.replay_forward()
            self._forward_generation += 1
            if self._guard is not None:
                self._guard.invalidate(f"{self._label} was replayed again")
            outputs = tuple(o.detach() for o in self._static_outputs)
            if self._debug_outputs:
                self._guard = OutputGuard(self._label, self._forward_generation)
                outputs = tuple(self._guard.wrap(o) for o in outputs)
            return outputs

    def _note_pending(self, token: _BackwardToken) -> None:
        """Remember (weakly) the autograd node of the latest replay, which awaits a backward."""
        self._awaiting_backward = weakref.ref(token)

    def _replay_backward(
        self, grads: Sequence[torch.Tensor], generation: int, clone_inputs: Sequence[bool]
    ) -> tuple[torch.Tensor | None, ...]:
        with self._lock:
            self._require_ready("run a backward")
            if generation != self._forward_generation:
                raise RuntimeError(
                    f"{self._label}: backward of forward replay {generation} requested, but the "
                    f"graph was replayed again since (replay {self._forward_generation}) and "
                    "its saved activations were overwritten; run each backward before the "
                    "next forward replay of the same graph"
                )
            if generation == self._backward_generation and not self._retain_graph:
                raise RuntimeError(
                    f"{self._label}: second backward through forward replay {generation}; "
                    "capture with retain_graph_in_backward=True to allow it"
                )
            assert self._pair is not None
            for static, grad in zip(self._static_grad_outputs, grads):
                if static is not None and not _same_buffer(static, grad):
                    static.copy_(grad)
            if self._static_grads:
                self._pair.replay_backward()
            self._backward_generation = generation
            self._awaiting_backward = None
            if self._split_backward:
                self._weight_pending = generation
                return self._scatter_grads(clone_inputs)
            if self._guard is not None:
                self._guard.invalidate(f"the backward of {self._label} ran")
            return self._scatter_grads(clone_inputs)

    def backward_dw(self) -> None:
        """Run the deferred weight-gradient step of the last backward (zero-bubble orders).

        Replays the weight-gradient graph and accumulates into each parameter's ``.grad`` as
        autograd would (``.grad`` set to a fresh tensor when None, else added to in place);
        parameter ``post_accumulate_grad`` hooks do not run. Call it at the schedule's W step,
        after the backward through this callable's outputs (which computed input gradients
        only) and before its next forward replay.

        Raises:
            GraphResetError: if the callable was reset.
            RuntimeError: if it was captured without weight steps, or no backward awaits its
                weight step.
        """
        with self._lock:
            self._require_ready("run its weight step")
            if not self._split_backward:
                raise RuntimeError(
                    f"{self._label}: backward_dw() needs an order with -(c + 0.5) weight "
                    "steps; this callable's backward computes weight gradients itself"
                )
            if self._weight_pending is None:
                raise RuntimeError(
                    f"{self._label}: backward_dw() called with no backward awaiting its weight "
                    "step; run the backward through this callable's outputs first"
                )
            assert self._pair is not None
            if self._static_weight_grads:
                self._pair.replay_weight()
            self._weight_pending = None
            if self._guard is not None:
                self._guard.invalidate(f"the weight step of {self._label} ran")
            with torch.no_grad():
                for param, grad in zip(self._param_targets(), self._static_weight_grads):
                    if grad is None:
                        continue
                    if param.grad is None:
                        param.grad = grad.clone()
                    else:
                        param.grad.add_(grad)

    def _scatter_grads(self, clone_inputs: Sequence[bool]) -> tuple[torch.Tensor | None, ...]:
        """One gradient per tensor passed to ``_Replay.apply`` (inputs, then parameters).

        A gradient autograd may *store* (a leaf input's ``.grad``, or a parameter whose
        ``.grad`` is still None, which autograd would take over) is cloned, so no stored
        gradient aliases a buffer that a later replay overwrites. A parameter that already has
        a ``.grad`` gets a view: autograd adds it in place right away, unless another graph
        training the same parameter still has to run in this backward pass (several
        microbatches, or tied weights, differentiated together): autograd then waits for that
        graph's gradient too, whose replay may overwrite this buffer first, so it gets a copy.
        A gradient flowing to an earlier autograd node is a view, consumed by that node before
        any other replay.
        """
        grads = iter(self._static_grads)
        result: list[torch.Tensor | None] = []
        copy_at: list[int] = []
        for spec, clone in zip(self._signature.specs, clone_inputs):
            grad = next(grads) if spec.requires_grad else None
            if grad is not None and clone:
                copy_at.append(len(result))
            result.append(grad)
        awaited = bool(self._shared_param_ids) and self._peer_runs_in_this_backward()
        for param, trains in zip(self._params, self._param_trains):
            grad = next(grads, None) if trains else None
            if grad is not None and (
                param.grad is None or (awaited and id(param) in self._shared_param_ids)
            ):
                copy_at.append(len(result))
            result.append(grad)
        views = [None if g is None else g.detach() for g in result]
        if copy_at:
            for index, copy in zip(copy_at, _copies([result[i] for i in copy_at])):
                views[index] = copy
        return tuple(views)

    def _peer_runs_in_this_backward(self) -> bool:
        """Whether a graph sharing a parameter with this one has a replay awaiting its
        backward that the running backward pass will reach."""
        will_execute = _WILL_ENGINE_EXECUTE_NODE
        for ref in self._param_peers:
            peer = ref()
            pending = peer._awaiting_backward if peer is not None else None
            token = pending() if pending is not None else None
            node = token.node() if token is not None and token.node is not None else None
            if node is not None and (will_execute is None or will_execute(node)):
                return True
        return False

    def _share_parameters_with(
        self, peers: Sequence[GraphedCallable], shared_param_ids: frozenset[int]
    ) -> None:
        """Record the other graphs of the call that train one of this graph's parameters,
        and which of its parameters (by id) they train."""
        self._param_peers = tuple(weakref.ref(peer) for peer in peers)
        self._shared_param_ids = shared_param_ids


def _copies(tensors: list[Any]) -> list[torch.Tensor]:
    """Fresh copies of ``tensors``; on CUDA in a few fused kernels instead of one per tensor
    (a layer's first backward of a step copies every parameter's gradient). Multiplying by
    one is exact for every value, signed zeros and infinities included."""
    if len(tensors) == 1:
        return [tensors[0].clone()]
    return list(torch._foreach_mul(tensors, 1.0))


def graphed_callables_of(result: Any, caller: str) -> list[GraphedCallable]:
    """The graphed callables of one ``make_graphed_callables`` result.

    ``result`` is what it returned: a :class:`GraphedCallable`, a module whose ``forward`` is
    one, or a tuple of those.

    Raises:
        TypeError: naming ``caller`` and the first entry that is none of these.
    """
    items = result if isinstance(result, (tuple, list)) else (result,)
    callables = []
    for index, item in enumerate(items):
        forward = item.__dict__.get("forward") if isinstance(item, torch.nn.Module) else item
        if not isinstance(forward, GraphedCallable):
            raise TypeError(
                f"{caller}: entry {index} is a {type(item).__name__}, expected a "
                "GraphedCallable or a module whose forward was graphed by leangraph (it is "
                "not a result of leangraph.make_graphed_callables)"
            )
        callables.append(forward)
    return callables


class _BackwardToken:
    """Lives exactly as long as one forward replay's autograd node (its ctx holds it).

    The graphed callable keeps only a weak reference: while it is alive, a backward through
    that replay may still come, so the next forward replay must not overwrite activations.
    """

    __slots__ = ("__weakref__", "node")

    def __init__(self) -> None:
        self.node: weakref.ref[Any] | None = None  # the replay's autograd node, once made


class _Replay(torch.autograd.Function):
    """Autograd node of one forward replay; its backward replays the backward graph."""

    @staticmethod
    def forward(
        ctx: Any,
        owner: GraphedCallable,
        clone_inputs: tuple[bool, ...],
        token: _BackwardToken,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        outputs = owner._replay_forward(tensors[: len(clone_inputs)])
        ctx.owner = owner
        ctx.generation = owner._forward_generation
        ctx.clone_inputs = clone_inputs
        ctx.token = token
        token.node = weakref.ref(ctx)
        if any(owner._output_requires_grad):
            owner._note_pending(token)
        frozen = [o for o, rg in zip(outputs, owner._output_requires_grad) if not rg]
        ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        owner: GraphedCallable = ctx.owner
        grad_inputs = owner._replay_backward(grads, ctx.generation, ctx.clone_inputs)
        return (None, None, None, *grad_inputs)
