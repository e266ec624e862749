"""Capture-time hooks: user code that runs around warm-up and capture steps, never at replay.

Graphs cannot replay Python hooks, so work such as activation offloading or token counting
that users attach with module hooks has to happen while the graphs are recorded instead.
Each graphed callable may carry lists of hooks; warm-up and capture call them outside stream
capture, in the plan's order, once per step (warm-up runs one graph per callable and sample
layout, capture every graph):

* ``forward_pre(callable, args, kwargs)`` before a forward step;
* ``forward(callable, args, kwargs, output)`` after it (``output`` as the callable returned
  it in warm-up; the static outputs at capture);
* ``backward_pre(callable)`` before a backward (or weight) step, ``backward(callable)`` after.

``args``/``kwargs`` are the warm-up samples, or the static inputs at capture.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["HOOK_KINDS", "CaptureHooks", "normalize_hooks"]

HOOK_KINDS = ("forward_pre", "forward", "backward_pre", "backward")

Hook = Callable[..., None]


@dataclass(frozen=True)
class CaptureHooks:
    """The hooks of one callable (``target`` is what they receive first)."""

    target: Any = None
    forward_pre: tuple[Hook, ...] = ()
    forward: tuple[Hook, ...] = ()
    backward_pre: tuple[Hook, ...] = ()
    backward: tuple[Hook, ...] = ()

    def run(self, kind: str, *args: Any) -> None:
        """Call every hook of ``kind`` with ``(target, *args)``."""
        for hook in getattr(self, kind):
            hook(self.target, *args)


def normalize_hooks(
    entries: Sequence[Mapping[str, Sequence[Hook]] | None] | None, callables: Sequence[Any]
) -> list[CaptureHooks]:
    """One :class:`CaptureHooks` per callable from the user's ``capture_time_hooks``.

    Raises:
        ValueError: for a count that does not match the callables, or an unknown hook kind.
        TypeError: for a hook that is not callable.
    """
    if entries is None:
        return [CaptureHooks(fn) for fn in callables]
    if not isinstance(entries, (list, tuple)):
        raise TypeError(
            "capture_time_hooks must be a list or tuple of one dict (or None) per callable, "
            f"got {type(entries).__name__}"
        )
    if len(entries) != len(callables):
        raise ValueError(
            f"capture_time_hooks has {len(entries)} entries for {len(callables)} "
            "callables; give one (or None) per callable"
        )
    result = []
    for index, (fn, entry) in enumerate(zip(callables, entries)):
        if entry is not None and not isinstance(entry, Mapping):
            raise TypeError(
                f"capture_time_hooks[{index}] must be a dict of hook kinds to lists of "
                f"callables, or None, got {type(entry).__name__}"
            )
        entry = entry or {}
        unknown = sorted(set(entry) - set(HOOK_KINDS))
        if unknown:
            raise ValueError(
                f"capture_time_hooks[{index}]: unknown hook kinds {unknown}; "
                f"expected some of {list(HOOK_KINDS)}"
            )
        for kind, hooks in entry.items():
            if not isinstance(hooks, (list, tuple)):
                raise TypeError(
                    f"capture_time_hooks[{index}][{kind!r}] must be a list or tuple of "
                    f"callables, got {type(hooks).__name__}"
                )
            for hook in hooks:
                if not callable(hook):
                    raise TypeError(
                        f"capture_time_hooks[{index}][{kind!r}] holds a "
                        f"{type(hook).__name__}, which is not callable"
                    )
        result.append(CaptureHooks(fn, **{k: tuple(v) for k, v in entry.items()}))
    return result
