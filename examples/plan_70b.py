"""Plan the graph memory of one pipeline rank of a Llama-3-70B pre-training run, on meta tensors.

Run from the repository root::

    python examples/plan_70b.py

The run: Llama-3-70B (80 layers, hidden 8192, 64 query heads and 8 KV heads of 128, SwiGLU FFN
28672, RMSNorm, RoPE, no dropout), bf16, sequence 8192, micro-batch 1, global batch 256 on 64
GPUs with TP2 x PP4 x DP8, so 256 / 8 = 32 microbatches per rank per iteration. Virtual
pipeline 5: each rank owns 20 layers as 5 chunks of 4. Rank 0 runs Megatron-LM's interleaved
1F1B order (``leangraph.schedules.interleaved_1f1b(4, 5, 0, 32)``), the rank that keeps the
most forwards in flight.

Assumptions, modelled on Megatron-LM with Transformer Engine-style fused kernels:

* Tensor parallelism 2 with sequence parallelism: a block's input and output are sharded
  along the sequence ([s/t, b, h]); the column-parallel linears all-gather their input and
  save only the shard (they all-gather again in backward); the row-parallel linears
  reduce-scatter their output. One process stands for one rank: the collectives are simulated
  by repeating / summing sequence slices, which gives the right shapes (and thus bytes), not
  the right values.
* Fused RMSNorm (saves its input and the fp32 reciprocal RMS), fused SwiGLU (saves its input
  only, as Megatron's ``bias_swiglu_impl``), RoPE that saves nothing but its cos/sin tables,
  flash attention through ``torch.nn.functional.scaled_dot_product_attention`` (measured on
  meta as CUDA's flash kernel: saves q, k, v, the output and its log-sum-exp; GQA without
  expanding k and v).
* Weights, main gradients and optimizer state are outside the plan: it covers what
  ``make_graphed_callables`` itself holds (activations, static buffers, transient gradients).

The script also checks ``plan_memory``'s measurement against Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models" (2022), section 4.1, on a GPT block of
the paper's structure.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional as F

from leangraph import MemoryPlan, plan_memory
from leangraph.memory import format_bytes
from leangraph.schedules import interleaved_1f1b, max_in_flight

GiB = 1024**3


# ---------------------------------------------------------------------------- Llama shard


@dataclass(frozen=True)
class LlamaShape:
    """One tensor-parallel rank's view of a Llama block and of its activations."""

    hidden: int = 8192
    heads: int = 64
    kv_heads: int = 8
    ffn: int = 28672
    tp: int = 2
    sequence_parallel: bool = True
    sequence: int = 8192
    micro_batch: int = 1
    dtype: torch.dtype = torch.bfloat16
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads // self.tp

    @property
    def local_ffn(self) -> int:
        return self.ffn // self.tp

    @property
    def input_sequence(self) -> int:
        """Sequence length of a block's input and output on this rank."""
        return self.sequence // self.tp if self.sequence_parallel else self.sequence


def _all_gather(x: torch.Tensor, tp: int) -> torch.Tensor:
    """Stand-in for the sequence all-gather of [s/t, b, h] -> [s, b, h] (shapes only)."""
    return x.repeat(tp, 1, 1)


def _reduce_scatter(x: torch.Tensor, tp: int) -> torch.Tensor:
    """Stand-in for the sequence reduce-scatter of [s, b, h] -> [s/t, b, h] (shapes only)."""
    return x.view(tp, x.shape[0] // tp, *x.shape[1:]).sum(0)


class _GatherLinear(torch.autograd.Function):
    """Column-parallel linear with sequence parallelism: all-gather, then ``x @ W^T``.

    Saves the sequence shard, not the gathered input, and gathers it again in backward (what
    Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` does).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, tp: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.tp = tp
        return F.linear(_all_gather(x, tp) if tp > 1 else x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight = ctx.saved_tensors
        total = _all_gather(x, ctx.tp) if ctx.tp > 1 else x
        grad_input = grad @ weight
        if ctx.tp > 1:
            grad_input = _reduce_scatter(grad_input, ctx.tp)
        grad_weight = grad.flatten(0, -2).t() @ total.flatten(0, -2)
        return grad_input, grad_weight, None


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least fp32 (fp64 stays fp64), as fused kernels compute."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm computed in fp32 that saves its input and the fp32 reciprocal RMS."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(_wide(x).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (_wide(x) * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight, rstd = ctx.saved_tensors
        normed = _wide(x) * rstd
        scaled = _wide(grad) * _wide(weight)
        grad_x = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
        grad_weight = (_wide(grad) * normed).flatten(0, -2).sum(0)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class _FusedSwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of the fused ``[gate | up]`` projection; saves its input only."""

    @staticmethod
    def forward(ctx: Any, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        gate, up = _wide(gate_up).chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        grad_gate = _wide(grad) * up * sig * (1 + gate * (1 - sig))
        grad_up = _wide(grad) * gate * sig
        return torch.cat([grad_gate, grad_up], dim=-1).to(gate_up.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class LlamaBlock(nn.Module):
    """One TP rank's shard of a Llama-3 decoder layer, sequence-first ([s, b, h])."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        d, tp = shape.head_dim, shape.tp
        qkv_out = (shape.local_heads + 2 * shape.local_kv_heads) * d
        dtype = shape.dtype
        self.norm1 = nn.Parameter(torch.ones(shape.hidden, dtype=dtype))
        self.qkv = nn.Parameter(torch.empty(qkv_out, shape.hidden, dtype=dtype))
        self.proj = nn.Parameter(torch.empty(shape.hidden, shape.local_heads * d, dtype=dtype))
        self.norm2 = nn.Parameter(torch.ones(shape.hidden, dtype=dtype))
        self.gate_up = nn.Parameter(torch.empty(2 * shape.local_ffn, shape.hidden, dtype=dtype))
        self.down = nn.Parameter(torch.empty(shape.hidden, shape.local_ffn, dtype=dtype))
        for weight in (self.qkv, self.proj, self.gate_up, self.down):
            nn.init.normal_(weight, std=0.02)
        inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, d, 2).float() / d)
        angles = torch.outer(torch.arange(shape.sequence).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos()[:, None, None, :].to(shape.dtype), False)
        self.register_buffer("sin", angles.sin()[:, None, None, :].to(shape.dtype), False)
        self._tp = tp if shape.sequence_parallel else 1

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cos + _rotate_half(x) * self.sin

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.shape
        s, b = x.shape[0] * self._tp, x.shape[1]
        qkv = _GatherLinear.apply(_FusedRMSNorm.apply(x, self.norm1, shape.eps), self.qkv,
                                  self._tp)
        q, k, v = qkv.split([shape.local_heads * shape.head_dim,
                             shape.local_kv_heads * shape.head_dim,
                             shape.local_kv_heads * shape.head_dim], dim=-1)
        q = self._rope(q.view(s, b, shape.local_heads, shape.head_dim))
        k = self._rope(k.view(s, b, shape.local_kv_heads, shape.head_dim))
        v = v.view(s, b, shape.local_kv_heads, shape.head_dim)
        out = F.scaled_dot_product_attention(
            q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
            is_causal=True, enable_gqa=True)
        out = F.linear(out.permute(2, 0, 1, 3).reshape(s, b, -1), self.proj)
        return _reduce_scatter(out, self._tp) if self._tp > 1 else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(x)
        normed = _FusedRMSNorm.apply(x, self.norm2, self.shape.eps)
        out = F.linear(_FusedSwiGLU.apply(_GatherLinear.apply(normed, self.gate_up, self._tp)),
                       self.down)
        return x + (_reduce_scatter(out, self._tp) if self._tp > 1 else out)


def flash_rng_state_bytes() -> int:
    """Bytes of the RNG seed and offset that CUDA's flash attention returns and saves.

    They differ between torch versions (two int64 scalars, 16 bytes, in torch 2.4 to 2.6; a
    uint64 pair and a uint64 scalar, 24 bytes, in newer ones), so they are read from this
    torch's own fake kernel.
    """
    with FakeTensorMode():
        query = torch.empty(1, 1, 1, 8, device="cuda")
        seed, offset = torch.ops.aten._scaled_dot_product_flash_attention(query, query, query)[6:8]
    return seed.numel() * seed.element_size() + offset.numel() * offset.element_size()


def llama_expected_bytes(shape: LlamaShape) -> dict[str, int]:
    """What :class:`LlamaBlock` should save for backward, tensor by tensor (inputs excluded).

    Used to check that the measured figure is exactly what the block's structure implies.
    """
    s, b, e = shape.sequence, shape.micro_batch, shape.dtype.itemsize
    shard = shape.input_sequence * b
    q_dim = shape.local_heads * shape.head_dim
    kv_dim = shape.local_kv_heads * shape.head_dim
    return {
        "RMSNorm 1 fp32 rstd": 4 * shard,
        "QKV linear input (norm 1 output)": e * shard * shape.hidden,
        "QKV output (v is a view of it)": e * s * b * (q_dim + 2 * kv_dim),
        "q after RoPE": e * s * b * q_dim,
        "k after RoPE": e * s * b * kv_dim,
        "attention output (= proj input)": e * s * b * q_dim,
        "attention log-sum-exp (fp32)": 4 * b * shape.local_heads * s,
        "flash RNG seed and offset": flash_rng_state_bytes(),
        "RMSNorm 2 input (residual)": e * shard * shape.hidden,
        "RMSNorm 2 fp32 rstd": 4 * shard,
        "gate/up linear input (norm 2 output)": e * shard * shape.hidden,
        "gate/up output (SwiGLU input)": e * s * b * 2 * shape.local_ffn,
        "SwiGLU output (down input)": e * s * b * shape.local_ffn,
    }


# ---------------------------------------------------------------------------- paper GPT block


class PaperGPTBlock(nn.Module):
    """The GPT layer of Korthikanti et al. (2022), batch-first.

    Pre-norm LayerNorm, QKV projection, explicit ``softmax(QK^T / sqrt(d)) V`` attention with
    dropout on the probabilities, output projection, dropout, residual; LayerNorm, 4h GeLU MLP,
    dropout, residual. Dropout uses ``torch.native_dropout`` (what ``F.dropout`` dispatches to
    on CUDA), whose saved mask is one byte per element as the paper assumes; on CPU and meta
    ``F.dropout`` would multiply by a noise tensor of the input's dtype instead (2 bytes).
    """

    causal: torch.Tensor

    def __init__(self, hidden: int, heads: int, max_sequence: int, dropout: float = 0.1,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1 = nn.LayerNorm(hidden, dtype=dtype)
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.ln2 = nn.LayerNorm(hidden, dtype=dtype)
        self.fc1 = nn.Linear(hidden, 4 * hidden, dtype=dtype)
        self.fc2 = nn.Linear(4 * hidden, hidden, dtype=dtype)
        mask = torch.ones(max_sequence, max_sequence, dtype=torch.bool).triu(1)
        self.register_buffer("causal", mask, persistent=False)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0:
            return x
        return torch.native_dropout(x, self.dropout, True)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.transpose(1, 2) for t in
                   self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).unbind(2))
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.heads))
        scores = scores.masked_fill(self.causal[:s, :s], float("-inf"))
        context = torch.matmul(self._drop(torch.softmax(scores, dim=-1)), v)
        x = x + self._drop(self.proj(context.transpose(1, 2).reshape(b, s, h)))
        return x + self._drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def korthikanti_bytes(sequence: int, batch: int, hidden: int, heads: int) -> int:
    """Activation bytes per layer of the paper's eq. (1): ``s*b*h*(34 + 5*a*s/h)``.

    Attention 11sbh + 5as^2b (QKV input 2, Q and K 4, softmax output 2as^2b, its dropout mask
    as^2b, dropout output 2as^2b and V 2, projection input 2, dropout mask 1), MLP 19sbh (fc1
    input 2, GeLU input 8, fc2 input 8, dropout mask 1), two LayerNorm inputs 4sbh.
    """
    sbh = sequence * batch * hidden
    return 34 * sbh + 5 * heads * sequence * sequence * batch


def paper_check(hidden: int = 1024, heads: int = 16, sequence: int = 2048,
                batch: int = 1) -> tuple[int, int, MemoryPlan]:
    """Measure :class:`PaperGPTBlock` on meta; returns (formula, measured, plan).

    ``measured`` is everything saved except parameters and buffers: the plan's activations
    plus the saved block input (the paper counts LayerNorm 1's input as the layer's).
    """
    with torch.device("meta"):
        block = PaperGPTBlock(hidden, heads, sequence)
        x = torch.empty(batch, sequence, hidden, dtype=torch.bfloat16, requires_grad=True)
    plan = plan_memory(block, (x,))
    layer = plan.layers[0]
    return korthikanti_bytes(sequence, batch, hidden, heads), \
        layer.activation_bytes + layer.saved_input_bytes, plan


# ---------------------------------------------------------------------------- the 70B plan


def plan_rank(shape: LlamaShape, pp: int = 4, vp: int = 5, layers_per_chunk: int = 4,
              microbatches: int = 32, rank: int = 0) -> tuple[MemoryPlan, Sequence[int]]:
    """Plan one pipeline rank on meta tensors; returns the plan and the order."""
    order = interleaved_1f1b(pp, vp, rank, microbatches)
    with torch.device("meta"):
        layers = tuple(LlamaBlock(shape) for _ in range(vp * layers_per_chunk))
        sample = torch.empty(shape.input_sequence, shape.micro_batch, shape.hidden,
                             dtype=shape.dtype, requires_grad=True)
    samples = tuple((sample,) for _ in range(len(layers) * microbatches))
    plan = plan_memory(layers, samples, order=order, num_layers_per_chunk=layers_per_chunk)
    return plan, order


def _gib(count: float) -> str:
    return f"{count / GiB:8.2f} GiB"


def _report_layer(shape: LlamaShape, plan: MemoryPlan) -> list[str]:
    layer = plan.layers[0]
    expected = llama_expected_bytes(shape)
    sbh_t = shape.sequence * shape.micro_batch * shape.hidden / shape.tp
    unit = (layer.activation_bytes + layer.saved_input_bytes) / sbh_t
    fp32 = sum(v for k, v in expected.items() if "fp32" in k or "RNG" in k)
    unit_bf16 = unit - fp32 / sbh_t
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaBlock(shape).parameters())
    lines = [f"Parameters per layer shard: {params / 1e6:.1f} M (bf16 weights of the rank's 20 "
             f"layers: {20 * params * shape.dtype.itemsize / GiB:.2f} GiB, outside the plan)",
             "",
             "Per layer (one TP rank's shard, one microbatch), measured on meta:"]
    for name, value in expected.items():
        lines.append(f"  {name:<48} {format_bytes(value):>11}")
    total = sum(expected.values())
    verdict = "exact" if total == layer.activation_bytes else "MISMATCH"
    lines += [
        f"  {'saved activations, measured':<48} {format_bytes(layer.activation_bytes):>11}"
        f"  (itemized sum {format_bytes(total)}: {verdict})",
        f"  {'block input (saved by RMSNorm 1; static input)':<48} "
        f"{format_bytes(layer.saved_input_bytes):>11}",
        f"  {'block output':<48} {format_bytes(layer.output_bytes):>11}",
        f"  {'backward transient: grad-input + param grads':<48} "
        f"{format_bytes(layer.grad_input_bytes):>11} + {format_bytes(layer.param_grad_bytes)}",
        f"  {'in units of s*b*h/t bytes, block input included':<48} {unit:11.3f}"
        f"  ({unit_bf16:.3f} of it in bf16 tensors)",
        "",
    ]
    return lines


def _report_plan(plan: MemoryPlan, order: Sequence[int]) -> list[str]:
    flight = max_in_flight(order)
    rows = [
        ("eager step peak (this order)", plan.eager_peak_bytes),
        ("warm-up of every graph, all kept (naive)", plan.naive_warmup_peak_bytes),
        ("warm-up peak, leangraph (one graph per layer)", plan.warmup_peak_bytes),
        ("capture peak", plan.capture_peak_bytes),
        ("held after capture (pool + static buffers)", plan.held_bytes),
        ("  of which static buffers", plan.static_bytes),
    ]
    lines = [f"Plan: {plan.layout.num_graphs} graphs; the order keeps at most {flight.total} "
             f"chunk-microbatches ({plan.max_in_flight} layer graphs) in flight"]
    lines += [f"  {name:<48} {_gib(value)}" for name, value in rows]
    naive = plan.naive_warmup_peak_bytes / plan.eager_peak_bytes
    lines += [f"  naive warm-up / eager step: {naive:.1f}x",
              f"  eager peak at {plan.eager_peak_step}; capture peak at "
              f"{plan.capture_peak_step}", ""]
    return lines


def _report_paper() -> list[str]:
    h, a, s, b = 1024, 16, 2048, 1
    formula, measured, _ = paper_check(h, a, s, b)
    return [
        f"Korthikanti check: GPT block h={h}, a={a}, s={s}, b={b}, bf16, dropout 0.1, "
        "explicit attention",
        f"  formula s*b*h*(34 + 5*a*s/h)        {format_bytes(formula):>11}",
        f"  measured (activations + block input) {format_bytes(measured):>11}"
        f"  ratio {measured / formula:.5f}",
        f"  difference {measured - formula} B; the two LayerNorms' fp32 mean and rstd, which "
        f"the paper leaves out, are 16*s*b = {16 * s * b} B",
        "",
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the per-layer measurement, the plan and the Korthikanti check."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--no-sequence-parallel", action="store_true")
    parser.add_argument("--describe", action="store_true", help="also print plan.describe()")
    args = parser.parse_args(argv)
    shape = LlamaShape(sequence_parallel=not args.no_sequence_parallel)
    plan, order = plan_rank(shape, microbatches=args.microbatches)
    sp = "with" if shape.sequence_parallel else "without"
    print(f"Llama-3-70B pre-training, pipeline rank 0 of PP4 x VP5 (5 chunks x 4 layers), TP2 "
          f"{sp} sequence parallelism, bf16, s={shape.sequence}, micro-batch "
          f"{shape.micro_batch}, {args.microbatches} microbatches, order "
          f"interleaved_1f1b(4, 5, rank=0, {args.microbatches})\n")
    print("\n".join(_report_layer(shape, plan) + _report_plan(plan, order) + _report_paper()))
    if args.describe:
        print(plan.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
