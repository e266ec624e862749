"""Reference orders and order helpers shared by the tests of leangraph.schedules."""

from __future__ import annotations

from leangraph.order import Layout, Step, parse_order


def parse_one_layer_per_chunk(order: list) -> tuple[Layout, tuple[Step, ...]]:
    """Run the order through leangraph.order.parse_order (one layer per chunk)."""
    chunks = max(abs(e) for e in order)
    microbatches = order.count(1)
    return parse_order(
        order, num_callables=chunks, num_samples=chunks * microbatches, num_layers_per_chunk=1
    )


def megatron_reference(pp: int, vp: int, rank: int, m: int, group: int) -> list[int]:
    """Megatron-LM's interleaved rule, formulated independently of leangraph.schedules.

    Chunk of virtual microbatch k computed arithmetically from Megatron's table layout (full
    groups of ``group`` microbatches, each run by chunk 0, 1, ..., then a last block of the
    ``m % group`` left over). The 1F1B merge: backward ``j`` directly follows forward
    ``j + warmup``; the backwards that never get a forward partner come last.
    """
    full_groups, rest = divmod(m, group)

    def chunk_of(k: int) -> int:
        if k < full_groups * group * vp:
            return (k % (group * vp)) // group
        return (k - full_groups * group * vp) // rest

    total = m * vp
    warmup = pp - rank - 1 if vp == 1 else 2 * (pp - rank - 1) + (vp - 1) * group
    warmup = min(warmup, total)
    order: list[int] = []
    backward = 0
    for k in range(total):
        order.append(chunk_of(k) + 1)
        if k >= warmup:
            order.append(-(vp - chunk_of(backward)))
            backward += 1
    order.extend(-(vp - chunk_of(j)) for j in range(backward, total))
    return order


def megatron_accepts(pp: int, m: int, group: int) -> bool:
    """Whether Megatron-LM accepts microbatch group size ``group`` (interleaving)."""
    return pp <= group <= m and (m % group == 0 or m % group >= pp)
