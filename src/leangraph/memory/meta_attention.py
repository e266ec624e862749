"""Fused attention on meta tensors, for memory plans of models that are never allocated.

On ``meta``, ``scaled_dot_product_attention`` has no kernel choice and would run its math
fallback (saving the ``s x s`` probabilities). :class:`MetaAttention` measures it instead as
the fused flash kernel of the modelled device, with the outputs of torch's own meta kernel (on
torch 2.4, which has no meta kernel for CUDA's flash attention, with the outputs torch 2.5
gives). Modelling the CPU, it follows CPU's own kernel choice: where that is the math path
(say grouped-query attention before CPU's flash kernel took it), the math path is measured,
as a CPU run would.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["META_ATTENTION", "MetaAttention"]

META_ATTENTION = ("cuda", "cpu", "math")
"""What ``scaled_dot_product_attention`` on meta tensors may stand for."""


class MetaAttention(TorchFunctionMode):
    """Measures ``scaled_dot_product_attention`` on meta tensors as a fused flash kernel."""

    def __init__(self, like: str) -> None:
        if like not in META_ATTENTION:
            raise ValueError(f"meta_attention must be one of {META_ATTENTION}, got {like!r}")
        super().__init__()
        self._like = like

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self._like != "math":
            fused = _flash_attention(self._like, *args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _flash_attention(
    like: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    """The flash kernel's output on meta tensors, or None where the kernel does not apply."""
    if query.device.type != "meta" or attn_mask is not None:
        return None
    if key.shape[-3] != query.shape[-3] and not enable_gqa:
        return None  # let PyTorch raise its own error
    if like == "cuda":
        with _cuda_flash_meta_kernel():
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
    if not _cpu_runs_flash(query, key, value, dropout_p, is_causal, scale, enable_gqa):
        return None  # a CPU run takes the math path, which is PyTorch's meta fallback too
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale
    )[0]


def _cpu_runs_flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> bool:
    """Whether CPU's SDPA would pick its flash kernel for tensors like these (no mask).

    Asks CPU's own kernel choice, which changes between torch versions (torch 2.5 and 2.6
    run grouped-query attention on the math path) and with ``torch.nn.attention.sdpa_kernel``.
    """
    gqa: dict[str, Any] = {"enable_gqa": True} if enable_gqa else {}  # torch 2.4 has none
    choice = torch._fused_sdp_choice(
        _cpu_stand_in(query),
        _cpu_stand_in(key),
        _cpu_stand_in(value),
        None,
        dropout_p,
        is_causal,
        scale=scale,
        **gqa,
    )
    return choice == SDPBackend.FLASH_ATTENTION.value


def _cpu_stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with ``tensor``'s sizes, dtype and last stride, all that CPU's kernel
    choice reads, over one row of memory (stride 0 elsewhere), whatever the sizes."""
    strides = [0] * tensor.dim()
    if strides:
        strides[-1] = tensor.stride(-1)
    return torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype)


_CUDA_FLASH = "aten::_scaled_dot_product_flash_attention"


def _cuda_flash_meta_kernel() -> contextlib.AbstractContextManager[Any]:
    """Torch's own meta kernel of CUDA's flash attention, or ours where torch has none."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(_CUDA_FLASH, "Meta"):
        return contextlib.nullcontext()
    return _CudaFlashMetaKernel()


class _CudaFlashMetaKernel(TorchDispatchMode):
    """CUDA's flash attention on meta tensors, for torch 2.4, which has no meta kernel for it.

    Autograd runs above this mode, so it saves what it saves for the real kernel; the outputs
    are those of torch 2.4's own FakeTensor kernel and torch 2.5's meta kernel: the output laid
    out as the query, its fp32 log-sum-exp, and the RNG seed and offset as int64 scalars.
    """

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is not torch.ops.aten._scaled_dot_product_flash_attention.default:
            return func(*args, **(kwargs or {}))
        query, key = args[0], args[1]
        batch, heads, query_length = query.shape[:3]
        output = torch.empty_like(query.transpose(1, 2)).transpose(1, 2)
        logsumexp = torch.empty(batch, heads, query_length, dtype=torch.float, device="meta")
        seed, offset = (torch.empty((), dtype=torch.long, device="meta") for _ in range(2))
        debug_mask = torch.empty(0, dtype=query.dtype, device="meta")  # never asked for
        return output, logsumexp, None, None, query_length, key.shape[2], seed, offset, debug_mask
