"""plan_memory: exact measurements on CPU and meta, the warm-up/capture model, the paper check."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import sys
import weakref
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import leangraph
from leangraph.cli.workloads import BlockShape, make_blocks, sample_hidden
from leangraph.memory import LayerMemory, MemoryPlan, format_bytes, plan_memory
from leangraph.schedules import gpipe, interleaved_1f1b, max_in_flight, one_f_one_b

DEVICES = ["cpu", "meta"]
F32 = 4


def _load_script() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "examples" / "plan_70b.py"
    spec = importlib.util.spec_from_file_location("plan_70b", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_70b"] = module
    spec.loader.exec_module(module)
    return module


script = _load_script()


def _numbers(layer: LayerMemory) -> dict[str, int]:
    """The byte counts of a measurement (not the device-specific buffer specs)."""
    return {f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)
            if f.name.endswith("_bytes")}


class Scale(nn.Module):
    """``(2 * x) * w``: saves the intermediate ``2 * x`` (and ``w``, a parameter)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (2 * x) * self.w


class Gated(nn.Module):
    """Saves two views of one intermediate, which costs its storage once."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.lin = nn.Linear(features, 2 * features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lin(x).chunk(2, dim=-1)
        return a * b


class DropsBranch(nn.Module):
    """Computes a branch that saves a tensor, then drops it: nothing of it stays alive."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _ = torch.sin(x * 3)
        return x * self.w


# ---------------------------------------------------------------------------- measurement


@pytest.mark.parametrize("device", DEVICES)
def test_linear_saves_its_input_only(device: str) -> None:
    lin = nn.Linear(8, 16).to(device)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    layer = plan_memory(lin, (x,)).layers[0]
    assert layer.activation_bytes == 0  # addmm saves the input (excluded) and the weight
    assert layer.saved_input_bytes == 4 * 8 * F32
    assert layer.output_bytes == layer.in_flight_bytes == 4 * 16 * F32
    assert layer.grad_input_bytes == 4 * 8 * F32
    assert layer.param_grad_bytes == (16 * 8 + 16) * F32


@pytest.mark.parametrize("device", DEVICES)
def test_mul_saves_both_operands(device: str) -> None:
    x = torch.randn(4, 8, device=device, requires_grad=True)
    w = torch.randn(4, 8, device=device, requires_grad=True)
    layer = plan_memory(lambda a, b: a * b, (x, w)).layers[0]
    assert (layer.activation_bytes, layer.saved_input_bytes) == (0, 2 * 4 * 8 * F32)
    assert layer.grad_input_bytes == 2 * 4 * 8 * F32 and layer.param_grad_bytes == 0
    scaled = plan_memory(Scale(8).to(device), (x,)).layers[0]
    assert scaled.activation_bytes == 4 * 8 * F32  # 2 * x; w is a parameter
    assert scaled.saved_input_bytes == 0
    assert scaled.in_flight_bytes == 2 * 4 * 8 * F32  # plus the output


@pytest.mark.parametrize("device", DEVICES)
def test_views_count_their_storage_once_and_dead_branches_not_at_all(device: str) -> None:
    x = torch.randn(4, 8, device=device, requires_grad=True)
    assert plan_memory(Gated(8).to(device), (x,)).layers[0].activation_bytes == 4 * 16 * F32
    assert plan_memory(DropsBranch().to(device), (x,)).layers[0].activation_bytes == 0


class SavesItsOutput(nn.Module):
    """``exp`` saves its own result: with a pack hook that kept the tensor itself, that output
    and its ``grad_fn`` would form a reference cycle holding the forward's memory."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.outputs: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = (x * self.weight).exp()
        self.outputs.append(weakref.ref(hidden))
        return hidden * 2


def test_measurement_frees_the_forward_by_reference_counting_alone() -> None:
    layer = SavesItsOutput()
    gc.disable()
    try:
        plan = plan_memory(layer, (torch.randn(4, 8, requires_grad=True),))
        assert plan.layers[0].activation_bytes > 0
        assert [ref() for ref in layer.outputs] == [None]
    finally:
        gc.enable()


def test_meta_matches_cpu_for_transformer_block() -> None:
    shape = BlockShape(hidden=64, heads=4, sequence=32, micro_batch=2)
    measured = {}
    for device, like in (("cpu", "cpu"), ("meta", "cpu"), ("meta", "cuda"), ("meta", "math")):
        block = make_blocks(1, shape, device)[0]
        plan = plan_memory(block, (sample_hidden(shape, device),), meta_attention=like)
        measured[device, like] = _numbers(plan.layers[0])
    assert measured["meta", "cpu"] == measured["cpu", "cpu"]
    cuda, cpu = measured["meta", "cuda"], measured["cpu", "cpu"]
    # CUDA's flash kernel also saves its RNG seed and offset (16 or 24 bytes by torch version).
    assert cuda["activation_bytes"] - cpu["activation_bytes"] == script.flash_rng_state_bytes()
    # PyTorch's own meta fallback is the math path, which saves the s x s probabilities
    # (and no log-sum-exp).
    probabilities = shape.micro_batch * shape.heads * shape.sequence**2 * F32
    lse = shape.micro_batch * shape.heads * shape.sequence * F32
    assert measured["meta", "math"]["activation_bytes"] >= \
        cpu["activation_bytes"] + probabilities - lse


def test_meta_follows_the_cpus_kernel_choice() -> None:
    # With CPU's flash kernel turned off, CPU's SDPA runs the math path; so does a meta plan
    # that models the CPU: it measures what meta_attention="math" measures, as the CPU run does.
    shape = BlockShape(hidden=64, heads=4, sequence=32, micro_batch=2)
    measured = {}
    for device, like in (("cpu", "cpu"), ("meta", "cpu"), ("meta", "math")):
        block = make_blocks(1, shape, device)[0]
        with sdpa_kernel(SDPBackend.MATH):
            plan = plan_memory(block, (sample_hidden(shape, device),), meta_attention=like)
        measured[device, like] = _numbers(plan.layers[0])
    assert measured["meta", "cpu"] == measured["cpu", "cpu"] == measured["meta", "math"]
    flash = plan_memory(block, (sample_hidden(shape, "meta"),), meta_attention="cpu").layers[0]
    assert measured["meta", "cpu"]["activation_bytes"] > flash.activation_bytes


def test_same_callable_and_shapes_are_measured_once():
    calls: list[tuple[int, ...]] = []

    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8, device="meta")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(tuple(x.shape))
            return self.linear(x)

    block = Counting()
    samples = tuple((torch.empty(4, 8, device="meta", requires_grad=True),) for _ in range(2 * 4))
    plan_memory((block, block), samples, order=one_f_one_b(2, 0, 4))
    assert calls == [(4, 8)]
    wider = samples[:4] + tuple(
        (torch.empty(6, 8, device="meta", requires_grad=True),) for _ in range(4)
    )
    calls.clear()
    plan_memory((block, block), wider, order=one_f_one_b(2, 0, 4))
    assert calls == [(4, 8), (6, 8)]  # a second signature is measured once more


# ---------------------------------------------------------------------------- paper check


@pytest.mark.parametrize("sequence", [2048, 256])
def test_korthikanti_formula(sequence: int) -> None:
    # The paper's sbh(34 + 5as/h) for a GPT block with dropout and explicit attention, at
    # 16 bits. Measured = everything saved except parameters and buffers, including the
    # block input that LayerNorm 1 saves (the paper counts it; leangraph counts it as a
    # static input). Per term: QKV input 2, the QKV output 6 (Q, K, V are views of it), the
    # softmax output 2as^2b, its dropout mask as^2b (bool), the dropout output 2as^2b, the
    # projection input 2 (a copy: merging heads), dropout mask 1, LayerNorm inputs 2 + 2,
    # fc1 input 2, GeLU input 8, fc2 input 8, dropout mask 1. The only extra is LayerNorm's
    # fp32 mean and rstd (2 x 2 x 4 bytes per token), which the formula leaves out.
    hidden, heads, batch = 1024, 16, 1
    formula, measured, _ = script.paper_check(hidden, heads, sequence, batch)
    assert abs(measured - formula) <= 0.10 * formula
    assert measured - formula == 16 * sequence * batch


# ---------------------------------------------------------------------------- the plan


def _blocks_plan(order: list[int], layers: int = 2, **kwargs: object) -> MemoryPlan:
    shape = BlockShape(hidden=32, heads=2, sequence=16)
    blocks = tuple(make_blocks(layers, shape, "meta"))
    chunks = max(abs(e) for e in order)
    microbatches = sum(1 for e in order if e == 1)
    samples = tuple((sample_hidden(shape, "meta"),) for _ in range(layers * microbatches))
    assert layers % chunks == 0
    return plan_memory(blocks, samples, order=order, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("make_order", [
    lambda m: one_f_one_b(4, 0, m),
    lambda m: interleaved_1f1b(2, 2, 0, m),
])
def test_1f1b_is_flat_in_microbatches(make_order) -> None:  # type: ignore[no-untyped-def]
    # Neither order keeps more forwards in flight when M grows past 4 (1F1B: 4; interleaved
    # 2 x 2: 5 chunk-microbatches), so neither does leangraph's warm-up or capture.
    assert len({max_in_flight(make_order(m)).total for m in (4, 8, 16)}) == 1
    plans = [_blocks_plan(make_order(m), layers=2) for m in (4, 8, 16)]
    assert len({p.warmup_peak_bytes for p in plans}) == 1
    assert len({p.eager_peak_bytes for p in plans}) == 1
    assert len({p.capture_peak_bytes for p in plans}) == 1
    assert len({p.held_bytes for p in plans}) == 1
    naive = [p.naive_warmup_peak_bytes for p in plans]
    assert naive[0] < naive[1] < naive[2]
    assert all(p.naive_warmup_peak_bytes > p.eager_peak_bytes for p in plans[1:])


def test_gpipe_grows_with_microbatches() -> None:
    plans = [_blocks_plan(gpipe(m)) for m in (2, 4, 8)]
    peaks = [p.eager_peak_bytes for p in plans]
    assert peaks[0] < peaks[1] < peaks[2]
    # GPipe holds every forward until the drain: lean is no better than keep-all.
    assert all(p.eager_peak_bytes == p.naive_warmup_peak_bytes for p in plans)
    # Warm-up runs microbatch 0 of each layer, whatever the schedule holds.
    assert len({p.warmup_peak_bytes for p in plans}) == 1
    assert all(p.warmup_peak_bytes < p.eager_peak_bytes for p in plans)


def test_model_by_hand() -> None:
    # One Scale layer, 2 microbatches, order F F B B: both forwards in flight.
    x = torch.empty(4, 8, device="meta", requires_grad=True)
    plan = plan_memory((Scale(8).to("meta"),), ((x,), (x,)), order=[1, 1, -1, -1])
    t = 4 * 8 * F32  # one activation-sized tensor
    layer = plan.layers[0]
    assert layer.in_flight_bytes == 2 * t  # 2 * x and the output
    grads = t + 8 * F32  # grad of x plus grad of w (8 floats)
    assert layer.transient_bytes == grads
    # Two input slots (both forwards in flight), one gradient seed.
    assert (plan.static_input_bytes, plan.grad_output_bytes) == (2 * t, t)
    warmup = [s.live_bytes for s in plan.steps if s.phase == "warm-up"]
    # Warm-up runs microbatch 0 only (microbatch 1's sample has its layout): its forward
    # holds 2t, its backward adds the gradients and its zero grad-output.
    assert warmup == [2 * t, 2 * t + grads + t]
    assert plan.warmup_peak_step == "warm-up step 1 (B c1 m0 l0)"
    # An eager pass holds both forwards.
    assert plan.eager_peak_bytes == 4 * t + grads + t
    assert plan.eager_peak_step == "eager step 2 (B c1 m0 l0)"
    capture = [s.live_bytes for s in plan.steps if s.phase == "capture"]
    static = 3 * t
    assert capture == [static + 2 * t, static + 4 * t, static + 4 * t + grads,
                       static + 2 * t + grads]
    assert plan.pool_bytes == 4 * t and plan.held_bytes == static + 4 * t
    assert plan.naive_warmup_peak_bytes == 4 * t + grads + t
    assert [s.step for s in plan.steps] == ["F c1 m0 l0", "B c1 m0 l0"] + [
        "F c1 m0 l0", "F c1 m1 l0", "B c1 m0 l0", "B c1 m1 l0"]


def test_static_buffers_follow_the_engines_buffer_plan() -> None:
    order = one_f_one_b(4, 0, 8)
    plan = _blocks_plan(order)  # two layers per chunk
    per_input = 16 * 32 * F32
    chunks_in_flight = max_in_flight(order).total
    assert plan.max_in_flight == 2 * chunks_in_flight
    # Layer 1's input is layer 0's output (chained): one slot per chunk-microbatch in flight.
    assert plan.static_input_bytes == chunks_in_flight * per_input
    assert plan.grad_output_bytes == per_input


def test_unordered_plan_is_the_torch_drop_in() -> None:
    shape = BlockShape(hidden=32, heads=2, sequence=16)
    blocks = tuple(make_blocks(3, shape, "meta"))
    plan = plan_memory(blocks, tuple((sample_hidden(shape, "meta"),) for _ in blocks))
    layer = plan.layers[0]
    assert not plan.ordered
    # Warm-up: one callable at a time; capture: every forward, then the backwards.
    assert plan.warmup_peak_bytes == layer.in_flight_bytes + layer.transient_bytes \
        + layer.output_bytes
    assert plan.pool_bytes == 3 * layer.in_flight_bytes
    assert plan.static_input_bytes == 3 * 16 * 32 * F32  # no chaining without an order
    assert plan.max_in_flight == 3
    assert len(plan.steps) == 12


def test_single_callable_and_kwargs() -> None:
    x = torch.empty(2, 8, device="meta", requires_grad=True)

    def fn(x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return (x * 2).sin() * scale

    plan = plan_memory(fn, (x,), sample_kwargs={"scale": torch.empty(2, 8, device="meta")})
    layer = plan.layers[0]
    # sin saves x * 2; the mul saves scale (an input) but not sin's output (scale needs no
    # gradient).
    assert (layer.activation_bytes, layer.saved_input_bytes) == (2 * 8 * F32, 2 * 8 * F32)
    assert plan.static_input_bytes == 2 * 2 * 8 * F32


def test_describe_and_steps() -> None:
    order = one_f_one_b(2, 0, 4)
    plan = _blocks_plan(order)
    text = plan.describe()
    for needle in ("per callable", "0-1", "warm-up peak, lean", "eager pass peak",
                   "held after capture", format_bytes(plan.held_bytes)):
        assert needle in text
    # Warm-up: microbatch 0's two entries of two layers; capture: every entry's.
    assert len(plan.steps) == 2 * 2 + 2 * len(order)
    assert plan.peak_step in (plan.capture_peak_step, plan.warmup_peak_step)
    assert format_bytes(1536) == "1.50 KiB" and format_bytes(12) == "12 B"


# ---------------------------------------------------------------------------- bad input


def test_bad_input() -> None:
    x = torch.empty(2, 4, device="meta", requires_grad=True)
    lin = nn.Linear(4, 4).to("meta")
    with pytest.raises(TypeError, match="not callable"):
        plan_memory((lin, 3), ((x,), (x,)))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tuple of arguments"):
        plan_memory((lin,), (x,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a tensor or a constant"):
        plan_memory(lin, (x, object()))
    with pytest.raises(ValueError, match="exactly one"):
        plan_memory((lin,), ((x,), (x,)))
    with pytest.raises(ValueError, match="needs an order"):
        plan_memory(lin, (x,), num_layers_per_chunk=1)
    with pytest.raises(ValueError, match="chunk ids are 1-based"):
        plan_memory((lin,), ((x,),), order=[0])
    with pytest.raises(ValueError, match="no outstanding forward"):
        plan_memory((lin,), ((x,),), order=[-1, 1])
    with pytest.raises(ValueError, match="meta_attention"):
        plan_memory(lin, (x,), meta_attention="tpu")
    with pytest.raises(ValueError, match="one device"):
        plan_memory(nn.Linear(4, 4), (x,))
    with pytest.raises(TypeError, match="output 1 must be a tensor or a constant"):
        plan_memory(lambda t: (t * 2, object()), (x,))


def test_v4_v30_plan_memory_refuses_callables_graphed_already() -> None:
    """A graphed module's forward replays its graphs, whose autograd node saves nothing: a
    plan of it counted no activations at all and replayed the graphs, moving their replay
    order; a reset one raised GraphResetError."""
    torch.manual_seed(0)
    layers = (nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Sequential(nn.Linear(4, 8), nn.Tanh()))
    samples = tuple((torch.randn(2, 4, requires_grad=True),) for _ in range(2))
    eager = plan_memory(layers[0], samples[0])
    assert eager.activation_bytes_per_graph[0] > 0
    graphed = leangraph.make_graphed_callables(layers[0], samples[0])
    for _ in range(2):  # before and after its reset
        with pytest.raises(ValueError, match=r"plan_memory: callables\[0\] \(Sequential\) was "
                           "graphed by make_graphed_callables .* plan a copy of the module made "
                           "before graphing it"):
            plan_memory(graphed, samples[0])
        leangraph.reset_all(graphed)
    holder = nn.Sequential(layers[1])
    leangraph.make_graphed_callables(layers[1][0], (torch.randn(2, 4, requires_grad=True),))
    with pytest.raises(ValueError, match=r"callables\[1\] \(Sequential\): submodule '0\.0' "
                       "was graphed"):
        plan_memory((nn.Linear(4, 4), holder), samples)
    function = leangraph.make_graphed_callables(lambda t: t.tanh(), (samples[0][0],))
    with pytest.raises(ValueError, match=r"callables\[0\] is a graphed callable .* plan the "
                       "eager callable it replays"):
        plan_memory(function, (samples[0][0],))
    leangraph.reset_all([holder[0][0], function])


# ---------------------------------------------------------------------------- the 70B script


SMALL = dict(hidden=64, heads=8, kv_heads=2, ffn=96, tp=2, sequence=32)


def _sdpa_takes_enable_gqa() -> bool:
    """Whether this torch's ``scaled_dot_product_attention`` takes ``enable_gqa`` (torch 2.5+)."""
    query = torch.zeros(1, 2, 4, 8)
    try:
        F.scaled_dot_product_attention(query, query[:, :1], query[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


needs_gqa = pytest.mark.skipif(
    not _sdpa_takes_enable_gqa(),
    reason="this torch's scaled_dot_product_attention has no enable_gqa argument, which "
           "LlamaBlock's grouped-query attention passes")


def _cpu_flash_takes_gqa() -> bool:
    """Whether CPU's SDPA runs grouped-query attention on its flash kernel (torch 2.5 and 2.6
    run it on the math path)."""
    query = torch.zeros(1, 2, 4, 8, requires_grad=True)
    out = F.scaled_dot_product_attention(query, query[:, :1], query[:, :1], enable_gqa=True)
    return type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"


def _llama_cpu_expected_bytes(shape: script.LlamaShape) -> int:
    """What a CPU run of the block saves, from the attention kernel CPU's SDPA runs."""
    expected = script.llama_expected_bytes(shape)
    del expected["flash RNG seed and offset"]  # CPU's flash kernel draws no RNG state
    if _cpu_flash_takes_gqa():
        return sum(expected.values())
    # The math path takes q, k and v as fp32 copies, so neither the RoPE outputs nor the QKV
    # output (v's storage) stay saved, nor a log-sum-exp; it saves, in fp32, the scaled q,
    # the scaled k^T and v (both expanded to the query heads) and the s x s probabilities.
    for flash_only in ("QKV output (v is a view of it)", "q after RoPE", "k after RoPE",
                       "attention log-sum-exp (fp32)"):
        del expected[flash_only]
    fp32_rows = 4 * shape.micro_batch * shape.local_heads * shape.sequence
    expected["math q, k^T, v (fp32)"] = 3 * fp32_rows * shape.head_dim
    expected["math probabilities (fp32)"] = fp32_rows * shape.sequence
    return sum(expected.values())


@needs_gqa
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_llama_block_saves_what_its_structure_implies(sequence_parallel: bool) -> None:
    shape = script.LlamaShape(sequence_parallel=sequence_parallel, **SMALL)
    expected = sum(script.llama_expected_bytes(shape).values())
    measured = {}
    for device, like in (("cpu", "cpu"), ("meta", "cpu"), ("meta", "cuda")):
        with torch.device(device):
            block = script.LlamaBlock(shape)
            x = torch.randn(shape.input_sequence, 1, shape.hidden, dtype=shape.dtype,
                            requires_grad=True)
        measured[device, like] = plan_memory(block, (x,), meta_attention=like).layers[0]
    assert _numbers(measured["meta", "cpu"]) == _numbers(measured["cpu", "cpu"])
    assert measured["meta", "cuda"].activation_bytes == expected
    assert measured["cpu", "cpu"].activation_bytes == _llama_cpu_expected_bytes(shape)


def test_llama_block_backward_is_correct() -> None:
    x = torch.randn(8, 2, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: script._FusedRMSNorm.apply(a, b, 1e-5), (x, w))
    g = torch.randn(8, 2, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(script._FusedSwiGLU.apply, (g,))
    weight = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    for tp in (1, 2):  # tp 2: the simulated all-gather's adjoint is the reduce-scatter
        assert torch.autograd.gradcheck(lambda a, b: script._GatherLinear.apply(a, b, tp),
                                        (x, weight))


@needs_gqa
def test_llama_block_keeps_its_input_shape() -> None:
    shape = script.LlamaShape(tp=1, dtype=torch.float64, **{k: v for k, v in SMALL.items()
                                                              if k != "tp"})
    block = script.LlamaBlock(shape)
    sample = torch.randn(shape.sequence, 1, shape.hidden, dtype=torch.float64)
    assert block(sample).shape == sample.shape


@needs_gqa
def test_70b_style_plan_is_flat_in_microbatches() -> None:
    shape = script.LlamaShape(**SMALL)
    plans = [script.plan_rank(shape, pp=4, vp=5, layers_per_chunk=1, microbatches=m)[0]
             for m in (8, 16)]
    assert plans[0].warmup_peak_bytes == plans[1].warmup_peak_bytes
    assert plans[0].naive_warmup_peak_bytes < plans[1].naive_warmup_peak_bytes


def test_warm_up_is_the_eager_pass_when_no_two_graphs_are_alike() -> None:
    # A sequence length per microbatch: every graph is warmed up, so warm-up holds what an
    # eager step holds; with one length, microbatch 0's graphs alone.
    order = one_f_one_b(2, 0, 4)
    layers = tuple(Scale(8).to("meta") for _ in range(2))
    apart = tuple((torch.empty(m + 1, 8, device="meta", requires_grad=True),)
                  for m in range(4) for _ in range(2))
    alike = tuple((torch.empty(4, 8, device="meta", requires_grad=True),) for _ in range(8))
    distinct = plan_memory(layers, apart, order=order, num_layers_per_chunk=2)
    same = plan_memory(layers, alike, order=order, num_layers_per_chunk=2)
    assert distinct.warmup_peak_bytes == distinct.eager_peak_bytes
    assert [s.step for s in distinct.steps if s.phase == "warm-up"] == [
        s.step for s in distinct.steps if s.phase == "capture"]
    assert same.warmup_peak_bytes < same.eager_peak_bytes
    assert {s.step.split()[2] for s in same.steps if s.phase == "warm-up"} == {"m0"}
