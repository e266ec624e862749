"""End-to-end training loops as users write them, graphed and eager, compared bitwise (CPU).

Each case trains copies of one transformer-ish stack (attention with a mask and rotary
cos/sin shared by every layer, an MLP, LayerNorm or RMSNorm, a router's auxiliary loss
returned beside the hidden state) for several optimizer steps in a pipeline order, once with
eager layers and once with leangraph's graphs, and compares every loss, gradient and
parameter after every step: the optimizers, schedulers, clipping, loss scaling, gradient
accumulation and ``zero_grad`` modes that real loops combine."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import TORCH_ZERO_BUBBLE_SCHEDULES
from torch import nn
from torch.distributed import pipelining
from torch.utils.checkpoint import checkpoint

import leangraph
from leangraph.order import Layout, StepKind, parse_order
from leangraph.schedules import from_pipelining, interleaved_1f1b

# A loop whose first steps overflow steps its scheduler past a skipped optimizer step, as
# GradScaler loops do.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`"
)

HIDDEN, HEADS, SEQ, BATCH = 16, 2, 6, 2
AUX_COEF = 0.01


# --------------------------------------------------------------------------------------------
# The model: a transformer block with extra non-differentiable arguments and a tuple output
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary(seq: int, dim: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def causal_mask(seq: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An additive mask (0 where attended, a large negative elsewhere), as HF builds them."""
    blocked = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return torch.zeros(seq, seq, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, sdpa: bool) -> None:
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x, mask, cos, sin):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(h // self.heads) + mask
            out = scores.softmax(-1).to(v.dtype) @ v
        return self.proj(out.transpose(1, 2).reshape(b, s, h))


class TransformerBlock(nn.Module):
    """Pre-norm attention + MLP; returns ``(hidden, aux)``, ``aux`` a router's load-balancing
    loss that the training loop adds to the total loss."""

    def __init__(
        self,
        hidden: int = HIDDEN,
        heads: int = HEADS,
        norm: str = "layer",
        sdpa: bool = False,
        ckpt: bool | None = None,
        experts: int = 4,
    ) -> None:
        super().__init__()
        make_norm = {"layer": nn.LayerNorm, "rms": RMSNorm}[norm]
        self.norm1, self.norm2 = make_norm(hidden), make_norm(hidden)
        self.attn = Attention(hidden, heads, sdpa)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.ckpt = ckpt  # None: no checkpoint; else checkpoint's use_reentrant

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm2(h))))

    def forward(self, x, mask, cos, sin):
        h = x + self.attn(self.norm1(x), mask, cos, sin)
        probs = self.router(h).float().softmax(-1)
        aux = probs.mean(dim=(0, 1)).square().sum() * probs.shape[-1]
        m = self.mlp(h) if self.ckpt is None else checkpoint(self.mlp, h, use_reentrant=self.ckpt)
        return h + m, aux


# --------------------------------------------------------------------------------------------
# The training loop
# --------------------------------------------------------------------------------------------


@dataclass
class Loop:
    """What one training loop combines (every option a real loop may set)."""

    order: Sequence[Any]
    layers_per_chunk: tuple[int, ...]
    microbatches: int
    norm: str = "layer"
    sdpa: bool = False
    ckpt: bool | None = None
    dtype: torch.dtype = torch.float32  # the parameters' and activations' dtype
    autocast: torch.dtype | None = None  # torch.autocast("cpu", dtype, cache_enabled=False)
    compile_backend: str | None = None
    optimizer: str = "adamw"  # or "sgd"
    foreach: bool = True
    clip: float | None = 1.0
    scheduler: bool = True
    loss_scale: float | None = None  # a dynamic scaler's initial scale
    accumulate: int = 1  # passes over the order per optimizer step
    set_to_none: bool = True
    main_grad: bool = False  # fp32 main_grad buffers (Megatron's convention)
    mask_as_kwarg: bool = False
    use_aux: bool = True  # False: the loss leaves the aux losses out (the router gets none)
    torch_scaler: bool = False  # torch.amp.GradScaler("cpu") instead of Scaler
    validate: bool = False  # an eager no_grad forward of the layers after every step
    steps: int = 2
    options: dict[str, Any] = field(default_factory=dict)  # make_graphed_callables options


def make_stack(loop: Loop) -> list[nn.Module]:
    torch.manual_seed(0)
    layers = [
        TransformerBlock(norm=loop.norm, sdpa=loop.sdpa, ckpt=loop.ckpt).to(loop.dtype)
        for _ in range(sum(loop.layers_per_chunk))
    ]
    return layers


def compiled(layers: list[nn.Module], backend: str | None) -> list[Any]:
    if backend is None:
        return list(layers)
    return [torch.compile(layer, backend=backend) for layer in layers]


def attach_main_grad(layers: Sequence[nn.Module]) -> None:
    for layer in layers:
        for p in layer.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)


def eager_main_grad_hooks(layers: Sequence[nn.Module]) -> None:
    """Megatron's eager convention: each accumulated gradient goes into ``main_grad``."""

    def hook(p: torch.Tensor) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None

    for layer in layers:
        for p in layer.parameters():
            p.register_post_accumulate_grad_hook(hook)


def autocast(loop: Loop):
    if loop.autocast is None:
        return torch.autocast("cpu", enabled=False)
    return torch.autocast("cpu", dtype=loop.autocast, cache_enabled=False)


@dataclass
class Data:
    inputs: list[list[torch.Tensor]]  # per pass, per microbatch
    targets: list[torch.Tensor]
    mask: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def make_data(loop: Loop) -> Data:
    gen = torch.Generator().manual_seed(1)
    passes = loop.steps * loop.accumulate
    inputs = [
        [
            torch.randn(BATCH, SEQ, HIDDEN, generator=gen).to(loop.dtype)
            for _ in range(loop.microbatches)
        ]
        for _ in range(passes)
    ]
    targets = [torch.randn(BATCH, SEQ, HIDDEN, generator=gen) for _ in range(loop.microbatches)]
    cos, sin = rotary(SEQ, HIDDEN // HEADS, loop.dtype)
    return Data(inputs, targets, causal_mask(SEQ, loop.dtype), cos, sin)


def layer_call(fn: Callable[..., Any], loop: Loop, data: Data, hidden: torch.Tensor):
    if loop.mask_as_kwarg:
        return fn(hidden, cos=data.cos, sin=data.sin, mask=data.mask)
    return fn(hidden, data.mask, data.cos, data.sin)


def run_pass(
    loop: Loop,
    lookup,
    data: Data,
    inputs: Sequence[torch.Tensor],
    scale: Callable[[torch.Tensor], torch.Tensor],
):
    """One pass over the order: forwards layer by layer (each layer's aux loss summed per
    chunk), backwards of the chunk's hidden output and its aux sum, weight steps. Returns the
    per-microbatch losses (detached, unscaled)."""
    lpc, m_count = loop.layers_per_chunk, loop.microbatches
    _, steps = parse_order(
        loop.order,
        num_callables=sum(lpc),
        num_samples=sum(lpc) * m_count,
        num_layers_per_chunk=list(lpc),
    )
    last = len(lpc)
    chunk_in: dict[tuple[int, int], torch.Tensor] = {}
    chunk_out: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    losses: dict[int, torch.Tensor] = {}
    for step in steps:
        c, m = step.chunk, step.microbatch
        if step.kind is StepKind.FORWARD:
            source = inputs[m] if c == 1 else chunk_out[(c - 1, m)][0]
            hidden = chunk_in[(c, m)] = source.detach().requires_grad_(True)
            aux_sum = None
            with autocast(loop):
                for index in range(lpc[c - 1]):
                    hidden, aux = layer_call(lookup(c, m, index), loop, data, hidden)
                    aux_sum = aux if aux_sum is None else aux_sum + aux
                if c == last:
                    loss = F.mse_loss(hidden.float(), data.targets[m]) / m_count
                    losses[m] = loss + AUX_COEF / m_count * aux_sum if loop.use_aux else loss
            chunk_out[(c, m)] = (hidden, aux_sum)
        elif step.kind is StepKind.WEIGHT:
            for index in reversed(range(lpc[c - 1])):
                weight_step = getattr(lookup(c, m, index), "backward_dw", None)
                if weight_step is not None:
                    weight_step()
        else:
            hidden, aux_sum = chunk_out.pop((c, m))
            if c == last:
                scale(losses[m]).backward()
            elif not loop.use_aux:
                hidden.backward(chunk_in.pop((c + 1, m)).grad)
            else:
                aux_grad = scale(torch.full_like(aux_sum, AUX_COEF / m_count))
                torch.autograd.backward(
                    [hidden, aux_sum], [chunk_in.pop((c + 1, m)).grad, aux_grad]
                )
    return [losses[m].detach() for m in range(m_count)]


class Scaler:
    """A dynamic loss scaler in GradScaler's manner: scale the loss, unscale the gradients in
    place, skip the step on an inf or NaN and back the scale off, grow it after clean steps."""

    def __init__(self, scale: float | None) -> None:
        # A float32 tensor, as GradScaler keeps it: the loss is multiplied by it in fp32.
        self.factor = torch.tensor(1.0 if scale is None else scale)
        self.enabled = scale is not None
        self.skipped = 0
        self.clean = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.factor

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        if not self.enabled:
            return True
        found = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, self.factor.reciprocal())
        return not bool(found.item())

    def update(self, ok: bool) -> None:
        if not self.enabled:
            return
        if ok:
            self.clean += 1
            if self.clean % 2 == 0:  # GradScaler's growth_interval, shortened
                self.factor *= 2.0
        else:
            self.clean = 0
            self.factor /= 2.0**8
            self.skipped += 1


def train(loop: Loop, layers: list[nn.Module], lookup, data: Data):
    """The loop: passes (accumulating), unscale and check, clip, step, schedule, zero. With
    ``main_grad`` the optimizer steps fp32 master copies whose gradients are ``main_grad``
    (Megatron's mixed-precision optimizer) and copies them back into the parameters."""
    params = [p for layer in layers for p in layer.parameters()]
    masters = (
        [p.detach().float().clone().requires_grad_() for p in params] if loop.main_grad else params
    )
    if loop.optimizer == "adamw":
        optim = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=loop.foreach)
    else:
        optim = torch.optim.SGD(masters, lr=0.05, momentum=0.9, foreach=loop.foreach)
    sched = (
        torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
        if loop.scheduler
        else None
    )
    scaler = Scaler(loop.loss_scale)
    amp = (
        torch.amp.GradScaler("cpu", init_scale=2.0**24, backoff_factor=2.0**-8, growth_interval=2)
        if loop.torch_scaler
        else None
    )
    history = []
    for step in range(loop.steps):
        losses = []
        for k in range(loop.accumulate):
            passed = step * loop.accumulate + k
            scale = amp.scale if amp is not None else scaler.scale
            losses += run_pass(loop, lookup, data, data.inputs[passed], scale)
        if loop.main_grad:
            for master, p in zip(masters, params):
                master.grad = p.main_grad
        norm = None
        if amp is not None:  # torch's loop: unscale_, clip, step (skips on inf), update
            before = amp.get_scale()
            amp.unscale_(optim)
            seen = [None if p.grad is None else p.grad.clone() for p in masters]
            if loop.clip is not None:
                norm = torch.nn.utils.clip_grad_norm_(masters, loop.clip, foreach=loop.foreach)
            amp.step(optim)
            amp.update()
            ok = amp.get_scale() >= before
        else:
            ok = scaler.unscale_and_check([p.grad for p in masters if p.grad is not None])
            seen = [None if p.grad is None else p.grad.clone() for p in masters]
            if ok:
                if loop.clip is not None:
                    norm = torch.nn.utils.clip_grad_norm_(masters, loop.clip, foreach=loop.foreach)
                optim.step()
            scaler.update(ok)
        if sched is not None:
            sched.step()
        if loop.main_grad:
            with torch.no_grad():
                for master, p in zip(masters, params):
                    master.grad = None
                    p.copy_(master)
                    p.main_grad.zero_()
        else:
            optim.zero_grad(set_to_none=loop.set_to_none)
        if loop.validate:  # the eager layers, as a validation pass runs them
            with torch.no_grad(), autocast(loop):
                hidden = data.inputs[0][0]
                for layer in layers:
                    hidden, _ = layer_call(layer, loop, data, hidden)
            losses.append(hidden)
        history.append(
            {
                "losses": losses,
                "grads": seen,
                "norm": norm,
                "ok": ok,
                "params": [p.detach().clone() for p in params],
            }
        )
    return history, (amp.get_scale() if amp is not None else scaler.factor, scaler.skipped)


def run_both(loop: Loop):
    """Train eager and graphed copies of one stack with ``loop``; both histories."""
    eager_layers = make_stack(loop)
    graph_layers = copy.deepcopy(eager_layers)
    if loop.main_grad:
        attach_main_grad(eager_layers)
        attach_main_grad(graph_layers)
        eager_main_grad_hooks(eager_layers)
        if not loop.options.get("fuse_grad_accumulation", False):
            eager_main_grad_hooks(graph_layers)  # unfused graphs: the same hook adds
    data = make_data(loop)
    layout = Layout(loop.layers_per_chunk, loop.microbatches)
    eager_fns = compiled(eager_layers, loop.compile_backend)
    graph_fns = compiled(graph_layers, loop.compile_backend)

    def sample():
        return torch.randn(BATCH, SEQ, HIDDEN, dtype=loop.dtype, requires_grad=True)

    if loop.mask_as_kwarg:
        sample_args = tuple((sample(),) for _ in range(layout.num_graphs))
        kwargs = [dict(cos=data.cos, sin=data.sin, mask=data.mask)] * layout.num_graphs
    else:
        sample_args = tuple(
            (sample(), data.mask, data.cos, data.sin) for _ in range(layout.num_graphs)
        )
        kwargs = None
    with autocast(loop):
        graphed = leangraph.make_graphed_callables(
            tuple(graph_fns),
            sample_args,
            sample_kwargs=kwargs,
            order=loop.order,
            num_layers_per_chunk=list(loop.layers_per_chunk),
            **loop.options,
        )
    try:
        histories = {
            "graphed": train(
                loop, graph_layers, lambda c, m, l: graphed[layout.graph_index(c, m, l)], data
            ),
            "eager": train(
                loop, eager_layers, lambda c, m, l: eager_fns[layout.callable_index(c, l)], data
            ),
        }
    finally:
        leangraph.reset_all(graphed)
    return histories


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (the NaN an overflowed step leaves included)."""
    return a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def assert_bitwise(histories) -> None:
    (graphed, g_scaler), (eager, e_scaler) = histories["graphed"], histories["eager"]
    assert str(g_scaler) == str(e_scaler), f"scales: {g_scaler} vs {e_scaler}"
    for step, (g, e) in enumerate(zip(graphed, eager, strict=True)):
        assert g["ok"] == e["ok"], f"step {step}: one skipped, the other not"
        for what in ("losses", "grads", "params"):
            for i, (a, b) in enumerate(zip(g[what], e[what], strict=True)):
                if a is None or b is None:
                    assert a is None and b is None, f"step {step} {what}[{i}]: None vs tensor"
                    continue
                assert same(a, b), (
                    f"step {step} {what}[{i}] ({a.dtype}, {b.dtype}): max diff "
                    f"{(a.float() - b.float()).abs().max()}"
                )
        if g["norm"] is not None or e["norm"] is not None:
            assert same(g["norm"], e["norm"]), f"step {step}: clip norm differs"


# --------------------------------------------------------------------------------------------
# Interleaved 1F1B loops
# --------------------------------------------------------------------------------------------


def interleaved(
    pp: int, vp: int, rank: int, m: int, group: int | None = None, layers: int = 2, **kwargs: Any
) -> Loop:
    return Loop(
        order=interleaved_1f1b(pp, vp, rank, m, microbatch_group_size=group),
        layers_per_chunk=(layers,) * vp,
        microbatches=m,
        **kwargs,
    )


def torch_interleaved(pp: int, rank: int, m: int) -> Any:
    """The loop of torch's interleaved 1F1B order, two one-layer chunks; where this torch
    refuses the order (before 2.5 it takes only a multiple of pp microbatches), a case that
    skips saying so."""
    try:
        order = from_pipelining(pipelining.ScheduleInterleaved1F1B, pp, m, rank, stages_per_rank=2)
    except ValueError as error:
        reason = f"torch {torch.__version__}: {error}"
        return pytest.param(None, marks=pytest.mark.skip(reason=reason))
    return Loop(order=order, layers_per_chunk=(1, 1), microbatches=m)


FUSED = {"fuse_grad_accumulation": True}
CASES = {
    "pp2vp2m4-adamw-foreach-clip-lr": interleaved(2, 2, 0, 4),
    "pp2vp2m4-rank1-rmsnorm-adamw-loop-accumulate": interleaved(
        2, 2, 1, 4, norm="rms", foreach=False, accumulate=2
    ),
    "pp4vp2m8-rank1-sdpa-mask-kwarg-zero-in-place": interleaved(
        4, 2, 1, 8, sdpa=True, mask_as_kwarg=True, set_to_none=False, accumulate=2
    ),
    "pp3vp3m6-rank2-sgd": interleaved(3, 3, 2, 6, layers=1, optimizer="sgd"),
    "pp4vp3m12-rank3": interleaved(4, 3, 3, 12, layers=1),
    # Microbatches not a multiple of pp: Megatron takes them with a larger group whose last
    # group holds >= pp (test_microbatches_megatron_refuses_are_refused_as_megatron_does).
    "pp2vp3m5-group3-rank1": interleaved(2, 3, 1, 5, group=3, layers=1),
    "pp4vp2m10-group5-rank0": interleaved(4, 2, 0, 10, group=5, layers=1),
    # torch's interleaved 1F1B takes 6 microbatches on 4 ranks, where Megatron's does not.
    "torch-interleaved-pp4m6-rank2": torch_interleaved(4, 2, 6),
    "uneven-chunks-aux-left-out-validate": Loop(
        order=interleaved_1f1b(2, 2, 0, 4),
        layers_per_chunk=(2, 1),
        microbatches=4,
        use_aux=False,
        validate=True,
    ),
    "autocast-bf16-checkpoint-non-reentrant": interleaved(
        2, 2, 0, 4, autocast=torch.bfloat16, ckpt=False
    ),
    "autocast-fp16-loss-scaling-skips": interleaved(
        2, 2, 1, 4, autocast=torch.float16, loss_scale=2.0**24, steps=4
    ),
    "bf16-params-sgd": interleaved(2, 2, 0, 4, dtype=torch.bfloat16, optimizer="sgd", clip=None),
    "fused-accumulate-set-to-none": interleaved(2, 2, 0, 4, accumulate=2, options=FUSED),
    "fused-accumulate-zero-in-place-aux-left-out": interleaved(
        2, 2, 1, 4, accumulate=2, set_to_none=False, use_aux=False, options=FUSED
    ),
    "fused-no-accumulator-hooks": interleaved(
        2, 2, 0, 4, options={**FUSED, "accumulator_hooks": False}
    ),
    "fused-python-accumulator-hooks-checkpoint": interleaved(
        2, 2, 1, 4, ckpt=False, options={**FUSED, "accumulator_hooks": "python"}
    ),
    "main-grad-unfused-hooks": interleaved(2, 2, 0, 4, main_grad=True),
    "main-grad-fused-accumulate": interleaved(
        2, 2, 0, 4, main_grad=True, accumulate=2, options=FUSED
    ),
    "main-grad-fused-bf16-params": interleaved(
        2, 2, 1, 4, main_grad=True, dtype=torch.bfloat16, options=FUSED
    ),
    "main-grad-fused-fp16-loss-scaling": interleaved(
        2,
        2,
        0,
        4,
        main_grad=True,
        autocast=torch.float16,
        loss_scale=2.0**24,
        steps=4,
        options=FUSED,
    ),
    "torch-grad-scaler-fp16-fused": interleaved(
        2, 2, 0, 4, autocast=torch.float16, torch_scaler=True, steps=4, options=FUSED
    ),
    "torch-grad-scaler-fp16-overlap-accumulate": interleaved(
        2,
        2,
        1,
        4,
        autocast=torch.float16,
        torch_scaler=True,
        steps=4,
        accumulate=2,
        options={"overlap_grad_accumulation": True},
    ),
    # docs/composition.md: graph the compiled module.
    "compiled-eager-backend": interleaved(2, 2, 0, 4, compile_backend="eager"),
    "compiled-aot-eager-fused": interleaved(2, 2, 1, 4, compile_backend="aot_eager", options=FUSED),
}


@pytest.mark.parametrize("loop", list(CASES.values()), ids=list(CASES))
def test_interleaved_training_loops_match_eager_bitwise(loop):
    assert_bitwise(run_both(loop))


def test_a_loss_scaling_case_skips_steps_then_applies_them():
    # The scaled cases above must exercise both branches of the loop.
    (history, (_, skipped)) = run_both(CASES["autocast-fp16-loss-scaling-skips"])["eager"]
    assert 0 < skipped < len(history) and history[-1]["ok"]


# --------------------------------------------------------------------------------------------
# Zero-bubble loops: -(c + 0.5) weight steps, backward_dw()
# --------------------------------------------------------------------------------------------


def zero_bubble(cls, pp: int, rank: int, m: int, **kwargs: Any) -> Loop:
    order = from_pipelining(cls, pp, m, rank, stages_per_rank=2)
    return Loop(order=order, layers_per_chunk=(1, 1), microbatches=m, **kwargs)


# Weight steps deferred past other chunks' work (tests/test_zero_bubble.py's ZB3).
DEFERRED = [1, 2, 1, 2, -2, -1, 1, -2, 2, -1.5, -1, -2.5, -2.5, -2, -1.5, -1, -2.5, -1.5]
ZB_CASES = {
    "deferred-fp16-loss-scaling-zero-in-place": Loop(
        order=DEFERRED,
        layers_per_chunk=(1, 1),
        microbatches=3,
        autocast=torch.float16,
        loss_scale=2.0**24,
        steps=4,
        set_to_none=False,
    ),
    "deferred-main-grad-fused-accumulate": Loop(
        order=DEFERRED,
        layers_per_chunk=(1, 1),
        microbatches=3,
        main_grad=True,
        accumulate=2,
        options=FUSED,
    ),
}
for _cls in [c for c in TORCH_ZERO_BUBBLE_SCHEDULES if isinstance(c, type)]:
    ZB_CASES[f"{_cls.__name__}-rank0-adamw"] = zero_bubble(_cls, 2, 0, 4, foreach=False)
    ZB_CASES[f"{_cls.__name__}-rank1-fused-accumulate"] = zero_bubble(
        _cls, 2, 1, 4, accumulate=2, options=FUSED
    )


@pytest.mark.parametrize("loop", list(ZB_CASES.values()), ids=list(ZB_CASES))
def test_zero_bubble_training_loops_match_eager_bitwise(loop):
    assert_bitwise(run_both(loop))


# --------------------------------------------------------------------------------------------
# What a loop may not do: refused before anything runs
# --------------------------------------------------------------------------------------------


def captured(loop: Loop):
    """``loop``'s stack graphed in its order: the layers, data, layout and graphs."""
    layers = make_stack(loop)
    data = make_data(loop)
    layout = Layout(loop.layers_per_chunk, loop.microbatches)
    samples = tuple(
        (torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True), data.mask, data.cos, data.sin)
        for _ in range(layout.num_graphs)
    )
    graphed = leangraph.make_graphed_callables(
        tuple(layers), samples, order=loop.order, num_layers_per_chunk=list(loop.layers_per_chunk)
    )
    return layers, data, layout, graphed


def no_scale(loss: torch.Tensor) -> torch.Tensor:
    return loss


def test_microbatches_megatron_refuses_are_refused_as_megatron_does():
    # Megatron-LM: the last microbatch group (of microbatch_group_size, default pp) must hold
    # 0 or >= pp microbatches; a larger group takes them (the cases above train such orders).
    with pytest.raises(ValueError, match=r"leaves a last microbatch group of 2 .* >= pp_size 4"):
        interleaved_1f1b(4, 2, 0, 6)
    with pytest.raises(ValueError, match=r"leaves a last microbatch group of 1 .* >= pp_size 2"):
        interleaved_1f1b(2, 3, 1, 5)
    assert (
        interleaved_1f1b(2, 3, 1, 5, microbatch_group_size=3)
        == CASES["pp2vp3m5-group3-rank1"].order
    )


def test_another_ranks_order_is_refused_at_its_first_deviation_and_the_captured_one_trains():
    loop = interleaved(2, 2, 0, 4)
    other = interleaved(2, 2, 1, 4)
    eager = make_stack(loop)
    layers, data, layout, graphed = captured(loop)
    deviation = next(i for i, (a, b) in enumerate(zip(loop.order, other.order)) if a != b)
    assert (loop.order[deviation], other.order[deviation]) == (2, -2)
    # Rank 1's order runs chunk 2's backward of microbatch 0 where rank 0's runs the forward
    # of chunk 2, microbatch 1: the backward is refused before it runs.
    with pytest.raises(RuntimeError) as info:
        run_pass(
            other,
            lambda c, m, l: graphed[layout.graph_index(c, m, l)],
            data,
            data.inputs[0],
            no_scale,
        )
    assert str(info.value).startswith(
        "graph (chunk 2, microbatch 0, layer 1): backward replayed out of capture order; the "
        "next replay must be the forward of graph (chunk 2, microbatch 1, layer 0)."
    )
    del info
    assert all(p.grad is None for layer in layers for p in layer.parameters())
    # The refused pass is dropped (its outputs with it); a pass in the captured order runs
    # from the start and trains as eager does.
    got = run_pass(
        loop, lambda c, m, l: graphed[layout.graph_index(c, m, l)], data, data.inputs[1], no_scale
    )
    want = run_pass(
        loop, lambda c, m, l: eager[layout.callable_index(c, l)], data, data.inputs[1], no_scale
    )
    assert all(same(a, b) for a, b in zip(got, want))
    for layer, reference in zip(layers, eager):
        assert all(same(p.grad, q.grad) for p, q in zip(layer.parameters(), reference.parameters()))
    leangraph.reset_all(graphed)


def test_a_microbatch_out_of_turn_is_refused_naming_the_one_expected():
    _, data, layout, graphed = captured(interleaved(2, 2, 0, 4))
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    with pytest.raises(
        RuntimeError,
        match=r"^graph \(chunk 1, microbatch 1, layer 0\): forward "
        r"replayed out of capture order; the next replay must be the forward of "
        r"graph \(chunk 1, microbatch 0, layer 0\)\.",
    ):
        graphed[layout.graph_index(1, 1, 0)](x, data.mask, data.cos, data.sin)
    leangraph.reset_all(graphed)


def test_zero_bubble_weight_steps_out_of_turn_are_refused_with_what_to_do():
    loop = Loop(order=DEFERRED, layers_per_chunk=(1, 1), microbatches=3)
    _, data, layout, graphed = captured(loop)
    _, steps = parse_order(DEFERRED, num_callables=2, num_samples=6, num_layers_per_chunk=1)
    # The same pass with every weight step right after its backward: W c2 m0 comes early.
    early = []
    for step in steps:
        if step.kind is not StepKind.WEIGHT:
            early.append(step)
        if step.kind is StepKind.BACKWARD:
            early += [
                s
                for s in steps
                if s.kind is StepKind.WEIGHT
                and (s.chunk, s.microbatch) == (step.chunk, step.microbatch)
            ]
    eager_like = Loop(order=early, layers_per_chunk=(1, 1), microbatches=3)

    def lookup(c, m, l):
        return graphed[layout.graph_index(c, m, l)]

    with pytest.raises(
        RuntimeError,
        match=r"^graph \(chunk 2, microbatch 0, layer 0\): weight "
        r"step replayed out of capture order; the next replay must be the "
        r"backward of graph \(chunk 1, microbatch 0, layer 0\)\. .*\); a weight "
        r"step \(backward_dw\(\)\) runs where the order has its -\(c \+ 0\.5\) "
        r"entry, not earlier$",
    ):
        run_pass(eager_like, lookup, data, data.inputs[0], no_scale)
    # Starting over is refused while that weight step is due, saying so...
    with pytest.raises(
        RuntimeError,
        match=r"a new pass cannot start while the weight step of "
        r"graph \(chunk 2, microbatch 0, layer 0\) is due .*call backward_dw\(\) "
        r"on it first",
    ):
        run_pass(loop, lookup, data, data.inputs[0], no_scale)
    # ...and runs once it ran.
    graphed[layout.graph_index(2, 0, 0)].backward_dw()
    run_pass(loop, lookup, data, data.inputs[1], no_scale)
    leangraph.reset_all(graphed)


def test_reentrant_checkpoint_inside_an_ordered_layer_is_refused_before_warm_up():
    with pytest.raises(
        ValueError,
        match=r"^graph \(chunk 1, microbatch 0, layer 0\) runs "
        r"torch.utils.checkpoint with use_reentrant=True.*expected "
        r"use_reentrant=False",
    ):
        captured(interleaved(2, 2, 0, 4, ckpt=True))
