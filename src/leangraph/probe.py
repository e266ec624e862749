"""The probe: one forward of each distinct callable, measured once for every later stage.

Before warm-up, every distinct (callable, sample layout) pair (``Call.alike``) runs forward
once under ``torch.autograd.graph.saved_tensors_hooks``. What it returns and what autograd
saves give the facts the memory check and the buffer plan both read, so the two cannot
disagree: each graph's input and output buffer keys, which outputs need a gradient (hence
whether the graph has a backward), its output structure, which parameters it trains, which
parameters' ``requires_grad`` its Python code reads, and the byte counts of
:class:`LayerMemory`. Nothing runs backward (gradient sizes come from tensor
metadata).

The probe leaves no trace: it runs in a forked RNG state, puts module buffers back (a forward
may update some, BatchNorm's running statistics), and frees what it allocated.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ._call import Call, Sample
from ._restore import module_buffers, values_kept
from .buffers import BufferKey
from .errors import phase_note
from .leaves import LeafTemplate, is_constant, leaf_names

__all__ = ["GraphFacts", "LayerMemory", "probe"]


@dataclass(frozen=True, slots=True)
class LayerMemory:
    """One measured forward of a callable on one sample signature.

    Byte counts are of distinct storages (a view keeps its whole storage alive, so a saved view
    costs its storage, and several views of one storage cost it once).

    Attributes:
        activation_bytes: Saved for backward, excluding parameters, buffers and the inputs.
        saved_input_bytes: Inputs that are saved for backward (static inputs or the previous
            layer's output; the Korthikanti formula counts them as the layer's activations).
        output_bytes: Outputs that await a backward (differentiable ones).
        in_flight_bytes: What one forward holds until its backward, in warm-up and in the
            capture pool: activations and outputs (a saved output counted once).
        grad_input_bytes: Gradients of inputs that require grad.
        param_grad_bytes: Gradients of parameters that require grad.
        inputs: Buffer key of every tensor leaf of the sample arguments.
        outputs: Buffer key of every tensor output (``requires_grad``: it needs a gradient).
    """

    activation_bytes: int
    saved_input_bytes: int
    output_bytes: int
    in_flight_bytes: int
    grad_input_bytes: int
    param_grad_bytes: int
    inputs: tuple[BufferKey, ...]
    outputs: tuple[BufferKey, ...]

    @property
    def transient_bytes(self) -> int:
        """What a backward allocates on top of what is held: grad-inputs + parameter grads."""
        return self.grad_input_bytes + self.param_grad_bytes


@dataclass(frozen=True)
class GraphFacts:
    """What one graph's probe forward showed; shared by graphs of one callable and signature.

    Attributes:
        memory: The byte counts and buffer keys of the forward (tensor outputs only).
        output_tree: The pytree structure of what the callable returned.
        output_template: Its leaves: a slot per tensor, the constants as returned.
        trains: Per parameter of the callable (``named_parameters`` order), whether it
            requires grad, so the graphs differentiate it.
        reach: Per tensor output, the inputs and parameters its gradient reaches, as
            positions among the tensor inputs then the parameters (an input ``i`` is ``i``,
            parameter ``j`` is ``len(inputs) + j``): what gets no gradient, as in eager,
            when a backward gives that output none. Empty where fewer than two outputs need
            a gradient.
        saved_outputs: The positions of tensor outputs whose memory the backward reads
            (saved for it, as ``tanh`` saves its result, or an input or parameter returned
            as is, or a view of one, that the backward reads: ``(x * w, x)``), whether they
            need a gradient or not: eager's backward refuses one modified in place after
            the forward.
        saved_params: The positions (``named_parameters`` order) of the parameters whose
            memory the backward reads (a linear layer's weight, for the input's gradient):
            eager's backward refuses one modified in place between the forward and the
            backward (an optimizer step), where a backward graph would read the new values.
        reads_requires_grad: The positions (``named_parameters`` order) of the parameters
            whose ``requires_grad`` the forward's Python code read (Megatron-core's linear
            layers switch to another autograd function for a frozen weight): its path may
            depend on them, so a replay is refused once one differs from capture.
        repeats: Per tensor output, the position of the first tensor output that is the
            same tensor object (its own where none is): ``return y, y`` gives ``(0, 0)``.
            A replay returns one tensor there too, so its gradients add up in autograd as
            eager's do. Empty where no output repeats another.
        views: The tensor outputs that are views of an earlier, contiguous tensor output
            (``return y, y[:, 0]``), as :class:`OutputView` records: a replay returns them
            as views of that output too, so an in-place write into one shows in the other,
            as in eager. Empty where no output views another.
        saved_inputs: The positions of tensor inputs whose memory the backward reads (saved
            for it, as a linear layer saves its input for the weight's gradient): a backward
            graph reads its static input there, which is the previous layer's output buffer
            itself in a chain, so one modified in place after the forward must be refused,
            as eager's backward refuses it.
        saved_buffers: The qualified names of the module's buffers whose memory the backward
            reads (a scale multiplied in; batch norm's running statistics, which its kernels
            update without a new version): the backward graph reads them where they are, so
            one modified in place between the forward and the backward must be refused, as
            eager's backward refuses it.
    """

    memory: LayerMemory
    output_tree: pytree.TreeSpec
    output_template: LeafTemplate
    trains: tuple[bool, ...]
    reach: tuple[frozenset[int], ...] = ()
    saved_outputs: tuple[int, ...] = ()
    reads_requires_grad: tuple[int, ...] = ()
    saved_params: tuple[int, ...] = ()
    repeats: tuple[int, ...] = ()
    views: tuple[OutputView, ...] = ()
    saved_inputs: tuple[int, ...] = ()
    saved_buffers: tuple[str, ...] = ()

    @property
    def inputs(self) -> tuple[BufferKey, ...]:
        """Buffer key of every tensor leaf of the sample arguments."""
        return self.memory.inputs

    @property
    def outputs(self) -> tuple[BufferKey, ...]:
        """Buffer key of every output; ``requires_grad`` says it needs a gradient."""
        return self.memory.outputs

    @property
    def has_backward(self) -> bool:
        """Whether any output needs a gradient, so the graph has a backward."""
        return any(key.requires_grad for key in self.memory.outputs)


def probe(
    call: Call,
    *,
    where: AbstractContextManager[Any] | None = None,
    around_forward: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> tuple[GraphFacts, ...]:
    """One :class:`GraphFacts` per graph of ``call``, each distinct forward run once.

    Args:
        call: The validated call.
        where: A context the forwards run in (the backend's warm-up context: the stream
            warm-up uses next, so lazily created per-stream state is where capture expects it).
        around_forward: Made anew around each forward (the memory plan's emulation of fused
            attention on meta tensors, say).

    Raises:
        TypeError: naming the graph whose output has a leaf that is not a tensor.
        ValueError: naming the graph whose callable writes into an input in place.
    """
    facts: list[GraphFacts] = []
    devices = [call.device] if call.device.type == "cuda" else []
    with (
        torch.random.fork_rng(devices=devices, device_type="cuda"),
        values_kept(module_buffers(call.callables)),
        where if where is not None else contextlib.nullcontext(),
    ):
        for graph, first in enumerate(call.alike):
            if first != graph:  # the same callable on a sample of the same layout
                facts.append(facts[first])
                continue
            label = call.label(graph)
            with phase_note("the probe", label, "its one forward before warm-up"):
                fn, sample = call.callable_of(graph), call.samples[graph]
                facts.append(_measure(fn, sample, label, around_forward))
    return tuple(facts)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """A key identifying ``tensor``'s storage while it is alive, and the storage's bytes."""
    try:
        storage = tensor.untyped_storage()
        return storage._cdata, storage.nbytes()
    except (NotImplementedError, RuntimeError):  # tensors without a plain storage
        return id(tensor), _nbytes(tensor)


def _bytes(storages: dict[int, int], keys: Iterable[int]) -> int:
    return sum(storages[k] for k in set(keys))


class _Packed:
    """What the pack hook hands autograd instead of a saved tensor.

    Packing the tensor itself would tie a saved *output* and its own ``grad_fn`` into a
    reference cycle (output -> node -> output), which keeps the whole graph of the forward,
    and its device memory, alive until the cycle collector runs. The holder is emptied once
    the measurement is done, which breaks every such cycle.
    """

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor


# The getter of ``Tensor.requires_grad``, as a TorchFunctionMode is handed it (a new
# method-wrapper at each lookup: compared with ``==``, which compares the descriptor).
_REQUIRES_GRAD_GET = torch.Tensor.requires_grad.__get__  # type: ignore[attr-defined]


class _RequiresGradReads(TorchFunctionMode):
    """Records which of ``watched`` (the callable's parameters) Python code reads
    ``requires_grad`` of while the mode is active.

    The attribute's getter goes through ``__torch_function__`` whenever a mode is active, for
    an ``nn.Parameter`` too (whose own ``__torch_function__`` is disabled: modes come first).
    Reads made in C++ (autograd, ``Function.apply``'s ``needs_input_grad``) do not: only what
    the callable's Python code decides by the flag is recorded. Thread-local, as the mode
    stack is.
    """

    def __init__(self, watched: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._position = {id(t): i for i, t in enumerate(watched)}
        self.read: set[int] = set()
        _skip_dynamo(type(self))

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if args and func == _REQUIRES_GRAD_GET:
            position = self._position.get(id(args[0]))
            if position is not None:
                self.read.add(position)
        return func(*args, **(kwargs or {}))


def _skip_dynamo(mode: type[_RequiresGradReads]) -> None:
    """Make ``mode.__torch_function__`` one dynamo never compiles, once, at the first probe.

    The eager ops of a compiled callable reach that method as a frame that dynamo compiles
    on its own, recompiling per arity; once that frame passed its recompile limit
    (tests/test_parity.py, test_runtime_accumulation.py then test_workflows.py in one
    process, torch 2.13) a ``.float()`` in the callable returned a ``torch.Size``. Skipped,
    the mode stays a plain Python observer. Done here rather than as a decorator because
    ``torch.compiler.disable`` imports dynamo: a second of ``import leangraph`` otherwise.
    Nor before dynamo is imported: only a compiled callable brings it (``torch.compile``
    imports it), and importing it here would be a second of every first capture.
    """
    if mode not in _UNCOMPILED and _DYNAMO in sys.modules:
        method = mode.__dict__["__torch_function__"]
        mode.__torch_function__ = torch.compiler.disable(  # type: ignore[method-assign]
            method, recursive=False
        )
        _UNCOMPILED.add(mode)


_UNCOMPILED: set[type] = set()
_DYNAMO = "torch._dynamo"


@contextlib.contextmanager
def _run_forward(
    fn: Any,
    inputs: list[Any],
    tree: pytree.TreeSpec,
    around_forward: Callable[[], AbstractContextManager[Any]],
    reads: _RequiresGradReads,
) -> Iterator[tuple[Any, list[torch.Tensor]]]:
    """Run ``fn`` once, under ``reads``; yields what it returned and the tensors autograd
    still saves.

    Saved tensors are tracked by weak reference: those of graph branches that died during the
    forward (results the callable dropped) are freed, so they neither count nor alias the
    storage keys of tensors allocated after them.
    """
    packed: list[weakref.ref[_Packed]] = []

    def pack(tensor: torch.Tensor) -> _Packed:
        holder = _Packed(tensor)
        packed.append(weakref.ref(holder))
        return holder

    def unpack(holder: _Packed) -> torch.Tensor:
        assert holder.tensor is not None, "the probe's graph is never differentiated"
        return holder.tensor

    args, kwargs = pytree.tree_unflatten(inputs, tree)
    with around_forward(), torch.autograd.graph.saved_tensors_hooks(pack, unpack), reads:
        returned = fn(*args, **kwargs)
    holders = [h for h in (ref() for ref in packed) if h is not None]
    try:
        yield returned, [h.tensor for h in holders if h.tensor is not None]
    finally:
        for holder in holders:
            holder.tensor = None


def _measure(
    fn: Any,
    sample: Sample,
    label: str,
    around_forward: Callable[[], AbstractContextManager[Any]],
) -> GraphFacts:
    """Probe one forward of ``fn`` on ``sample``; see :class:`GraphFacts`."""
    leaves, tree = pytree.tree_flatten(sample)
    call_leaves = [
        t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
        for t in leaves
    ]
    inputs = [t for t in call_leaves if isinstance(t, torch.Tensor)]
    params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    named_buffers = list(fn.named_buffers()) if isinstance(fn, torch.nn.Module) else []
    buffers = [buffer for _, buffer in named_buffers]
    before = [_InputState.of(t) for t in inputs]
    reads = _RequiresGradReads(params)
    with _run_forward(fn, call_leaves, tree, around_forward, reads) as (returned, saved_tensors):
        _refuse_input_writes(label, sample, inputs, before)
        output_leaves, output_tree = pytree.tree_flatten(returned)
        template = output_template(label, output_leaves)
        outputs = [t for t in output_leaves if isinstance(t, torch.Tensor)]
        _refuse_uncapturable_nodes(label, outputs)
        _refuse_outside_leaves(label, outputs, [*inputs, *params])
        memory = _layer_memory(inputs, params, buffers, outputs, saved_tensors)
        # Only several outputs that need a gradient can leave some without one.
        several = sum(o.requires_grad for o in outputs) > 1
        reach = _reach(outputs, [*inputs, *params]) if several else ()
        saved_outputs = _saved_outputs(outputs, saved_tensors, buffers)
        saved_params = _saved_among(params, saved_tensors)
        saved_inputs = _saved_among(inputs, saved_tensors)
        saved_buffers = tuple(named_buffers[i][0] for i in _saved_among(buffers, saved_tensors))
    named = fn.named_parameters() if isinstance(fn, torch.nn.Module) else ()
    trains = tuple(p.requires_grad for _, p in named)
    return GraphFacts(
        memory,
        output_tree,
        template,
        trains,
        reach,
        saved_outputs,
        tuple(sorted(reads.read)),
        saved_params,
        output_repeats(outputs),
        output_views(outputs, [*inputs, *params, *buffers]),
        saved_inputs,
        saved_buffers,
    )


def output_repeats(outputs: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """Per output, the position of the first output that is the same tensor object; empty
    where all are distinct (see :attr:`GraphFacts.repeats`)."""
    first: dict[int, int] = {}
    repeats = tuple(first.setdefault(id(o), i) for i, o in enumerate(outputs))
    return repeats if len(first) < len(outputs) else ()


@dataclass(frozen=True)
class OutputView:
    """Tensor output ``position`` as eager returned it: a view of tensor output ``base``
    with ``size`` and ``stride``, ``offset`` elements into the base's memory; ``detached``
    where it needs no gradient and the base does (``return y, y.detach()``)."""

    position: int
    base: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    detached: bool = False


def output_views(
    outputs: Sequence[torch.Tensor], foreign: Sequence[torch.Tensor] = ()
) -> tuple[OutputView, ...]:
    """The outputs that are views of another contiguous output of their dtype, their
    elements within its (see :attr:`GraphFacts.views`): an earlier one where there is one,
    else a later one (``return y[0], y``), which stays itself. Outputs that are the same
    tensor are repeats, not views; outputs in the memory of ``foreign`` (the inputs,
    parameters and buffers) are none's views nor bases (each comes back in a buffer of its
    own). A view that requires grad of a base that does not is left out, as is one of
    another dtype (``y.view(torch.int32)``)."""
    views: list[OutputView] = []
    bases: set[int] = set()
    outside = {t.untyped_storage()._cdata for t in foreign if _has_storage(t)}
    for position, output in enumerate(outputs):
        if position in bases:  # an earlier output's base stays itself
            continue
        if not _has_storage(output) or output.untyped_storage()._cdata in outside:
            continue
        viewed = {view.position for view in views}
        for base in (*range(position), *range(position + 1, len(outputs))):
            candidate = outputs[base]
            if candidate is output or base in viewed:
                continue
            if output.requires_grad and not candidate.requires_grad:
                continue
            offset = _offset_within(output, candidate)
            if offset is not None:
                detached = candidate.requires_grad and not output.requires_grad
                size, stride = tuple(output.shape), output.stride()
                views.append(OutputView(position, base, size, stride, offset, detached))
                bases.add(base)
                break
    return tuple(views)


def _has_storage(tensor: torch.Tensor) -> bool:
    try:
        tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested: no storage to view
        return False
    return True


def _offset_within(view: torch.Tensor, base: torch.Tensor) -> int | None:
    """Where ``view``'s elements start in the contiguous ``base``'s memory, if all of them
    lie in it; else None."""
    if not base.is_contiguous() or view.numel() == 0 or min(view.stride(), default=0) < 0:
        return None
    if view.dtype != base.dtype:  # the bits reinterpreted: offsets count other elements
        return None
    if view.untyped_storage()._cdata != base.untyped_storage()._cdata:
        return None
    offset = int(view.storage_offset() - base.storage_offset())
    last = offset + sum((n - 1) * s for n, s in zip(view.shape, view.stride()))
    return offset if offset >= 0 and last < base.numel() else None


def _reach(
    outputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
) -> tuple[frozenset[int], ...]:
    """Per output, the positions of ``targets`` (leaves) its autograd graph reaches."""
    position = {id(t): i for i, t in enumerate(targets)}
    result = []
    for output in outputs:
        reached: set[int] = set()
        returned_input = output.grad_fn is None and output.requires_grad
        if returned_input and id(output) in position:  # an input returned as is
            reached.add(position[id(output)])
        reached.update(position[id(v)] for v in _leaves_reached([output]) if id(v) in position)
        result.append(frozenset(reached))
    return tuple(result)


def _autograd_nodes(outputs: Iterable[torch.Tensor]) -> Iterator[Any]:
    """Every node of the outputs' autograd graphs, once each. The walk holds every node it
    met: a node's Python object lives only while referenced, and a freed one's ``id`` is
    soon another node's, which would end the walk early (seen on CUDA, not on CPU)."""
    met: dict[int, Any] = {}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in met:
            continue
        met[id(node)] = node
        yield node
        stack.extend(n for n, _ in node.next_functions if n is not None)


def _leaves_reached(outputs: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The leaves the outputs' autograd graphs accumulate into (their AccumulateGrad nodes')."""
    for node in _autograd_nodes(outputs):
        variable = getattr(node, "variable", None)
        if variable is not None:
            yield variable


def _saved_outputs(
    outputs: Sequence[torch.Tensor],
    saved_tensors: Sequence[torch.Tensor],
    others: Sequence[torch.Tensor],
) -> tuple[int, ...]:
    """Positions of the outputs whose storage the backward saved, those needing no gradient
    included (``max``'s indices): eager's backward refuses any of them modified in place. An
    output in an input's or parameter's memory (returned as is, or a view of one) counts:
    a CUDA graph returns that memory itself, which its backward reads. Not one in the memory
    of ``others`` (the module's buffers: their in-place updates, BatchNorm's statistics at
    every forward, are no output's to guard)."""
    saved = {_storage(t)[0] for t in saved_tensors} - {_storage(t)[0] for t in others}
    return tuple(i for i, o in enumerate(outputs) if _storage(o)[0] in saved)


def _saved_among(
    tensors: Sequence[torch.Tensor], saved_tensors: Sequence[torch.Tensor]
) -> tuple[int, ...]:
    """Positions of ``tensors`` whose memory the backward saved (a view of it, as a linear
    layer saves ``weight.t()``): bytes of their storage that a saved tensor spans too, so
    that parameters laid out in one flat buffer (Megatron-core's) are told apart."""
    saved: dict[int, list[tuple[int, int]]] = {}
    for t in saved_tensors:
        saved.setdefault(_storage(t)[0], []).append(_span(t))
    return tuple(
        i
        for i, t in enumerate(tensors)
        if any(_overlap(_span(t), span) for span in saved.get(_storage(t)[0], ()))
    )


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its storage that ``tensor`` can reach."""
    if tensor.numel() == 0:
        return (0, 0)
    size = tensor.element_size()
    reach = sum((int(n) - 1) * abs(int(s)) for n, s in zip(tensor.shape, tensor.stride())) + 1
    start = int(tensor.storage_offset()) * size
    return start, start + reach * size


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _refuse_outside_leaves(
    label: str, outputs: Sequence[torch.Tensor], known: Sequence[torch.Tensor]
) -> None:
    """Refuse outputs that differentiate a tensor neither an input nor a parameter of the
    callable (a closure tensor, a parameter of a module outside it, say a tied embedding):
    the backward graph differentiates the inputs and parameters only, so that tensor would
    get no gradient where eager's backward gives it one."""
    ids = {id(t) for t in known}
    outside = [t for t in outputs if t.requires_grad and t.grad_fn is None and id(t) not in ids]
    outside += [v for v in _leaves_reached(outputs) if id(v) not in ids]
    if not outside:
        return
    kinds = sorted(
        {
            f"{'parameter' if isinstance(t, torch.nn.Parameter) else 'tensor'} of shape "
            f"{tuple(t.shape)} ({t.dtype})"
            for t in outside
        }
    )
    raise ValueError(
        f"{label}: outputs need the gradient of {len(outside)} tensor(s) that are neither "
        f"inputs nor parameters of the callable ({', '.join(kinds)}: a closure tensor, or a "
        "parameter of a module outside it); the graphs would give them none, where eager's "
        "backward gives them one. Expected every tensor the outputs differentiate to be an "
        "input or a parameter: pass it as an argument, or graph an nn.Module that registers it"
    )


@dataclass(frozen=True)
class _InputState:
    """What tells that a forward wrote into an input: its version counter (in-place
    operators), its data pointer (``x.data = ...`` re-points the tensor) and sums of its bytes
    (writes the counter does not see: through ``x.data``, or a custom kernel writing the
    memory it is handed); ``sums`` is None where there are no bytes to read (meta, sparse)."""

    version: int
    pointer: int | None
    sums: torch.Tensor | None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _InputState:
        pointer = tensor.data_ptr() if _has_storage(tensor) else None
        return cls(tensor._version, pointer, _byte_sums(tensor))

    def written(self, tensor: torch.Tensor) -> tuple[bool, bool]:
        """Whether ``tensor`` (this state's input after a forward) was written into, and
        whether its version counter says so."""
        if tensor._version != self.version:
            return True, True
        after = _InputState.of(tensor)
        if after.pointer != self.pointer:
            return True, False
        if self.sums is None or after.sums is None:
            return False, False
        return not torch.equal(self.sums, after.sums), False


def _byte_sums(tensor: torch.Tensor) -> torch.Tensor | None:
    """Sums of ``tensor``'s bytes, as bytes and (where they make whole 4-byte words) as
    int32 words, in one tensor on its device; None for a tensor without bytes to read."""
    if (
        tensor.is_meta
        or tensor.layout is not torch.strided
        or tensor.is_quantized
        # A subclass (DTensor, an FP8 wrapper) may hold its bytes elsewhere, or none.
        or type(tensor) not in (torch.Tensor, torch.nn.Parameter)
    ):
        return None
    try:
        flat = tensor.detach().resolve_conj().resolve_neg().contiguous().view(-1)
        flat = flat.view(torch.uint8)
    except (RuntimeError, NotImplementedError, TypeError):  # a dtype with no byte view
        return None
    sums = [flat.sum(dtype=torch.int64)]
    if flat.numel() % 4 == 0:
        with contextlib.suppress(RuntimeError):  # bytes at an offset that is no multiple of 4
            sums.append(flat.view(torch.int32).sum(dtype=torch.int64))
    return torch.stack(sums)


def _refuse_input_writes(
    label: str,
    sample: Sample,
    inputs: Sequence[torch.Tensor],
    before: Sequence[_InputState],
) -> None:
    """Refuse a callable that writes into one of its inputs in place (a KV-cache update, an
    in-place activation on its argument, a write through ``.data`` or by a custom kernel): a
    replay writes into its static copy of the input, so the tensor the caller passed would
    silently keep its old values."""
    found = [state.written(t) for t, state in zip(inputs, before)]
    written = [i for i, (wrote, _) in enumerate(found) if wrote]
    if not written:
        return
    leaves = pytree.tree_leaves(sample)
    tensor_names = [
        name for name, leaf in zip(leaf_names(sample), leaves) if isinstance(leaf, torch.Tensor)
    ]
    names = ", ".join(tensor_names[i] for i in written)
    unseen = (
        ""
        if all(found[i][1] for i in written)
        else " (a write autograd's version counter does not see: through .data, or by a custom "
        "kernel writing the memory it is handed)"
    )
    raise ValueError(
        f"{label} writes into {names} in place{unseen}, but a graphed replay writes into its "
        "static copy of each input, not into the tensor the caller passes, which would keep "
        "its old values; expected a callable that leaves its inputs alone (clone an input "
        "before writing into it, or return the new values)"
    )


def _refuse_uncapturable_nodes(label: str, outputs: Sequence[torch.Tensor]) -> None:
    """Refuse, in one walk of the outputs' autograd graphs and before any warm-up, what a
    capture cannot take, rather than let torch's message surface from it:

    * ``torch.utils.checkpoint(..., use_reentrant=True)`` inside the callable: its backward
      raises under ``torch.autograd.grad``, which warm-up and capture differentiate with;
    * a call of a graphed callable (V30, as for one among the callables or as a submodule):
      the capture would record its replay, which CUDA refuses ("Cannot prepare for replay
      during capturing stage") and the CPU backend would record as kernels on that callable's
      static buffers, outside its checks. Its autograd node's class is named here, not
      imported: the probe comes before the runtime.
    """
    for node in _autograd_nodes(outputs):
        if node.name().startswith("CheckpointFunctionBackward"):
            raise ValueError(
                f"{label} runs torch.utils.checkpoint with use_reentrant=True, whose backward "
                "refuses torch.autograd.grad (which leangraph's warm-up and capture use); "
                "expected use_reentrant=False inside a graphed callable, or the checkpoint "
                "around it (docs/composition.md)"
            )
        if getattr(getattr(node, "_forward_cls", None), "__module__", None) == _REPLAY_MODULE:
            raise ValueError(
                f"{label} calls a graphed callable (a result of make_graphed_callables) in its "
                "forward: its capture would record that callable's graph replay, which a CUDA "
                "graph cannot capture; expected a forward of eager code only: graph the "
                "eager callable it replays instead, or call the graphed one outside"
            )


_REPLAY_MODULE = "leangraph.runtime.graphed"  # where the replays' autograd Function lives


def output_template(label: str, leaves: Sequence[Any]) -> LeafTemplate:
    """The template of a callable's output leaves: tensors, and constants it returns as
    they were (Megatron-core's ``(hidden, None)``).

    Raises:
        TypeError: for a leaf that is neither, or outputs without a tensor.
    """
    for index, leaf in enumerate(leaves):
        if not (isinstance(leaf, torch.Tensor) or is_constant(leaf)):
            raise TypeError(
                f"{label}: output {index} must be a tensor or a constant (None, bool, int, "
                f"float, str, ...), got {type(leaf).__name__}"
            )
    template = LeafTemplate.of(leaves)
    if template.num_tensors == 0:
        raise TypeError(f"{label}: outputs hold no tensor; a graph must return at least one")
    return template


def _layer_memory(
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    saved_tensors: Sequence[torch.Tensor],
) -> LayerMemory:
    everything = [*saved_tensors, *inputs, *params, *buffers, *outputs]
    storages = dict(_storage(t) for t in everything)
    saved = {_storage(t)[0] for t in saved_tensors}
    fixed = {_storage(t)[0] for t in (*params, *buffers)}
    input_keys = {_storage(t)[0] for t in inputs} - fixed
    kept_keys = {_storage(t)[0] for t in outputs if t.requires_grad} - fixed - input_keys
    activations = saved - fixed - input_keys
    return LayerMemory(
        activation_bytes=_bytes(storages, activations),
        saved_input_bytes=_bytes(storages, saved & input_keys),
        output_bytes=_bytes(storages, kept_keys),
        # Without a differentiable output there is no backward: nothing outlives the forward.
        in_flight_bytes=_bytes(storages, activations | kept_keys) if kept_keys else 0,
        grad_input_bytes=sum(_nbytes(t) for t in inputs if t.requires_grad),
        param_grad_bytes=sum(_nbytes(p) for p in params if p.requires_grad),
        inputs=tuple(BufferKey.of(t, keep_layout=True) for t in inputs),
        # An output's layout too: its gradient seed is allocated by this key, and eager's
        # backward reads the incoming gradient in the output's layout (a transposed one, as
        # LAPACK returns, picks other GEMM paths than a contiguous copy's: other last bits).
        outputs=tuple(BufferKey.of(t, keep_layout=True) for t in outputs),
    )
