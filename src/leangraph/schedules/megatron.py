"""Orders of the Megatron-LM schedules, and GPipe's fill-then-drain order.

* :func:`interleaved_1f1b` and :func:`one_f_one_b` follow Megatron-LM
  (``megatron/core/pipeline_parallel/schedules.py``: ``get_pp_rank_microbatches``,
  ``get_schedule_table`` and the warm-up / steady / cool-down loops of
  ``forward_backward_pipelining_with_interleaving``).
* :func:`gpipe` is fill-then-drain.

Each returns an order in the convention of :mod:`leangraph.order`.
"""

from __future__ import annotations

from ._arguments import check_int, check_rank

__all__ = ["gpipe", "interleaved_1f1b", "one_f_one_b"]


def _check_group(group: int, pp_size: int, num_microbatches: int) -> None:
    """Megatron-LM's limits on ``microbatch_group_size_per_vp_stage`` (interleaving only)."""
    if not pp_size <= group <= num_microbatches:
        raise ValueError(
            f"microbatch_group_size {group} must lie in [pp_size, num_microbatches] = "
            f"[{pp_size}, {num_microbatches}] for the interleaved schedule (Megatron-LM's rule)"
        )
    remainder = num_microbatches % group
    if 0 < remainder < pp_size:
        raise ValueError(
            f"num_microbatches {num_microbatches} leaves a last microbatch group of {remainder} "
            f"(group size {group}); Megatron-LM requires it to be 0 or >= pp_size {pp_size}"
        )


def _chunk_table(num_microbatches: int, vp_size: int, group: int) -> list[int]:
    """0-based model chunk of each virtual microbatch, as in Megatron-LM's schedule table.

    Microbatches go in groups of ``group``; every chunk runs the whole group before the next
    chunk starts it. The last group holds whatever is left (``num_microbatches % group`` when
    that is not zero).
    """
    table: list[int] = []
    for start in range(0, num_microbatches, group):
        size = min(group, num_microbatches - start)
        for chunk in range(vp_size):
            table.extend([chunk] * size)
    return table


def _num_warmup(pp_size: int, vp_size: int, rank: int, num_microbatches: int, group: int) -> int:
    """Forwards run before the first backward's step (Megatron's ``num_warmup_microbatches``)."""
    if vp_size == 1:
        warmup = pp_size - rank - 1
    else:
        warmup = (pp_size - rank - 1) * 2 + (vp_size - 1) * group
    return min(warmup, num_microbatches * vp_size)


def interleaved_1f1b(
    pp_size: int,
    vp_size: int,
    rank: int,
    num_microbatches: int,
    microbatch_group_size: int | None = None,
) -> list[int]:
    """The order Megatron-LM's interleaved 1F1B schedule runs on one pipeline rank.

    Warm-up runs ``(pp_size - rank - 1) * 2 + (vp_size - 1) * group`` forwards (capped at
    ``num_microbatches * vp_size``, all of them); the steady state alternates one forward and one
    backward; the cool-down runs the remaining backwards. Forward ``k`` belongs to 0-based chunk
    ``table[k]`` and backward ``k`` to ``vp_size - 1 - table[k]``, where ``table`` is Megatron's
    schedule table: with ``num_microbatches % group == 0`` it is ``(k // group) % vp_size``; a
    smaller last group (newer Megatron-LM) keeps the same rule within that group. With
    ``vp_size == 1`` this is plain 1F1B with ``pp_size - rank - 1`` warm-up forwards.

    Args:
        pp_size: Pipeline-parallel size (number of ranks), >= 1.
        vp_size: Virtual pipeline size (model chunks per rank), >= 1.
        rank: Pipeline rank, ``0 <= rank < pp_size``.
        num_microbatches: Microbatches per iteration, >= 1.
        microbatch_group_size: Megatron's ``microbatch_group_size_per_vp_stage`` (default
            ``pp_size``); ignored when ``vp_size == 1``.

    Returns:
        The order, ``2 * num_microbatches * vp_size`` entries with chunk ids ``1..vp_size``.

    Raises:
        ValueError: if an argument is not a positive integer, ``rank`` is out of range, or
            (``vp_size > 1``) the group size breaks Megatron-LM's rules: it must lie in
            ``[pp_size, num_microbatches]`` and leave a last group of 0 or ``>= pp_size``.
    """
    pp_size = check_int("pp_size", pp_size, 1)
    vp_size = check_int("vp_size", vp_size, 1)
    rank = check_rank(rank, pp_size)
    num_microbatches = check_int("num_microbatches", num_microbatches, 1)
    group = pp_size if microbatch_group_size is None else microbatch_group_size
    group = check_int("microbatch_group_size", group, 1)
    if vp_size == 1:
        group = num_microbatches  # one chunk: the table is all zeros whatever the group
    else:
        _check_group(group, pp_size, num_microbatches)
    table = _chunk_table(num_microbatches, vp_size, group)
    total = len(table)
    warmup = _num_warmup(pp_size, vp_size, rank, num_microbatches, group)
    order = [table[k] + 1 for k in range(warmup)]
    for k in range(total - warmup):
        order.append(table[warmup + k] + 1)
        order.append(-(vp_size - table[k]))
    order.extend(-(vp_size - table[k]) for k in range(total - warmup, total))
    return order


def one_f_one_b(pp_size: int, rank: int, num_microbatches: int) -> list[int]:
    """The order of the non-interleaved 1F1B schedule (one chunk) on one pipeline rank.

    ``min(pp_size - rank - 1, num_microbatches)`` warm-up forwards, then one forward / one
    backward, then the remaining backwards. All entries are ``+1`` or ``-1``.

    Args:
        pp_size: Pipeline-parallel size, >= 1.
        rank: Pipeline rank, ``0 <= rank < pp_size``.
        num_microbatches: Microbatches per iteration, >= 1.

    Returns:
        The order, ``2 * num_microbatches`` entries.

    Raises:
        ValueError: if an argument is not a positive integer or ``rank`` is out of range.
    """
    return interleaved_1f1b(pp_size, 1, rank, num_microbatches)


def gpipe(num_microbatches: int, vp_size: int = 1) -> list[int]:
    """The fill-then-drain (GPipe) order, the same on every rank.

    All forwards first, microbatch by microbatch, each microbatch through chunks
    ``1, 2, ..., vp_size``; then all backwards, microbatch by microbatch (oldest first, as the
    order convention's ``-c`` always takes the oldest outstanding forward), each microbatch
    through chunks ``vp_size, ..., 1``. For ``vp_size = 2, num_microbatches = 2`` that is
    ``[1, 2, 1, 2, -2, -1, -2, -1]``.

    Args:
        num_microbatches: Microbatches per iteration, >= 1.
        vp_size: Model chunks on the rank, >= 1.

    Returns:
        The order, ``2 * num_microbatches * vp_size`` entries.

    Raises:
        ValueError: if an argument is not a positive integer.
    """
    num_microbatches = check_int("num_microbatches", num_microbatches, 1)
    vp_size = check_int("vp_size", vp_size, 1)
    forwards = list(range(1, vp_size + 1)) * num_microbatches
    backwards = list(range(-vp_size, 0)) * num_microbatches
    return forwards + backwards
