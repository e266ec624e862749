"""What composes with leangraph's graphed callables, established against eager PyTorch.

The table of docs/composition.md cites these tests. On the CPU reference backend: activation
checkpointing around and inside graphed layers (with dropout, whose masks a recompute must
reproduce), GradScaler with autocast, one graphed set per sequence length; and on two ranks
over gloo (one pair of processes, this file run as a script, runs every case): graphed layers
inside DDP with ``no_sync`` microbatches, tensor-parallel collectives inside a graphed layer,
and FSDP2, which leangraph refuses. Where a composition works the check is bitwise against
eager over several optimizer steps; where it cannot, a leangraph error naming the callable,
what was expected and what it got.

The ``cuda`` tests redo on a GPU what real CUDA graph capture changes: CUDA's RNG under
checkpointing, the shared pool of several graphed sets, NCCL collectives inside a capture (a
world of one rank, so one GPU suffices).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import assert_replays_like_eager, gloo_rank, raises, two_gloo_ranks
from models import Block
from torch import nn
from torch.utils.checkpoint import checkpoint

import leangraph

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240
STEPS = 3
CUDA = pytest.mark.cuda


def leaf(*shape: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, device=device, requires_grad=True)


def twin(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(x.requires_grad)


def grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def assert_equal(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for index, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what} {index}: max diff {(x - y).abs().max()}"


class Dropping(nn.Module):
    """A residual MLP with dropout between its two linears."""

    def __init__(self, width: int = 8, p: float = 0.5) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.dropout(F.gelu(self.up(x)), self.p, training=self.training))


# --------------------------------------------------------------------------------------------
# Activation checkpointing
# --------------------------------------------------------------------------------------------


def train_checkpointed_around(use_reentrant: bool, device: str = "cpu") -> None:
    """``checkpoint(graphed_layer, x)``, with dropout, against ``checkpoint(eager_layer, x)``:
    both runs start each step from the same generator state, so equal masks mean equal
    gradients; the optimizer steps keep the parameters equal too."""
    torch.manual_seed(0)
    layer = Dropping().to(device)
    eager = copy.deepcopy(layer)
    graphed = leangraph.make_graphed_callables(layer, (leaf(4, 8, device=device),))
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (layer, eager)]
    for step in range(STEPS):
        x = leaf(4, 8, device=device)
        outs = []
        for module, inputs in ((graphed, x), (eager, x_eager := twin(x))):
            torch.manual_seed(100 + step)
            out = checkpoint(module, inputs, use_reentrant=use_reentrant)
            out.square().sum().backward()
            outs.append(out.detach().clone())
        if not use_reentrant:  # reentrant returns the no-grad forward's output, fine as well
            assert torch.equal(outs[0], outs[1]), f"step {step}: outputs differ"
        assert torch.equal(x.grad, x_eager.grad), f"step {step}: input gradients differ"
        assert_equal(grads(layer), grads(eager), f"step {step} parameter gradient")
        for optim in optims:
            optim.step()
            optim.zero_grad()
    leangraph.reset_all(graphed)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_around_a_graphed_layer_reproduces_dropout_masks(use_reentrant: bool):
    train_checkpointed_around(use_reentrant)


def test_reentrant_checkpoint_around_graphs_of_an_order_is_refused_as_out_of_order():
    """Its recompute replays microbatch 0's forward again at backward time, while the order
    has microbatch 1's forward next: the replay-order check refuses, naming both."""
    torch.manual_seed(0)
    layer = Dropping()
    graphed = leangraph.make_graphed_callables(
        (layer,), tuple((leaf(4, 8),) for _ in range(2)), order=[1, 1, -1, -1]
    )
    outs = [checkpoint(graphed[m], leaf(4, 8), use_reentrant=True) for m in range(2)]
    with raises(RuntimeError, "graph (chunk 1, microbatch 0, layer 0): backward replayed out of "
                "capture order", "must be the forward of graph (chunk 1, microbatch 1"):
        outs[0].sum().backward()
    leangraph.reset_all(graphed)


def test_non_reentrant_checkpoint_around_graphs_of_an_order_trains_like_eager():
    torch.manual_seed(0)
    layer = Dropping()
    eager = copy.deepcopy(layer)
    graphed = leangraph.make_graphed_callables(
        (layer,), tuple((leaf(4, 8),) for _ in range(2)), order=[1, 1, -1, -1]
    )
    for step in range(2):
        xs = [leaf(4, 8) for _ in range(2)]
        xs_eager = [twin(x) for x in xs]
        for run, inputs in ((lambda m, x: graphed[m](x), xs), (lambda m, x: eager(x), xs_eager)):
            torch.manual_seed(100 + step)
            outs = [checkpoint(run, m, x, use_reentrant=False) for m, x in enumerate(inputs)]
            for out in outs:
                out.square().sum().backward()
        assert_equal([x.grad for x in xs], [x.grad for x in xs_eager], f"step {step} input grad")
        assert_equal(grads(layer), grads(eager), f"step {step} parameter gradient")
    leangraph.reset_all(graphed)


class Checkpointed(nn.Module):
    """``inner`` under ``torch.utils.checkpoint`` (a module, so its parameters train)."""

    def __init__(self, inner: nn.Module, **options: Any) -> None:
        super().__init__()
        self.inner = inner
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, **self.options)


def test_non_reentrant_checkpoint_inside_without_rng_preservation_replays_as_eager():
    """``preserve_rng_state=False`` recomputes dropout with fresh masks, in eager as in the
    graphs (so it is only right for code without random ops); the graphs draw the same
    numbers eager does, so they agree bitwise."""
    torch.manual_seed(0)
    layer = Checkpointed(Dropping(), use_reentrant=False, preserve_rng_state=False)
    eager = copy.deepcopy(layer)
    graphed = leangraph.make_graphed_callables(layer, (leaf(4, 8),))
    for step in range(2):
        x = leaf(4, 8)
        x_eager = twin(x)
        for run, inputs in ((graphed, x), (eager, x_eager)):
            torch.manual_seed(100 + step)
            run(inputs).square().sum().backward()
        assert torch.equal(x.grad, x_eager.grad), f"step {step}"
        assert_equal(grads(layer), grads(eager), f"step {step} parameter gradient")
    leangraph.reset_all(graphed)


def test_w9_reentrant_checkpoint_inside_a_graphed_callable_is_refused_before_warm_up():
    torch.manual_seed(0)
    inner = Block(8)
    warmed = []

    def checkpointed(x: torch.Tensor) -> torch.Tensor:
        warmed.append(1)
        return checkpoint(inner, x, use_reentrant=True)

    with raises(ValueError, "callable 0 (", "use_reentrant=True", "expected use_reentrant=False"):
        leangraph.make_graphed_callables(checkpointed, (leaf(4, 8),))
    assert warmed == [1]  # the probe's forward only


# --------------------------------------------------------------------------------------------
# GradScaler and autocast
# --------------------------------------------------------------------------------------------


def train_scaled(device: str, dtype: torch.dtype) -> dict[str, list[Any]]:
    """Two graphed blocks captured under autocast, trained with a GradScaler whose first
    scale overflows (skipped steps, the scale halving) until steps apply."""
    torch.manual_seed(0)
    layers = [Block(8).to(device) for _ in range(2)]
    eager = copy.deepcopy(layers)
    with torch.autocast(device, dtype=dtype, cache_enabled=False):
        graphed = leangraph.make_graphed_callables(
            tuple(layers), tuple((leaf(4, 8, device=device),) for _ in layers)
        )
    history: dict[str, list[Any]] = {}
    for name, modules in (("graphed", graphed), ("eager", eager)):
        params = [p for m in modules for p in m.parameters()]
        optim = torch.optim.SGD(params, lr=0.1)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**24, growth_interval=2)
        gen = torch.Generator().manual_seed(1)
        history[name] = []
        for _ in range(12):
            x = torch.randn(4, 8, generator=gen).to(device).requires_grad_()
            with torch.autocast(device, dtype=dtype, cache_enabled=False):
                loss = modules[1](modules[0](x)).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(optim)
            scaler.update()
            optim.zero_grad()
            history[name].append(
                (loss.detach(), scaler.get_scale(), [p.detach().clone() for p in params])
            )
    leangraph.reset_all(graphed)
    return history


def check_scaled(history: dict[str, list[Any]]) -> None:
    scales = [scale for _, scale, _ in history["eager"]]
    assert scales[0] < 2.0**24 and any(b > a for a, b in zip(scales, scales[1:])), scales
    for step, ((lg, sg, pg), (le, se, pe)) in enumerate(zip(history["graphed"], history["eager"])):
        assert torch.equal(lg, le) and sg == se, f"step {step}: loss or scale differ"
        assert_equal(pg, pe, f"step {step} parameter")


def test_grad_scaler_with_autocast_trains_like_eager_through_skipped_steps():
    check_scaled(train_scaled("cpu", torch.float16))


# --------------------------------------------------------------------------------------------
# Variable sequence length: one graphed set per length
# --------------------------------------------------------------------------------------------


def train_per_length(lengths: tuple[int, ...], device: str = "cpu", pool: Any = None) -> None:
    """The same two blocks graphed once per sequence length (one call each, an order of one
    microbatch, the modules themselves left eager); steps alternate between the lengths, each
    step whole (forward and backward) before the next, against the eager blocks."""
    torch.manual_seed(0)
    layers = (Block(8).to(device), Block(8).to(device))
    eager = copy.deepcopy(layers)
    options = {} if pool is None else {"pool": pool}
    sets = {
        length: leangraph.make_graphed_callables(
            layers, tuple((leaf(2, length, 8, device=device),) for _ in layers),
            order=[1, -1], num_layers_per_chunk=2, **options,
        )
        for length in lengths
    }
    optims = [torch.optim.SGD([p for m in ms for p in m.parameters()], lr=0.1)
              for ms in (layers, eager)]
    for step in range(2 * len(lengths)):
        length = lengths[step % len(lengths)]
        graphed = sets[length]
        x = leaf(2, length, 8, device=device)
        x_eager = twin(x)
        out = graphed[1](graphed[0](x))
        expected = eager[1](eager[0](x_eager))
        assert torch.equal(out, expected), f"step {step} (length {length}): outputs differ"
        out.square().mean().backward()
        expected.square().mean().backward()
        assert torch.equal(x.grad, x_eager.grad)
        for modules in (layers, eager):
            assert all(p.grad is not None for m in modules for p in m.parameters())
        assert_equal([p.grad for m in layers for p in m.parameters()],
                     [p.grad for m in eager for p in m.parameters()], f"step {step} grad")
        for optim in optims:
            optim.step()
            optim.zero_grad()
    for graphed in sets.values():
        leangraph.reset_all(graphed)


def test_one_graphed_set_per_sequence_length_trains_like_eager():
    train_per_length((16, 8))


def test_a_sequence_length_a_set_was_not_captured_for_is_refused():
    torch.manual_seed(0)
    layer = Block(8)
    graphed = leangraph.make_graphed_callables((layer,), ((leaf(2, 8, 8),),), order=[1, -1])
    with raises(ValueError, "graph (chunk 1, microbatch 0, layer 0) input 0 must keep shape "
                "(2, 8, 8), got (2, 16, 8)"):
        graphed[0](leaf(2, 16, 8))
    leangraph.reset_all(graphed)
    drop_in = leangraph.make_graphed_callables(Block(8), (leaf(2, 8, 8),))
    with raises(ValueError, "callable 0 (Block) input 0 must keep shape (2, 8, 8), got "
                "(2, 16, 8)"):
        drop_in(leaf(2, 16, 8))
    leangraph.reset_all(drop_in)


# --------------------------------------------------------------------------------------------
# Two ranks over gloo: DDP, tensor-parallel collectives, FSDP2 (one pair of processes)
# --------------------------------------------------------------------------------------------


def _ddp_case(rank: int, device: str = "cpu") -> dict[str, Any]:
    """Graphed blocks inside a DDP-wrapped model, two microbatches a step (the first under
    ``no_sync``), against the same model eager under DDP; gradients after the all-reduce and
    parameters after every optimizer step must be bitwise equal."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    layers = [Block(8).to(device) for _ in range(2)]
    eager = nn.Sequential(*copy.deepcopy(layers))
    graphed_layers = leangraph.make_graphed_callables(
        tuple(layers), tuple((leaf(4, 8, device=device),) for _ in layers)
    )
    graphed = nn.Sequential(*graphed_layers)
    history: dict[str, list[list[torch.Tensor]]] = {}
    for name, model in (("graphed", graphed), ("eager", eager)):
        ddp = DistributedDataParallel(model)
        optim = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(10 + rank)  # each rank its own data
        history[name] = []
        for _ in range(STEPS):
            for micro in range(2):
                sync = ddp.no_sync() if micro == 0 else contextlib.nullcontext()
                with sync:
                    ddp(torch.randn(4, 8, generator=gen).to(device)).square().mean().backward()
            history[name].append(grads(model))
            optim.step()
            optim.zero_grad()
            history[name].append([p.detach().clone() for p in model.parameters()])
    leangraph.reset_all(graphed_layers)
    mismatches = [
        step for step, (a, b) in enumerate(zip(history["graphed"], history["eager"]))
        if not all(torch.equal(x, y) for x, y in zip(a, b))
    ]
    # What the all-reduce made of rank-local gradients: the same on both ranks.
    return {"mismatches": mismatches, "grad_sum": float(history["graphed"][0][0].sum())}


class _CopyToParallel(torch.autograd.Function):
    """Megatron's column-parallel entry: identity forward, all-reduce of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's row-parallel exit: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ParallelMLP(nn.Module):
    """A tensor-parallel MLP: this rank's column slice of ``up`` and row slice of ``down``,
    with an all-reduce in the forward and one in the backward."""

    def __init__(self, width: int, shards: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width // shards)
        self.down = nn.Linear(2 * width // shards, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.up(_CopyToParallel.apply(x)))
        return x + _ReduceFromParallel.apply(self.down(hidden))


def _tp_case(rank: int, world: int, device: str = "cpu") -> dict[str, Any]:
    """The tensor-parallel MLP graphed (the collectives inside its forward and backward
    graphs) against it eager, over optimizer steps; plus the full MLP unsharded, which the
    sharded eager run must match closely (so the collectives did run)."""
    torch.manual_seed(rank)
    layer = ParallelMLP(8, world).to(device)
    eager = copy.deepcopy(layer)
    graphed = leangraph.make_graphed_callables(layer, (leaf(4, 8, device=device),))
    mismatches = []
    gen = torch.Generator().manual_seed(7)  # the same data on every rank, as TP needs
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (layer, eager)]
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=gen).to(device).requires_grad_()
        x_eager = twin(x)
        out, expected = graphed(x), eager(x_eager)
        same = torch.equal(out, expected)
        out.square().mean().backward()
        expected.square().mean().backward()
        same = same and torch.equal(x.grad, x_eager.grad)
        same = same and all(torch.equal(a, b) for a, b in zip(grads(layer), grads(eager)))
        if not same:
            mismatches.append(step)
        for optim in optims:
            optim.step()
            optim.zero_grad()
    leangraph.reset_all(graphed)
    return {"mismatches": mismatches, "out_sum": float(expected.detach().sum())}


def _fsdp_cases(rank: int) -> dict[str, str]:
    """FSDP2 both ways round: sharding first is refused at capture, graphing first at the
    first forward through the sharded model."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return {"skip": "this torch has no torch.distributed.fsdp.fully_shard"}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    found = {}
    torch.manual_seed(0)
    layer = Block(8)
    fully_shard(layer, mesh=mesh)
    try:
        leangraph.make_graphed_callables(layer, (leaf(4, 8),))
        found["shard_then_graph"] = "no error"
    except ValueError as exc:
        found["shard_then_graph"] = str(exc)
    torch.manual_seed(0)
    layers = [Block(8) for _ in range(2)]
    graphed = leangraph.make_graphed_callables(tuple(layers), tuple((leaf(4, 8),) for _ in layers))
    model = nn.Sequential(*layers)
    fully_shard(model, mesh=mesh)
    try:
        model(torch.randn(4, 8)).sum().backward()
        found["graph_then_shard"] = "no error"
    except RuntimeError as exc:
        found["graph_then_shard"] = str(exc)
    leangraph.reset_all(graphed)
    return found


@pytest.fixture
def gloo_world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_v21_a_module_sharded_by_fully_shard_is_refused_at_capture(gloo_world_of_one):
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard")
    from torch.distributed.device_mesh import init_device_mesh

    model = nn.Sequential(Block(8), Block(8))
    fsdp.fully_shard(model[1], mesh=init_device_mesh("cpu", (1,)))
    with raises(ValueError, "callables[0] (Sequential): submodule '1' is sharded by FSDP2's "
                "fully_shard", "does not compose with graphed layers"):
        leangraph.make_graphed_callables(model, (leaf(4, 8),))


@pytest.mark.parametrize("sharded", ["the layer", "a module holding the layers"])
def test_graphs_of_an_order_whose_layers_are_sharded_after_capture_are_refused(
    gloo_world_of_one, sharded
):
    # docs/composition.md said these are called directly and not checked; the replays check
    # their layers' hooks (R21) and parameters (R13) with an order too.
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard")
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    layers = (Block(8), Block(8))
    graphed = leangraph.make_graphed_callables(layers, (((leaf(4, 8),),) * 2), order=[1, -1])
    mesh = init_device_mesh("cpu", (1,))
    fsdp.fully_shard(layers[0] if sharded == "the layer" else nn.Sequential(*layers), mesh=mesh)
    expected = ("graph (chunk 1, microbatch 0, layer 0): the module got _forward_hooks"
                if sharded == "the layer" else
                "graph (chunk 1, microbatch 0, layer 0) parameter 'norm.weight' must be the "
                "tensor it was captured with, got another DTensor")
    with raises(RuntimeError, expected):
        graphed[0](leaf(4, 8))
    leangraph.reset_all(graphed)


def test_r13_a_parameter_replaced_after_capture_is_refused_at_replay():
    torch.manual_seed(0)
    layer = Block(8)
    graphed = leangraph.make_graphed_callables(layer, (leaf(4, 8),))
    graphed(leaf(4, 8)).sum().backward()
    layer.up.weight = nn.Parameter(layer.up.weight.detach().clone())
    with raises(RuntimeError, "callable 0 (Block) parameter 'up.weight' must be the tensor it "
                "was captured with, got another Parameter"):
        graphed(leaf(4, 8))
    layer.eval()  # outside its training mode the module runs eagerly, with what it has now
    graphed(leaf(4, 8))
    leangraph.reset_all(graphed)


def _distributed_cases(rank: int) -> dict[str, Any]:
    """Every distributed case on ``rank`` of two."""
    return {"ddp": _ddp_case(rank), "tp": _tp_case(rank, 2), "fsdp": _fsdp_cases(rank)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return two_gloo_ranks(__file__, tmp_path_factory.mktemp("composition"), timeout=TIMEOUT_S)


def test_two_ranks_ddp_with_no_sync_trains_bitwise_like_eager(two_ranks):
    for rank, report in enumerate(two_ranks):
        assert report["ddp"]["mismatches"] == [], f"rank {rank}: {report['ddp']}"
    # The gradients were all-reduced: both ranks hold the same ones, from different data.
    assert two_ranks[0]["ddp"]["grad_sum"] == two_ranks[1]["ddp"]["grad_sum"]


def test_two_ranks_tensor_parallel_collectives_inside_a_graph_replay_like_eager(two_ranks):
    for rank, report in enumerate(two_ranks):
        assert report["tp"]["mismatches"] == [], f"rank {rank}: {report['tp']}"
    # The forward all-reduce sums both ranks' partial outputs: the ranks agree.
    assert two_ranks[0]["tp"]["out_sum"] == two_ranks[1]["tp"]["out_sum"]


def test_two_ranks_fsdp2_is_refused_both_ways_round(two_ranks):
    fsdp = two_ranks[0]["fsdp"]
    if "skip" in fsdp:
        pytest.skip(fsdp["skip"])
    assert "callables[0] (FSDPBlock): the module is sharded by FSDP2's fully_shard" in (
        fsdp["shard_then_graph"])
    assert "callable 0 (Block) parameter 'norm.weight' must be the tensor it was captured " \
        "with, got another" in fsdp["graph_then_shard"]
    assert two_ranks[1]["fsdp"] == fsdp


# --------------------------------------------------------------------------------------------
# CUDA: what real capture changes
# --------------------------------------------------------------------------------------------


@CUDA
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_cuda_checkpoint_around_a_graphed_layer_reproduces_dropout_masks(use_reentrant: bool):
    """Bitwise against eager needs a replay to draw the numbers eager draws from the same
    generator state (a CUDA graph's Philox offset starts where the generator stands)."""
    train_checkpointed_around(use_reentrant, device="cuda")


@CUDA
def test_cuda_checkpoint_around_backward_uses_the_forward_replays_mask():
    """Independent of eager's numbers: the gradient through dropout is zero exactly where the
    forward replay dropped, so the recompute (reentrant) reproduced the forward's mask."""
    torch.manual_seed(0)
    drop = nn.Dropout(0.5).cuda()
    graphed = leangraph.make_graphed_callables(drop, (leaf(64, 64, device="cuda"),))
    x = (torch.rand(64, 64, device="cuda") + 1).requires_grad_()  # nonzero everywhere
    out = checkpoint(graphed, x, use_reentrant=True)
    kept = out.detach() != 0
    out.sum().backward()
    assert 0 < int(kept.sum()) < kept.numel()
    assert torch.equal(x.grad != 0, kept)
    leangraph.reset_all(graphed)


@CUDA
@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_cuda_checkpoint_inside_without_random_ops_is_exact(preserve_rng_state):
    """On the H200 (torch 2.11) CUDA capture takes checkpoint's generator-state read too
    (its default preserve_rng_state=True); the recompute is recorded in the backward graph."""
    torch.manual_seed(0)
    layer = Checkpointed(Block(8), use_reentrant=False,
                         preserve_rng_state=preserve_rng_state).cuda()
    eager = copy.deepcopy(layer)
    graphed = leangraph.make_graphed_callables(layer, (leaf(4, 8, device="cuda"),))
    assert_replays_like_eager(graphed, eager, lambda: leaf(4, 8, device="cuda"))
    assert_equal(grads(layer), grads(eager), "parameter gradient")
    leangraph.reset_all(graphed)


@CUDA
def test_cuda_grad_scaler_with_autocast_trains_like_eager_through_skipped_steps():
    check_scaled(train_scaled("cuda", torch.float16))


@CUDA
def test_cuda_graphed_sets_per_sequence_length_share_one_pool():
    train_per_length((16, 8), device="cuda", pool=torch.cuda.graph_pool_handle())


@CUDA
def test_cuda_nccl_collectives_inside_a_graphed_layer_replay_like_eager(nccl_world_of_one):
    report = _tp_case(0, 1, device="cuda")
    assert report["mismatches"] == [], report


@CUDA
def test_cuda_ddp_over_nccl_with_no_sync_trains_like_eager(nccl_world_of_one):
    report = _ddp_case(0, device="cuda")
    assert report["mismatches"] == [], report


if __name__ == "__main__":
    gloo_rank(_distributed_cases, "one rank of the two-rank composition tests")
