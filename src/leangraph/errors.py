"""Exceptions leangraph raises beyond the built-in ``ValueError`` and ``TypeError``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["LeangraphError", "GraphResetError", "phase_note"]


class LeangraphError(RuntimeError):
    """Base of leangraph's own runtime errors."""


class GraphResetError(LeangraphError):
    """A graphed callable was used (called, or reached by a backward) after ``reset()``."""


@contextlib.contextmanager
def phase_note(phase: str, label: str, position: str) -> Iterator[None]:
    """Add a note naming the phase, the callable and the step to an exception passing by.

    The exception itself propagates unchanged (type, message and traceback), so callers can
    still catch what their callable raised.
    """
    try:
        yield
    except BaseException as exc:
        add_note = getattr(exc, "add_note", None)  # Python >= 3.11
        if add_note is not None:
            add_note(f"leangraph: raised during {phase} of {label}, at {position}")
        raise
