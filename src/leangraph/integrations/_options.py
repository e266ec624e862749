"""What the integrations pass on to ``make_graphed_callables`` from a user's capture options."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

__all__ = ["capture_options"]

# The integrations compute these from the schedule or the recorded calls themselves.
_OWN_OPTIONS = frozenset({"order", "num_layers_per_chunk", "sample_kwargs"})


def capture_options(
    options: Mapping[str, Any] | None,
    *,
    why: str,
    sets: Mapping[str, str] | None = None,
    check: bool = False,
) -> dict[str, Any]:
    """``options`` as a dict to pass on, unless it sets what the integration computes.

    ``sets`` names further options the integration sets itself, each with where it takes it
    from. With ``check``, also refuse names ``make_graphed_callables`` does not take, and run
    its checks of the values that need no call (:func:`leangraph.api.check_option_values`).

    Raises:
        ValueError: naming the refused options, then ``why`` the integration sets them (and
            where from, for those of ``sets``).
        TypeError: with ``check``, for an option ``make_graphed_callables`` does not take,
            naming the closest one it does; and its own refusals of the values.
    """
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(
            "capture_options must be a mapping of make_graphed_callables option names to "
            f"values (a dict), got {type(options).__name__}"
        )
    given = dict(options or {})
    own = {**dict.fromkeys(_OWN_OPTIONS, ""), **(sets or {})}
    refused = sorted(set(own).intersection(given))
    if refused:
        sources = "; ".join(f"{name} from {own[name]}" for name in refused if own[name])
        raise ValueError(
            f"capture_options may not set {', '.join(refused)}: {why}"
            + (f" ({sources})" if sources else "")
        )
    if check:
        from leangraph.api import check_option_values, option_defaults

        known = option_defaults()
        for name in given:
            if name not in known:
                raise TypeError(_unknown_option(name, sorted(set(known) - set(own))))
        check_option_values(given)
    return given


def _unknown_option(name: object, allowed: list[str]) -> str:
    close = difflib.get_close_matches(str(name), allowed, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"expected one of {', '.join(allowed)}"
    return f"capture_options: leangraph.make_graphed_callables has no option {name!r}; {hint}"
