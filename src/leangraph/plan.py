"""The liveness plan: the order turned, once, into per-graph steps with births and deaths.

Warm-up and capture never re-derive anything from the order: they walk the plan. A
:class:`GraphStep` says which graph runs (forward or backward) and which graphs' forward
outputs are born and die at that step, so "what is alive" at any point is a fold over the
steps before it. Forward outputs are born at their graph's forward and die at its backward,
or, when the order splits backwards (zero-bubble), at its deferred weight step: that step
still differentiates the forward's saved activations.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, replace

from .order import GraphId, Layout, Step, StepKind, unordered_layout

__all__ = ["GraphStep", "Plan", "build_plan", "build_unordered_plan"]


@dataclass(frozen=True, slots=True)
class GraphStep:
    """One graph's forward or backward, with the forward outputs it creates and kills.

    ``born`` and ``dies`` hold graph indices whose *forward outputs* start and stop being
    alive at this step; ``order_step`` is the order entry this step came from.
    """

    kind: StepKind
    graph: int
    graph_id: GraphId
    callable_index: int
    born: tuple[int, ...]
    dies: tuple[int, ...]
    order_step: Step

    def __str__(self) -> str:
        g = self.graph_id
        return f"{self.kind.value} c{g.chunk} m{g.microbatch} l{g.layer}"

    @property
    def is_backward(self) -> bool:
        """A backward (full or input-gradient) or weight-gradient step."""
        return self.kind is not StepKind.FORWARD


@dataclass(frozen=True, slots=True)
class Plan:
    """What warm-up and capture run, step by step.

    ``full_pass`` is one eager pass over every graph in the plan's order (what a tool that
    warms every graph runs; the memory plan's keep-everything baseline walks it).
    ``warmup`` is one warm-up pass (repeated ``num_warmup_iters`` times): the steps of
    ``full_pass`` whose graphs warm-up runs (:meth:`warming`). ``capture`` is the capture
    pass, which records graphs in exactly this sequence into one pool.
    """

    layout: Layout
    full_pass: tuple[GraphStep, ...]
    warmup: tuple[GraphStep, ...]
    capture: tuple[GraphStep, ...]
    ordered: bool
    split_backward: bool = False

    def warming(self, graphs: Collection[int]) -> Plan:
        """This plan with warm-up running only ``graphs``: the full pass's steps of those
        graphs, in its order (every graph keeps its own forward before its backward)."""
        chosen = frozenset(graphs)
        warmup = tuple(step for step in self.full_pass if step.graph in chosen)
        return replace(self, warmup=warmup)

    def live_during(
        self, steps: Sequence[GraphStep], *, keep_all: bool = False
    ) -> list[frozenset[int]]:
        """The graphs whose forward outputs are alive during each of ``steps``: those born
        at or before it, less those that died before it (a step's own deaths still count).

        ``keep_all`` folds births only (nothing ever dies), the keep-everything baseline of a
        tool that frees warm-up outputs at the end. One set per step: for many steps with
        many graphs alive, :meth:`live_weights` gives the sums without them.
        """
        return [frozenset(live) for live, _, _ in self._fold(steps, keep_all)]

    def live_after(self, steps: Sequence[GraphStep]) -> list[frozenset[int]]:
        """The graphs whose forward outputs are alive after each of ``steps``."""
        return [frozenset(live).difference(dies) for live, _, dies in self._fold(steps, False)]

    def live_weights(
        self,
        steps: Sequence[GraphStep],
        weights: Sequence[int],
        *,
        keep_all: bool = False,
        after: bool = False,
    ) -> list[int]:
        """Per step, the sum of ``weights[g]`` over the graphs alive during it (``after``:
        after it), as :meth:`live_during` (:meth:`live_after`) would give them, in time
        linear in the steps: the memory walk's bytes, in-flight counts."""
        total = 0
        sums = []
        for _, born, dies in self._fold(steps, keep_all):
            total += sum(map(weights.__getitem__, born))
            if after:
                total -= sum(map(weights.__getitem__, dies))
            sums.append(total)
            if not after:
                total -= sum(map(weights.__getitem__, dies))
        return sums

    def _fold(
        self, steps: Sequence[GraphStep], keep_all: bool
    ) -> Iterator[tuple[set[int], tuple[int, ...], tuple[int, ...]]]:
        """This plan's one fold of "what is alive": per step, the live set during it (the
        same set, updated in place after the step: read it before the next), the graphs
        born into it at this step and those that leave it after this step."""
        live: set[int] = set()
        for step in steps:
            born = tuple(g for g in step.born if g not in live)
            live.update(born)
            dies = () if keep_all else tuple(g for g in step.dies if g in live)
            yield live, born, dies
            live.difference_update(dies)

    def lifetimes(self, has_backward: Sequence[bool]) -> tuple[tuple[int, int], ...]:
        """Per graph, the (first, last) capture-step index during which its static inputs
        must hold: from its forward to its last backward-side step while it is alive, or its
        forward alone when it has no backward (``has_backward[g]``)."""
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for index, (step, (live, _, _)) in enumerate(
            zip(self.capture, self._fold(self.capture, False))
        ):
            if step.kind is StepKind.FORWARD:
                first[step.graph] = last[step.graph] = index
            elif has_backward[step.graph] and step.graph in live:
                last[step.graph] = index
        return tuple((first[g], last[g]) for g in range(self.layout.num_graphs))

    def max_live(self, steps: Sequence[GraphStep]) -> int:
        """Most graphs with live forward outputs at once during ``steps``."""
        ones = [1] * self.layout.num_graphs
        return max(self.live_weights(steps, ones, after=True), default=0)

    def max_live_per_chunk(self, steps: Sequence[GraphStep]) -> tuple[int, ...]:
        """Most graphs of each chunk with live forward outputs at once during ``steps``.

        Entry ``c - 1`` is chunk ``c``'s maximum. Chunks may peak at different steps, so the
        entries can sum to more than :meth:`max_live`.
        """
        chunk_of = [self.layout.graph_id(g).chunk for g in range(self.layout.num_graphs)]
        return tuple(
            max(
                self.live_weights(steps, [int(c == chunk) for c in chunk_of], after=True),
                default=0,
            )
            for chunk in range(1, self.layout.num_chunks + 1)
        )


def _graph_step(
    layout: Layout,
    kind: StepKind,
    chunk: int,
    microbatch: int,
    layer: int,
    order_step: Step,
    split: bool = False,
) -> GraphStep:
    graph = layout.graph_index(chunk, microbatch, layer)
    last = StepKind.WEIGHT if split else StepKind.BACKWARD
    return GraphStep(
        kind=kind,
        graph=graph,
        graph_id=GraphId(chunk, microbatch, layer),
        callable_index=layout.callable_index(chunk, layer),
        born=(graph,) if kind is StepKind.FORWARD else (),
        dies=(graph,) if kind is last else (),
        order_step=order_step,
    )


def _expand(layout: Layout, step: Step, split: bool = False) -> list[GraphStep]:
    """A chunk's forward runs its layers first to last; its backward, last to first."""
    layers = range(layout.layers_per_chunk[step.chunk - 1])
    if step.kind is not StepKind.FORWARD:
        layers = reversed(layers)  # type: ignore[assignment]
    return [
        _graph_step(layout, step.kind, step.chunk, step.microbatch, l, step, split) for l in layers
    ]


def build_plan(layout: Layout, steps: Sequence[Step]) -> Plan:
    """Plan for an explicit pipeline order: warm-up and capture both follow the order (warm-up
    over every graph until :meth:`Plan.warming` says which)."""
    split = any(step.kind is StepKind.WEIGHT for step in steps)
    expanded = tuple(g for step in steps for g in _expand(layout, step, split))
    return Plan(
        layout=layout,
        full_pass=expanded,
        warmup=expanded,
        capture=expanded,
        ordered=True,
        split_backward=split,
    )


def build_unordered_plan(num_callables: int) -> Plan:
    """Plan for callables given without an order (the torch drop-in).

    Warm-up runs each callable's forward and backward back to back, so at most one callable's
    warm-up outputs are alive. Capture records every forward in the given order, then every
    backward in reverse, which is the order a model built from these callables replays them in
    (the same contract as ``torch.cuda.make_graphed_callables``).
    """
    layout = unordered_layout(num_callables)
    forward = Step(StepKind.FORWARD, 1, 0)
    backward = Step(StepKind.BACKWARD, 1, 0)
    warmup = []
    for layer in range(num_callables):
        warmup.append(_graph_step(layout, StepKind.FORWARD, 1, 0, layer, forward))
        warmup.append(_graph_step(layout, StepKind.BACKWARD, 1, 0, layer, backward))
    capture = _expand(layout, forward) + _expand(layout, backward)
    return Plan(
        layout=layout,
        full_pass=tuple(warmup),
        warmup=tuple(warmup),
        capture=tuple(capture),
        ordered=False,
    )
