"""Dispatcher-level traces: what the CPU backend records at capture and replays.

A trace is the straight-line sequence of aten calls one capture body made, recorded by a
``TorchDispatchMode``: below autograd, so a forward body's kernels and, for a backward body,
the kernels the autograd engine ran (on the calling thread, for CPU tensors, with the mode in
its thread-local state). Replaying it runs those calls again and nothing else: no Python code
of the callable, no autograd. Memory is modelled the way a CUDA graph sees it:

* a tensor the trace did not create (a static input, a parameter, a gradient seed, a tensor
  the callable closes over) is *external*: the trace keeps a view of its memory made at
  capture, and a replay reads and writes that memory as it is then, like the fixed device
  address a CUDA graph bakes in;
* a tensor an op of the trace created is *internal*: it is known by its storage (autograd
  unpacks saved tensors as new tensor objects on the same storage) plus the view onto it
  (offset, sizes, strides, dtype). A replay's ops make new storages; a view that no replayed
  op returns is rebuilt onto them.

A later part of the same graph pair (the backward of a forward) finds the earlier part's
storages through its :class:`StorageTable` and reads them as that part's last replay left
them, as a CUDA backward graph reads the pool memory its forward wrote.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ._cpu_refusals import (
    check_host_read,
    host_read_error,
    may_read_host,
    refusal,
    unsited_refusal,
)

__all__ = ["StorageTable", "Trace", "record"]

_View = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype, bool, bool]
"""Storage offset, sizes, strides, dtype, conjugate bit and negative bit of a view."""

_Key = tuple[int, _View]
"""A view onto the storage whose first tensor lives in the given slot."""

Env = list[Any]
"""The values of one replay, by slot: tensors, None until the op that makes them has run."""

_SINGLE, _FLAT, _TREE = 0, 1, 2  # how an op returns its tensors

# What a plain tensor (or a Parameter) has; a subclass with its own dispatch differs.
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def _view_of(tensor: torch.Tensor) -> _View:
    return (
        int(tensor.storage_offset()),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.is_conj(),
        tensor.is_neg(),
    )


def _view_onto(base: torch.Tensor, view: _View) -> torch.Tensor:
    """A tensor with ``view``'s metadata onto ``base``'s storage."""
    offset, size, stride, dtype, conj, neg = view
    rebuilt = torch.empty(0, dtype=dtype, device=base.device)
    rebuilt.set_(base.untyped_storage(), offset, size, stride)
    if conj:
        rebuilt = rebuilt.conj()
    if neg:
        rebuilt = torch._neg_view(rebuilt)
    return rebuilt


def _plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has one storage a trace can name and rebuild views onto."""
    return tensor.layout == torch.strided and not (tensor.is_quantized or tensor.is_nested)


def _result_layout(result: Any) -> tuple[int, list[Any]]:
    if isinstance(result, torch.Tensor):
        return _SINGLE, [result]
    if isinstance(result, (tuple, list)) and not any(isinstance(r, (tuple, list)) for r in result):
        return _FLAT, list(result)
    return _TREE, pytree.tree_leaves(result)


# ---------------------------------------------------------------------------------- replay


_ListFill = tuple[int | str, tuple[Any, ...], tuple[tuple[int, int], ...]]
"""A list argument (position or keyword), its constants, and (index, slot) of its tensors."""


@dataclass(frozen=True, slots=True)
class _Call:
    """One recorded aten call: constants and external tensors are baked into ``args`` and
    ``kwargs``; the fills say where the replay's internal tensors go (by slot)."""

    func: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    arg_fills: tuple[tuple[int, int], ...]
    kwarg_fills: tuple[tuple[str, int], ...]
    list_fills: tuple[_ListFill, ...]
    layout: int
    out: tuple[int | None, ...]
    collective: bool = False
    grad: bool = False  # the grad mode the kernel ran under at capture

    def run(self, env: Env) -> None:
        args: list[Any] = list(self.args)
        for index, slot in self.arg_fills:
            args[index] = env[slot]
        kwargs = self.kwargs
        if self.kwarg_fills or self.list_fills:
            kwargs = dict(kwargs)
            for name, slot in self.kwarg_fills:
                kwargs[name] = env[slot]
            for where, template, pairs in self.list_fills:
                items = list(template)
                for index, slot in pairs:
                    items[index] = env[slot]
                if isinstance(where, int):
                    args[where] = items
                else:
                    kwargs[where] = items
        if self.grad:
            # A kernel may branch on the grad mode (nn.LSTM's aten.mkldnn_rnn_layer runs
            # oneDNN's training kernel, and returns the workspace its backward reads, only with
            # grad enabled): it replays under the mode it saw at capture and, as there, below
            # autograd, which records nothing of it.
            with torch.enable_grad(), torch._C._AutoDispatchBelowAutograd():
                result = self.func(*args, **kwargs)
        else:
            result = self.func(*args, **kwargs)
        if self.collective:
            _wait(result)
        if self.layout == _SINGLE:
            target = self.out[0]
            if target is not None:
                env[target] = self._made(result)
            return
        values = result if self.layout == _FLAT else pytree.tree_leaves(result)
        for target, value in zip(self.out, values):
            if target is not None:
                env[target] = self._made(value)

    def _made(self, value: Any) -> torch.Tensor:
        """A tensor the call made, where its capture's made one (not an undefined one)."""
        if not isinstance(value, torch.Tensor):
            raise RuntimeError(
                f"the CPU backend's replay of {self.func} returned {type(value).__name__} "
                "where its capture returned a tensor: the kernel ran otherwise than at capture"
            )
        return value


def _wait(result: Any) -> None:
    """Wait for the work a collective returned: at capture the callable's Python waited
    (``dist.all_reduce`` does, or a later ``work.wait()``), which a replay does not run; a
    replay waits at once, so what it reads next is the collective's result, as on a CUDA
    stream that orders the collective's kernels before the next ones."""
    for value in pytree.tree_leaves(result):
        if isinstance(value, torch.ScriptObject) and hasattr(value, "wait"):
            value.wait()


@dataclass(frozen=True, slots=True)
class _Rebuild:
    """A view the trace read that no op returned: rebuilt onto the replay's storage."""

    slot: int
    base: int
    view: _View

    def run(self, env: Env) -> None:
        env[self.slot] = _view_onto(env[self.base], self.view)


@dataclass(slots=True)
class Trace:
    """The recorded calls of one capture body, replayable without its Python code.

    ``results`` are what the body returned: a slot (an internal tensor), an external tensor
    (read as it is at replay) or None. ``imports`` are (slot, part, slot of that part): tensors
    of an earlier part of the pair. ``exports`` are the slots later parts import; a replay
    hands them back so that the pair can keep them until those parts replay.
    """

    steps: tuple[_Call | _Rebuild, ...]
    size: int
    imports: tuple[tuple[int, int, int], ...]
    results: tuple[Any, ...]
    exports: set[int] = field(default_factory=set)

    def replay(
        self, earlier: Mapping[int, Mapping[int, torch.Tensor]]
    ) -> tuple[list[torch.Tensor | None], dict[int, torch.Tensor]]:
        """Run the recorded calls; return the results and the exports.

        ``earlier[p]`` is what part ``p`` of the pair exported at its last replay. The
        results are this replay's tensors or external ones; the caller copies them into its
        static buffers (an external one stays its owner's, overwritten when the owner writes).
        """
        env: Env = [None] * self.size
        for slot, part, source in self.imports:
            env[slot] = earlier[part][source]
        # The recorded calls are what autograd and autocast made of the body at capture; a
        # replay redoes neither, whatever modes its caller has on (a CUDA graph replays kernels).
        # A call recorded with grad enabled turns it back on for its kernel (_Call.run).
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            for step in self.steps:
                step.run(env)
        results = [env[r] if isinstance(r, int) else r for r in self.results]
        return results, {slot: env[slot] for slot in self.exports}

    @property
    def parts_read(self) -> frozenset[int]:
        """The earlier parts whose exports a replay needs."""
        return frozenset(part for _, part, _ in self.imports)


@dataclass(frozen=True, slots=True)
class StorageTable:
    """How a later part finds the storages a trace created: the first slot on each, and the
    view that slot holds at the end of the capture. It holds weak references, which keep
    only the storages' bookkeeping (not their memory) and so their identities unique."""

    trace: Trace
    storages: dict[StorageWeakRef, int]
    views: dict[int, _View]


# --------------------------------------------------------------------------------- capture


class _Binding:
    """One call's arguments as the trace will replay them, and what capture learnt binding
    them: the internal tensors among them (with their slots) and the external storages."""

    __slots__ = ("arg_fills", "args", "external", "internal", "kwarg_fills", "kwargs", "lists")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args = list(args)
        self.kwargs = dict(kwargs)
        self.arg_fills: list[tuple[int, int]] = []
        self.kwarg_fills: list[tuple[str, int]] = []
        self.lists: list[_ListFill] = []
        self.internal: list[tuple[torch.Tensor, int]] = []
        self.external: set[StorageWeakRef] = set()

    def call(
        self,
        func: torch._ops.OpOverload,
        layout: int,
        out: tuple[int | None, ...],
        *,
        collective: bool,
        grad: bool,
    ) -> _Call:
        return _Call(
            func,
            tuple(self.args),
            self.kwargs,
            tuple(self.arg_fills),
            tuple(self.kwarg_fills),
            tuple(self.lists),
            layout,
            out,
            collective,
            grad,
        )


@dataclass(frozen=True, slots=True)
class _OpFacts:
    """What recording needs to know of an operator, looked up once per operator."""

    may_read_host: bool
    mutable: bool
    inplace_view: bool
    random: bool
    collective: bool


@functools.cache
def _facts(func: torch._ops.OpOverload) -> _OpFacts:
    tags = func.tags
    return _OpFacts(
        may_read_host=may_read_host(func),
        mutable=func._schema.is_mutable,
        inplace_view=torch.Tag.inplace_view in tags,
        random=torch.Tag.nondeterministic_seeded in tags,
        # torch.distributed's collectives (c10d's in-place ones return their tensors and a
        # Work to wait on; the functional ones wait in a wait_tensor call of their own).
        collective=func.namespace in ("c10d", "_c10d_functional"),
    )


class _Builder:
    """Turns the calls a body makes into a :class:`Trace`, naming every tensor as a slot of
    the replay or an external tensor."""

    def __init__(self, earlier: Sequence[StorageTable], foreign: set[StorageWeakRef]) -> None:
        self._earlier = tuple(earlier)
        self._foreign = foreign
        self._steps: list[_Call | _Rebuild] = []
        self._size = 0
        self._imports: list[tuple[int, int, int]] = []
        self._storages: dict[StorageWeakRef, int] = {}  # known storage -> its first slot
        self._created: dict[StorageWeakRef, int] = {}  # the ones this trace's ops made
        self._views: dict[_Key, int] = {}
        self._keys: dict[int, _Key] = {}
        # A replay draws from the CPU generator as it is then; the capture must have drawn
        # from it in the same way, from one state onwards, for the masks to be fresh ones.
        self._rng = torch.default_generator.get_state()

    def call(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        facts = _facts(func)
        if facts.may_read_host:
            check_host_read(func, args, kwargs)
        random = facts.random and _default_generator(args, kwargs)
        if random:
            self._check_generator(func)
        binding = self._bind(args, kwargs)
        grad = torch.is_grad_enabled()  # what the kernel sees (below autograd, as a replay)
        result = func(*args, **kwargs)
        if random:
            self._rng = torch.default_generator.get_state()
        self._note(func, facts, binding, result, grad=grad)
        return result

    def _check_generator(self, func: torch._ops.OpOverload) -> None:
        if not torch.equal(torch.default_generator.get_state(), self._rng):
            raise refusal(
                f"{func} drawing from a CPU generator that was re-seeded or restored during the "
                "capture (torch.manual_seed, torch.set_rng_state, torch.utils.checkpoint "
                "recomputing its forward), or drawn from by another thread (its state cannot "
                "tell which)",
                _RESET_WHY,
            )

    def check_generator_left(self) -> None:
        """Raise if the body left the CPU generator other than its last draw did (or than it
        found it): a reset no draw followed, which a replay would not repeat either, so the
        generator after a replay would differ from eager's."""
        if not torch.equal(torch.default_generator.get_state(), self._rng):
            raise unsited_refusal(
                "a re-seeded or restored CPU generator: the callable (or its backward) left it "
                "in another state than its last draw, or the capture's start, left it "
                "(torch.manual_seed, torch.set_rng_state, torch.random.fork_rng around a draw; "
                "or another thread drew from it meanwhile, which its state cannot tell apart)",
                _RESET_WHY,
            )

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Binding:
        binding = _Binding(args, kwargs)
        for index, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                source: int | torch.Tensor | None = self._source(value, binding)
                if isinstance(source, int):
                    binding.arg_fills.append((index, source))
                    source = None
                binding.args[index] = source
            elif isinstance(value, (list, tuple)):
                self._bind_list(binding, index, value)
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                source = self._source(value, binding)
                if isinstance(source, int):
                    binding.kwarg_fills.append((name, source))
                    source = None
                binding.kwargs[name] = source
            elif isinstance(value, (list, tuple)):
                self._bind_list(binding, name, value)
        return binding

    def _bind_list(self, binding: _Binding, where: int | str, value: Sequence[Any]) -> None:
        """A ``Tensor[]`` (or ``Tensor?[]``) argument; other lists are constants."""
        if not any(isinstance(v, torch.Tensor) for v in value):
            return
        items, pairs = list(value), []
        for index, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                source: int | torch.Tensor | None = self._source(item, binding)
                if isinstance(source, int):
                    pairs.append((index, source))
                    source = None
                items[index] = source
        binding.lists.append((where, tuple(items), tuple(pairs)))
        if isinstance(where, int):
            binding.args[where] = None  # the replay puts a fresh list here
        else:
            binding.kwargs[where] = None

    def _source(self, tensor: torch.Tensor, binding: _Binding) -> int | torch.Tensor:
        """The slot holding ``tensor`` at replay, or the external tensor itself."""
        if not _plain(tensor):
            return tensor  # only ops of the trace make internal tensors, and those are plain
        storage = StorageWeakRef(tensor.untyped_storage())
        first = self._known(storage)
        if first is None:
            if storage in self._foreign:
                raise refusal(
                    "a read of a tensor that another graph's capture created (kept in Python "
                    "state from one callable to another?)",
                    "a replay would read it as it was at that capture, not as the other "
                    "graph's replays leave it. Pass it as an input or an output instead",
                )
            binding.external.add(storage)
            return tensor.detach()  # the memory, not the autograd history
        slot = self._slot_for((first, _view_of(tensor)), rebuild=True)
        binding.internal.append((tensor, slot))
        return slot

    def _known(self, storage: StorageWeakRef) -> int | None:
        """The first slot on ``storage``, importing it from an earlier part if it made it."""
        first = self._storages.get(storage)
        if first is not None:
            return first
        for part, table in enumerate(self._earlier):
            source = table.storages.get(storage)
            if source is not None:
                first = self._slot_for((self._size, table.views[source]), rebuild=False)
                self._imports.append((first, part, source))
                table.trace.exports.add(source)
                self._storages[storage] = first
                return first
        return None

    def _slot_for(self, key: _Key, *, rebuild: bool) -> int:
        slot = self._views.get(key)
        if slot is None:
            slot = self._size
            self._size += 1
            self._views[key] = slot
            self._keys[slot] = key
            if rebuild:
                self._steps.append(_Rebuild(slot, key[0], key[1]))
        return slot

    def _note(
        self,
        func: torch._ops.OpOverload,
        facts: _OpFacts,
        binding: _Binding,
        result: Any,
        *,
        grad: bool,
    ) -> None:
        """Record the call unless replaying it cannot matter."""
        if facts.mutable:
            self._follow_mutations(func, binding.internal)
        layout, values = _result_layout(result)
        out = tuple(
            self._output_slot(func, v, binding.external) if isinstance(v, torch.Tensor) else None
            for v in values
        )
        if facts.inplace_view:
            # Metadata only: a view of external memory keeps what capture made of it, as a
            # CUDA graph keeps the addresses; internal tensors need it redone.
            wanted = bool(binding.internal)
        else:
            # A collective talks to other ranks, whose replays run it too: always replayed.
            wanted = facts.mutable or facts.collective or any(slot is not None for slot in out)
        if wanted:
            call = binding.call(func, layout, out, collective=facts.collective, grad=grad)
            self._steps.append(call)

    def _follow_mutations(
        self, func: torch._ops.OpOverload, internal: Sequence[tuple[torch.Tensor, int]]
    ) -> None:
        """Re-key slots whose tensor an in-place op gave new metadata (``t_``, ``resize_``)."""
        for tensor, slot in internal:
            old = self._keys[slot]
            first = self._storages.get(StorageWeakRef(tensor.untyped_storage()))
            if first != old[0]:
                raise refusal(
                    f"{func}, which points a tensor at other memory",
                    "the trace names tensors by their memory and cannot follow the move",
                )
            new = (first, _view_of(tensor))
            if new != old:
                if self._views.get(old) == slot:
                    del self._views[old]
                self._views[new] = slot
                self._keys[slot] = new

    def _output_slot(
        self, func: torch._ops.OpOverload, tensor: torch.Tensor, external: set[StorageWeakRef]
    ) -> int | None:
        """The slot of an op's output; None for a view of external memory."""
        if not _plain(tensor):
            raise refusal(
                f"{func} returning a {tensor.layout} tensor"
                + (" (quantized)" if tensor.is_quantized else "")
                + (" (nested)" if tensor.is_nested else ""),
                "the trace replays dense strided tensors only",
            )
        storage = StorageWeakRef(tensor.untyped_storage())
        first = self._known(storage)
        if first is None:
            if storage in external:
                return None
            first = self._size  # a new storage: its first slot is made right below
            self._storages[storage] = first
            self._created[storage] = first
        return self._slot_for((first, _view_of(tensor)), rebuild=False)

    def finish(self, values: Sequence[torch.Tensor | None]) -> tuple[Trace, StorageTable]:
        binding = _Binding((), {})
        results = tuple(None if v is None else self._source(v, binding) for v in values)
        trace = Trace(tuple(self._steps), self._size, tuple(self._imports), results)
        views = {first: self._keys[first][1] for first in self._created.values()}
        return trace, StorageTable(trace, dict(self._created), views)


_RESET_WHY = (
    "a replay draws on from the generator as it is then and cannot repeat that reset; CUDA "
    "refuses to seed or restore a generator during capture too. Seed before the capture; "
    "checkpoint around the graphed callable, not inside it (preserve_rng_state=False would "
    "recompute other dropout masks); give a thread that draws while others capture a "
    "torch.Generator of its own"
)


def _default_generator(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a random op draws from the default CPU generator (no other one passed)."""
    generators = [v for v in [*args, *kwargs.values()] if isinstance(v, torch.Generator)]
    return all(g is torch.default_generator for g in generators)


class _Recorder(TorchDispatchMode):
    """Hands every aten call below autograd to a :class:`_Builder`."""

    def __init__(self, builder: _Builder) -> None:
        super().__init__()
        self.builder = builder

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not isinstance(func, torch._ops.OpOverload):
            raise refusal(f"{func}", "the trace replays aten operators only")
        subclasses = [
            t for t in types if getattr(t, "__torch_dispatch__", None) is not _PLAIN_DISPATCH
        ]
        if subclasses:
            raise refusal(
                f"{func} on tensor subclasses ({', '.join(t.__name__ for t in subclasses)})",
                "the trace replays plain tensors only",
            )
        return self.builder.call(func, args, kwargs or {})


class _HostReadGuard(TorchFunctionMode):
    """Refuses tensor methods that read values on the host without an aten call the
    recorder would see (printing runs with dispatch modes disabled)."""

    def __torch_function__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        error = host_read_error(func)
        if error is not None:
            raise error
        return func(*args, **(kwargs or {}))


def record(
    run: Callable[[], Sequence[torch.Tensor | None]],
    *,
    earlier: Sequence[StorageTable],
    foreign: set[StorageWeakRef],
) -> tuple[tuple[torch.Tensor | None, ...], Trace, StorageTable]:
    """Run ``run`` once, recording its aten calls; return what it returned and the trace.

    ``earlier`` are the tables of the pair's parts captured before (a backward reads its
    forward's tensors through them); ``foreign`` are the storages other graphs' traces
    created, which this one must not read. What ``run`` returned is capture-time work, with
    its autograd history; the trace replays it from then on.

    Raises:
        RuntimeError: naming what the body did that a replay cannot repeat (a host read of a
            tensor's values, an output shape that depends on them, a reset generator, ...).
    """
    builder = _Builder(earlier, foreign)
    with _HostReadGuard(), _Recorder(builder):
        values = tuple(run())
    builder.check_generator_left()
    trace, table = builder.finish(values)
    return values, trace, table
