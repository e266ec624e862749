"""The records of a memory plan, and their human-readable description."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..order import Layout
from ..probe import LayerMemory

__all__ = ["MemoryPlan", "StepMemory", "format_bytes"]


@dataclass(frozen=True, slots=True)
class StepMemory:
    """Live bytes during one step of warm-up or capture.

    Attributes:
        phase: ``"warm-up"`` or ``"capture"``.
        index: Position of the step within its phase.
        step: The plan step, e.g. ``"F c1 m0 l2"``.
        in_flight: Graphs whose forward ran and whose backward has not finished.
        live_bytes: Highest live bytes during the step (a backward's transient included).
    """

    phase: str
    index: int
    step: str
    in_flight: int
    live_bytes: int

    def where(self) -> str:
        """E.g. ``"capture step 183 (B c1 m0 l3)"``."""
        return f"{self.phase} step {self.index} ({self.step})"


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes that warm-up and capture of one ``make_graphed_callables`` call hold.

    Attributes:
        ordered: Whether an order was given (else the torch drop-in plan).
        layout: Chunks, layers and microbatches of the graphs.
        layers: One measurement per callable (``callables[i]`` -> ``layers[i]``), on its
            microbatch-0 sample.
        activation_bytes_per_graph: ``activation_bytes`` of each graph, by graph index.
        static_input_bytes: Shared static input slots (chained inputs need none).
        grad_output_bytes: Gradient seeds (static grad-outputs), one per key.
        static_bytes: The two above.
        accumulation_bytes: The buffers ``fuse_grad_accumulation=True`` allocates before
            capture to add parameter gradients into (outside the pool, kept until reset):
            one per trained parameter with neither a ``main_grad`` nor a ``.grad`` of its
            layout; 0 without in-graph accumulation.
        warmup_peak_bytes: Lean warm-up peak: in-flight forwards + a backward's gradients and
            its zero grad-outputs, over the graphs warm-up runs (one per callable and sample
            layout).
        eager_peak_bytes: Peak of one eager pass over every graph in the plan's order with
            outputs held until their backward, as the lean warm-up holds them: what an eager
            step of this order holds (no static buffers, no pool).
        naive_warmup_peak_bytes: Warm-up peak if every graph were warmed up and every
            warm-up output and saved activation kept for the whole pass (a tool that frees
            warm-up outputs only at the end).
        capture_peak_bytes: Capture peak: static buffers + accumulation buffers + in-flight
            forwards + transient (+ with ``overlap_grad_accumulation``, the previous
            backward's parameter gradients, which capture keeps until the next backward).
        pool_bytes: High-water mark of in-flight forwards (activations and outputs) in the
            capture pool, with ``overlap_grad_accumulation`` the kept parameter gradients
            included.
        held_bytes: Held after capture: ``static_bytes + accumulation_bytes + pool_bytes``.
        peak_transient_bytes: Largest backward transient (grad-inputs + parameter grads).
        max_in_flight: Most graphs in flight at once during capture.
        warmup_peak_step, eager_peak_step, capture_peak_step, naive_peak_step: Where each
            peak falls.
        peak_step: Where the larger of the warm-up and capture peaks falls.
        steps: Every warm-up step, then every capture step.
    """

    ordered: bool
    layout: Layout
    layers: tuple[LayerMemory, ...]
    activation_bytes_per_graph: tuple[int, ...]
    static_input_bytes: int
    grad_output_bytes: int
    accumulation_bytes: int
    warmup_peak_bytes: int
    eager_peak_bytes: int
    naive_warmup_peak_bytes: int
    capture_peak_bytes: int
    pool_bytes: int
    peak_transient_bytes: int
    max_in_flight: int
    warmup_peak_step: str
    eager_peak_step: str
    naive_peak_step: str
    capture_peak_step: str
    steps: tuple[StepMemory, ...]

    @property
    def static_bytes(self) -> int:
        """Static input slots and gradient seeds together."""
        return self.static_input_bytes + self.grad_output_bytes

    @property
    def held_bytes(self) -> int:
        """What the graphs hold after capture: the pool's high-water mark, the static buffers
        and the accumulation buffers."""
        return self.pool_bytes + self.static_bytes + self.accumulation_bytes

    @property
    def peak_step(self) -> str:
        """Where the larger of the warm-up and capture peaks falls."""
        if self.capture_peak_bytes >= self.warmup_peak_bytes:
            return self.capture_peak_step
        return self.warmup_peak_step

    def describe(self) -> str:
        """A human-readable table of the per-callable measurements and the plan's figures."""
        return "\n".join(_describe_header(self) + _describe_layers(self) + _describe_plan(self))


def format_bytes(count: float) -> str:
    """``count`` bytes in the largest binary unit that keeps it >= 1, e.g. ``"1.50 GiB"``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def _describe_header(plan: MemoryPlan) -> list[str]:
    layout = plan.layout
    kind = "ordered" if plan.ordered else "unordered (torch drop-in)"
    return [
        f"leangraph memory plan, {kind}: {layout.num_chunks} chunk(s) of "
        f"{list(layout.layers_per_chunk)} layer(s) x {layout.num_microbatches} microbatch(es) "
        f"= {layout.num_graphs} graphs",
        "",
    ]


def _ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[str] = []
    start = prev = indices[0]
    following: list[int | None] = [*indices[1:], None]
    for index in following:
        if index is not None and index == prev + 1:
            prev = index
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if index is not None:
            start = prev = index
    return ", ".join(parts)


def _describe_layers(plan: MemoryPlan) -> list[str]:
    groups: dict[LayerMemory, list[int]] = {}
    for index, layer in enumerate(plan.layers):
        groups.setdefault(layer, []).append(index)
    header = ("callables", "activations", "saved inputs", "outputs", "grad-inputs", "param grads")
    rows = [header] + [
        (
            _ranges(indices),
            format_bytes(m.activation_bytes),
            format_bytes(m.saved_input_bytes),
            format_bytes(m.output_bytes),
            format_bytes(m.grad_input_bytes),
            format_bytes(m.param_grad_bytes),
        )
        for m, indices in groups.items()
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["per callable (one forward):"]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  " + "  ".join(cells))
    return [*lines, ""]


def _describe_plan(plan: MemoryPlan) -> list[str]:
    rows = [
        ("static input slots", plan.static_input_bytes, "shared; chained inputs need none"),
        ("static grad-output seeds", plan.grad_output_bytes, "one per shape"),
        *(
            [("accumulation buffers", plan.accumulation_bytes, "fuse_grad_accumulation")]
            if plan.accumulation_bytes
            else []
        ),
        ("eager pass peak", plan.eager_peak_bytes, plan.eager_peak_step),
        ("warm-up peak, keep-all", plan.naive_warmup_peak_bytes, plan.naive_peak_step),
        ("warm-up peak, lean", plan.warmup_peak_bytes, plan.warmup_peak_step),
        ("capture peak", plan.capture_peak_bytes, plan.capture_peak_step),
        ("capture pool high-water", plan.pool_bytes, ""),
        (
            "held after capture",
            plan.held_bytes,
            "pool high-water + static buffers"
            + (" + accumulation buffers" if plan.accumulation_bytes else ""),
        ),
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = [
        f"  {name.ljust(width)}  {format_bytes(value):>11}  {note}".rstrip()
        for name, value, note in rows
    ]
    lines.append(
        f"  most graphs in flight: {plan.max_in_flight}; largest backward transient "
        f"{format_bytes(plan.peak_transient_bytes)}"
    )
    return ["plan:", *lines]
