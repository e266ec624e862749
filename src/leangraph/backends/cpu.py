"""A CPU reference backend that emulates CUDA-graph semantics.

It exists so that ordering, liveness, buffer reuse and lifecycle are tested without a GPU, and
so that a callable that a CUDA graph would replay differently from eager fails here too. A
"graph" is a trace: the aten calls the capture body made, recorded below autograd (for a
backward body, the calls the autograd engine made) and replayed without the body's Python
code (see :mod:`._cpu_trace`). It behaves like a CUDA graph where the engine or the callable
can observe it:

* only the recorded calls replay: Python in the callable (a branch, a ``print``, a counter)
  runs once, at capture; a host read of tensor values during capture (``.item()``,
  ``bool(tensor)``, printing a tensor, an output shape that depends on values) raises;
* tensors the trace did not create (inputs, parameters, gradient seeds, closed-over tensors)
  are read at their memory as it is at replay; random ops draw fresh numbers from the CPU
  generator at every replay, as a CUDA graph advances its Philox offset, and a backward uses
  the mask of the forward replay it differentiates;
* outputs and gradients live in static buffers that every replay overwrites in place; an
  output the backward reads (``tanh``'s) is read from its static buffer, so a write autograd
  does not see (``out.data.mul_(2)``) reaches the backward, as it does eager's;
* capture computes nothing the caller may rely on (static buffers are filled with NaN, as
  CUDA capture leaves them uninitialised);
* the backward differentiates the *last* forward replay, and without ``retain_graph`` it can
  run once per forward replay;
* static buffers come from an emulated pool: a buffer the engine disowns goes back to a free
  list and is handed to the next capture that needs one of the same shape, as the CUDA
  caching allocator reuses freed pool blocks, so later replays overwrite it.

It does not emulate the pool for intermediates (each replay allocates its own and keeps what
the backward reads until that backward), nor tell host tensors from device ones (every CPU
tensor counts as device memory: its ops replay, its value reads are refused).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._cpu_trace import StorageTable, Trace, record
from .base import BackwardBody, CapturedOutputs, ForwardBody

__all__ = ["CpuBackend", "CpuGraphPair"]

_PoolKey = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


def _copy_into(static: Sequence[torch.Tensor | None], fresh: Sequence[torch.Tensor | None]) -> None:
    with torch.no_grad():
        for buffer, value in zip(static, fresh):
            if buffer is not None and value is not None:
                if 0 in buffer.stride():
                    buffer, value = _one_per_broadcast(buffer, value)
                buffer.copy_(value)


def _one_per_broadcast(
    buffer: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``buffer`` and ``value`` narrowed to one element along every dimension ``buffer``
    broadcasts (stride 0, an expanded output's): the memory a CUDA graph's kernels write, which
    a copy into the whole overlapping view cannot."""
    for dim, (size, stride) in enumerate(zip(buffer.shape, buffer.stride())):
        if stride == 0 and size > 1:
            buffer, value = buffer.narrow(dim, 0, 1), value.narrow(dim, 0, 1)
    return buffer, value


def _poisoned(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` filled with NaN where its dtype has one: capture leaves a CUDA graph's
    buffers uninitialised, so nothing may rely on what capture put there."""
    if buffer.is_floating_point() or buffer.is_complex():
        buffer.fill_(float("nan"))
    return buffer


class CpuGraphPair:
    """Forward and backward "graphs": traces recorded at capture, replayed into static buffers.

    The parts are ``"forward"``, then ``"backward"`` (a full or input-gradient backward) and,
    for zero-bubble orders, ``"weight"`` (the deferred weight-gradient backward), each a
    :class:`Trace`. A part reads the tensors of the parts before it as their last replays left
    them; the pair holds those (``_saved``, by part) from a forward replay until the backward
    that consumes them, as autograd holds saved tensors.
    """

    def __init__(self, backend: CpuBackend) -> None:
        self._backend = backend
        self._parts: list[str] = []
        self._traces: list[Trace] = []
        # Until the last backward part is captured: the forward's outputs with their
        # autograd history (the backward bodies differentiate them) and the parts' tables.
        self._live_outputs: Sequence[torch.Tensor] | None = None
        self._tables: list[StorageTable] = []
        self._static_outputs: tuple[torch.Tensor, ...] = ()
        self._static_grads: dict[str, tuple[torch.Tensor | None, ...]] = {}
        self._retain: dict[str, bool] = {}
        self._differentiable = False
        self._saved: dict[int, dict[int, torch.Tensor]] | None = None
        # From a forward replay to its backward: each output in memory a backward part reads
        # (tanh's result), as (static buffer, the replay's tensor). On CUDA the static output
        # is that memory, so a write that autograd does not see (``out.data.mul_(2)``) reaches
        # the backward, as in eager; a backward replay copies the buffers back to match.
        self._outputs_read: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    def capture_forward(self, body: ForwardBody) -> CapturedOutputs:
        values, trace, table = self._backend.record(body, earlier=())
        outputs = tuple(v for v in values if v is not None)
        if len(outputs) != len(values):  # the trace's results and the buffers pair up by index
            raise TypeError("a forward body must return tensors only, got None")
        self._parts, self._traces = ["forward"], [trace]
        self._differentiable = any(o.requires_grad for o in outputs)
        self._live_outputs = outputs if self._differentiable else None
        self._tables = [table] if self._differentiable else []
        self._static_outputs = self._backend.poisoned_outputs(outputs, table.storages.keys())
        return CapturedOutputs(self._static_outputs, tuple(o.requires_grad for o in outputs))

    def _capture_grads(
        self, part: str, body: BackwardBody, retain_graph: bool
    ) -> tuple[torch.Tensor | None, ...]:
        outputs = self._live_outputs
        if outputs is None:
            raise RuntimeError(f"{part} captured before its forward")
        grads, trace, table = self._backend.record(lambda: body(outputs), earlier=self._tables)
        self._parts.append(part)
        self._traces.append(trace)
        self._retain[part] = retain_graph
        if retain_graph:
            self._tables.append(table)
        else:
            self.release_saved()
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
        self._tables = []

    def replay_forward(self) -> None:
        if not self._traces:
            raise RuntimeError("forward graph was reset or never captured")
        trace = self._traces[0]
        outputs, exports = trace.replay({})
        _copy_into(self._static_outputs, outputs)
        # What the backward parts read of this replay; the previous replay's is dropped.
        self._saved = {0: exports} if self._differentiable else None
        read = {StorageWeakRef(t.untyped_storage()) for t in exports.values()}
        self._outputs_read = tuple(
            (static, fresh)
            for static, fresh, result in zip(self._static_outputs, outputs, trace.results)
            if fresh is not None
            and isinstance(result, int)  # made by the trace, not an external tensor
            and StorageWeakRef(fresh.untyped_storage()) in read
        )

    def _replay_grads(self, part: str) -> None:
        if part not in self._parts:
            raise RuntimeError(f"{part} graph was reset or never captured")
        index = self._parts.index(part)
        saved = self._saved
        if saved is None:
            raise RuntimeError(f"{part} replayed with no forward replay to differentiate")
        trace = self._traces[index]
        missing = trace.parts_read - saved.keys()
        if missing:
            names = ", ".join(self._parts[p] for p in sorted(missing))
            raise RuntimeError(f"{part} replayed before {names}, whose tensors it reads")
        if self._outputs_read:
            buffers, replay_tensors = zip(*self._outputs_read)
            _copy_into(replay_tensors, buffers)  # the buffers into what the backward reads
        grads, exports = trace.replay(saved)
        for later in [p for p in saved if p >= index]:
            del saved[later]  # what a replay of this or a later part left before is stale now
        saved[index] = exports
        if not self._retain[part]:
            self._saved = None
            self._outputs_read = ()
        _copy_into(self._static_grads[part], grads)

    def replay_backward(self) -> None:
        self._replay_grads("backward")

    def replay_weight(self) -> None:
        self._replay_grads("weight")

    def reset(self) -> None:
        self._parts = []
        self._traces = []
        self.release_saved()
        self._saved = None
        self._outputs_read = ()
        self._static_outputs = ()
        self._static_grads.clear()


class CpuBackend:
    """Graph backend for CPU tensors (development and tests), with an emulated pool."""

    name = "cpu"
    capture_runs_work = True

    def __init__(self) -> None:
        self._free: dict[_PoolKey, list[torch.Tensor]] = {}
        # Storages the traces of this capture session created, by any pair: a trace reading
        # one of another pair's is refused (its replay could not follow that tensor).
        self._traced: set[StorageWeakRef] = set()
        # Buffers outputs share (:meth:`poisoned_outputs`), kept out of the pool.
        self._unpooled: set[StorageWeakRef] = set()

    @contextmanager
    def warmup(self) -> Iterator[None]:
        yield

    @contextmanager
    def capture_session(self) -> Iterator[None]:
        try:
            yield
        finally:
            self._traced.clear()

    def record(
        self, body: Callable[[], Sequence[torch.Tensor | None]], *, earlier: Sequence[StorageTable]
    ) -> tuple[tuple[torch.Tensor | None, ...], Trace, StorageTable]:
        """Run ``body`` once and record it as a trace (see :func:`._cpu_trace.record`)."""
        values, trace, table = record(body, earlier=earlier, foreign=self._traced)
        self._traced.update(table.storages)
        return values, trace, table

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
        return _poisoned(buffer)

    def poisoned_outputs(
        self, outputs: Sequence[torch.Tensor], created: Collection[StorageWeakRef]
    ) -> tuple[torch.Tensor, ...]:
        """Static buffers for a forward's ``outputs``. Outputs in one storage the trace
        ``created`` (``return y[:2], y[1:]``, views of a tensor the callable does not return)
        get views of one buffer at their offsets: a CUDA graph's outputs share the memory its
        capture gave them, so a write into one shows in the other there too. Every other
        output gets a buffer of its own (:meth:`poisoned_like`)."""
        found = [StorageWeakRef(output.untyped_storage()) for output in outputs]
        storages = [storage if storage in created else None for storage in found]
        counts = collections.Counter(storage for storage in storages if storage is not None)
        shared = {storage for storage, count in counts.items() if count > 1}
        bases: dict[StorageWeakRef, torch.Tensor] = {}
        static = []
        for output, storage in zip(outputs, storages):
            if storage is None or storage not in shared:
                static.append(self.poisoned_like(output))
                continue
            if storage not in bases:
                base = torch.empty(output.untyped_storage().nbytes(), dtype=torch.uint8)
                self._unpooled.add(StorageWeakRef(base.untyped_storage()))
                bases[storage] = base
            view = torch.empty(0, dtype=output.dtype).set_(
                bases[storage].untyped_storage(),
                output.storage_offset(),
                output.shape,
                output.stride(),
            )
            static.append(_poisoned(view))
        return tuple(static)

    def alias(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    def disown(self, tensor: torch.Tensor) -> torch.Tensor:
        if StorageWeakRef(tensor.untyped_storage()) in self._unpooled:
            # A view of outputs' shared buffer: the pool hands out buffers of one tensor each,
            # and its siblings may still be in use.
            return tensor.detach()
        key = (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        self._free.setdefault(key, []).append(tensor)
        return tensor.detach()

    def teardown(self) -> None:
        self._free.clear()
        self._traced.clear()
        self._unpooled.clear()
