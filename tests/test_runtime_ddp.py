"""Graphed layers whose outputs a loss may leave out, inside torch's DistributedDataParallel,
2 ranks over gloo (CPU backend), in the default, ``overlap_grad_accumulation`` and
``fuse_grad_accumulation`` (relay) modes, each against the same model eager under DDP.

A layer returns ``(y, head(y))``. With every output in the loss, training equals eager DDP's
bitwise. With ``find_unused_parameters=False`` (DDP's default) and a loss on ``y`` alone, eager
DDP raises at the next forward (the head's parameters got no gradient); the replay's autograd
node has an edge to every parameter, so autograd would run the head's accumulators anyway, and
DDP's reducer (hooked on them from C++) would silently all-reduce zeros: the backward replay
refuses before anything runs (R29). Under ``no_sync()``, for parameters DDP ignores, and with
``find_unused_parameters=True`` eager DDP accepts such a loss, and so do the replays: training
equals eager's bitwise."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import gloo_rank, two_gloo_ranks
from models import TwoOutputs
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import leangraph

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)

STEPS = 3
MODES: dict[str, dict[str, bool]] = {
    "default": {},
    "overlap": {"overlap_grad_accumulation": True},
    "fused": {"fuse_grad_accumulation": True},
}
HEAD = ("layer.head.weight", "layer.head.bias")  # what only the second output reaches


class Model(nn.Module):
    """An eager embedding, then the (graphed) layer; returns both of its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layer = TwoOutputs()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer(self.embed(x))


class DropsAux(Model):
    """The same, but the DDP model returns ``y`` alone (twice): ``head(y)`` is left out inside
    it, so no output of DDP's forward reaches the head's parameters."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, _ = self.layer(self.embed(x))
        return y, y


UsesAux = Callable[[int, int], bool]  # (step, microbatch) -> whether the loss takes head(y)


def _models(mode: str, device: str = "cpu", model: type[Model] = Model) -> tuple[Model, Model]:
    """The eager model and a copy whose layer is graphed (drop-in), in ``mode``."""
    torch.manual_seed(0)
    eager = model().to(device)
    graphed = copy.deepcopy(eager)
    leangraph.make_graphed_callables(
        graphed.layer, (torch.randn(4, 8, device=device, requires_grad=True),), **MODES[mode]
    )
    return eager, graphed


def _train(model: Model, rank: int, uses_aux: UsesAux, *, find_unused: bool = False,
           static_graph: bool = False, microbatches: int = 1, ignored: tuple[str, ...] = (),
           device: str = "cpu") -> dict[str, Any]:
    """``STEPS`` SGD steps of ``model`` under DDP, ``microbatches`` a step (all but the last
    under ``no_sync()``), each rank on its own data. The gradients after each step's last
    backward and the parameters after each step; or where it raised (``"raised"``: forward
    or backward, and the step) and what."""
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(ignored))
    ddp = DistributedDataParallel(
        model, find_unused_parameters=find_unused, static_graph=static_graph
    )
    optim = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(10 + rank)
    history: list[list[torch.Tensor | None]] = []
    for step in range(STEPS):
        optim.zero_grad()
        for micro in range(microbatches):
            sync = ddp.no_sync() if micro < microbatches - 1 else contextlib.nullcontext()
            with sync:
                x = torch.randn(4, 8, generator=gen).to(device)
                try:
                    y, aux = ddp(x)
                except RuntimeError as exc:
                    return {"raised": ["forward", step], "error": str(exc), "history": history}
                loss = y.square().sum()
                if uses_aux(step, micro):
                    loss = loss + aux.square().sum()
                try:
                    loss.backward()
                except RuntimeError as exc:
                    return {"raised": ["backward", step], "error": str(exc), "history": history,
                            "head_grads": [p.grad is None for p in model.layer.head.parameters()]}
        history.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        optim.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return {"raised": None, "history": history}


def _mismatches(eager: dict[str, Any], graphed: dict[str, Any]) -> list[str]:
    """Where two histories differ (bitwise, a missing gradient only matching one)."""
    if eager["raised"] or graphed["raised"]:
        return [f"raised: eager {eager['raised']}, graphed {graphed['raised']}"]
    found = []
    for index, (a, b) in enumerate(zip(eager["history"], graphed["history"], strict=True)):
        for position, (x, y) in enumerate(zip(a, b, strict=True)):
            if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
                found.append(f"entry {index} (step {index // 2}), tensor {position}")
    return found


def _compare(mode: str, rank: int, uses_aux: UsesAux, model: type[Model] = Model,
             **options: Any) -> dict[str, Any]:
    """Eager and graphed trained alike: their mismatches, and the sums of the graphed model's
    first gradients (the all-reduce makes them one across ranks)."""
    eager_model, graphed_model = _models(mode, options.get("device", "cpu"), model)
    eager = _train(eager_model, rank, uses_aux, **options)
    graphed = _train(graphed_model, rank, uses_aux, **options)
    leangraph.reset_all(graphed_model.layer)
    first = graphed["history"][0] if graphed["history"] else []
    second = graphed["history"][2] if len(graphed["history"]) > 2 else []
    return {"mismatches": _mismatches(eager, graphed),
            "grad_sums": [None if g is None else float(g.sum()) for g in first],
            "late_head_sums": [None if g is None else float(g.sum()) for g in second[-2:]]}


def _left_out(mode: str, rank: int, device: str = "cpu") -> dict[str, Any]:
    """``find_unused_parameters=False``, a loss on ``y`` alone: where each raises, and what."""
    eager_model, graphed_model = _models(mode, device)
    eager = _train(eager_model, rank, lambda step, micro: False, device=device)
    graphed = _train(graphed_model, rank, lambda step, micro: False, device=device)
    leangraph.reset_all(graphed_model.layer)
    return {"eager": {"raised": eager["raised"], "error": eager.get("error")},
            "graphed": {"raised": graphed["raised"], "error": graphed.get("error"),
                        "head_grads_none": graphed.get("head_grads")}}


def _cases(rank: int) -> dict[str, Any]:
    always: UsesAux = lambda step, micro: True  # noqa: E731
    # Data-dependent use: some steps on one rank only, some on none.
    sometimes: UsesAux = lambda step, micro: step == 0 or (step == 2 and rank == 0)  # noqa: E731
    report = {}
    for mode in MODES:
        report[mode] = {
            "all_used": _compare(mode, rank, always),
            "left_out": _left_out(mode, rank),
            "find_unused": _compare(mode, rank, sometimes, find_unused=True),
            # Left out under no_sync() only: the reducer waits for no parameter there.
            "no_sync": _compare(mode, rank, lambda step, micro: micro == 1, microbatches=2),
            "ignored": _compare(mode, rank, lambda step, micro: False, ignored=HEAD),
            # static_graph: nothing is refused; what eager's static graph trains, the same.
            "static_all_used": _compare(mode, rank, always, static_graph=True),
            "static_dropped": _compare(mode, rank, always, DropsAux, static_graph=True),
            # The head first reached at step 1: eager's static graph learned it unused at
            # step 0 and never all-reduces it (each rank keeps its own), and so do the replays.
            "static_late": _compare(mode, rank, lambda step, micro: step >= 1,
                                    static_graph=True),
        }
    return report


def _check_refused(found: dict[str, Any], where: str) -> None:
    """``_left_out``'s report: eager DDP raised at the next forward, the replay at the first
    backward, naming the head's parameters, whose gradients stay None."""
    # Eager DDP raises at the next forward: the head's parameters got no gradient.
    assert found["eager"]["raised"] == ["forward", 1], f"{where}: {found}"
    assert "Expected to have finished reduction in the prior iteration" in (
        found["eager"]["error"]), f"{where}: {found}"
    # The replay refuses at the first backward, before DDP could reduce anything.
    assert found["graphed"]["raised"] == ["backward", 0], f"{where}: {found}"
    assert found["graphed"]["error"] == (
        "callable 0 (TwoOutputs) parameters 'head.weight', 'head.bias' get no gradient in "
        "this backward (no output that got a gradient reaches them: the loss leaves an "
        "output out), but the forward replay ran inside torch's DistributedDataParallel "
        "with find_unused_parameters=False, which expects every parameter it manages to get "
        "one. Eager DDP raises at the next forward (parameters that did not receive grad); "
        "here autograd would still run their accumulators (the replay's node has an edge "
        "to every parameter) and DDP would silently all-reduce zeros for them. Use every "
        "output in the loss, or construct DDP with find_unused_parameters=True, as eager "
        "DDP requires"), f"{where}: {found}"
    assert found["graphed"]["head_grads_none"] == [True, True], f"{where}: {found}"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return two_gloo_ranks(__file__, tmp_path_factory.mktemp("runtime_ddp"), timeout=300)


@pytest.mark.parametrize("mode", list(MODES))
def test_r29_every_output_in_the_loss_trains_bitwise_like_eager_ddp(two_ranks, mode):
    for rank, report in enumerate(two_ranks):
        assert report[mode]["all_used"]["mismatches"] == [], f"rank {rank}: {report[mode]}"
    # The all-reduce ran: both ranks hold the same gradients, from different data.
    sums = [report[mode]["all_used"]["grad_sums"] for report in two_ranks]
    assert sums[0] == sums[1] and None not in sums[0], sums


@pytest.mark.parametrize("mode", list(MODES))
def test_r29_an_output_left_out_of_the_loss_is_refused_inside_ddp_as_eager_ddp_raises(
    two_ranks, mode
):
    for rank, report in enumerate(two_ranks):
        _check_refused(report[mode]["left_out"], f"rank {rank}")


@pytest.mark.parametrize("mode", list(MODES))
def test_r29_with_find_unused_parameters_an_output_left_out_trains_bitwise_like_eager(
    two_ranks, mode
):
    for rank, report in enumerate(two_ranks):
        assert report[mode]["find_unused"]["mismatches"] == [], f"rank {rank}: {report[mode]}"
    sums = [report[mode]["find_unused"]["grad_sums"] for report in two_ranks]
    assert sums[0] == sums[1], sums


@pytest.mark.parametrize("mode", list(MODES))
def test_r29_an_output_left_out_under_no_sync_or_for_ignored_parameters_is_accepted(
    two_ranks, mode
):
    """Eager DDP waits for no parameter under ``no_sync()``, nor for those it ignores: no
    refusal, and the same training."""
    for rank, report in enumerate(two_ranks):
        assert report[mode]["no_sync"]["mismatches"] == [], f"rank {rank}: {report[mode]}"
        assert report[mode]["ignored"]["mismatches"] == [], f"rank {rank}: {report[mode]}"


@pytest.mark.parametrize("mode", list(MODES))
def test_r29_with_static_graph_nothing_is_refused_and_training_is_eager_static_graphs(
    two_ranks, mode
):
    """``static_graph=True``: every output in the loss, the head's output left out inside the
    DDP model, and the head first reached after DDP's first step (where eager's static graph
    silently keeps each rank's head gradients unreduced) train bitwise as eager does."""
    for rank, report in enumerate(two_ranks):
        for case in ("static_all_used", "static_dropped", "static_late"):
            assert report[mode][case]["mismatches"] == [], f"rank {rank} {case}: {report[mode]}"
    sums = [report[mode]["static_all_used"]["grad_sums"] for report in two_ranks]
    assert sums[0] == sums[1] and None not in sums[0], sums
    # Left out inside the model: the head's parameters get no gradient, on every step.
    dropped = two_ranks[0][mode]["static_dropped"]["grad_sums"]
    assert dropped[-2:] == [None, None] and None not in dropped[:-2], dropped
    # Reached late: eager's static graph reduces the head's gradients on neither rank.
    late = [report[mode]["static_late"]["late_head_sums"] for report in two_ranks]
    assert late[0] != late[1], late


@pytest.mark.cuda
@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_r29_over_nccl_refused_as_eager_ddp_raises_and_trains_like_eager_otherwise(
    nccl_world_of_one, mode
):
    """The same on CUDA, in an NCCL world of one: the refusal where eager DDP raises, and
    bitwise eager's training with every output in the loss or find_unused_parameters=True."""
    _check_refused(_left_out(mode, 0, device="cuda"), "cuda")
    always: UsesAux = lambda step, micro: True  # noqa: E731
    sometimes: UsesAux = lambda step, micro: step != 1  # noqa: E731
    assert _compare(mode, 0, always, device="cuda")["mismatches"] == []
    assert _compare(mode, 0, sometimes, find_unused=True, device="cuda")["mismatches"] == []


if __name__ == "__main__":
    gloo_rank(_cases, "one rank of the DDP tests of outputs a loss leaves out")
