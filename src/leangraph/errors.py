"""Exceptions leangraph raises beyond the built-in ``ValueError`` and ``TypeError``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["CaptureMemoryError", "GraphResetError", "LeangraphError", "phase_note"]


class LeangraphError(RuntimeError):
    """Base of leangraph's own runtime errors."""


class GraphResetError(LeangraphError):
    """A graphed callable was used (called, or reached by a backward) after ``reset()``."""


class CaptureMemoryError(LeangraphError):
    """The memory plan of a capture does not fit in the GPU memory available to it.

    Raised by ``make_graphed_callables`` before any warm-up or capture work, so nothing is
    left half-built. ``needed_bytes`` is the plan's peak above what is allocated now,
    ``available_bytes`` what the allocator can still hand out, ``step`` where the peak falls.
    """

    def __init__(self, needed_bytes: int, available_bytes: int, step: str) -> None:
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.step = step
        super().__init__(
            f"capture needs {needed_bytes / 2**20:.1f} MiB at its peak ({step}) but only "
            f"{available_bytes / 2**20:.1f} MiB of GPU memory is available; free memory, use "
            "fewer microbatches in flight, or pass check_memory=False to try anyway"
        )


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
            if "CUDAGeneratorImpl" in str(exc):
                add_note(_GENERATOR_HINT)
            elif _CAPTURE_UNSUPPORTED in str(exc):
                add_note(_SYNC_HINT)
        raise


# cudaErrorStreamCaptureUnsupported, CUDA's refusal of a host sync while a stream captures.
_CAPTURE_UNSUPPORTED = "operation not permitted when stream is capturing"
_SYNC_HINT = (
    "leangraph: the callable synchronizes the host with the GPU during capture, which a CUDA "
    "graph cannot record: it reads a tensor's values on the host (.item(), .tolist(), "
    "bool(tensor), printing one), or makes a tensor whose shape depends on its values "
    "(nonzero, boolean-mask indexing, unique); a replay reruns kernels only, never that host "
    "decision. Keep the computation on the device (torch.where instead of an if, a fixed-size "
    "mask), or leave that part outside the graphed callable"
)
_GENERATOR_HINT = (
    "leangraph: CUDA refuses to read or set the CUDA generator while a graph captures; "
    "torch.utils.checkpoint does both (preserve_rng_state=True, its default). Checkpoint "
    "around the graphed callable instead, or pass preserve_rng_state=False where the "
    "checkpointed code draws no random numbers (docs/composition.md)"
)
