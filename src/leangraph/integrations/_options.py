"""What the integrations pass on to ``make_graphed_callables`` from a user's capture options."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["capture_options"]

# The integrations compute these from the schedule or the recorded calls themselves.
_OWN_OPTIONS = frozenset({"order", "num_layers_per_chunk", "sample_kwargs"})


def capture_options(options: Mapping[str, Any] | None, *, why: str) -> dict[str, Any]:
    """``options`` as a dict to pass on, unless it sets what the integration computes.

    Raises:
        ValueError: naming the refused options, then ``why`` the integration sets them.
    """
    given = dict(options or {})
    refused = sorted(_OWN_OPTIONS.intersection(given))
    if refused:
        raise ValueError(f"capture_options may not set {', '.join(refused)}: {why}")
    return given
