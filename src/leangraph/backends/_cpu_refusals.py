"""What the CPU backend refuses to capture, because a CUDA graph could not replay it either.

A CUDA graph replays kernels, never the host code that launched them, and stream capture
refuses a host sync outright (``cudaErrorStreamCaptureUnsupported``: "operation not permitted
when stream is capturing"). The CPU backend's trace replays recorded aten calls the same way,
so where the host *reads* a tensor's values during capture it refuses, with the reason, rather
than let a replay silently keep what the capture read.
"""

from __future__ import annotations

import functools
import sysconfig
import traceback
from pathlib import Path
from typing import Any

import torch

__all__ = ["check_host_read", "host_read_error", "may_read_host", "refusal", "unsited_refusal"]

_aten = torch.ops.aten

_SCALAR_READS = frozenset({_aten._local_scalar_dense.default, _aten.item.default})

# Indexing ops whose output shape depends on tensor values only through a boolean mask.
_MASK_INDEXING = frozenset(
    {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}
    | {_aten._index_put_impl_.default}
)

# Operators whose CUDA kernels read a result on the host, where the CPU kernels read nothing a
# dispatch mode sees: cuSOLVER's error codes (the checks torch.linalg's functions without
# "_ex" make, and the convergence checks of the SVD and eigh), MAGMA's eig (which copies the
# matrix to the host). torch documents each as synchronizing a CUDA device with the CPU.
_CUDA_SYNCS: dict[Any, str] = {
    _aten._linalg_check_errors.default: (
        "the error check of torch.linalg.cholesky, inv, solve, lu_factor or ldl_factor "
        "(aten._linalg_check_errors)"
    ),
    _aten._linalg_svd.default: (
        "torch.linalg.svd, svdvals, matrix_rank, cond or a matrix norm of order 2 or 'nuc' "
        "(aten._linalg_svd, which checks its convergence)"
    ),
    _aten._linalg_eigh.default: (
        "torch.linalg.eigh or eigvalsh (aten._linalg_eigh, which checks its convergence)"
    ),
    _aten.linalg_eig.default: "torch.linalg.eig or eigvals (aten.linalg_eig)",
    _aten.cholesky.default: "torch.cholesky (aten.cholesky, which checks its result)",
}
_CUDA_SYNC_PACKETS: dict[Any, str] = {_aten.linalg_pinv: "torch.linalg.pinv (aten.linalg_pinv)"}

_SYNC = (
    "CUDA stream capture refuses the host sync it needs too ('operation not permitted when "
    "stream is capturing')"
)

# Tensor methods that read values on the host without an aten call (printing runs with
# dispatch modes disabled; tolist and numpy read the memory directly).
_HOST_METHODS: dict[Any, str] = {
    torch.Tensor.__repr__: "printing a tensor (its values)",
    torch.Tensor.__format__: "formatting a tensor (its values)",
    torch.Tensor.tolist: "Tensor.tolist()",
    torch.Tensor.numpy: "Tensor.numpy()",
    torch.Tensor.__array__: "converting a tensor to a NumPy array",
    # A synchronous copy to the host: CUDA stream capture refuses it (autograd's save_on_cpu
    # makes one for every saved tensor).
    torch.Tensor.cpu: "Tensor.cpu() (a copy to the host)",
}


def refusal(what: str, why: str) -> RuntimeError:
    """The error for something a capture on the CPU backend cannot record faithfully."""
    return unsited_refusal(f"{what}{user_site()}", why)


def unsited_refusal(what: str, why: str) -> RuntimeError:
    """:func:`refusal` for what no line of the callable names (found once it has returned)."""
    return RuntimeError(f"the CPU backend cannot capture {what}: {why}")


def _value_read(what: str) -> RuntimeError:
    return refusal(
        what,
        "it reads a tensor's values on the host, and a replay reruns only the recorded "
        "kernels, so the value (and whatever Python decided from it) would stay as at "
        f"capture; {_SYNC}. Read it outside the graphed callable, or keep it on the device "
        "(torch.where instead of an if)",
    )


def may_read_host(func: torch._ops.OpOverload) -> bool:
    """Whether :func:`check_host_read` may refuse ``func`` (for some arguments)."""
    tags = func.tags
    return (
        func in _SCALAR_READS
        or func in _MASK_INDEXING
        or func in _CUDA_SYNCS
        or func.overloadpacket in _CUDA_SYNC_PACKETS
        or func is _aten.histc.default
        or _CHECK_ERRORS in _argument_names(func)
        or torch.Tag.data_dependent_output in tags
        or torch.Tag.dynamic_output_shape in tags
    )


def check_host_read(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: Any) -> None:
    """Raise if ``func`` reads tensor values on the host or sizes its output by them."""
    tags = func.tags
    if func in _SCALAR_READS:
        raise _value_read(
            "Tensor.item(), or bool(), int() or float() of a tensor (aten._local_scalar_dense)"
        )
    if torch.Tag.data_dependent_output in tags:
        raise _value_read(f"{func}, which returns a value computed from tensor values")
    if func in _MASK_INDEXING:
        if any(_is_mask(i) for i in _indices(args, kwargs)):
            raise _shape_read(f"indexing with a boolean mask ({func})")
        return
    if torch.Tag.dynamic_output_shape in tags and not _sized_by_argument(func, args, kwargs):
        raise _shape_read(f"{func}")
    _check_cuda_sync(func, args, kwargs)


_CHECK_ERRORS = "check_errors"


@functools.cache
def _argument_names(func: torch._ops.OpOverload) -> tuple[str, ...]:
    return tuple(argument.name for argument in func._schema.arguments)


def _argument(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: Any, name: str) -> Any:
    """The value ``func`` got for its argument ``name`` (its default where not passed)."""
    if name in kwargs:
        return kwargs[name]
    index = _argument_names(func).index(name)
    if index < len(args):
        return args[index]
    return func._schema.arguments[index].default_value


def _check_cuda_sync(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: Any) -> None:
    """Raise for an operator whose CUDA kernel reads results on the host (its CPU kernel
    reads them inside, where the recorder cannot see it)."""
    what = _CUDA_SYNCS.get(func) or _CUDA_SYNC_PACKETS.get(func.overloadpacket)
    if what is not None:
        raise _cuda_sync(
            what,
            "Compute it outside the graphed callable, or use a form that stays on the device "
            "where torch has one (torch.linalg.cholesky_ex, inv_ex, solve_ex, lu_factor_ex "
            "and ldl_factor_ex return their error codes as a tensor)",
        )
    if _CHECK_ERRORS in _argument_names(func) and _argument(func, args, kwargs, _CHECK_ERRORS):
        raise _cuda_sync(
            f"{func} with check_errors=True",
            "Pass check_errors=False and check the returned info outside the graphed callable",
        )
    if func is _aten.histc.default:
        low, high = _argument(func, args, kwargs, "min"), _argument(func, args, kwargs, "max")
        if low == high:
            raise _cuda_sync(
                f"torch.histc with min == max == {low} (the input's own range)",
                "Pass the range as min and max",
            )


def _cuda_sync(what: str, instead: str) -> RuntimeError:
    return refusal(
        what,
        "on CUDA it reads a result on the host (error codes, a range) before it returns, "
        f"where the CPU kernel reads it inside, out of the trace's sight; {_SYNC}. {instead}",
    )


def _shape_read(what: str) -> RuntimeError:
    return refusal(
        what,
        "its output's shape depends on tensor values, which the host must read to allocate "
        f"it; a replay keeps the shape the capture found; {_SYNC}. Use a fixed-size form "
        "(torch.where(mask, x, 0), nonzero_static, repeat_interleave with output_size)",
    )


def _indices(args: tuple[Any, ...], kwargs: Any) -> list[Any]:
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    return list(indices) if isinstance(indices, (list, tuple)) else []


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _sized_by_argument(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: Any) -> bool:
    """Whether a dynamic-shape op got its output size as an argument (no value read)."""
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is not None
    return False


def host_read_error(func: Any) -> RuntimeError | None:
    """The refusal for a tensor method that reads values on the host, else None."""
    what = _HOST_METHODS.get(func)
    return None if what is None else _value_read(what)


_TORCH_DIR = str(Path(torch.__file__).parent)
_LEANGRAPH_DIR = str(Path(__file__).resolve().parents[1])
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]


def _library_frame(filename: str) -> bool:
    if filename.startswith((_TORCH_DIR, _LEANGRAPH_DIR)):
        return True
    return filename.startswith(_STDLIB_DIR) and "site-packages" not in filename


CALLABLE_ENTRY = "_run_callable"
"""The function of ``leangraph.build.graph`` that calls the callable being captured."""


def user_site() -> str:
    """' at FILE:LINE in FUNCTION' for the innermost frame outside torch, leangraph and the
    standard library: where in the user's code the refused thing happened. Where the callable
    is torch's own (a ``torch.nn`` module graphed as it is), leangraph's capture comes before
    any such frame: then the innermost ``forward`` in torch, the module's code that did it
    ('' if none)."""
    torch_forward = None
    for frame in reversed(traceback.extract_stack()):
        if not _library_frame(frame.filename):
            return f" at {frame.filename}:{frame.lineno} in {frame.name}"
        if frame.filename.startswith(_LEANGRAPH_DIR):
            if frame.name == CALLABLE_ENTRY:
                break  # where the capture called the callable: all below it was torch's
        elif torch_forward is None and frame.name == "forward":
            torch_forward = frame
    if torch_forward is None:
        return ""
    return f" at {torch_forward.filename}:{torch_forward.lineno} in forward"
