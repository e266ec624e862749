"""The result of one ``make_graphed_callables`` call: its callables, its record, its pool.

A :class:`GraphedSet` is made once per call. It owns what the call's graphs share (the
capture record and the memory pool's handle) and knows the call's graphed callables without
keeping them alive: the returned callables and modules do that, and each graphed callable
keeps its set (``GraphedCallable.graphed_set``), so the set is reachable from every form
``make_graphed_callables`` returns. :func:`reset_all` and :func:`memory_report` go through
it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from .report import CallableMemory, CaptureRecord, MemoryReport

__all__ = ["GraphedSet", "is_graphed", "memory_report", "reset_all"]


class _Member(Protocol):
    """What the set needs of a graphed callable."""

    @property
    def label(self) -> str: ...

    @property
    def is_reset(self) -> bool: ...

    def reset(self) -> None: ...

    def static_tensors(self) -> list[torch.Tensor]: ...


class GraphedSet:
    """The graphed callables of one call, the capture record and the pool they share.

    Memory aliasing: the set holds no static buffer itself; its callables' outputs alias
    graph-owned memory as each callable's docstring says. ``pool`` is the graph memory pool's
    handle, valid for sharing (``make_graphed_callables(..., pool=...)``) until every
    callable is reset.
    """

    def __init__(self, record: CaptureRecord, *, single: bool) -> None:
        self._record = record
        self._single = single
        self._entries: tuple[weakref.ref[Any], ...] = ()
        self._members: tuple[weakref.ref[_Member], ...] = ()

    def adopt(self, entries: Sequence[Any], members: Sequence[_Member]) -> None:
        """Take the returned entries (callables or modules) and their graphed callables, once,
        when the call hands them back."""
        if self._entries:
            raise RuntimeError("a GraphedSet adopts its callables once")
        self._entries = tuple(weakref.ref(e) for e in entries)
        self._members = tuple(weakref.ref(m) for m in members)

    @property
    def record(self) -> CaptureRecord:
        """What the call measured (timings, memory peaks, the timeline)."""
        return self._record

    @property
    def pool(self) -> Any:
        """The graph memory pool's handle (None on the CPU backend)."""
        return self._record.pool

    @property
    def callables(self) -> tuple[Any, ...]:
        """The graphed callables still alive, by graph index."""
        return tuple(m for m in (ref() for ref in self._members) if m is not None)

    def returned(self) -> Any:
        """The call's result in torch's form: one entry alone for a single callable, else a
        tuple (modules for modules graphed without an order, graphed callables otherwise).

        Raises:
            RuntimeError: if an entry no longer exists (nothing kept the result alive).
        """
        entries = [ref() for ref in self._entries]
        if any(entry is None for entry in entries):
            raise RuntimeError("the result of this call was dropped; nothing kept it alive")
        return entries[0] if self._single else tuple(entries)

    def reset(self) -> None:
        """Reset every graphed callable of the call (idempotent, like each ``reset()``)."""
        for member in self.callables:
            member.reset()

    def memory_report(self) -> MemoryReport:
        """The memory report of every graphed callable of the call."""
        return _report(self._record, self.callables)

    def __repr__(self) -> str:
        count = len(self.callables)
        return f"<GraphedSet of {count} graphed callables on {self._record.device}>"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"{self!r}: a GraphedSet cannot be copied or pickled (it owns one capture's record "
            "and pool, and its graphed callables cannot be copied either); copy the modules "
            "before graphing them, and save a model holding graphed modules (torch.save) by "
            "its state_dict()"
        )

    @staticmethod
    def members_of(result: Any, caller: str) -> list[Any]:
        """The graphed callables of ``result``: a :class:`GraphedSet`, a graphed callable, a
        module whose ``forward`` is one, or a tuple or list of those.

        Raises:
            TypeError: naming ``caller`` and the first entry that is none of these.
        """
        if isinstance(result, GraphedSet):
            return list(result.callables)
        items = result if isinstance(result, (tuple, list)) else (result,)
        for index, item in enumerate(items):
            if isinstance(item, (GraphedSet, tuple, list)):
                raise TypeError(
                    f"{caller}: entry {index} is a {type(item).__name__}, a result of its own; "
                    "pass the result of one make_graphed_callables call (or its GraphedSet), "
                    "not a list of results (reset_all takes several)"
                )
        return [_member(item, caller, f"entry {index}") for index, item in enumerate(items)]

    @classmethod
    def of(cls, result: Any) -> GraphedSet:
        """The set ``result`` (any form ``make_graphed_callables`` returns) came from.

        Raises:
            TypeError: for anything else, or entries of several calls.
        """
        return _one_set(cls.members_of(result, "GraphedSet.of"), "GraphedSet.of")


def reset_all(graphed: Any) -> None:
    """Reset every graphed callable of ``make_graphed_callables`` results.

    Accepts what ``make_graphed_callables`` returned: a :class:`GraphedCallable`, a module
    whose ``forward`` is one, or a tuple of those, or the call's :class:`GraphedSet`; or
    lists and tuples of any of these, nested (the results of several calls, one per chunk
    say). Every entry is checked before any is reset. Idempotent, like each ``reset()``.

    Memory aliasing: outputs of earlier replays that are still referenced keep their buffers'
    memory, which goes back to the pool once they are dropped; nothing replays into it again.
    Modules keep their graphed ``forward``, which raises :class:`GraphResetError` from then on.

    Raises:
        TypeError: for anything that is not such a result.
    """
    if isinstance(graphed, (tuple, list)):
        members = list(_nested_members(graphed, "reset_all", "entry "))
    else:
        members = GraphedSet.members_of(graphed, "reset_all")
    for member in members:
        member.reset()


def is_graphed(obj: Any) -> bool:
    """Whether ``obj`` is a graphed callable of a ``make_graphed_callables`` result, or a
    module whose ``forward`` is one (reset or not)."""
    if isinstance(obj, torch.nn.Module):
        obj = obj.__dict__.get("forward")
    return isinstance(getattr(obj, "graphed_set", None), GraphedSet)


def _member(item: Any, caller: str, where: str) -> Any:
    """The graphed callable ``item`` is or holds as its ``forward``.

    Raises:
        TypeError: naming ``caller`` and ``where`` (``entry 1``) for anything else.
    """
    if not is_graphed(item):
        raise TypeError(
            f"{caller}: {where} is a {type(item).__name__}, expected a "
            "GraphedCallable or a module whose forward was graphed by leangraph (it is "
            "not a result of leangraph.make_graphed_callables)"
        )
    return item.__dict__["forward"] if isinstance(item, torch.nn.Module) else item


def _nested_members(items: Sequence[Any], caller: str, prefix: str) -> Iterable[Any]:
    """The graphed callables of a list or tuple of results, sets and callables, nested; an
    entry is named by its path (``entry 1[0]``)."""
    for index, item in enumerate(items):
        where = f"{prefix}{index}" if prefix.endswith(" ") else f"{prefix}[{index}]"
        if isinstance(item, GraphedSet):
            yield from item.callables
        elif isinstance(item, (tuple, list)):
            yield from _nested_members(item, caller, where)
        else:
            yield _member(item, caller, where)


def memory_report(graphed: Any) -> MemoryReport:
    """The memory report of one ``make_graphed_callables`` result.

    Args:
        graphed: What ``make_graphed_callables`` returned (a callable, a module, or a tuple),
            or its :class:`GraphedSet`.

    Raises:
        TypeError: for anything else.
    """
    if isinstance(graphed, GraphedSet):
        return graphed.memory_report()
    members = GraphedSet.members_of(graphed, "memory_report")
    return _report(_one_set(members, "memory_report").record, members)


def _one_set(members: Sequence[Any], caller: str) -> GraphedSet:
    """The one set ``members`` come from.

    Raises:
        TypeError: for no members, or members of several calls.
    """
    sets = {id(m.graphed_set): m.graphed_set for m in members}
    if len(sets) != 1:
        raise TypeError(
            f"{caller}: the entries come from {len(sets)} make_graphed_callables calls; pass "
            "the result of one call"
        )
    return next(iter(sets.values()))


def _report(record: CaptureRecord, members: Iterable[_Member]) -> MemoryReport:
    every: dict[int, int] = {}
    rows = []
    for member in members:
        held = _storage_bytes(member.static_tensors())
        every.update(held)
        rows.append(CallableMemory(member.label, sum(held.values()), member.is_reset))
    reserved, allocated = _pool_bytes(record)
    return MemoryReport(
        record, tuple(rows), sum(every.values()), reserved, allocated, record.timeline
    )


def _pool_bytes(record: CaptureRecord) -> tuple[int | None, int | None]:
    if not record.device.startswith("cuda") or record.pool is None:
        return None, None
    reserved = allocated = 0
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", ())) == tuple(record.pool):
            reserved += segment["total_size"]
            allocated += segment["allocated_size"]
    return reserved, allocated


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
