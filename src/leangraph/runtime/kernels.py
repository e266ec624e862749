"""The process-wide settings that choose a graph's kernels, as capture saw them.

A graph replays the kernels its capture launched. Which kernels those were followed settings
that eager code reads at every call: the precision of float32 matmuls and convolutions (TF32,
bf16), reduced-precision reductions in half-precision matmuls, deterministic algorithms, whether
cuDNN or oneDNN run at all, and which attention kernels ``scaled_dot_product_attention`` may
pick; and the default dtype, which factories without one make floats in. Changed after
capture, eager's next call would run other kernels, with other numerics (or raise, for an
operation without a deterministic implementation); a replay would silently run the captured
ones. So a forward replay compares the settings of its device type with capture's
(R30): a CPU graph does not care about cuDNN, nor a CUDA graph about oneDNN.

Left out: ``torch.backends.cudnn.benchmark``, which picks among algorithms for speed (eager with
it on is not reproducible from run to run either), and settings a callable changes and restores
inside its own forward (capture recorded the kernels chosen under them).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import torch

__all__ = ["KernelSettings"]

Getter = Callable[[], object]
Named = tuple[tuple[str, Getter], ...]

# ``operator.call`` (Python 3.11+) calls each reader directly; a method caller is 2.5x slower.
_CALL = getattr(operator, "call", operator.methodcaller("__call__"))
_FIRST, _FALLBACK = "first", "fallback"  # which precision readers answered


def _present(named: Sequence[tuple[str, str]]) -> Named:
    """The (name, reader) pairs whose reader (a ``torch._C`` function) this torch has."""
    found = ((name, getattr(torch._C, reader, None)) for name, reader in named)
    return tuple((name, getter) for name, getter in found if getter is not None)


def _per_backend_precisions(backends: Sequence[str]) -> Named:
    """The per-backend float32 precisions (``torch.backends.*.fp32_precision``, newer torch)
    of ``backends`` this build knows, with their readers."""
    reader = getattr(torch._C, "_get_fp32_precision_getter", None)
    if reader is None:
        return ()
    found = []
    for backend in backends:
        for op in ("all", "matmul", "conv", "rnn"):
            getter = functools.partial(reader, backend, op)
            try:
                getter()
            except RuntimeError:  # no such pair in this build (cudnn in a CPU build, ...)
                continue
            found.append((_precision_name(backend, op), getter))
    return tuple(found)


def _precision_name(backend: str, op: str) -> str:
    where = "torch.backends" + ("" if backend == "generic" else f".{backend}")
    return where + ("" if op == "all" else f".{op}") + ".fp32_precision"


def _effective(values: dict[str, object]) -> dict[str, object]:
    """Per-backend precisions as the kernels see them: ``"none"`` follows the backend's
    ``all``, which follows the generic one, whose ``"none"`` is full float32 (``"ieee"``);
    so a value set to what it already was is no change. Legacy readers' values pass as they
    are."""
    if not any(name.endswith(".fp32_precision") for name in values):
        return values

    def resolved(name: str) -> object:
        # "torch.backends.<backend>.<op>.fp32_precision": the backend's part of the name.
        backend = name.split(".")[2]
        for key in (name, _precision_name(backend, "all"), _precision_name("generic", "all")):
            if values.get(key, "none") != "none":
                return values[key]
        return "ieee"

    return {name: resolved(name) for name in values if name.count(".") == 4}


_MATMUL_PRECISION = ("torch.get_float32_matmul_precision()", "_get_float32_matmul_precision")
_DETERMINISTIC = ("torch.are_deterministic_algorithms_enabled()", "_get_deterministic_algorithms")
_FLASH = ("torch.backends.cuda.flash_sdp_enabled()", "_get_flash_sdp_enabled")
_MATH = ("torch.backends.cuda.math_sdp_enabled()", "_get_math_sdp_enabled")
# The dtype factories make floats in without one (`torch.ones(4)`, a Python scalar's tensor):
# eager's constants, and what follows from them, would take the new one.
_DEFAULT_DTYPE = ("torch.get_default_dtype()", "get_default_dtype")

# Per device type: float32 precision as the legacy readers say it (cheap, tens of ns each, but
# they raise where the per-backend API set it last), the per-backend readers that answer then
# (about a µs each), and the other settings its kernels follow.
_SETTINGS: dict[str, tuple[Named, Named, Named]] = {
    "cuda": (
        _present(
            [
                _MATMUL_PRECISION,
                ("torch.backends.cuda.matmul.allow_tf32", "_get_cublas_allow_tf32"),
                ("torch.backends.cudnn.allow_tf32", "_get_cudnn_allow_tf32"),
            ]
        ),
        _per_backend_precisions(("generic", "cuda", "cudnn")),
        _present(
            [
                (
                    "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
                    "_get_cublas_allow_fp16_reduced_precision_reduction",
                ),
                (
                    "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
                    "_get_cublas_allow_bf16_reduced_precision_reduction",
                ),
                _DETERMINISTIC,
                _DEFAULT_DTYPE,
                ("torch.backends.cudnn.deterministic", "_get_cudnn_deterministic"),
                ("torch.backends.cudnn.enabled", "_get_cudnn_enabled"),
                _FLASH,
                (
                    "torch.backends.cuda.mem_efficient_sdp_enabled()",
                    "_get_mem_efficient_sdp_enabled",
                ),
                _MATH,
                ("torch.backends.cuda.cudnn_sdp_enabled()", "_get_cudnn_sdp_enabled"),
            ]
        ),
    ),
    "cpu": (
        _present([_MATMUL_PRECISION]),
        _per_backend_precisions(("generic", "mkldnn")),
        _present(
            [
                _DETERMINISTIC,
                _DEFAULT_DTYPE,
                ("torch.backends.mkldnn.enabled", "_get_mkldnn_enabled"),
                _FLASH,  # the CPU's flash attention kernel follows it too
                _MATH,
            ]
        ),
    ),
}


class KernelSettings:
    """The kernel settings of one device type at capture, and the check of a replay's.

    Args:
        device_type: The graphs' device type; one without settings here (``meta``) is never
            refused.
    """

    def __init__(self, device_type: str) -> None:
        legacy, per_backend, others = _SETTINGS.get(device_type, ((), (), ()))
        # Float32 precision: the readers tried first, and those that answer where they raise.
        # On CUDA the legacy readers come first (they are cheap); elsewhere the per-backend
        # ones, where this torch has them: the legacy reader raises once a CUDA precision was
        # set through the per-backend API, which CPU kernels ignore.
        first = legacy if device_type == "cuda" or not per_backend else per_backend
        self._first, self._fallback, self._others = first, per_backend, others
        self._first_getters = tuple(getter for _, getter in first)
        self._fallback_getters = tuple(getter for _, getter in per_backend)
        self._other_getters = tuple(getter for _, getter in others)
        self.captured = self.read()

    def read(self) -> tuple[tuple[str, tuple[object, ...]], tuple[object, ...]]:
        """The settings now: the float32 precisions (tagged by which readers answered), and
        the others (C-level readers, in two maps)."""
        try:
            precision = (_FIRST, tuple(map(_CALL, self._first_getters)))
        except RuntimeError:  # the per-backend API set it last: only its readers answer
            precision = (_FALLBACK, tuple(map(_CALL, self._fallback_getters)))
        return precision, tuple(map(_CALL, self._other_getters))

    def check(self, label: str) -> None:
        """After :meth:`read` differed from :attr:`captured`: refuse the forward replay where a
        setting's effect changed, naming each (a per-backend precision set to what it meant
        already, ``"ieee"`` where it said ``"none"``, is no change).

        Raises:
            RuntimeError: naming the callable and every setting that changed.
        """
        (was_precision, was), (now_precision, now) = map(
            self._described, (self.captured, self.read())
        )
        changed = _changes(was_precision, now_precision) + _changes(was, now)
        if not changed:
            return
        raise RuntimeError(
            f"{label} is replayed under other kernel settings than at capture: "
            f"{'; '.join(changed)}. Its graphs run the "
            "kernels (and precision) chosen at capture, where eager's would follow the new "
            "settings. Set them back before replaying, or capture again under the settings you "
            "train with"
        )

    def _described(
        self, settings: tuple[tuple[str, tuple[object, ...]], tuple[object, ...]]
    ) -> tuple[dict[str, object], dict[str, object]]:
        """The float32 precisions and the other settings, each value by the name a user sets
        it by."""
        (tag, values), others = settings
        named = self._first if tag == _FIRST else self._fallback
        precision = _effective({name: value for (name, _), value in zip(named, values)})
        return precision, {name: value for (name, _), value in zip(self._others, others)}


def _changes(was: dict[str, object], now: dict[str, object]) -> list[str]:
    if was.keys() != now.keys():  # read through torch's other precision API at capture
        return [f"float32 precision was {_listed(was)} at capture, is {_listed(now)} now"]
    return [
        f"{name} was {was[name]!r} at capture, is {now[name]!r} now"
        for name in now
        if was[name] != now[name]
    ]


def _listed(values: dict[str, object]) -> str:
    return "(" + ", ".join(f"{name} {value!r}" for name, value in values.items()) + ")"
