"""The memory model: live bytes at every step of warm-up and capture, from the plan's fold.

Warm-up holds, for each forward whose backward has not run, its saved activations and its
outputs; a backward step adds its gradients (and warm-up's zero grad-outputs) for the step.
Warm-up runs one graph per callable and sample layout; the same walk over every graph is what
an eager pass of the order holds.
Capture adds the static buffers of the engine's own buffer plan (and, with in-graph
accumulation, the buffers it adds parameter gradients into), and the pool keeps what the
in-flight forwards hold (and, with ``overlap_grad_accumulation``, the latest backward's
parameter gradients, which capture keeps until the next backward is recorded). "What is
alive" at a step is the plan's own fold (:meth:`~leangraph.plan.Plan.live_weights`); this
module only puts bytes on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..buffers import BufferPlan
from ..order import StepKind
from ..plan import GraphStep, Plan
from ..probe import LayerMemory
from .records import MemoryPlan, StepMemory

__all__ = ["walk_plan"]


def walk_plan(
    plan: Plan,
    graphs: Sequence[LayerMemory],
    buffers: BufferPlan,
    *,
    accumulation_bytes: int = 0,
    hold_param_grads: bool = False,
) -> MemoryPlan:
    """Walk warm-up (lean), one eager pass over every graph (lean and keep-all) and capture
    over the per-graph measurements.

    Args:
        plan: The liveness plan.
        graphs: The probe's measurement of every graph, by graph index.
        buffers: The static buffers the engine allocates for this plan.
        accumulation_bytes: The accumulation buffers in-graph accumulation allocates before
            capture (0 without it).
        hold_param_grads: Whether capture keeps each backward's parameter gradients until
            the next backward is recorded (``overlap_grad_accumulation``).
    """
    held = [m.in_flight_bytes for m in graphs]
    transient = _Transients.of(graphs, plan.split_backward, seeds=False)
    seeded = _Transients.of(graphs, plan.split_backward, seeds=True)  # warm-up's zero seeds
    static_in = sum(key.nbytes for key in buffers.slot_keys)
    grad_out = sum(key.nbytes for key in buffers.seed_keys)
    warmup = _walk(plan, "warm-up", plan.warmup, 0, held, seeded)
    eager = _walk(plan, "eager", plan.full_pass, 0, held, seeded)
    naive = _walk(plan, "warm-up", plan.full_pass, 0, held, seeded, keep_all=True)
    capture = _walk(
        plan,
        "capture",
        plan.capture,
        static_in + grad_out + accumulation_bytes,
        held,
        transient,
        kept_grads=[m.param_grad_bytes for m in graphs] if hold_param_grads else None,
    )
    return MemoryPlan(
        ordered=plan.ordered,
        layout=plan.layout,
        layers=_per_callable(plan, graphs),
        activation_bytes_per_graph=tuple(m.activation_bytes for m in graphs),
        static_input_bytes=static_in,
        grad_output_bytes=grad_out,
        accumulation_bytes=accumulation_bytes,
        warmup_peak_bytes=warmup.peak.live_bytes,
        eager_peak_bytes=eager.peak.live_bytes,
        naive_warmup_peak_bytes=naive.peak.live_bytes,
        capture_peak_bytes=capture.peak.live_bytes,
        pool_bytes=capture.high_water,
        peak_transient_bytes=max((*transient.backward, *transient.weight), default=0),
        max_in_flight=max((s.in_flight for s in capture.steps), default=0),
        warmup_peak_step=warmup.peak.where(),
        eager_peak_step=eager.peak.where(),
        naive_peak_step=naive.peak.where(),
        capture_peak_step=capture.peak.where(),
        steps=warmup.steps + capture.steps,
    )


def _per_callable(plan: Plan, graphs: Sequence[LayerMemory]) -> tuple[LayerMemory, ...]:
    """Each callable's measurement on its first graph (microbatch 0)."""
    first: dict[int, LayerMemory] = {}
    layout = plan.layout
    for graph in reversed(range(layout.num_graphs)):
        first[layout.callable_of_graph(graph)] = graphs[graph]
    return tuple(first[index] for index in range(layout.num_callables))


@dataclass(frozen=True, slots=True)
class _Transients:
    """What each graph's backward and weight steps allocate on top of what is held.

    A full backward allocates input and parameter gradients; a split one allocates the input
    gradients at ``-c`` and the parameter gradients at the deferred ``-(c + 0.5)``.
    """

    backward: tuple[int, ...]
    weight: tuple[int, ...]

    @classmethod
    def of(cls, graphs: Sequence[LayerMemory], split: bool, *, seeds: bool) -> _Transients:
        seed = [m.output_bytes if seeds else 0 for m in graphs]
        if not split:
            return cls(
                tuple(m.transient_bytes + s for m, s in zip(graphs, seed)), (0,) * len(graphs)
            )
        return cls(
            tuple(m.grad_input_bytes + s for m, s in zip(graphs, seed)),
            tuple(m.param_grad_bytes + s for m, s in zip(graphs, seed)),
        )

    def at(self, step: GraphStep) -> int:
        if step.kind is StepKind.BACKWARD:
            return self.backward[step.graph]
        if step.kind is StepKind.WEIGHT:
            return self.weight[step.graph]
        return 0


@dataclass(frozen=True, slots=True)
class _Walk:
    steps: tuple[StepMemory, ...]
    peak: StepMemory
    high_water: int  # most in-flight bytes (and kept gradients), transients excluded


def _walk(
    plan: Plan,
    phase: str,
    steps: Sequence[GraphStep],
    static: int,
    held: Sequence[int],
    transient: _Transients,
    *,
    keep_all: bool = False,
    kept_grads: Sequence[int] | None = None,
) -> _Walk:
    """Live bytes at each step: ``static`` + what live graphs hold + a backward's transient.

    ``held[g]`` is what graph ``g`` holds while the plan has it alive; with ``keep_all``
    nothing dies (the keep-everything baseline). With ``kept_grads`` (``kept_grads[g]``:
    graph ``g``'s parameter gradients) the latest backward's stay in the pool until the
    next backward has been recorded, through that backward's step too.
    """
    records = []
    high_water = 0
    kept = 0  # the parameter gradients of the latest backward, where they are kept
    counts = plan.live_weights(steps, [1] * len(held), keep_all=keep_all)
    totals = plan.live_weights(steps, held, keep_all=keep_all)
    for index, (step, count, total) in enumerate(zip(steps, counts, totals)):
        high_water = max(high_water, total + kept)
        live_bytes = static + total + kept + transient.at(step)
        records.append(StepMemory(phase, index, str(step), count, live_bytes))
        if kept_grads is not None and step.kind is StepKind.BACKWARD:
            kept = kept_grads[step.graph]
    if not records:
        raise ValueError("the plan has no steps")
    peak = max(records, key=lambda r: r.live_bytes)
    return _Walk(tuple(records), peak, high_water)
