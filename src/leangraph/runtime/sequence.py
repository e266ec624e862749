"""Replay order: graphs captured into one pool replay safely only in the order of capture.

Capture hands a block that one graph freed (its saved activations, once its backward was
recorded) to graphs recorded after it. Replayed in another order, a later graph's forward can
overwrite activations an earlier graph's backward still reads, silently on CUDA. One
:class:`ReplaySequence` per call holds the capture order and checks every forward, backward
and weight-step replay against it, on every backend.

A step that can no longer come is passed over: the backward (and weight step) of a forward
replayed without anything requiring grad, or whose outputs were dropped before their
backward, every step of a graph that was reset, and, for one pass, every step of a graph
whose module ran its eager forward instead (a drop-in module called in another training
mode) where its forward was due. A graph captured with
``retain_graph_in_backward`` may repeat the forward or backward it just ran. A pass may start
over from its first step once nothing is in flight (no backward or weight step can still
come): a pass abandoned midway, by an exception say, leaves nothing a new pass could clobber.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from ..order import StepKind

__all__ = ["ReplaySequence"]

_WHAT = {StepKind.FORWARD: "forward", StepKind.BACKWARD: "backward", StepKind.WEIGHT: "weight step"}


class ReplaySequence:
    """The capture order of one call's graph replays, and where the replays are in it.

    Args:
        steps: ``(graph, kind)`` of every replay one pass runs, in capture order.
        labels: How errors name each graph, by graph index.
        awaits: ``awaits(graph)`` says whether a backward through the graph's latest forward
            replay may still come (its outputs are alive).
    """

    def __init__(
        self,
        steps: Sequence[tuple[int, StepKind]],
        labels: Sequence[str],
        awaits: Callable[[int], bool],
    ) -> None:
        self._steps = tuple(steps)
        self._labels = tuple(labels)
        self._awaits = awaits
        self._next = 0
        self._last: tuple[int, StepKind] | None = None
        self._no_backward: set[int] = set()  # graphs whose backward side will not come
        self._dropped: set[int] = set()  # graphs that were reset
        self._in_flight: set[int] = set()  # forward replayed, backward side not finished
        self._weight_due: set[int] = set()  # backward replayed, weight step to come
        last = {g: k for g, k in self._steps if k is not StepKind.FORWARD}
        self._last_kind = last  # per graph with a backward: the kind of its final step
        self._lock = threading.Lock()
        # Graphs reset but not yet marked dropped: see drop().
        self._drops: deque[int] = deque()

    def expect(self, graph: int, kind: StepKind, *, may_repeat: bool = False) -> None:
        """Check that the replay of ``kind`` of ``graph`` is the next one, and move past it.

        ``may_repeat``: the replay may come again right after itself (a graph captured with
        ``retain_graph_in_backward``: its forward may replay with a backward outstanding,
        and its backward more than once).

        Raises:
            RuntimeError: naming the replay expected and the one attempted.
        """
        step = (graph, kind)
        with self._lock:
            if self._drops:
                self._apply_drops()
            if may_repeat and self._last == step:
                return
            if self._steps[self._next] == step and (
                kind is StepKind.FORWARD or graph not in self._no_backward
            ):
                # The common replay: the expected one (nothing before it to pass over).
                self._advance()
                return
            self._pass_over_what_cannot_come()
            expected = self._steps[self._next]
            if expected != (graph, kind) and self._may_drain(graph, kind):
                self._finish_step(graph, kind)
                return
            if expected != (graph, kind) and self._may_start_over(graph, kind):
                self._next = 0
                expected = self._steps[0]
            if expected != (graph, kind):
                raise RuntimeError(
                    f"{self._labels[graph]}: {_WHAT[kind]} replayed out of capture order; the "
                    f"next replay must be the {_WHAT[expected[1]]} of {self._labels[expected[0]]}. "
                    "Graphs that share a memory pool are safe only replayed in the order they "
                    "were captured in (the order you gave, or torch's: forwards in order, then "
                    f"backwards in reverse){self._hint(graph, kind, expected, may_repeat)}"
                )
            self._advance()

    def _hint(
        self, graph: int, kind: StepKind, expected: tuple[int, StepKind], may_repeat: bool
    ) -> str:
        """What most likely went wrong, for the usual ways out of order (error path)."""
        if may_repeat and kind is StepKind.BACKWARD and graph not in self._in_flight:
            # A second backward pass through several graphs (loss.backward(retain_graph=True),
            # then loss.backward()): the graphs captured after this one's backward may reuse
            # the saved activations it reads, so only a repeat right after itself is safe.
            return (
                "; retain_graph_in_backward lets a backward replay again only right after "
                "itself, not after the backwards of other graphs: those were captured later "
                "and may reuse the activations it reads. For a second backward pass through "
                "several graphs, replay their forwards again"
            )
        if (graph, kind) == self._steps[0] and self._weight_due:
            # A new pass after one abandoned midway (an exception, say): the weight steps of
            # backwards that ran still hold their activations, which the new pass would
            # overwrite; the expected step above is the abandoned pass's next one.
            due = [self._labels[g] for g in self._due_weight_graphs()]
            steps = "step of" if len(due) == 1 else "steps of"
            which = "it" if len(due) == 1 else "them, in this order,"
            return (
                f"; a new pass cannot start while the weight {steps} {', '.join(due)} "
                f"{'is' if len(due) == 1 else 'are'} due (the backward ran, and the weight "
                "step reads activations the new pass would overwrite): call backward_dw() on "
                f"{which} first, or finish the pass"
            )
        if kind is StepKind.WEIGHT and graph in self._weight_due:
            return (
                "; a weight step (backward_dw()) runs where the order has its -(c + 0.5) "
                "entry, not earlier"
            )
        if kind is not StepKind.FORWARD and expected[1] is StepKind.FORWARD:
            return (
                "; every pass runs every step of the order, for all the microbatches it was "
                "captured with"
            )
        both_backwards = kind is expected[1] is StepKind.BACKWARD
        if both_backwards and graph in self._in_flight and expected[0] in self._in_flight:
            return (
                "; a backward pass over several microbatches' summed losses runs their "
                "backwards newest first: give such an order as leangraph.order.Step records "
                "in that sequence (docs/pipelines.md)"
            )
        return ""

    def without_backward(self, graph: int) -> None:
        """The latest forward replay of ``graph`` needs no backward (nothing required grad)."""
        with self._lock:
            if self._drops:
                self._apply_drops()
            self._no_backward.add(graph)

    def ran_eagerly(self, graph: int) -> None:
        """The module of ``graph`` ran its eager forward (a drop-in module called in another
        training mode than capture's): where its forward is the next replay (or the first of a
        pass that may start over), this pass runs none of ``graph``'s steps, so they are passed
        over, as a reset graph's are, and the other graphs replay as if it were not there.
        Elsewhere nothing changes: an eager call touches no graph memory."""
        step = (graph, StepKind.FORWARD)
        with self._lock:
            if self._drops:
                self._apply_drops()
            self._pass_over_what_cannot_come()
            if self._steps[self._next] != step and self._may_start_over(graph, StepKind.FORWARD):
                self._next = 0
            if self._steps[self._next] == step:
                self._advance()
                self._no_backward.add(graph)  # after _advance, which clears it

    def drop(self, graph: int) -> None:
        """``graph`` was reset: none of its steps will come again, so nothing of it is in
        flight (a weight step it owed no longer keeps a new pass from starting over).

        A callable the garbage collector frees drops its graph from ``__del__``, which may run
        on a thread that is inside one of this sequence's own checks (an allocation there
        collected a cycle): that thread holds the lock, which is not re-entrant, and may be
        iterating the sets a drop changes. So a drop is queued, and applied at once where the
        lock is free, else by the holder's next check, which applies queued drops first.
        """
        self._drops.append(graph)
        if self._lock.acquire(blocking=False):
            try:
                self._apply_drops()
            finally:
                self._lock.release()

    def _apply_drops(self) -> None:
        while self._drops:
            graph = self._drops.popleft()
            self._dropped.add(graph)
            self._in_flight.discard(graph)
            self._weight_due.discard(graph)

    def _advance(self) -> None:
        graph, kind = self._last = self._steps[self._next]
        if kind is StepKind.FORWARD:
            self._no_backward.discard(graph)
            if graph in self._last_kind:
                self._in_flight.add(graph)
        else:
            self._finish_step(graph, kind)
        self._next = (self._next + 1) % len(self._steps)

    def _finish_step(self, graph: int, kind: StepKind) -> None:
        """Bookkeeping of what is in flight once a backward-side step ran or was passed."""
        if kind is StepKind.FORWARD:
            return
        if kind is self._last_kind[graph]:
            self._in_flight.discard(graph)
            self._weight_due.discard(graph)
        elif graph not in self._no_backward:
            self._weight_due.add(graph)

    def _may_drain(self, graph: int, kind: StepKind) -> bool:
        """Whether ``kind`` is a weight step that may run out of order: one that is due, of a
        pass abandoned with nothing else in flight (no forward's backward can still come),
        where nothing it could overwrite is alive; so an abandoned pass can be drained and a
        new one started. The due weight steps drain in capture order: one captured after
        another reuses the activations that one freed, which are still alive until it runs."""
        return (
            kind is StepKind.WEIGHT
            and graph in self._weight_due
            and not any(
                self._awaits(g) and g not in self._no_backward and g not in self._weight_due
                for g in self._in_flight
            )
            and self._first_due_weight() == graph
        )

    def _first_due_weight(self) -> int | None:
        """The graph of the first due weight step from where the replays are (the next due
        one in capture order), or None."""
        return next(self._due_weight_graphs(), None)

    def _due_weight_graphs(self) -> Iterator[int]:
        """The graphs whose weight steps are due, in capture order from where the replays
        are: the order they may drain in."""
        count = len(self._steps)
        for offset in range(count):
            graph, kind = self._steps[(self._next + offset) % count]
            if kind is StepKind.WEIGHT and graph in self._weight_due:
                yield graph

    def _may_start_over(self, graph: int, kind: StepKind) -> bool:
        if self._drops:  # a drop queued by a collection inside this check (see drop())
            self._apply_drops()
        return (graph, kind) == self._steps[0] and not any(
            g in self._weight_due or (self._awaits(g) and g not in self._no_backward)
            for g in self._in_flight
        )

    def _pass_over_what_cannot_come(self) -> None:
        for _ in range(len(self._steps)):
            if self._drops:  # a drop queued by a collection inside this check (see drop())
                self._apply_drops()
            graph, kind = self._steps[self._next]
            if graph in self._dropped:
                pass
            elif kind is StepKind.FORWARD:
                return
            elif kind is StepKind.BACKWARD and not self._awaits(graph):
                self._no_backward.add(graph)  # its outputs were dropped: so is its weight step
            elif kind is StepKind.WEIGHT and graph not in self._weight_due:
                pass  # ran already, drained out of order (or its backward cannot come)
            elif graph not in self._no_backward:
                return
            self._finish_step(graph, kind)
            self._next = (self._next + 1) % len(self._steps)
        # Every graph was reset: nothing can replay, and the callables say so themselves.
