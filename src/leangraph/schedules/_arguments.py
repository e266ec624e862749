"""Argument checks shared by the order builders of :mod:`leangraph.schedules`."""

from __future__ import annotations

import numbers

__all__ = ["check_int", "check_rank"]


def check_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` as an int, or raise ValueError if it is not an integer >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_rank(rank: object, pp_size: int) -> int:
    """Return ``rank`` as an int, or raise ValueError unless ``0 <= rank < pp_size``."""
    rank = check_int("rank", rank, 0)
    if rank >= pp_size:
        raise ValueError(
            f"rank {rank} out of range for pp_size {pp_size} (valid: 0..{pp_size - 1})"
        )
    return rank
