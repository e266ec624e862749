"""In-graph gradient accumulation on a real GPU (skipped without one): exact against eager in
``.grad`` and Megatron-style ``main_grad``, hooks in eager's order (the accumulators run on
autograd's device thread there), fired by the relay or called by the replays
(``accumulator_hooks="python"``), and no accumulation kernel launched outside the graphs."""

from __future__ import annotations

import copy

import pytest
import torch
from models import Block, assert_histories_equal, train_both
from test_accumulator_hooks import _accumulator
from test_runtime_accumulation import HOOK_MODES, ZB, _Megatron

import leangraph
import leangraph.schedules

pytestmark = pytest.mark.cuda

INTERLEAVED = leangraph.schedules.interleaved_1f1b(pp_size=2, vp_size=2, rank=0, num_microbatches=4)


@HOOK_MODES
@pytest.mark.parametrize(("order", "layers", "microbatches"), [
    (INTERLEAVED, [2, 2], 4), (ZB, [1, 1], 2)], ids=["interleaved", "zero-bubble"])
def test_fused_training_is_exact_with_hooks_in_eager_order_on_cuda(
        order, layers, microbatches, hooks):
    logs: dict[str, list] = {}
    history, graphed = train_both(order, layers, width=64, microbatches=microbatches, steps=4,
                                  device="cuda", set_to_none=lambda step: step % 2 == 0,
                                  hook_logs=logs, fuse_grad_accumulation=True,
                                  accumulator_hooks=hooks)
    assert_histories_equal(history, exact=True)
    assert logs["graphed"] == logs["eager"]
    assert all(len(step) == sum(layers) * 6 * microbatches for step in logs["eager"])
    leangraph.reset_all(graphed)


@HOOK_MODES
def test_bf16_gradients_accumulate_into_fp32_main_grad_exactly_on_cuda(hooks):
    torch.manual_seed(0)
    eager = Block(256).to("cuda", torch.bfloat16)
    module = copy.deepcopy(eager)
    ddp_eager = _Megatron(eager, overlap_grad_reduce=True)
    # The accumulator hooks come after graphing: held accumulator nodes made on the default
    # stream break a capture (test_cuda_faults.py), as they do torch's own.
    ddp_graphed = _Megatron(module, overlap_grad_reduce=True, hooks=False)
    sample = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = leangraph.make_graphed_callables(module, (sample,), fuse_grad_accumulation=True,
                                               accumulator_hooks=hooks)
    ddp_graphed.register_hooks()
    for _ in range(2):
        for _ in range(4):
            x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
            eager(x).float().square().sum().backward()
            graphed(x).float().square().sum().backward()
        assert ddp_graphed.ready == ddp_eager.ready
        for a, b in zip(eager.parameters(), module.parameters()):
            assert torch.equal(a.main_grad, b.main_grad)
        for ddp in (ddp_eager, ddp_graphed):
            ddp.ready.clear()
            ddp.zero_grad_buffer()


class _TiedLinear(torch.nn.Module):
    def __init__(self, shared: torch.nn.Parameter) -> None:
        super().__init__()
        self.shared = shared
        self.bias = torch.nn.Parameter(torch.randn(shared.shape[0], dtype=shared.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.shared.t() + self.bias)


@HOOK_MODES
def test_a_weight_tied_across_layers_accumulates_into_fp32_main_grad_as_eager_on_cuda(hooks):
    """Two layers tying a bf16 weight and an untied block after them: eager sums the tied
    weight's two gradients in bf16 before Megatron's hook adds them into main_grad; so do the
    replays, whose tied layers hand autograd their gradients, over passes never zeroed."""
    torch.manual_seed(0)
    shared = torch.nn.Parameter(torch.randn(256, 256, dtype=torch.bfloat16) / 16)
    eager = torch.nn.ModuleList([_TiedLinear(shared), _TiedLinear(shared), Block(256)])
    eager = eager.to("cuda", torch.bfloat16)
    model = copy.deepcopy(eager)
    ddp_eager = _Megatron(eager, overlap_grad_reduce=True)
    ddp_graphed = _Megatron(model, overlap_grad_reduce=True, hooks=False)
    samples = tuple((torch.randn(32, 256, device="cuda", dtype=torch.bfloat16,
                                 requires_grad=True),) for _ in range(3))
    graphed = leangraph.make_graphed_callables(
        tuple(model), samples, order=[1, -1], num_layers_per_chunk=[3],
        fuse_grad_accumulation=True, accumulator_hooks=hooks)
    ddp_graphed.register_hooks()
    for _ in range(3):
        x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
        for layers in (eager, graphed):
            layers[2](layers[1](layers[0](x))).float().square().sum().backward()
    torch.cuda.synchronize()
    assert sorted(ddp_graphed.ready) == sorted(ddp_eager.ready)
    assert len(ddp_eager.ready) == 3 * len(ddp_eager.params)
    for a, b in zip(eager.parameters(), model.parameters()):
        assert torch.equal(a.main_grad, b.main_grad)
        assert a.grad is None and b.grad is None
    leangraph.reset_all(graphed)


def _adds_outside_graphs(fuse: bool) -> int:
    """Accumulation ops autograd runs outside the graphs in one step of 4 microbatches."""
    torch.manual_seed(0)
    module = Block(64).cuda()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(8, 64, device="cuda", requires_grad=True),),
        fuse_grad_accumulation=fuse)
    inputs = [torch.randn(8, 64, device="cuda") for _ in range(4)]
    for x in inputs:  # a first step: .grad exists from here on, as in training
        graphed(x).sum().backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for x in inputs:
            graphed(x).sum().backward()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages()
               if e.key in ("aten::add_", "aten::_foreach_add_", "aten::add"))


def test_fused_backward_launches_no_accumulation_outside_the_graphs():
    assert _adds_outside_graphs(fuse=False) >= 4 * 6 - 6  # the control: autograd's adds
    assert _adds_outside_graphs(fuse=True) == 0


@pytest.mark.parametrize(("order", "layers", "microbatches"), [
    (INTERLEAVED, [2, 2], 4), (ZB, [1, 1], 2)], ids=["interleaved", "zero-bubble"])
def test_fused_training_without_accumulator_hooks_is_exact_on_cuda(order, layers, microbatches):
    history, graphed = train_both(order, layers, width=64, microbatches=microbatches, steps=4,
                                  device="cuda", set_to_none=lambda step: step % 2 == 0,
                                  fuse_grad_accumulation=True, accumulator_hooks=False)
    assert_histories_equal(history, exact=True)
    leangraph.reset_all(graphed)


def test_r15_a_hook_on_an_accumulator_node_after_capture_is_refused_on_cuda():
    """Without accumulator hooks the nodes capture holds (made after each graph's capture,
    as ``"python"`` makes them) are the ones a later hook lands on: refused at the next
    backward, before the graph runs; removed, the same backward runs."""
    torch.manual_seed(0)
    module = Block(64).cuda()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(8, 64, device="cuda", requires_grad=True),),
        fuse_grad_accumulation=True, accumulator_hooks=False)
    graphed(torch.randn(8, 64, device="cuda")).sum().backward()
    before = [p.grad.clone() for p in module.parameters()]
    node = _accumulator(module.up.weight)
    handle = node.register_hook(lambda *_: None)
    out = graphed(torch.randn(8, 64, device="cuda")).sum()
    with pytest.raises(RuntimeError, match="parameter 'up.weight' has a hook on its gradient "
                       "accumulator node since capture"):
        out.backward(retain_graph=True)
    torch.cuda.synchronize()
    assert all(torch.equal(p.grad, g) for p, g in zip(module.parameters(), before))
    handle.remove()
    out.backward()
    assert not all(torch.equal(p.grad, g) for p, g in zip(module.parameters(), before))
    leangraph.reset_all(graphed)


def _accumulators_run(**options) -> int:
    """AccumulateGrad nodes autograd's engine runs in 4 fused backwards of one block whose
    input requires grad (1 accumulator of its own per backward, and without a relay the empty
    stand-in leaf whose node tells the replay that the pass accumulates: R18)."""
    torch.manual_seed(0)
    module = Block(64).cuda()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(8, 64, device="cuda", requires_grad=True),),
        fuse_grad_accumulation=True, **options)
    inputs = [torch.randn(8, 64, device="cuda", requires_grad=True) for _ in range(4)]
    graphed(inputs[0]).sum().backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for x in inputs:
            graphed(x).sum().backward()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.key == "torch::autograd::AccumulateGrad")


def test_without_accumulator_hooks_only_the_inputs_accumulator_runs_on_cuda():
    assert _accumulators_run() == 4 * (6 + 1)  # the control: the relay reaches 6 parameters
    assert _accumulators_run(accumulator_hooks=False) == 4 * (1 + 1)
    assert _accumulators_run(accumulator_hooks="python") == 4 * (1 + 1)


@pytest.mark.parametrize("hooks", [True, "python", False], ids=["relay", "python", "none"])
def test_r18_autograd_grad_through_fused_graphs_is_refused_on_cuda(hooks):
    """The refusal asks autograd's engine about accumulator nodes; on CUDA it runs them on
    its device thread, so the same question is asked there."""
    torch.manual_seed(0)
    module = Block(64).cuda()
    graphed = leangraph.make_graphed_callables(
        module, (torch.randn(8, 64, device="cuda", requires_grad=True),),
        fuse_grad_accumulation=True, accumulator_hooks=hooks)
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    out = graphed(x).square().sum()
    with pytest.raises(RuntimeError, match="accumulates no gradient into some or all"):
        torch.autograd.grad(out, x, retain_graph=True)
    assert all(p.grad is None for p in module.parameters())
    out.backward()
    torch.cuda.synchronize()
    assert all(p.grad is not None for p in module.parameters())


def _wide_stack(layers: int = 4, width: int = 2048) -> tuple[torch.nn.Module, ...]:
    """Layers whose weights (16 MiB each at 2048) outweigh their activations (16 rows)."""
    torch.manual_seed(0)
    return tuple(torch.nn.Linear(width, width).cuda() for _ in range(layers))


def _wide_samples(count: int, width: int = 2048) -> tuple[tuple[torch.Tensor], ...]:
    return tuple((torch.randn(16, width, device="cuda", requires_grad=True),)
                 for _ in range(count))


ONE_CHUNK = [1, 1, -1, -1]


def test_fused_plan_counts_the_accumulation_buffers_capture_allocates_on_cuda():
    measured = {}
    for fuse in (False, True):
        layers, samples = _wide_stack(), _wide_samples(8)
        plan = leangraph.plan_memory(layers, samples, order=ONE_CHUNK,
                                     fuse_grad_accumulation=fuse)
        torch.cuda.synchronize()
        graphed = leangraph.make_graphed_callables(layers, samples, order=ONE_CHUNK,
                                                   fuse_grad_accumulation=fuse)
        record = leangraph.memory_report(graphed).record
        measured[fuse] = (plan, record.capture_peak_bytes - record.baseline_bytes)
        leangraph.reset_all(graphed)
        del layers, samples, graphed
        torch.cuda.empty_cache()
    (plain, plain_peak), (fused, fused_peak) = measured[False], measured[True]
    every = 4 * (2048 * 2048 + 2048) * 4
    assert (plain.accumulation_bytes, fused.accumulation_bytes) == (0, every)
    assert fused.capture_peak_bytes - plain.capture_peak_bytes == every
    # What capture measured grew by the buffers too (allocator rounding aside).
    assert abs((fused_peak - plain_peak) - every) <= 2 * 2**20, (fused_peak, plain_peak, every)


def test_memory_check_counts_the_accumulation_buffers_on_cuda():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    layers, samples = _wide_stack(), _wide_samples(8)
    plain = leangraph.plan_memory(layers, samples, order=ONE_CHUNK)
    fused = leangraph.plan_memory(layers, samples, order=ONE_CHUNK, fuse_grad_accumulation=True)
    plain_needed = max(plain.warmup_peak_bytes, plain.capture_peak_bytes)
    fused_needed = max(fused.warmup_peak_bytes, fused.capture_peak_bytes)
    assert fused_needed - plain_needed >= fused.accumulation_bytes // 2
    total = torch.cuda.get_device_properties(0).total_memory
    allowed = torch.cuda.memory_allocated() + (plain_needed + fused_needed) // 2
    torch.cuda.set_per_process_memory_fraction(allowed / total)
    try:
        with pytest.raises(leangraph.CaptureMemoryError) as caught:
            leangraph.make_graphed_callables(layers, samples, order=ONE_CHUNK,
                                             fuse_grad_accumulation=True)
        assert caught.value.needed_bytes == fused_needed
        assert plain_needed <= caught.value.available_bytes < fused_needed
        assert all(p.grad is None for layer in layers for p in layer.parameters())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
