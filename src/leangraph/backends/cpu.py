"""A CPU reference backend that emulates CUDA-graph semantics.

It exists so that ordering, liveness, buffer reuse and lifecycle are tested without a GPU. A
"graph" is the recorded body, rerun on replay; what matters is that it behaves like a CUDA
graph where the engine can observe it:

* outputs and gradients live in static buffers that every replay overwrites in place;
* capture computes nothing the caller may rely on (static buffers are filled with NaN, as
  CUDA capture leaves them uninitialised);
* the backward differentiates the *last* forward replay, and without ``retain_graph`` it can
  run once per forward replay;
* static buffers come from an emulated pool: a buffer the engine disowns goes back to a free
  list and is handed to the next capture that needs one of the same shape, as the CUDA
  caching allocator reuses freed pool blocks, so later replays overwrite it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from .base import BackwardBody, CapturedOutputs, ForwardBody

__all__ = ["CpuBackend", "CpuGraphPair"]

_PoolKey = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


def _copy_into(static: Sequence[torch.Tensor | None], fresh: Sequence[torch.Tensor | None]) -> None:
    with torch.no_grad():
        for buffer, value in zip(static, fresh):
            if buffer is not None and value is not None:
                buffer.copy_(value)


class CpuGraphPair:
    """Forward and backward "graphs" that rerun their bodies into static buffers.

    The backward part is ``"backward"`` (a full or input-gradient backward) and, for
    zero-bubble orders, ``"weight"`` (the deferred weight-gradient backward).
    """

    def __init__(self, backend: CpuBackend) -> None:
        self._backend = backend
        self._forward_body: ForwardBody | None = None
        self._live_outputs: Sequence[torch.Tensor] | None = None
        self._static_outputs: tuple[torch.Tensor, ...] = ()
        self._grad_bodies: dict[str, BackwardBody] = {}
        self._static_grads: dict[str, tuple[torch.Tensor | None, ...]] = {}
        self._retain: dict[str, bool] = {}
        self._grad_enabled = True

    def capture_forward(self, body: ForwardBody) -> CapturedOutputs:
        # Replays run inside an autograd Function (grad disabled); like a CUDA graph they
        # must redo what capture did, so the capture-time grad mode is kept for them.
        self._grad_enabled = torch.is_grad_enabled()
        outputs = tuple(body())
        self._forward_body = body
        self._keep_for_backward(outputs)
        self._static_outputs = tuple(self._backend.poisoned_like(o) for o in outputs)
        return CapturedOutputs(self._static_outputs, tuple(o.requires_grad for o in outputs))

    def _capture_grads(
        self, part: str, body: BackwardBody, retain_graph: bool
    ) -> tuple[torch.Tensor | None, ...]:
        if self._live_outputs is None:
            raise RuntimeError(f"{part} captured before its forward")
        grads = tuple(body(self._live_outputs))
        self._grad_bodies[part] = body
        self._retain[part] = retain_graph
        if not retain_graph:
            self._live_outputs = None
        static = tuple(None if g is None else self._backend.poisoned_like(g) for g in grads)
        self._static_grads[part] = static
        return static

    def capture_backward(
        self, body: BackwardBody, *, retain_graph: bool
    ) -> tuple[torch.Tensor | None, ...]:
        return self._capture_grads("backward", body, retain_graph)

    def capture_weight(
        self, body: BackwardBody, *, retain_graph: bool
    ) -> tuple[torch.Tensor | None, ...]:
        return self._capture_grads("weight", body, retain_graph)

    def release_saved(self) -> None:
        self._live_outputs = None

    def replay_forward(self) -> None:
        if self._forward_body is None:
            raise RuntimeError("forward graph was reset or never captured")
        with torch.set_grad_enabled(self._grad_enabled):
            outputs = tuple(self._forward_body())
        _copy_into(self._static_outputs, outputs)
        self._keep_for_backward(outputs)

    def _keep_for_backward(self, outputs: tuple[torch.Tensor, ...]) -> None:
        """Hold the autograd graph of ``outputs`` only if a backward can differentiate it."""
        self._live_outputs = outputs if any(o.requires_grad for o in outputs) else None

    def _replay_grads(self, part: str) -> None:
        body = self._grad_bodies.get(part)
        if body is None:
            raise RuntimeError(f"{part} graph was reset or never captured")
        if self._live_outputs is None:
            raise RuntimeError(f"{part} replayed with no forward replay to differentiate")
        grads = body(self._live_outputs)
        if not self._retain[part]:
            self._live_outputs = None
        _copy_into(self._static_grads[part], grads)

    def replay_backward(self) -> None:
        self._replay_grads("backward")

    def replay_weight(self) -> None:
        self._replay_grads("weight")

    def reset(self) -> None:
        self._forward_body = None
        self._live_outputs = None
        self._static_outputs = ()
        self._grad_bodies.clear()
        self._static_grads.clear()


class CpuBackend:
    """Graph backend for CPU tensors (development and tests), with an emulated pool."""

    name = "cpu"

    def __init__(self) -> None:
        self._free: dict[_PoolKey, list[torch.Tensor]] = {}

    @contextmanager
    def warmup(self) -> Iterator[None]:
        yield

    @contextmanager
    def capture_session(self) -> Iterator[None]:
        yield

    def new_pair(self) -> CpuGraphPair:
        return CpuGraphPair(self)

    def poisoned_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """A static buffer shaped like ``tensor``: a disowned one if any, else a new one."""
        key = (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        free = self._free.get(key)
        buffer = (
            free.pop()
            if free
            else torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
        )
        if buffer.is_floating_point() or buffer.is_complex():
            buffer.fill_(float("nan"))
        return buffer

    def alias(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    def disown(self, tensor: torch.Tensor) -> torch.Tensor:
        key = (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        self._free.setdefault(key, []).append(tensor)
        return tensor.detach()

    def teardown(self) -> None:
        self._free.clear()
