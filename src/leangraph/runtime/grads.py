"""Gradient routing: what a backward replay hands autograd, buffer or copy, per gradient.

A backward graph writes its gradients into static buffers that later replays overwrite.
Autograd may *store* some of them (a leaf input's ``.grad``, or a parameter's ``.grad`` while
it is None), hold them while it waits for other branches, or hand them to code outside the
graphs; those get copies. The rest are tensors made once over the static buffers (a chained
layer's input's, a parameter's, or a leaf input's whose ``.grad`` exists), not views made per
replay, which cost a call per gradient per replay; they are safe to hand, since autograd
adds into a gradient it was handed only where it holds the sole reference to the tensor and
its memory, and leangraph holds one.

A parameter's gradient lent so (a tensor made once over the buffer) is safe while autograd
adds it into ``.grad`` before the next replay writes graph memory, as it does at once unless
eager code in the same backward pass reaches the parameter too (a weight tied to an eager
module used before the graphed layers): autograd then waits for that gradient, and the
graphs replayed meanwhile may write over the buffer, whose memory later graphs share. So
every replay first settles what the previous backward replays lent
(:func:`settle_lent_gradients`): where autograd still holds the lent tensor (its count of
C++ references is above the routing's one), that tensor is moved onto a copy of its values
(autograd adds the copy), and the routing lends a new tensor over the buffer from then on.
Leangraph cannot see the eager use; this sees its effect, one C-level read of each lent
tensor's count per backward replay. A leaf input's lent gradient is settled the same way
(eager code may take the input too: ``2 * x`` beside the graphed ``layer(x)``). What keeps a
lent tensor from Python shares the routing's count of C++ references, so its count of
Python references is read too: a hook on its accumulator storing the gradient it sees holds
it so, and it is moved onto a copy the same way, before a replay can write over it. So is
a chained layer's input gradient, the previous layer's seed, once that layer's backward
replay has read it: a tensor hook on the previous layer's output may have stored it, or
``torch.autograd.grad`` returned it (``settle_lent_gradients``' ``reading``).
(``torch.autograd.grad`` with respect to a parameter, whose caller keeps what it returns,
gets copies: :func:`returns_gradients`.)
"""

from __future__ import annotations

import itertools
import operator
import sys
import types
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..build.accumulation import TENSOR_HOOKS
from ..build.record import GraphRecord
from .pending import PendingBackwards

__all__ = [
    "NO_LEAVES",
    "GradRouting",
    "accumulating_leaves",
    "keep_apart",
    "returns_gradients",
    "settle_lent_gradients",
    "trained_elsewhere_in_pass",
]

NO_LEAVES: Mapping[int, torch.Tensor] = types.MappingProxyType({})
"""No input's gradient accumulating into a leaf's ``.grad`` (``accumulating`` left out)."""


class GradRouting:
    """The gradients of one graph's backward replay, in ``_Replay.apply``'s argument order.

    A gradient autograd may store (a leaf input's ``.grad``, or a parameter whose ``.grad`` is
    still None, which autograd would take over), or a tensor hook on the parameter may keep, is
    copied, so no stored gradient aliases a buffer that a later replay overwrites. A
    parameter that already has a ``.grad`` (and no tensor hook) gets a tensor over the
    buffer: autograd adds it into that ``.grad`` right away, unless another graph training
    the same parameter still has to run in this backward pass (several microbatches, or tied
    weights, differentiated together): autograd then waits for that graph's gradient too,
    whose replay may overwrite this buffer first, so it gets a copy; so it does where the
    pass returns it (``torch.autograd.grad``: :func:`returns_gradients`). Where a hook on
    the accumulator kept the lent tensor, the next replay moves it onto a copy first
    (:func:`settle_lent_gradients`). An input's
    gradient is copied too, except input 0's of a chain (``record.input_grad_lent``: the
    previous layer's seed, which that layer's backward replay reads in place; lent, and
    settled once that replay has read it) and a leaf's
    that autograd adds into its existing ``.grad`` (:func:`accumulating_leaves`), lent as a
    parameter's is. Any other node it flows to may keep it past the next replay:
    ``AccumulateGrad`` takes a view of it as a leaf's ``.grad`` (a parameter reaching the
    graph through ``view`` or ``x + p``), ``torch.autograd.grad`` returns it, a tensor hook
    stores it, a node waits for more gradients (an input several graphs take, GPipe's summed
    losses).
    """

    def __init__(self, record: GraphRecord, pending: PendingBackwards) -> None:
        delivers = record.delivers_param_grads()
        grads = iter(record.static_grads)  # empty for a graph without a backward
        inputs = tuple(
            next(grads, None) if s.requires_grad else None for s in record.signature.specs
        )
        params = (
            tuple(next(grads, None) if trains else None for trains in record.param_trains)
            if delivers
            else ()
        )
        # Per tensor passed to the replay that gets a gradient: its static gradient, or None;
        # a parameter's as a tensor of its own over the buffer, which autograd may hold
        # past the next replay (settle_lent_gradients moves that one onto a copy).
        # Every input's gradient but a chain's (see the class docstring): copied, unless the
        # replay finds it goes straight into a leaf's .grad (``accumulating``).
        lent = record.input_grad_lent
        self._inputs_copied = tuple(
            i for i, g in enumerate(inputs) if g is not None and not (i == 0 and lent)
        )
        self._buffers = inputs + params
        # Every gradient a tensor of its own over its buffer, made once, as a lent one must
        # be (settle_lent_gradients moves it, never the buffer, onto a copy). A chain's is
        # lent to the previous layer, whose backward replay reads it in place as its seed.
        self._grads = tuple(None if g is None else g.detach() for g in inputs) + tuple(
            None if g is None else g.detach() for g in params
        )
        self._chain_lent = bool(lent) and inputs[0] is not None
        self._params_with_grad = tuple(
            (len(inputs) + j, param)
            for j, (param, grad) in enumerate(zip(record.params, params))
            if grad is not None
        )
        self._peers = record.sharing.peers
        # Shared parameters matter only where this replay hands their gradients to autograd.
        self._shared_param_ids = record.sharing.shared_param_ids if delivers else frozenset()
        self._pending = pending
        # Parameters graphs of another live call train too (the same layers graphed twice,
        # a weight tied across calls): their peers are not this call's, so whenever such a
        # parameter's gradient is handed, it is a copy (see _CallsTraining).
        _TRAINING.add(record.trained_params(), pending)
        self._delivered = tuple(p for _, p in self._params_with_grad)
        self._lent_positions = tuple(i for i, _ in self._params_with_grad)
        self._seen_version = -1
        self._other_calls_ids: frozenset[int] = frozenset()

    @property
    def inputs_copied(self) -> tuple[int, ...]:
        """The positions of the inputs whose gradients are copied, unless a replay finds
        them accumulating into a leaf's ``.grad`` (:func:`accumulating_leaves`)."""
        return self._inputs_copied

    @property
    def lent_params(self) -> tuple[int, ...]:
        """The positions of the parameters whose gradients are lent, unless a replay finds
        the backward pass returning them (:func:`returns_gradients`)."""
        return self._lent_positions

    def scatter(
        self, accumulating: Mapping[int, torch.Tensor] = NO_LEAVES, *, returned: bool = False
    ) -> tuple[torch.Tensor | None, ...]:
        """One gradient per tensor passed to the replay (inputs, then parameters); lent, not
        copied, for the inputs at the positions of ``accumulating``; every parameter's copied
        where ``returned`` (:meth:`hand`)."""
        grads = self._grads
        copy_at = (
            [i for i in self._inputs_copied if i not in accumulating]
            if accumulating
            else list(self._inputs_copied)
        )
        if returned:
            copy_at += self._lent_positions
            return _with_copies(grads, copy_at)
        if _TRAINING.version != self._seen_version:
            self._seen_version = _TRAINING.version
            self._other_calls_ids = _TRAINING.by_other_calls(self._delivered, self._pending)
        shared = self._other_calls_ids
        if self._shared_param_ids and self._pending.reached_now(self._peers):
            shared = shared | self._shared_param_ids
        # A tensor hook on a parameter (register_hook) sees the gradient handed and may keep
        # it, as eager's hooks may keep the fresh gradient they see: a copy too.
        if shared:
            copy_at += [
                i
                for i, p in self._params_with_grad
                if p.grad is None or id(p) in shared or TENSOR_HOOKS(p)
            ]
        else:
            copy_at += [i for i, p in self._params_with_grad if p.grad is None or TENSOR_HOOKS(p)]
        return _with_copies(grads, copy_at)

    def hand(
        self,
        reached: frozenset[int] | None,
        accumulating: Mapping[int, torch.Tensor] = NO_LEAVES,
        *,
        returned: bool = False,
    ) -> tuple[torch.Tensor | None, ...]:
        """What the backward replay hands autograd: :meth:`scatter`'s gradients, None
        outside ``reached`` where given (:meth:`without_unreached`), the lent ones noted
        (:meth:`lend`).

        ``accumulating``: per input position, the leaf input whose ``.grad`` autograd adds
        that input's gradient into in place, right away (:func:`accumulating_leaves`); that
        gradient is lent as a parameter's is, not copied, and settled the same way.
        ``returned``: the backward pass returns the parameters' gradients to its caller
        (:func:`returns_gradients`): each is a copy."""
        handed = self.scatter(accumulating, returned=returned)
        if reached is not None:
            handed = self.without_unreached(handed, reached)
        self.lend(handed, accumulating)
        return handed

    def without_unreached(
        self, handed: tuple[torch.Tensor | None, ...], reached: frozenset[int]
    ) -> tuple[torch.Tensor | None, ...]:
        """``handed`` with None for every input and parameter outside ``reached`` (the
        positions the outputs with a gradient reach, ``GraphRecord.reached_by``): eager's
        backward gives them none, not zeros."""
        return tuple(g if i in reached else None for i, g in enumerate(handed))

    def lend(
        self,
        handed: tuple[torch.Tensor | None, ...],
        accumulating: Mapping[int, torch.Tensor] = NO_LEAVES,
    ) -> None:
        """Note the gradients of ``handed`` (what the replay returns to autograd) that are
        lent tensors over the static buffers, not copies, for the next
        :func:`settle_lent_gradients`: the parameters', and the inputs' of ``accumulating``."""
        grads = self._grads
        if handed is grads:  # the usual case: every parameter's, none copied or left out
            positions = self._lent_positions
        else:
            positions = tuple(i for i, _ in self._params_with_grad if handed[i] is grads[i])
        if accumulating:
            positions += tuple(i for i in accumulating if handed[i] is grads[i])
        if positions:
            _LENT.append((self, positions))
        if self._chain_lent and handed[0] is grads[0]:
            _CHAIN_LENT.append(self)

    def _settle(self, positions: tuple[int, ...]) -> None:
        """Move the lent tensors at ``positions`` that something besides the routing still
        holds onto copies (see the module docstring); the routing lends new tensors over
        those buffers from then on."""
        moved = _held_elsewhere(self._grads, positions)
        if not moved:
            return
        grads = list(self._grads)
        lent: list[Any] = [grads[position] for position in moved]
        for position in moved:
            buffer = self._buffers[position]
            assert buffer is not None
            grads[position] = buffer.detach()
        self._grads = tuple(grads)  # first: a scatter from now on hands the new tensors
        for tensor, copy in zip(lent, copies(lent)):
            tensor.data = copy  # whoever holds this tensor now holds the copy


# What backward replays lent autograd since the last settle: (routing, positions of its
# lent tensors). Process-wide: graphs of any call may share memory through a pool. Appended
# and popped whole (atomic under the GIL).
_LENT: list[tuple[GradRouting, tuple[int, ...]]] = []
# The routings whose chained input gradient (input 0's, the previous layer's seed, read in
# place) is lent, kept apart from _LENT: autograd holds one until that layer's backward replay
# takes it, which must not count as held elsewhere there (see settle_lent_gradients).
_CHAIN_LENT: list[GradRouting] = []
_CHAIN_INPUT: tuple[int, ...] = (0,)
# A tensor's count of references from C++ (autograd's, a .grad's, a view's base), which the
# Python objects referring to it share one of; without it (a torch lacking it), 2: held.
_USE_COUNT = getattr(torch.Tensor, "_use_count", lambda tensor: 2)
_ONES = itertools.repeat(1)
_PYTHON_REFS = sys.getrefcount
# A tensor's count of Python references as settle_lent_gradients reads it (through the same
# maps) where a routing's tuple alone holds it: read once, as this interpreter counts them.
_ALONE: int = next(map(_PYTHON_REFS, map((torch.empty(0),).__getitem__, (0,))))
_ALONES = itertools.repeat(_ALONE)
_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
# Whether the running backward pass executes a node (torch >= 1.13); without it, nothing
# is taken as executed, so every input's gradient is copied as before.
_WILL_EXECUTE = getattr(torch._C, "_will_engine_execute_node", lambda node: False)


def accumulating_leaves(
    edges: Sequence[Any], positions: Iterable[int]
) -> Mapping[int, torch.Tensor]:
    """Called from a backward replay's autograd node (with grad mode off; ``edges``: its
    ``next_functions``, one per tensor passed to the replay, inputs first): of the inputs
    at ``positions``, each that is a leaf whose ``AccumulateGrad`` this backward pass runs,
    with a ``.grad`` already and no tensor hook, by position. Autograd adds such an input's
    gradient into its ``.grad`` in place and keeps nothing (the routing's reference keeps
    it from taking the tensor over), so the gradient may be lent instead of copied, as a
    parameter's is. Not so under ``torch.autograd.grad``, which runs no accumulator of a
    leaf but returns the gradient (``_will_engine_execute_node`` raises for one then); a
    tensor hook may keep what it sees."""
    found: dict[int, torch.Tensor] = {}
    for position in positions:
        accumulator = edges[position][0]
        if type(accumulator) is not _ACCUMULATE_GRAD:  # a non-leaf's node, or no gradient
            continue
        leaf = accumulator.variable
        if leaf.grad is None or TENSOR_HOOKS(leaf):
            continue
        try:
            if not _WILL_EXECUTE(accumulator):
                continue
        except RuntimeError:  # torch.autograd.grad: it returns the gradient
            continue
        found[position] = leaf
    return found


def keep_apart(lent: list[torch.Tensor]) -> None:
    """Once the backward pass that was handed ``lent`` (tensors over graph buffers, which
    only this list holds besides autograd) has finished: move each that something still
    holds (a hook stored it) onto a copy, before a replay writes over its buffer."""
    moved = _held_elsewhere(lent, range(len(lent)))
    if not moved:
        return
    for position, copy in zip(moved, copies([lent[i] for i in moved])):
        lent[position].data = copy  # whoever holds the tensor now holds the copy


def _with_copies(
    grads: tuple[torch.Tensor | None, ...], copy_at: list[int]
) -> tuple[torch.Tensor | None, ...]:
    """``grads`` with a copy at each position of ``copy_at`` (itself where there is none)."""
    if not copy_at:
        return grads
    handed = list(grads)
    for index, copy in zip(copy_at, copies([grads[i] for i in copy_at])):
        handed[index] = copy
    return tuple(handed)


def returns_gradients(edges: Sequence[Any], positions: Sequence[int]) -> bool:
    """Called from a backward replay's autograd node (``edges``: its ``next_functions``):
    whether the running backward pass returns the gradients of the parameters at
    ``positions`` rather than accumulating them: ``torch.autograd.grad`` runs no
    accumulator (asked of a parameter it returns the gradient of,
    ``_will_engine_execute_node`` raises). Its caller
    keeps what it returns (a ``.detach()`` of it, say, which no count of the lent tensor's
    references sees), so they are copies. One accumulator tells: a plain backward runs
    every one (``backward(inputs=...)`` leaving the first out copies the rest needlessly)."""
    for position in positions:
        accumulator = edges[position][0]
        if type(accumulator) is _ACCUMULATE_GRAD:
            try:
                return not _WILL_EXECUTE(accumulator)
            except RuntimeError:  # torch.autograd.grad, returning this one's gradient
                return True
    return False


def _held_elsewhere(grads: Sequence[torch.Tensor | None], positions: Iterable[int]) -> list[int]:
    """The ``positions`` of ``grads`` (lent tensors, in a tuple or list that nothing else
    refers to them from) that something besides it holds: from C++ (autograd, waiting to
    add it; Python references share one count; without the count, taken as held), or from
    Python (a hook stored it). One autograd added, or dropped unread, is held by none."""
    positions = tuple(positions)
    uses = map(_USE_COUNT, map(grads.__getitem__, positions))
    refs = map(_PYTHON_REFS, map(grads.__getitem__, positions))  # the form _ALONE was read in
    return [
        position for position, use, ref in zip(positions, uses, refs) if use > 1 or ref > _ALONE
    ]


def settle_lent_gradients(reading: Sequence[torch.Tensor | None] = ()) -> None:
    """Before a replay writes graph memory: every gradient a backward replay lent autograd as
    a tensor over its static buffer that autograd still holds (waiting for a gradient from
    eager code reaching the parameter in the same pass) is moved onto a copy, so that the
    replay cannot write over it (see the module docstring).

    A chained layer's input gradient is lent to the previous layer as its seed; a tensor
    hook on that layer's output may store it, or ``torch.autograd.grad`` return it, where
    eager's would be a fresh tensor. Its settling waits for the previous layer's backward
    replay, which passes the gradients it was handed as ``reading``: autograd holds those
    until that replay has read them, so they are settled at the replay after it, when only
    what kept them (the hook, the caller) holds them still."""
    taken = _settle_chained(reading) if _CHAIN_LENT else ()
    while _LENT:
        routing, positions = _LENT.pop()
        grads = routing._grads
        # The usual case, in C-level loops: autograd added every one (or dropped it unread),
        # and nothing in Python kept one.
        if any(map(operator.lt, _ONES, map(_USE_COUNT, map(grads.__getitem__, positions)))) or any(
            map(operator.lt, _ALONES, map(_PYTHON_REFS, map(grads.__getitem__, positions)))
        ):
            routing._settle(positions)
    _LENT.extend(taken)  # for the next settle, once the replay reading them has read them


def _settle_chained(
    reading: Sequence[torch.Tensor | None],
) -> list[tuple[GradRouting, tuple[int, ...]]]:
    """Settle the lent chained input gradients but those in ``reading`` (the seeds the running
    backward replay is handed), which it returns: they wait for the next settle."""
    taken = []
    while _CHAIN_LENT:
        routing = _CHAIN_LENT.pop()
        # (No local name for the lent tensor: _settle counts its references.)
        if any(map(operator.is_, reading, itertools.repeat(routing._grads[0]))):
            taken.append((routing, _CHAIN_INPUT))
        else:
            routing._settle(_CHAIN_INPUT)  # the previous layer's replay did not take it
    return taken


def trained_elsewhere_in_pass(record: GraphRecord, pending: PendingBackwards) -> frozenset[int]:
    """The ids of ``record``'s trained parameters whose accumulator another graph may hand a
    gradient in the running backward pass (called from the graph's backward replay): one
    another live call trains (it cannot tell when that call's graphs run), or one a peer graph
    of this call trains whose backward ran in this pass already or is still to come in it."""
    elsewhere = _TRAINING.by_other_calls(record.trained_params(), pending)
    peers = record.sharing.peers
    if peers and (pending.ran_in_this_pass(peers) or pending.reached_now(peers)):
        elsewhere |= record.sharing.shared_param_ids
    return elsewhere


class _CallsTraining:
    """Per parameter, the live ``make_graphed_callables`` calls (their
    :class:`PendingBackwards`, one per call) whose graphs train it.

    A parameter's gradient handed as the static buffer is safe only while autograd adds it at
    once. With another call's graph also training it in the same backward pass, autograd
    waits for that contribution too, and meanwhile this call's later backward replays may
    reuse the buffer's pool memory: the gradient would be silently wrong. Calls do not know
    each other, so this registry, process-wide, is what tells them; ``version`` changes
    whenever a parameter gets a second live call, so a replay checks one integer on its way.
    A call that is gone drops out (weakly held); one only reset still counts, which costs
    copies, never correctness.
    """

    def __init__(self) -> None:
        self._calls: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.version = 0

    def add(self, params: Iterable[torch.Tensor], call: PendingBackwards) -> None:
        for param in params:
            calls = self._calls.get(param)
            if calls is None:
                calls = self._calls[param] = weakref.WeakSet()
            if call not in calls:
                calls.add(call)
                if len(calls) > 1:
                    self.version += 1

    def by_other_calls(
        self, params: Iterable[torch.Tensor], call: PendingBackwards
    ) -> frozenset[int]:
        """The ids of ``params`` that graphs of a live call other than ``call`` train."""
        return frozenset(
            id(p) for p in params if any(c is not call for c in self._calls.get(p, ()))
        )


_TRAINING = _CallsTraining()


def copies(tensors: list[Any]) -> list[torch.Tensor]:
    """Fresh copies of ``tensors``; on CUDA in a few fused kernels instead of one per tensor
    (a layer's first backward of a step copies every parameter's gradient). Multiplying by
    one is exact for every value, signed zeros and infinities included."""
    if len(tensors) == 1:
        return [tensors[0].clone()]
    return list(torch._foreach_mul(tensors, 1.0))
