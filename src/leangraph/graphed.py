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
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from .backends.base import GraphPair
from .errors import GraphResetError
from .order import GraphId

__all__ = ["GraphedCallable", "TensorSpec"]


class _State(enum.Enum):
    CAPTURING = "capturing"
    READY = "ready"
    RESET = "reset"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a replay argument must match: the captured tensor's metadata."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), tensor.dtype, tensor.device, tensor.requires_grad)

    def check(self, owner: str, value: object) -> torch.Tensor:
        """Return ``value`` if it matches this spec, else raise naming ``owner``."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{owner} {self.name} must be a tensor as at capture, got {type(value).__name__}"
            )
        if value.dtype != self.dtype:
            raise TypeError(f"{owner} {self.name} must keep dtype {self.dtype}, got {value.dtype}")
        if tuple(value.shape) != self.shape:
            raise ValueError(
                f"{owner} {self.name} must keep shape {self.shape}, got {tuple(value.shape)}"
            )
        if value.device != self.device:
            raise ValueError(
                f"{owner} {self.name} must stay on {self.device}, got {value.device}"
            )
        if value.requires_grad != self.requires_grad:
            raise ValueError(
                f"{owner} {self.name} must have requires_grad={self.requires_grad} as at "
                f"capture, got requires_grad={value.requires_grad}"
            )
        return value


def _leaf_names(tree: Any) -> list[str]:
    """Readable names for the tensor leaves of ``(args, kwargs)``."""
    names = []
    for path, _ in pytree.tree_flatten_with_path(tree)[0]:
        head, *rest = path[1:]
        suffix = "".join(str(k) for k in rest)
        if path[0].idx == 0:  # positional arguments
            names.append(f"input {head.idx}{suffix}")
        else:
            names.append(f"kwarg {head.key!r}{suffix}")
    return names


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

    Memory aliasing: the returned outputs are views of graph-owned static buffers. They stay
    valid until this callable's next forward replay (or its :meth:`reset`); clone them to keep
    them longer. Gradients handed to parameters and to leaf inputs are fresh tensors; gradients
    flowing into earlier autograd nodes alias the static gradient buffers until the next
    backward replay of this callable.
    """

    def __init__(
        self,
        *,
        fn: Callable[..., Any],
        label: str,
        graph_id: Optional[GraphId],
        static_inputs: Sequence[torch.Tensor],
        input_tree: pytree.TreeSpec,
        params: Sequence[torch.nn.Parameter],
        pair: GraphPair,
        allow_unused_input: bool,
        retain_graph_in_backward: bool,
    ) -> None:
        self._label = label
        self._graph_id = graph_id
        self._lock = threading.RLock()
        self._state = _State.CAPTURING
        self._fn: Optional[Callable[..., Any]] = fn
        self._pair: Optional[GraphPair] = pair
        self._static_inputs = tuple(static_inputs)
        self._input_tree = input_tree
        self._input_specs = tuple(
            TensorSpec.of(name, t)
            for name, t in zip(_leaf_names(pytree.tree_unflatten(static_inputs, input_tree)),
                               static_inputs)
        )
        self._params = tuple(params)
        self._allow_unused_input = allow_unused_input
        self._retain_graph = retain_graph_in_backward
        self._output_tree: Optional[pytree.TreeSpec] = None
        self._static_outputs: tuple[torch.Tensor, ...] = ()
        self._output_requires_grad: tuple[bool, ...] = ()
        self._static_grad_outputs: tuple[Optional[torch.Tensor], ...] = ()
        self._static_grads: tuple[Optional[torch.Tensor], ...] = ()
        self._has_backward = False
        self._forward_generation = 0
        self._backward_generation = -1
        self._module_binding: Optional[_ModuleBinding] = None

    # ----------------------------------------------------------------------------- public

    @property
    def label(self) -> str:
        """How errors name this callable, e.g. ``graph (chunk 1, microbatch 0, layer 2)``."""
        return self._label

    @property
    def graph_id(self) -> Optional[GraphId]:
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
        leaves = self._flatten_call(args, kwargs)
        clone_grads = tuple(t.requires_grad and t.grad_fn is None for t in leaves)
        outputs = _Replay.apply(self, clone_grads, *leaves, *self._params)
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
        self._static_inputs = ()
        self._params = ()
        self._static_outputs = ()
        self._static_grad_outputs = ()
        self._static_grads = ()

    def __del__(self) -> None:
        if getattr(self, "_pair", None) is not None:
            self._release()

    def _require_ready(self, what: str) -> None:
        if self._state is _State.RESET:
            raise GraphResetError(f"{self._label}: cannot {what}: this graphed callable was reset")
        if self._state is not _State.READY:
            raise RuntimeError(f"{self._label}: cannot {what} before capture has finished")

    def _flatten_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        leaves, tree = pytree.tree_flatten((args, kwargs))
        if tree != self._input_tree:
            want_args, want_kwargs = pytree.tree_unflatten(list(self._static_inputs),
                                                           self._input_tree)
            if len(args) != len(want_args):
                raise TypeError(
                    f"{self._label} takes {len(want_args)} positional arguments as at capture, "
                    f"got {len(args)}"
                )
            if set(kwargs) != set(want_kwargs):
                raise TypeError(
                    f"{self._label} takes keyword arguments {sorted(want_kwargs)} as at "
                    f"capture, got {sorted(kwargs)}"
                )
            raise TypeError(
                f"{self._label}: arguments must keep the structure they had at capture "
                f"({self._input_tree}), got {tree}"
            )
        return [spec.check(self._label, leaf) for spec, leaf in zip(self._input_specs, leaves)]

    def _run_user_fn(self) -> tuple[torch.Tensor, ...]:
        """Run the user callable on the static inputs and flatten what it returns."""
        assert self._fn is not None
        args, kwargs = pytree.tree_unflatten(list(self._static_inputs), self._input_tree)
        leaves, tree = pytree.tree_flatten(self._fn(*args, **kwargs))
        for index, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"{self._label}: output {index} must be a tensor, got {type(leaf).__name__}"
                )
        if self._output_tree is None:
            self._output_tree = tree
        elif tree != self._output_tree:
            raise RuntimeError(
                f"{self._label}: outputs changed structure between runs: {self._output_tree} "
                f"then {tree}"
            )
        return tuple(leaves)

    def _grad_targets(self) -> tuple[torch.Tensor, ...]:
        inputs = tuple(t for t in self._static_inputs if t.requires_grad)
        return inputs + tuple(p for p in self._params if p.requires_grad)

    def _target_names(self) -> list[str]:
        names = [s.name for s in self._input_specs if s.requires_grad]
        return names + [f"parameter {i}" for i, p in enumerate(self._params) if p.requires_grad]

    def _check_unused(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        if self._allow_unused_input:
            return
        unused = [name for name, g in zip(self._target_names(), grads) if g is None]
        if unused:
            raise ValueError(
                f"{self._label}: outputs do not depend on {', '.join(unused)}, which "
                "require grad; pass allow_unused_input=True to allow it"
            )

    def _differentiable(self, outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        differentiable = tuple(o for o in outputs if o.requires_grad)
        if differentiable and not self._grad_targets():
            raise ValueError(
                f"{self._label}: outputs require grad only through tensors that are neither "
                "inputs nor module parameters; graph an nn.Module so its parameters are known"
            )
        return differentiable

    # Warm-up: eager passes whose outputs the caller holds only until their backward.

    def _warmup_forward(self) -> Optional[tuple[torch.Tensor, ...]]:
        """One eager forward; returns the outputs that await a backward, or None."""
        return self._differentiable(self._run_user_fn()) or None

    def _warmup_backward(self, outputs: tuple[torch.Tensor, ...]) -> None:
        grads = torch.autograd.grad(
            outputs,
            self._grad_targets(),
            grad_outputs=[torch.zeros_like(o) for o in outputs],
            allow_unused=True,
        )
        self._check_unused(grads)

    # Capture.

    def _capture_forward(self) -> None:
        pair = self._pair
        assert pair is not None
        captured = pair.capture_forward(self._run_user_fn)
        self._static_outputs = captured.outputs
        self._output_requires_grad = captured.requires_grad
        self._has_backward = any(captured.requires_grad)

    def _capture_backward(self) -> None:
        pair = self._pair
        assert pair is not None
        if not self._has_backward:
            return
        targets = self._grad_targets()
        flags = self._output_requires_grad
        grad_outputs = tuple(
            torch.empty_like(o) if rg else None for o, rg in zip(self._static_outputs, flags)
        )
        self._static_grad_outputs = grad_outputs
        seeds = [g for g in grad_outputs if g is not None]
        retain = self._retain_graph

        def backward_body(outputs: Sequence[torch.Tensor]) -> Sequence[Optional[torch.Tensor]]:
            differentiable = self._differentiable(outputs)
            return torch.autograd.grad(
                differentiable, targets, grad_outputs=seeds, allow_unused=True,
                retain_graph=retain,
            )

        self._static_grads = pair.capture_backward(backward_body, retain_graph=retain)
        self._check_unused(self._static_grads)

    def _finish_capture(self, module_binding: Optional[_ModuleBinding] = None) -> None:
        self._module_binding = module_binding
        self._state = _State.READY

    # Replay.

    def _replay_forward(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        with self._lock:
            self._require_ready("replay its forward graph")
            assert self._pair is not None
            for static, value in zip(self._static_inputs, inputs):
                if not _same_buffer(static, value):
                    static.copy_(value)
            self._pair.replay_forward()
            self._forward_generation += 1
            return tuple(o.detach() for o in self._static_outputs)

    def _replay_backward(
        self, grads: Sequence[torch.Tensor], generation: int, clone_inputs: Sequence[bool]
    ) -> tuple[Optional[torch.Tensor], ...]:
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
            self._pair.replay_backward()
            self._backward_generation = generation
            return self._scatter_grads(clone_inputs)

    def _scatter_grads(self, clone_inputs: Sequence[bool]) -> tuple[Optional[torch.Tensor], ...]:
        """One gradient per tensor passed to ``_Replay.apply`` (inputs, then parameters).

        Gradients that autograd stores (parameter and leaf-input ``.grad``) are cloned so no
        stored gradient aliases a buffer that the next backward replay overwrites.
        """
        grads = iter(self._static_grads)
        result: list[Optional[torch.Tensor]] = []
        for static, clone in zip(self._static_inputs, clone_inputs):
            grad = next(grads) if static.requires_grad else None
            result.append(None if grad is None else (grad.clone() if clone else grad.detach()))
        for param in self._params:
            grad = next(grads) if param.requires_grad else None
            result.append(None if grad is None else grad.clone())
        return tuple(result)


class _Replay(torch.autograd.Function):
    """Autograd node of one forward replay; its backward replays the backward graph."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, owner: GraphedCallable, clone_inputs: tuple[bool, ...], *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        outputs = owner._replay_forward(tensors[: len(clone_inputs)])
        ctx.owner = owner
        ctx.generation = owner._forward_generation
        ctx.clone_inputs = clone_inputs
        frozen = [o for o, rg in zip(outputs, owner._output_requires_grad) if not rg]
        ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        owner: GraphedCallable = ctx.owner
        grad_inputs = owner._replay_backward(grads, ctx.generation, ctx.clone_inputs)
        return (None, None, *grad_inputs)
