"""Model pieces for the demo and the benchmark: a pre-norm transformer block and its samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "BlockShape",
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


def make_blocks(
    count: int, shape: BlockShape, device: torch.device | str, seed: int = 0
) -> list[TransformerBlock]:
    """``count`` blocks with deterministic initial weights."""
    torch.manual_seed(seed)
    return [TransformerBlock(shape).to(device=device, dtype=shape.dtype) for _ in range(count)]


def sample_hidden(
    shape: BlockShape, device: torch.device | str, requires_grad: bool = True
) -> torch.Tensor:
    """A random activation of the block's input shape."""
    x = torch.randn(
        shape.micro_batch, shape.sequence, shape.hidden, device=device, dtype=shape.dtype
    )
    return x.requires_grad_(requires_grad)


def hidden_batches(
    shape: BlockShape, count: int, device: torch.device | str, generator: torch.Generator
) -> list[torch.Tensor]:
    """``count`` random activations of the block's input shape, drawn on the CPU from
    ``generator`` (so they do not depend on the device) and moved to ``device``."""
    return [
        torch.randn(shape.micro_batch, shape.sequence, shape.hidden, generator=generator).to(
            device, shape.dtype
        )
        for _ in range(count)
    ]


def plural(count: int, noun: str) -> str:
    """``1 block``, ``4 blocks``: how the tools count things in their output."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
