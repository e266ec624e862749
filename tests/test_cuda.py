"""The CUDA backend on a real GPU (skipped without one). Memory read with memory_allocated."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from models import Block, assert_histories_equal, replay_step, train_both
from test_build_warmup import MEGATRON_PP2_VP2_RANK0, ORDER, expected_alive

import leangraph
from leangraph.cli.local_pipeline import run_order
from leangraph.order import parse_order

pytestmark = pytest.mark.cuda

SIZE = 512 * 1024  # float32 elements: 2 MiB, a multiple of the allocator's rounding


class MemProbe(torch.nn.Module):
    """``x * w``: saves only tensors that already exist, so each live output costs SIZE * 4."""

    def __init__(self, log: list[int]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(SIZE, device="cuda"))
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(torch.cuda.memory_allocated())
        return x * self.weight


def _capture_probes(order, log, grad=True, share_buffers=True, distinct=False):
    """``distinct``: each microbatch's samples of their own layout (stride ``m + 1``), so
    warm-up runs every graph; else one layout, and warm-up runs microbatch 0's."""
    probes = tuple(MemProbe(log) for _ in range(4))
    layout, _ = parse_order(order, num_callables=4, num_samples=4 * order.count(1))
    strides = [layout.graph_id(g).microbatch + 1 if distinct else 1
               for g in range(layout.num_graphs)]
    samples = tuple((torch.randn(SIZE * step, device="cuda")[::step].requires_grad_(grad),)
                    for step in strides)
    torch.cuda.synchronize()
    with torch.set_grad_enabled(grad):
        graphed = leangraph.make_graphed_callables(probes, samples, order=order,
                                                   num_warmup_iters=2,
                                                   share_buffers=share_buffers,
                                                   check_memory=False)  # it calls forward too
    return probes, samples, graphed


@pytest.mark.parametrize("order", [ORDER, MEGATRON_PP2_VP2_RANK0])
def test_ordered_warmup_releases_consumed_outputs(order):
    log: list[int] = []
    _, _, graphed = _capture_probes(order, log, distinct=True)
    microbatches = order.count(1)
    alive = expected_alive(order, (2, 2), passes=2, probes=microbatches)
    expected = [len(tags) for tags in alive]
    warmup = log[: len(expected)]
    base = warmup[0]
    assert [(m - base) // (SIZE * 4) for m in warmup] == expected
    assert all((m - base) % (SIZE * 4) == 0 for m in warmup)
    leangraph.reset_all(graphed)


def test_inference_warmup_retains_no_outputs():
    log: list[int] = []
    _, _, graphed = _capture_probes(ORDER, log, grad=False, distinct=True)
    warmup = log[: 2 * 12]  # the probes and the first warm-up pass, of every graph
    assert warmup == [warmup[0]] * len(warmup)
    leangraph.reset_all(graphed)


def test_reset_releases_exactly_its_memory_and_others_keep_working():
    # Without buffer sharing every graph owns its buffers, so the release is exact.
    log: list[int] = []
    probes, samples, graphed = _capture_probes(ORDER, log, share_buffers=False)
    x = torch.randn(SIZE, device="cuda", requires_grad=True)
    before = torch.cuda.memory_allocated()
    graphed[5].reset()
    torch.cuda.synchronize()
    # Static output, grad-output seed, grad of x and grad of the weight: 4 buffers of SIZE.
    assert before - torch.cuda.memory_allocated() == 4 * SIZE * 4
    graphed[5].reset()
    assert torch.cuda.memory_allocated() == before - 4 * SIZE * 4
    with pytest.raises(RuntimeError, match=r"graph \(chunk 1, microbatch 2, layer 1\).*reset"):
        graphed[5](x)
    # The other graphs train on: a whole step with the reset graph's place run eagerly.
    layout = leangraph.Layout((2, 2), 3)

    def layer(chunk, microbatch, index):
        if layout.graph_index(chunk, microbatch, index) == 5:
            return probes[layout.callable_index(chunk, index)]
        return graphed[layout.graph_index(chunk, microbatch, index)]

    inputs = [torch.randn(SIZE, device="cuda", requires_grad=True) for _ in range(3)]
    step = run_order(ORDER, (2, 2), layer, inputs, lambda out, m: out.sum())
    weights = [p.weight.detach() for p in probes]
    for x_m, loss, grad in zip(inputs, step.losses, step.input_grads):
        product = weights[0] * weights[1] * weights[2] * weights[3]
        assert torch.equal(loss, (x_m.detach() * product).sum())
        assert torch.equal(grad, product)
    leangraph.reset_all(graphed)
    del samples, step
    torch.cuda.synchronize()


def test_backward_after_reset_raises():
    log: list[int] = []
    _, _, graphed = _capture_probes(ORDER, log)
    out = graphed[0](torch.randn(SIZE, device="cuda", requires_grad=True))
    graphed[0].reset()
    with pytest.raises(RuntimeError, match=r"chunk 1, microbatch 0, layer 0.*cannot run a backward"):
        out.sum().backward()
    leangraph.reset_all(graphed)


@pytest.mark.parametrize(("order", "microbatches"), [(ORDER, 3), (MEGATRON_PP2_VP2_RANK0, 4)])
def test_ordered_training_matches_eager_exactly_on_cuda(order, microbatches):
    history, graphed = train_both(order, [2, 2], width=64, microbatches=microbatches, steps=3,
                                  device="cuda")
    assert_histories_equal(history, exact=True)
    leangraph.reset_all(graphed)


def test_module_drop_in_matches_torch_make_graphed_callables():
    torch.manual_seed(0)
    ours = Block(64).cuda()
    theirs = copy.deepcopy(ours)
    sample = torch.randn(8, 64, device="cuda", requires_grad=True)
    leangraph.make_graphed_callables(ours, (sample,))
    torch.cuda.make_graphed_callables(theirs, (sample.detach().clone().requires_grad_(),))
    for _ in range(3):
        # torch's graphed backward hands out its static buffers as .grad (then accumulates into
        # them), so it is only right when grads are cleared between steps; compare that way.
        for p in (*ours.parameters(), *theirs.parameters()):
            p.grad = None
        x = torch.randn(8, 64, device="cuda", requires_grad=True)
        y = x.detach().clone().requires_grad_()
        a, b = ours(x), theirs(y)
        a.square().sum().backward()
        b.square().sum().backward()
        assert torch.equal(a, b) and torch.equal(x.grad, y.grad)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(p.grad, q.grad)
    leangraph.reset_all(ours)


def _one_f_one_b(microbatches):
    return [1] + [e for _ in range(microbatches - 1) for e in (1, -1)] + [-1]


def _held_after_capture(microbatches):
    # Garbage of earlier tests (graphed modules sit in reference cycles until collected) must
    # not be freed inside the measurement: the call's own gc.collect would free it there.
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base_alloc, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    blocks = tuple(Block(256).cuda() for _ in range(2))
    samples = tuple((torch.randn(16, 256, device="cuda", requires_grad=True),)
                    for _ in range(2 * microbatches))
    graphed = leangraph.make_graphed_callables(blocks, samples, order=_one_f_one_b(microbatches))
    del samples
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - base_alloc, torch.cuda.memory_reserved() - base_reserved)
    leangraph.reset_all(graphed)
    del graphed, blocks
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    after = (torch.cuda.memory_allocated() - base_alloc, torch.cuda.memory_reserved() - base_reserved)
    return held, after


def test_held_memory_is_flat_in_microbatches_and_freed_by_reset_all():
    (alloc4, reserved4), after4 = _held_after_capture(4)
    (alloc16, reserved16), after16 = _held_after_capture(16)
    # The static buffers are the same. torch may keep a little bookkeeping per CUDA graph
    # (32 bytes on average for trivial graphs on an H200; the test below checks the bound);
    # 8 KiB per extra graph is below any buffer here (an activation is 16 KiB), so a
    # per-graph buffer would still fail this.
    extra_graphs = 2 * 16 - 2 * 4
    assert abs(alloc16 - alloc4) <= 8192 * extra_graphs, (alloc4, alloc16)
    assert reserved16 <= reserved4 + 2 * 1024 * 1024, (reserved4, reserved16)
    assert after4 == after16 == (0, 0)



def test_torch_keeps_under_8_kib_per_graph_of_one_pool():
    """The allowance of the flatness test above: what torch itself keeps per CUDA graph,
    measured on 32 trivial graphs sharing one pool."""
    x = torch.zeros(1024, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graphs = []
    for _ in range(32):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            x.add_(1)
        graphs.append(graph)
    torch.cuda.synchronize()
    per_graph = (torch.cuda.memory_allocated() - before) / len(graphs)
    assert per_graph <= 8192, per_graph

def test_debug_mode_catches_a_read_of_a_reused_output_on_cuda():
    torch.manual_seed(0)
    blocks = tuple(Block(64).cuda() for _ in range(2))
    samples = tuple((torch.randn(8, 64, device="cuda", requires_grad=True),) for _ in range(4))
    graphed = leangraph.make_graphed_callables(blocks, samples, order=[1, -1, 1, -1],
                                               debug_outputs=True)
    out = graphed[1](graphed[0](torch.randn(8, 64, device="cuda", requires_grad=True)))
    out.sum().backward()
    with pytest.raises(RuntimeError, match=r"graph \(chunk 1, microbatch 0, layer 1\).*was read "
                                           r"after the backward"):
        out.sum()
    leangraph.reset_all(graphed)


def test_debug_mode_guards_a_kept_detach_and_slice_of_an_output_on_cuda():
    torch.manual_seed(0)
    graphed = leangraph.make_graphed_callables(
        Block(64).cuda(), (torch.randn(8, 64, device="cuda", requires_grad=True),),
        debug_outputs=True)
    out = graphed(torch.randn(8, 64, device="cuda", requires_grad=True))
    logged, row, copied = out.detach(), out[0], out.clone()
    out.sum().backward()
    for alias in (logged, row):
        with pytest.raises(RuntimeError, match="was read after the backward"):
            alias.sum()
    assert torch.isfinite(copied).all()  # memory of its own: still the caller's
    leangraph.reset_all(graphed)


def test_capture_memory_error_when_the_plan_does_not_fit():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blocks = tuple(Block(1024).cuda() for _ in range(2))
    samples = tuple((torch.randn(4096, 1024, device="cuda", requires_grad=True),)
                    for _ in range(16))
    order = [1] * 8 + [-1] * 8  # GPipe-like: all eight microbatches in flight
    plan = leangraph.plan_memory(blocks, samples, order=order)
    needed = max(plan.warmup_peak_bytes, plan.capture_peak_bytes)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + needed // 2) / total)
    try:
        before = torch.cuda.memory_allocated()
        with pytest.raises(leangraph.CaptureMemoryError,
                           match=r"capture needs [\d.]+ MiB at its peak \(.+\) but only [\d.]+ MiB"
                           ) as caught:
            leangraph.make_graphed_callables(blocks, samples, order=order)
        assert caught.value.needed_bytes == needed
        assert caught.value.available_bytes < needed
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


class LinearStack(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_zero_bubble_training_is_bitwise_equal_to_eager_for_fp32_linear_stacks():
    from leangraph.cli.local_pipeline import run_order
    from leangraph.order import Layout

    order = [1, 2, 1, 2, -2, -1, 1, -2, 2, -1.5, -1, -2.5, -2.5, -2, -1.5, -1, -2.5, -1.5]
    torch.manual_seed(0)
    eager = [LinearStack(64).cuda() for _ in range(2)]
    graphed_layers = copy.deepcopy(eager)
    layout = Layout((1, 1), 3)
    samples = tuple((torch.randn(8, 64, device="cuda", requires_grad=True),) for _ in range(6))
    graphed = leangraph.make_graphed_callables(tuple(graphed_layers), samples, order=order)
    data = [torch.randn(8, 64, device="cuda") for _ in range(3)]
    target = [torch.randn(8, 64, device="cuda") for _ in range(3)]

    def loss(out, m):
        return torch.nn.functional.mse_loss(out, target[m])

    for step in range(3):
        results = []
        for layers, lookup in ((eager, lambda c, m, l: eager[c - 1]),
                               (graphed_layers, lambda c, m, l: graphed[layout.graph_index(c, m, l)])):
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            results.append(run_order(order, [1, 1], lookup, data, loss))
        (e, g) = results
        assert all(torch.equal(a, b) for a, b in zip(e.losses, g.losses)), step
        assert all(torch.equal(a, b) for a, b in zip(e.input_grads, g.input_grads)), step
        for p, q in zip((p for l in eager for p in l.parameters()),
                        (p for l in graphed_layers for p in l.parameters())):
            assert torch.equal(p.grad, q.grad), step
            with torch.no_grad():
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
    leangraph.reset_all(graphed)


def test_capture_time_hooks_never_run_while_the_stream_captures():
    log: list[bool] = []

    def hook(module, *args):
        log.append(torch.cuda.is_current_stream_capturing())

    hooks = {kind: [hook] for kind in ("forward_pre", "forward", "backward_pre", "backward")}
    layers = tuple(LinearStack(32).cuda() for _ in range(2))
    samples = tuple((torch.randn(4, 32, device="cuda", requires_grad=True),) for _ in range(4))
    graphed = leangraph.make_graphed_callables(layers, samples, order=[1, 2, -2, -1, 1, 2, -2, -1],
                                               num_warmup_iters=2,
                                               capture_time_hooks=[hooks, hooks])
    # Two hooks a step: two warm-up passes of microbatch 0's 4 steps, then 8 to capture.
    assert len(log) == (2 * 4 + 8) * 2 and not any(log)
    leangraph.reset_all(graphed)


def test_memory_report_on_cuda_reads_the_pool_and_the_phase_peaks():
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    blocks = tuple(Block(256).cuda() for _ in range(2))
    samples = tuple((torch.randn(64, 256, device="cuda", requires_grad=True),) for _ in range(4))
    graphed = leangraph.make_graphed_callables(blocks, samples, order=[1, 1, -1, -1])
    report = leangraph.memory_report(graphed)
    assert report.pool_reserved_bytes is not None and report.pool_reserved_bytes > 0
    assert report.pool_allocated_bytes is not None
    assert report.pool_allocated_bytes <= report.pool_reserved_bytes
    assert report.record.warmup_peak_bytes > base and report.record.capture_peak_bytes > base
    # Order [1, 1, -1, -1] over 2 layers: 8 steps to capture; the first of the 3 warm-up
    # passes (the others repeat it) runs microbatch 0's 4.
    assert len(report.timeline) == 4 + 8
    assert max(p.allocated_bytes for p in report.timeline) > base
    assert report.static_bytes > 0 and "graph pool: reserved" in report.describe()
    leangraph.reset_all(graphed)


FIRST_CAPTURE = """
import sys, torch, leangraph
from models import replay_step
from torch.nn.attention import SDPBackend, sdpa_kernel
from leangraph.schedules import interleaved_1f1b
from leangraph.cli.workloads import BlockShape, make_blocks, sample_hidden
shape = BlockShape(hidden=256, heads=4, sequence=128, dtype=torch.bfloat16)
blocks = make_blocks(4, shape, "cuda")
samples = tuple((sample_hidden(shape, "cuda"),) for _ in range(16))
with sdpa_kernel([getattr(SDPBackend, sys.argv[1])]):
    order = interleaved_1f1b(4, 2, 0, 4)
    graphed = leangraph.make_graphed_callables(tuple(blocks), samples, order=order)
    inputs = [sample_hidden(shape, "cuda") for _ in range(4)]
    grads = replay_step(graphed, order, [2, 2], inputs).input_grads
    assert all(bool(torch.isfinite(g).all()) for g in grads)
leangraph.reset_all(graphed)
print("ok")
"""


@pytest.mark.parametrize("attention", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"])
def test_first_capture_of_a_process_runs_the_memory_check_without_breaking_capture(attention):
    """The memory check runs the real layers before warm-up. On the default stream that once
    broke the SDPA backward capture of a fresh process ("would make the legacy stream depend
    on a capturing blocking stream"); it runs on the warm-up stream now. A fresh process each,
    since only a process's first SDPA calls create the state that matters."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "tests"),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", FIRST_CAPTURE, attention], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("check_memory", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize("share_buffers", [False, True], ids=["own", "shared"])
@pytest.mark.parametrize("same_sample", [False, True], ids=["samples", "one-sample"])
def test_a_transformer_stack_captures_under_every_option_combination(
    dtype, check_memory, share_buffers, same_sample
):
    """Backward capture of SDPA blocks once failed with "operation would make the legacy
    stream depend on a capturing blocking stream" under some of these options (the memory
    check ran the modules on the default stream); every combination captures and replays."""
    from leangraph.cli.workloads import BlockShape, make_blocks, sample_hidden
    from leangraph.schedules import interleaved_1f1b

    shape = BlockShape(hidden=256, heads=4, sequence=128, dtype=dtype)
    blocks = make_blocks(4, shape, "cuda")
    one = sample_hidden(shape, "cuda")
    samples = tuple((one if same_sample else sample_hidden(shape, "cuda"),) for _ in range(16))
    graphed = leangraph.make_graphed_callables(
        tuple(blocks), samples, order=interleaved_1f1b(4, 2, 0, 4),
        check_memory=check_memory, share_buffers=share_buffers)
    inputs = [sample_hidden(shape, "cuda") for _ in range(4)]
    grads = replay_step(graphed, interleaved_1f1b(4, 2, 0, 4), [2, 2], inputs).input_grads
    assert len(grads) == 4 and all(bool(torch.isfinite(g).all()) for g in grads)
    leangraph.reset_all(graphed)

def test_no_garbage_collection_runs_while_streams_capture():
    """A collection in the middle of a stream capture can destroy garbage from outside the
    call (a dropped torch.cuda.make_graphed_callables result sits in reference cycles); its
    graph and pool teardown then invalidates the capture ("operation failed due to a previous
    error during capture", seen on an H200). The collector is forced to run at every chance
    here; it must run during warm-up and never while a stream captures."""
    capturing: list[bool] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            capturing.append(torch.cuda.is_current_stream_capturing())

    thresholds = gc.get_threshold()
    gc.callbacks.append(record)
    gc.set_threshold(1, 1, 1)
    try:
        layers = tuple(Block(64).cuda() for _ in range(2))
        graphed = leangraph.make_graphed_callables(
            layers, tuple((torch.randn(8, 64, device="cuda", requires_grad=True),)
                          for _ in range(8)), order=[1, 1, -1, 1, -1, 1, -1, -1])
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(record)
    assert gc.isenabled()
    assert capturing and not any(capturing), capturing.count(True)
    order = [1, 1, -1, 1, -1, 1, -1, -1]
    inputs = [torch.randn(8, 64, device="cuda", requires_grad=True) for _ in range(4)]
    grads = replay_step(graphed, order, [2], inputs).input_grads
    assert len(grads) == 4 and all(bool(torch.isfinite(g).all()) for g in grads)
    leangraph.reset_all(graphed)

