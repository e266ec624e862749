"""The CUDA backend: ``torch.cuda.CUDAGraph`` captured on a side stream into one shared pool.

Graphs that share a pool may reuse each other's freed blocks, which is safe exactly when they
are replayed in the order they were captured. The engine captures in the schedule's order, so
blocks freed by one graph (its saved activations once its backward is captured) are reused only
by graphs whose work the schedule runs after it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from .base import BackwardBody, CapturedOutputs, ForwardBody

__all__ = ["CudaBackend", "CudaGraphPair", "stream_per_device"]

_T = TypeVar("_T")

# cuBLAS keeps a workspace per (handle, stream) for the life of the process, so a fresh
# capture stream per call would leak tens of MiB each time. One side stream per device is
# created on first use and reused by every capture on that device.
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def stream_per_device(
    streams: dict[int, torch.cuda.Stream], device: torch.device
) -> torch.cuda.Stream:
    """``streams``' stream of ``device``, made on first use (one per device for the process:
    per-stream state, cuBLAS's workspaces and the caching allocator's pools, then stays
    bounded)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in streams:
        streams[index] = torch.cuda.Stream(device=index)
    return streams[index]


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    return stream_per_device(_CAPTURE_STREAMS, device)


class CudaBackend:
    """Owns the pool handle and capture stream shared by one ``make_graphed_callables`` call.

    Args:
        device: The GPU the sample tensors live on.
        pool: A handle from ``torch.cuda.graph_pool_handle()`` (or another graph's
            ``pool()``) to share; default: a fresh pool.
        generator_states: Graph-safe CUDA generator states the captured code switches to
            (Megatron-core's graph-safe RNG tracker); each is registered with every graph,
            so replays draw from and advance it as capture did.
    """

    name = "cuda"
    capture_runs_work = False

    def __init__(
        self,
        device: torch.device,
        pool: Any | None = None,
        generator_states: tuple[torch.Generator, ...] = (),
    ) -> None:
        self.device = device
        self._generator_states = generator_states
        with torch.cuda.device(device):
            self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
            self._stream: torch.cuda.Stream | None = _capture_stream(device)

    @property
    def stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            raise RuntimeError("the CUDA graph backend was torn down")
        return self._stream

    @contextmanager
    def warmup(self) -> Iterator[None]:
        # Warm-up runs on the capture stream so lazily created per-stream state (cuBLAS
        # workspaces, for one) exists before capture begins.
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                yield
        finally:  # also after a failure, so later work never races what warm-up queued
            torch.cuda.current_stream(self.device).wait_stream(stream)

    @contextmanager
    def capture_session(self) -> Iterator[None]:
        torch.cuda.synchronize(self.device)
        # Once for the whole pass: drop what warm-up left cached so the graph pool can take
        # that memory instead of adding to it. Only the young generations: cycles warm-up made
        # are young, and a full collection costs seconds in a process with millions of
        # objects (torch.cuda.graph stopped collecting by default for that reason).
        gc.collect(1)
        torch.cuda.empty_cache()
        # No automatic collection while streams capture: garbage from outside this call (an
        # old CUDA graph in a reference cycle, say) would be destroyed mid-capture, and the
        # cudaFree or graph teardown that runs then invalidates the capture. Seen on an H200
        # after a torch.cuda.make_graphed_callables result was dropped without a collection.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.device(self.device):
                yield
        finally:
            if collecting:
                gc.enable()
            torch.cuda.synchronize(self.device)

    def capture(self, graph: torch.cuda.CUDAGraph, body: Callable[[], _T]) -> _T:
        """Record ``body`` into ``graph`` on the capture stream, in this backend's pool."""
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                for state in self._generator_states:
                    graph.register_generator_state(state)
                graph.capture_begin(pool=self.pool)
                try:
                    result = body()
                except BaseException as exc:
                    _abandon_capture(graph)
                    _explain(exc)
                    raise
                graph.capture_end()
        finally:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        return result

    def new_pair(self) -> CudaGraphPair:
        return CudaGraphPair(self)

    def disown(self, tensor: torch.Tensor) -> torch.Tensor:
        # The pool frees a block once no owning reference is left; dropping ours is enough.
        return self.alias(tensor)

    def alias(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        alias = torch._C._construct_storage_from_data_pointer(
            storage.data_ptr(), tensor.device, storage.nbytes()
        )
        view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return view.set_(alias, tensor.storage_offset(), tensor.shape, tensor.stride())

    def teardown(self) -> None:
        self._stream = None


def _abandon_capture(graph: torch.cuda.CUDAGraph) -> None:
    """End a capture whose body failed, so the stream leaves capture mode."""
    # The capture is invalid by now and the body's exception is the one to report;
    # torch.AcceleratorError is not always a RuntimeError, hence Exception.
    try:
        graph.capture_end()
    except Exception:
        # torch takes the CUDA generators out of capture mode only when capture_end
        # succeeds; left in it, every later random op raises "Offset increment outside graph
        # capture". An empty capture on this stream runs their prologue and epilogue again.
        graph.reset()
        with contextlib.suppress(Exception), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the CUDA graph is empty"
            settle = torch.cuda.CUDAGraph()
            settle.capture_begin()
            settle.capture_end()
            settle.reset()
        return
    graph.reset()


_STALE_ACCUMULATOR = "legacy stream depend on a capturing"


def _explain(exc: BaseException) -> None:
    """Add what to do to a capture failure whose cause leangraph can tell."""
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if add_note is not None and _STALE_ACCUMULATOR in str(exc):
        add_note(
            "leangraph: a parameter's gradient accumulator was made on the default stream "
            "before capture and is still held (by DistributedDataParallel, a hook registered "
            "on it, or a live autograd graph); torch then syncs that stream with the capture. "
            "Wrap the model in DDP, or register accumulator hooks, after graphing it, or do so "
            "under a side stream (torch's CUDA-graph notes on DDP)"
        )


class CudaGraphPair:
    """A forward ``CUDAGraph`` and the backward ``CUDAGraph`` that differentiates it."""

    def __init__(self, backend: CudaBackend) -> None:
        self._backend: CudaBackend | None = backend
        self._forward: torch.cuda.CUDAGraph | None = None
        self._backward: torch.cuda.CUDAGraph | None = None
        self._weight: torch.cuda.CUDAGraph | None = None
        self._captured_outputs: tuple[torch.Tensor, ...] | None = None

    def _owner(self) -> CudaBackend:
        if self._backend is None:
            raise RuntimeError("graph pair was reset")
        return self._backend

    def capture_forward(self, body: ForwardBody) -> CapturedOutputs:
        graph = torch.cuda.CUDAGraph()
        self._forward = graph
        outputs = tuple(self._owner().capture(graph, body))
        if any(o.requires_grad for o in outputs):
            self._captured_outputs = outputs  # holds the autograd graph until the backward
        return CapturedOutputs(
            tuple(o.detach() for o in outputs), tuple(o.requires_grad for o in outputs)
        )

    def capture_backward(
        self, body: BackwardBody, *, retain_graph: bool
    ) -> tuple[torch.Tensor | None, ...]:
        self._backward = torch.cuda.CUDAGraph()
        return self._capture_grads(self._backward, body, retain_graph)

    def capture_weight(
        self, body: BackwardBody, *, retain_graph: bool
    ) -> tuple[torch.Tensor | None, ...]:
        self._weight = torch.cuda.CUDAGraph()
        return self._capture_grads(self._weight, body, retain_graph)

    def _capture_grads(
        self, graph: torch.cuda.CUDAGraph, body: BackwardBody, retain_graph: bool
    ) -> tuple[torch.Tensor | None, ...]:
        outputs = self._captured_outputs
        if outputs is None:
            raise RuntimeError("backward captured before its forward")
        grads = tuple(self._owner().capture(graph, functools.partial(body, outputs)))
        if not retain_graph:
            # The saved activations go back to the pool; later captures may reuse them.
            self._captured_outputs = None
        return tuple(None if g is None else g.detach() for g in grads)

    def release_saved(self) -> None:
        self._captured_outputs = None

    def replay_forward(self) -> None:
        if self._forward is None:
            raise RuntimeError("forward graph was reset or never captured")
        self._forward.replay()

    def replay_backward(self) -> None:
        if self._backward is None:
            raise RuntimeError("backward graph was reset or never captured")
        self._backward.replay()

    def replay_weight(self) -> None:
        if self._weight is None:
            raise RuntimeError("weight-gradient graph was reset or never captured")
        self._weight.replay()

    def reset(self) -> None:
        for graph in (self._forward, self._backward, self._weight):
            if graph is not None:
                graph.reset()
        self._forward = None
        self._backward = None
        self._weight = None
        self._captured_outputs = None
        self._backend = None
