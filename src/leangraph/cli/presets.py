"""``leangraph bench --preset``: named workloads at a real model's layer geometry, on one GPU.

A preset fixes the pipeline rank and its layers; ``--sequence`` and ``--microbatches`` may
change its size (they default to what fits), every other workload flag is the preset's.

``llama3-70b-pp4vp5`` is the A/B of the seed's validation report: rank 0 of a PP4 x VP5
Llama-3-70B pipeline (Megatron interleaved 1F1B order of that rank), its 20 decoder layers
(5 chunks of 4) as one TP2 rank holds them: hidden 8192, 32 query and 4 KV heads of 128,
SwiGLU FFN 14336, RMSNorm, RoPE; micro-batch 1, bf16, sequence 4096, 16 microbatches. Per
layer that is 427.8 M parameters (816 MiB in bf16), so 15.9 GiB of weights and as much again
of gradients; the schedule keeps at most 23 chunk-microbatches (92 layer forwards) in flight,
at 812 MiB saved per layer forward: about 73 GiB of activations at eager's step peak.
``llama3-70b-pp4vp5-norope`` is the same without RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from .bench import FUSED, BenchConfig, method_unavailable
from .workloads import LlamaShape

__all__ = ["PRESETS", "BenchPreset"]

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class BenchPreset:
    """One named bench workload: rank ``rank`` of a ``pp_size`` x ``vp_size`` interleaved
    pipeline of ``layers_per_chunk`` Llama layers per chunk, and the methods it compares."""

    name: str
    title: str
    pp_size: int
    vp_size: int
    rank: int
    layers_per_chunk: int
    num_microbatches: int
    shape: LlamaShape
    steps: int = 3
    methods: tuple[str, ...] = ("eager", "torch", "leangraph", FUSED)

    @property
    def num_layers(self) -> int:
        """Layers the rank holds: every chunk's."""
        return self.vp_size * self.layers_per_chunk

    def available_methods(self, device: str) -> tuple[str, ...]:
        """The preset's methods that can run on ``device`` (:func:`method_unavailable`)."""
        return tuple(m for m in self.methods if method_unavailable(m, device) is None)

    def weight_bytes(self) -> int:
        """Bytes of the rank's weights (and as many again of their gradients)."""
        return self.num_layers * self.shape.parameter_count() * self.shape.dtype.itemsize

    def config(
        self,
        *,
        device: str,
        sequence: int | None = None,
        num_microbatches: int | None = None,
        steps: int | None = None,
        methods: tuple[str, ...] | None = None,
        rounds: int = 0,
        launch_steps: int = 0,
    ) -> BenchConfig:
        """The bench's config of this preset; ``sequence`` and ``num_microbatches`` (None:
        the preset's) are the only geometry one may change. ``methods`` default to the
        preset's that can run on ``device`` with this leangraph."""
        shape = self.shape if sequence is None else replace(self.shape, sequence=sequence)
        return BenchConfig(
            pp_size=self.pp_size,
            vp_size=self.vp_size,
            rank=self.rank,
            num_microbatches=num_microbatches or self.num_microbatches,
            layers_per_chunk=self.layers_per_chunk,
            shape=shape,
            steps=steps or self.steps,
            methods=self.available_methods(device) if methods is None else methods,
            device=device,
            rounds=rounds,
            launch_steps=launch_steps,
            initial_on_host=True,
            preset=self.name,
        )

    def describe(self, *, sequence: int | None = None, microbatches: int | None = None) -> str:
        """One line: what the preset runs, with ``sequence`` and ``microbatches`` if given."""
        s = self.shape
        rope = "RoPE" if s.rope else "no RoPE"
        return (
            f"{self.name}: {self.title}; rank {self.rank} of PP{self.pp_size} x VP{self.vp_size}, "
            f"{self.vp_size} chunks x {self.layers_per_chunk} layers, hidden {s.hidden}, "
            f"{s.heads} query and {s.kv_heads} KV heads of {s.head_dim}, SwiGLU FFN {s.ffn}, "
            f"RMSNorm, {rope}, {microbatches or self.num_microbatches} microbatches, sequence "
            f"{sequence or s.sequence}, micro-batch {s.micro_batch}, bf16; "
            f"{self.weight_bytes() / GIB:.1f} GiB of weights"
        )


_LLAMA3_70B_TP2 = LlamaShape(
    hidden=8192, heads=32, kv_heads=4, head_dim=128, ffn=14336, sequence=4096, rope=True
)
"""A Llama-3-70B decoder layer as one rank of TP2 holds it (half its 64 query heads, 8 KV
heads and 28672 FFN columns)."""

_SEED_RUN = BenchPreset(
    name="llama3-70b-pp4vp5",
    title="20 Llama-3-70B layers of one TP2 rank",
    pp_size=4,
    vp_size=5,
    rank=0,
    layers_per_chunk=4,
    num_microbatches=16,
    shape=_LLAMA3_70B_TP2,
)
"""The seed's run: rank 0 of PP4 x VP5, its 20 layers at their TP2 geometry."""

PRESETS: Mapping[str, BenchPreset] = MappingProxyType(
    {
        preset.name: preset
        for preset in (
            _SEED_RUN,
            replace(
                _SEED_RUN,
                name="llama3-70b-pp4vp5-norope",
                title="20 Llama-3-70B layers of one TP2 rank, without RoPE",
                shape=replace(_LLAMA3_70B_TP2, rope=False),
            ),
        )
    }
)
"""The presets by name."""
