"""What a failed call puts back, and what it adds to an out-of-memory error.

A failure in the probe, warm-up or capture must leave the caller's state as it found it:
RNG states, grad mode and autocast, modules' training flags and the tensors parameters have
as ``.grad`` (warm-up and capture differentiate with ``torch.autograd.grad``, which never
touches ``.grad``, but in-graph accumulation may attach a buffer of its own). Module buffers
the probe, warm-up and a capture that runs its work write into are put back whether the call
fails or not (:func:`values_kept`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "BufferBinding",
    "SavedState",
    "buffer_bindings",
    "module_buffers",
    "note_out_of_memory",
    "values_kept",
]


class SavedState:
    """What a failed warm-up or capture puts back: RNG states, grad mode and autocast,
    modules' training flags and parameters' ``.grad`` tensors.

    Taken before the memory check and warm-up. On success nothing is restored, as in
    ``torch.cuda.make_graphed_callables``: warm-up and capture advance the RNGs the callables
    draw from (and in-graph accumulation keeps the ``.grad`` buffers it attached).
    """

    def __init__(self, callables: tuple[Any, ...]) -> None:
        self.cpu_rng = torch.get_rng_state()
        # Only where CUDA is already initialised (a CUDA backend initialises it): reading the
        # CUDA RNG would otherwise initialise CUDA for a CPU-only call.
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.training = [
            (module, module.training)
            for fn in callables
            if isinstance(fn, torch.nn.Module)
            for module in fn.modules()
        ]
        # With fuse_grad_accumulation a build may attach a gradient buffer of its own as
        # .grad (where the parameter's had another layout): the failed call's graphs are
        # gone, so the caller's tensor goes back.
        self.grads = [
            (param, param.grad)
            for fn in callables
            if isinstance(fn, torch.nn.Module)
            for param in fn.parameters()
        ]
        # A forward that assigns a new tensor to its own buffer rebinds it at every run; the
        # values the failed phases wrote are put back in place, the tensors here too.
        self.buffers = buffer_bindings(callables)
        # A callable that switches grad mode or autocast without a context manager
        # (torch.set_grad_enabled(False), an autocast entered by hand) and then raises would
        # leave the caller's process in its modes.
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = [
            (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in _AUTOCAST_DEVICES
        ]
        self.autocast_cache = torch.is_autocast_cache_enabled()

    def restore(self, exc: BaseException) -> None:
        """Put everything back; a step that fails is noted on ``exc``, which stays the error."""
        steps: list[tuple[str, Callable[[], None]]] = [
            ("the CPU RNG state", lambda: torch.set_rng_state(self.cpu_rng))
        ]
        if self.cuda_rng is not None:
            cuda_rng = self.cuda_rng
            steps.append(("the CUDA RNG states", lambda: torch.cuda.set_rng_state_all(cuda_rng)))
        for what, step in steps:
            try:
                step()
            except Exception as error:
                _add_note(exc, f"leangraph: could not restore {what} after the failure: {error!r}")
        self._restore_modes()
        for module, training in self.training:
            module.training = training
        for param, grad in self.grads:
            if param.grad is not grad:
                param.grad = grad
        for binding in self.buffers:
            binding.rebind()

    def _restore_modes(self) -> None:
        torch.set_grad_enabled(self.grad_enabled)
        for device, enabled, dtype in self.autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.autocast_cache)


# The device types whose autocast state a failed call puts back (those capture can run on).
_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class BufferBinding:
    """Which tensor one module buffer is, as found: ``owner._buffers[local] is tensor``.

    Attributes:
        callable_index: The position of the module among the callables.
        name: The buffer's qualified name in that module, as ``named_buffers()`` gives it.
        owner: The (sub)module whose ``_buffers`` holds it.
        local: Its name there.
        tensor: The tensor (or None, a buffer registered as None).
    """

    callable_index: int
    name: str
    owner: torch.nn.Module
    local: str
    tensor: torch.Tensor | None

    def holds(self) -> bool:
        """Whether the owner still holds this tensor under the name."""
        return self.local in self.owner._buffers and self.owner._buffers[self.local] is self.tensor

    def rebind(self) -> None:
        """Register the tensor under the name again, if anything replaced or removed it."""
        if not self.holds():
            self.owner._buffers[self.local] = self.tensor


def buffer_bindings(callables: Sequence[Any]) -> tuple[BufferBinding, ...]:
    """Every buffer binding of the modules among ``callables``, as they are now."""
    return tuple(
        BufferBinding(index, f"{path}.{local}" if path else local, owner, local, tensor)
        for index, fn in enumerate(callables)
        if isinstance(fn, torch.nn.Module)
        for path, owner in fn.named_modules(remove_duplicate=False)
        for local, tensor in list(owner._buffers.items())
    )


def _add_note(exc: BaseException, note: str) -> None:
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(note)


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def note_out_of_memory(exc: BaseException, device: torch.device) -> None:
    """Add the CUDA allocator's figures to an out-of-memory error raised by warm-up or capture."""
    if not isinstance(exc, torch.cuda.OutOfMemoryError) or device.type != "cuda":
        return
    try:
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch>=2.7
        fraction = (
            ""
            if get_fraction is None
            else f", per-process memory fraction {get_fraction(device):g}"
        )
    except Exception:
        return
    _add_note(
        exc,
        (
            f"leangraph: out of memory on {device} in make_graphed_callables: memory_allocated "
            f"{_mib(allocated)}, memory_reserved {_mib(reserved)}, free on the device {_mib(free)} "
            f"of {_mib(total)}{fraction}; the graphs made so far were reset, and "
            "torch.cuda.empty_cache() returns their memory once this error is dropped"
        ),
    )


@contextlib.contextmanager
def values_kept(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Put the values of ``tensors`` back after the block, in place (references to them stay
    valid): what forwards nobody asked for (the probe's, warm-up's on the samples), or a
    capture that runs its work (the CPU backend's; a CUDA capture records kernels without
    running them), wrote into them must not stay. After a failure too; a put-back that fails
    then (a CUDA error the device keeps) is noted on the error, which stays the error."""
    kept = {id(t): (t, t.detach().clone()) for t in tensors}
    try:
        yield
    except BaseException as exc:
        try:
            _put_back(kept.values())
        except Exception as error:
            _add_note(
                exc,
                "leangraph: could not put back the module buffers (or accumulation targets) "
                f"the failed phase wrote into: {error!r}",
            )
        raise
    _put_back(kept.values())


def _put_back(kept: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for tensor, value in kept:
            tensor.copy_(value)


def module_buffers(callables: Iterable[Any]) -> list[torch.Tensor]:
    """The buffers of the modules among ``callables`` (BatchNorm's running statistics)."""
    return [b for fn in callables if isinstance(fn, torch.nn.Module) for b in fn.buffers()]
