"""Model pieces for the demo and the benchmark: a pre-norm transformer block (GPT style), a
Llama decoder layer as one tensor-parallel rank holds it (the bench's presets), their samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias, cast, overload

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "BlockShape",
    "LlamaBlock",
    "LlamaShape",
    "RMSNorm",
    "Shape",
    "TransformerBlock",
    "hidden_batches",
    "make_blocks",
    "plural",
    "sample_hidden",
]


@dataclass(frozen=True, slots=True)
class BlockShape:
    """Shape of one transformer block and of the activations it sees (batch-first)."""

    hidden: int = 64
    heads: int = 4
    sequence: int = 32
    micro_batch: int = 1
    dtype: torch.dtype = torch.float32


class TransformerBlock(nn.Module):
    """Pre-norm self-attention plus a 4x GELU MLP, GPT style, causal."""

    def __init__(self, shape: BlockShape) -> None:
        super().__init__()
        if shape.hidden % shape.heads:
            raise ValueError(f"hidden {shape.hidden} is not divisible by heads {shape.heads}")
        self.heads = shape.heads
        self.norm1 = nn.LayerNorm(shape.hidden)
        self.qkv = nn.Linear(shape.hidden, 3 * shape.hidden)
        self.proj = nn.Linear(shape.hidden, shape.hidden)
        self.norm2 = nn.LayerNorm(shape.hidden)
        self.fc1 = nn.Linear(shape.hidden, 4 * shape.hidden)
        self.fc2 = nn.Linear(4 * shape.hidden, shape.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, -1).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """One tensor-parallel rank's share of a Llama decoder layer, and its activations.

    ``heads``, ``kv_heads`` and ``ffn`` are the rank's own (Llama-3-70B over TP2: 32 of its 64
    query heads, 4 of its 8 KV heads, 14336 of its 28672 FFN columns); ``hidden`` is the
    model's, as the rank's input and output are (no sequence parallelism). No tensor-parallel
    communication: one process computes what one rank computes between its collectives.
    """

    hidden: int = 8192
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    ffn: int = 14336
    sequence: int = 4096
    micro_batch: int = 1
    dtype: torch.dtype = torch.bfloat16
    rope: bool = True
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @property
    def qkv_width(self) -> int:
        """Output features of the fused QKV projection: query, key and value heads."""
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def parameter_count(self) -> int:
        """Parameters of one layer: QKV, output projection, gate+up, down, two RMSNorms."""
        h, q = self.hidden, self.heads * self.head_dim
        return h * self.qkv_width + q * h + h * 2 * self.ffn + self.ffn * h + 2 * h


Shape: TypeAlias = "BlockShape | LlamaShape"
"""What the bench's workload is made of: GPT-style blocks or Llama layers."""

_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
"""``scaled_dot_product_attention(enable_gqa=...)`` exists from torch 2.5 on."""


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least fp32, as fused norm kernels compute."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm that saves what a fused kernel saves: its input and the fp32 reciprocal RMS
    (torch's composite ``rms_norm`` saves fp32 copies instead, 4x the bytes in bf16)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(_wide(x).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (_wide(x) * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        normed = _wide(x) * rstd
        scaled = _wide(grad) * _wide(weight)
        grad_x = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
        grad_weight = (_wide(grad) * normed).flatten(0, -2).sum(0)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned scale (:class:`_RMSNormFunction`)."""

    def __init__(self, size: int, *, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _RMSNormFunction.apply(x, self.weight, self.eps)
        return cast(torch.Tensor, out)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class LlamaBlock(nn.Module):
    """A Llama decoder layer, batch-first, from plain torch ops: RMSNorm, fused QKV with
    grouped-query heads, RoPE (unless ``shape.rope`` is False), causal SDPA (flash attention on
    a GPU), output projection, RMSNorm, SwiGLU FFN (fused gate+up), no biases, no dropout.

    What it saves for backward per layer is what fused kernels save (the RMSNorms their input
    and fp32 reciprocal RMS, SwiGLU the gate+up output, flash attention q, k, v, its output and
    log-sum-exp): at sequence 4096 in bf16, 812 MiB with RoPE, the block input included.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        if shape.heads % shape.kv_heads:
            raise ValueError(f"heads {shape.heads} is not a multiple of kv_heads {shape.kv_heads}")
        self.shape = shape
        h, q, dtype = shape.hidden, shape.heads * shape.head_dim, shape.dtype
        self.norm1 = RMSNorm(h, eps=shape.eps, dtype=dtype)
        self.qkv = nn.Linear(h, shape.qkv_width, bias=False, dtype=dtype)
        self.proj = nn.Linear(q, h, bias=False, dtype=dtype)
        self.norm2 = RMSNorm(h, eps=shape.eps, dtype=dtype)
        self.gate_up = nn.Linear(h, 2 * shape.ffn, bias=False, dtype=dtype)
        self.down = nn.Linear(shape.ffn, h, bias=False, dtype=dtype)
        d = shape.head_dim
        inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, d, 2).float() / d)
        angles = torch.outer(torch.arange(shape.sequence).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype), persistent=False)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        if not self.shape.rope:
            return x
        return x * self.cos + _rotate_half(x) * self.sin

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.shape
        batch, seq, _ = x.shape
        d, kv = shape.head_dim, shape.kv_heads
        q, k, v = self.qkv(self.norm1(x)).split([shape.heads * d, kv * d, kv * d], dim=-1)
        q = self._rope(q.view(batch, seq, shape.heads, d).transpose(1, 2))
        k = self._rope(k.view(batch, seq, kv, d).transpose(1, 2))
        v = v.view(batch, seq, kv, d).transpose(1, 2)
        if _SDPA_HAS_GQA:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            groups = shape.heads // kv
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, shape.heads * d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(x)
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


@overload
def make_blocks(
    count: int, shape: BlockShape, device: torch.device | str, seed: int = 0
) -> list[TransformerBlock]: ...
@overload
def make_blocks(
    count: int, shape: LlamaShape, device: torch.device | str, seed: int = 0
) -> list[LlamaBlock]: ...
@overload
def make_blocks(
    count: int, shape: Shape, device: torch.device | str, seed: int = 0
) -> list[TransformerBlock] | list[LlamaBlock]: ...
def make_blocks(
    count: int, shape: Shape, device: torch.device | str, seed: int = 0
) -> list[TransformerBlock] | list[LlamaBlock]:
    """``count`` blocks of ``shape`` with deterministic initial weights: GPT-style
    :class:`TransformerBlock` for a :class:`BlockShape`, :class:`LlamaBlock` for a
    :class:`LlamaShape` (made on ``device`` directly: 20 of them are 16 GiB)."""
    torch.manual_seed(seed)
    if isinstance(shape, LlamaShape):
        with torch.device(device):
            return [LlamaBlock(shape) for _ in range(count)]
    if torch.device(device).type == "meta":  # sizes only: nothing is allocated anywhere
        with torch.device("meta"):
            return [TransformerBlock(shape).to(dtype=shape.dtype) for _ in range(count)]
    return [TransformerBlock(shape).to(device=device, dtype=shape.dtype) for _ in range(count)]


def sample_hidden(
    shape: Shape, device: torch.device | str, requires_grad: bool = True
) -> torch.Tensor:
    """A random activation of the block's input shape."""
    x = torch.randn(
        shape.micro_batch, shape.sequence, shape.hidden, device=device, dtype=shape.dtype
    )
    return x.requires_grad_(requires_grad)


def hidden_batches(
    shape: Shape, count: int, device: torch.device | str, generator: torch.Generator
) -> list[torch.Tensor]:
    """``count`` random activations of the block's input shape, drawn on the CPU from
    ``generator`` (so they do not depend on the device) and moved to ``device``."""
    return [
        torch.randn(shape.micro_batch, shape.sequence, shape.hidden, generator=generator).to(
            device, shape.dtype
        )
        for _ in range(count)
    ]


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 block``, ``4 blocks``: how the tools count things in their output; ``nouns`` where
    the plural is not ``noun`` + s (``microbatch``, ``microbatches``)."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"
