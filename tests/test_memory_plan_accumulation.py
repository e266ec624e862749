"""plan_memory with the accumulation modes: in-graph accumulation's buffers, overlap's kept
parameter gradients, and the refusals plan_memory shares with make_graphed_callables."""

from __future__ import annotations

import gc

import pytest
import torch
from models import replay_step
from test_memory_plan import Scale
from torch import nn

import leangraph
from leangraph.memory import plan_memory

F32 = 4


class Tied(nn.Module):
    """Two layers that train one shared weight, and a bias of their own each."""

    def __init__(self, shared: nn.Parameter) -> None:
        super().__init__()
        self.shared = shared
        self.bias = nn.Parameter(torch.zeros(shared.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.shared.t() + self.bias


def _meta_sample(rows: int = 4, features: int = 8) -> torch.Tensor:
    return torch.empty(rows, features, device="meta", requires_grad=True)


def test_by_hand_fused_adds_one_buffer_per_trained_parameter_to_capture_and_held() -> None:
    x = _meta_sample()
    layer = Scale(8).to("meta")
    plain = plan_memory((layer,), ((x,), (x,)), order=[1, 1, -1, -1])
    fused = plan_memory((layer,), ((x,), (x,)), order=[1, 1, -1, -1],
                        fuse_grad_accumulation=True)
    assert plain.accumulation_bytes == 0
    assert fused.accumulation_bytes == 8 * F32  # w, once for both microbatches' graphs
    plain_capture = [s.live_bytes for s in plain.steps if s.phase == "capture"]
    fused_capture = [s.live_bytes for s in fused.steps if s.phase == "capture"]
    assert fused_capture == [b + 8 * F32 for b in plain_capture]
    assert fused.capture_peak_bytes == plain.capture_peak_bytes + 8 * F32
    assert fused.held_bytes == plain.held_bytes + 8 * F32
    # Warm-up differentiates with autograd.grad and allocates no buffer.
    assert fused.warmup_peak_bytes == plain.warmup_peak_bytes
    assert "accumulation buffers" in fused.describe()
    assert "accumulation buffers" not in plain.describe()


def test_by_hand_overlap_keeps_the_latest_backwards_parameter_gradients() -> None:
    x = _meta_sample()
    layer = Scale(8).to("meta")
    order = [1, 1, -1, 1, -1, -1]  # three microbatches: B, then F, then two Bs
    samples = ((x,), (x,), (x,))
    plain = plan_memory((layer,), samples, order=order)
    overlap = plan_memory((layer,), samples, order=order, overlap_grad_accumulation=True)
    w_grad = 8 * F32
    plain_capture = [s.live_bytes for s in plain.steps if s.phase == "capture"]
    overlap_capture = [s.live_bytes for s in overlap.steps if s.phase == "capture"]
    # Steps F F B F B B: nothing kept before the first backward, then one w gradient kept
    # through every later step (the next backward's own in its transient, as before).
    kept = [0, 0, 0, w_grad, w_grad, w_grad]
    assert overlap_capture == [b + k for b, k in zip(plain_capture, kept)]
    assert overlap.capture_peak_bytes == plain.capture_peak_bytes + w_grad
    assert overlap.accumulation_bytes == 0
    # The kept gradient shares the pool with the in-flight forwards.
    t = 4 * 8 * F32
    assert plain.pool_bytes == 4 * t and overlap.pool_bytes == 4 * t + w_grad


def test_fused_counts_a_parameter_once_and_skips_those_with_a_buffer() -> None:
    shared = nn.Parameter(torch.ones(4, 4))
    layer = Tied(shared)
    samples = tuple((torch.randn(2, 4, requires_grad=True),) for _ in range(2))
    order = [1, 1, -1, -1]  # two microbatches: two graphs train each parameter
    plan = plan_memory((layer,), samples, order=order, fuse_grad_accumulation=True)
    assert plan.accumulation_bytes == (4 * 4 + 4) * F32
    # A .grad of the parameter's layout is adopted (the caller's memory already); one of
    # other strides is replaced by a new buffer; a main_grad is used as it is.
    layer.bias.grad = torch.zeros(8)[::2]
    shared.main_grad = torch.zeros(4, 4)  # type: ignore[attr-defined]
    plan = plan_memory((layer,), samples, order=order, fuse_grad_accumulation=True)
    assert plan.accumulation_bytes == 4 * F32
    layer.bias.grad = torch.zeros(4)
    plan = plan_memory((layer,), samples, order=order, fuse_grad_accumulation=True)
    assert plan.accumulation_bytes == 0


def test_fused_counts_no_buffer_for_layers_tying_a_weight_across_callables() -> None:
    shared = nn.Parameter(torch.ones(4, 4))
    layers = (Tied(shared), Tied(shared), Scale(4))
    samples = tuple((torch.randn(2, 4, requires_grad=True),) for _ in range(3))
    plan = plan_memory(layers, samples, order=[1, -1], num_layers_per_chunk=3,
                       fuse_grad_accumulation=True)
    assert plan.accumulation_bytes == 4 * F32  # Scale's weight: autograd accumulates the rest


def test_fused_plan_counts_exactly_the_buffers_capture_allocates() -> None:
    torch.manual_seed(0)
    single = Tied(nn.Parameter(torch.randn(8, 8)))
    single.bias.grad = torch.zeros(8)  # adopted
    scale = Scale(8)
    scale.w.grad = torch.zeros(16)[::2]  # other strides: replaced
    tied = nn.Parameter(torch.randn(8, 8))
    pair = (Tied(tied), Tied(tied))  # accumulated by autograd: no buffer
    frozen = Scale(8)
    frozen.w.requires_grad_(False)  # trains nothing
    callables = (single, scale, *pair, frozen)
    samples = tuple((torch.randn(2, 8, requires_grad=True),) for _ in range(2 * len(callables)))
    order = [1, 1, -1, -1]
    kwargs = {"order": order, "num_layers_per_chunk": len(callables)}
    plan = plan_memory(callables, samples, fuse_grad_accumulation=True, **kwargs)
    fused = [p for fn in (single, scale) for p in fn.parameters()]
    before = {id(p): p.grad for p in fused}
    graphed = leangraph.make_graphed_callables(callables, samples, fuse_grad_accumulation=True,
                                               **kwargs)
    # A buffer is attached as .grad at the first replay that adds into it.
    replay_step(graphed, order, [len(callables)],
                [torch.randn(2, 8, requires_grad=True) for _ in range(2)])
    allocated = {id(p): p.grad for p in fused
                 if p.grad is not None and p.grad is not before[id(p)]}
    assert sum(g.numel() * g.element_size() for g in allocated.values()) \
        == plan.accumulation_bytes == (8 * 8 + 8) * F32
    assert frozen.w.grad is None and tied.grad is not None
    leangraph.reset_all(graphed)


def test_the_accumulation_options_are_refused_as_make_graphed_callables_refuses_them() -> None:
    x = _meta_sample()
    layer = Scale(8).to("meta")
    with pytest.raises(ValueError, match="choose one"):
        plan_memory(layer, (x,), fuse_grad_accumulation=True, overlap_grad_accumulation=True)
    with pytest.raises(TypeError, match="fuse_grad_accumulation must be a bool, got str"):
        plan_memory(layer, (x,), fuse_grad_accumulation="False")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="overlap_grad_accumulation must be a bool, got int"):
        plan_memory(layer, (x,), overlap_grad_accumulation=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs an order without weight steps"):
        plan_memory((layer,), ((x,),), order=[1, -1, -1.5], overlap_grad_accumulation=True)


def test_a_second_fused_call_shares_the_first_calls_buffers_and_plans_none() -> None:
    torch.manual_seed(0)
    layer = Scale(8)
    samples = ((torch.randn(2, 8, requires_grad=True),),)
    first = leangraph.make_graphed_callables(layer, samples[0], fuse_grad_accumulation=True)
    assert layer.w.grad is None  # attached at the first replay; held by the first call till then
    again = Scale(8)
    again.w = layer.w  # the same parameter, graphed by a second call
    plan = plan_memory(again, samples[0], fuse_grad_accumulation=True)
    assert plan.accumulation_bytes == 0
    leangraph.reset_all(first)  # its buffer, never attached, goes with its graphs
    gc.collect()
    assert plan_memory(again, samples[0], fuse_grad_accumulation=True).accumulation_bytes \
        == 8 * 4
