"""In-graph gradient accumulation under torch's DistributedDataParallel, 2 ranks over gloo
(CPU backend): DDP's reducer hooks (C++, on the parameters' accumulators) fire through the
relay and all-reduce the fused ``.grad``; training equals eager DDP bitwise, ``no_sync``
microbatches included. ``gradient_as_bucket_view=True`` makes DDP swap ``.grad`` for its
bucket, which the next replay refuses clearly. With ``accumulator_hooks="python"`` the replays
could not call DDP's hooks (C++), and with ``False`` no accumulator runs at all, so a replay
inside DDP's forward is refused in both (R17)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import gloo_rank, two_gloo_ranks
from models import Block
from torch.nn.parallel import DistributedDataParallel

import leangraph

STEPS, MICROBATCHES = 3, 3


def _train(rank: int, bucket_view: bool, hooks: bool | str = True) -> dict[str, object]:
    torch.manual_seed(0)
    eager_module = Block(16)
    graphed_module = copy.deepcopy(eager_module)
    leangraph.make_graphed_callables(
        graphed_module, (torch.randn(4, 16, requires_grad=True),), fuse_grad_accumulation=True,
        accumulator_hooks=hooks)
    models = [DistributedDataParallel(m, gradient_as_bucket_view=bucket_view)
              for m in (eager_module, graphed_module)]
    optims = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    data = [[torch.randn(4, 16, generator=gen) for _ in range(MICROBATCHES)] for _ in range(STEPS)]
    grads: list[list[list[float]]] = [[], []]
    for which, (model, optim) in enumerate(zip(models, optims)):
        for step in range(STEPS):
            optim.zero_grad(set_to_none=step % 2 == 0)
            for index, x in enumerate(data[step]):
                last = index == MICROBATCHES - 1
                with model.no_sync() if not last else _nothing():
                    model(x).square().mean().backward()
            grads[which].append([p.grad.sum().item() for p in model.parameters()])
            optim.step()
    same_grads = all(
        torch.equal(a.grad, b.grad) for a, b in zip(eager_module.parameters(),
                                                     graphed_module.parameters()))
    same_params = all(torch.equal(a, b) for a, b in zip(eager_module.parameters(),
                                                       graphed_module.parameters()))
    return {"same_grads": same_grads, "same_params": same_params,
            "grad_sums_equal": grads[0] == grads[1]}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def _refusal(rank: int, hooks: bool | str) -> str:
    try:
        _train(rank, bucket_view=False, hooks=hooks)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _cases(rank: int) -> dict[str, object]:
    result: dict[str, object] = {"plain": _train(rank, bucket_view=False)}
    try:
        _train(rank, bucket_view=True)
        result["bucket_view"] = "no error"
    except RuntimeError as exc:
        result["bucket_view"] = str(exc)
    result["python_hooks"] = _refusal(rank, "python")
    result["no_hooks"] = _refusal(rank, False)
    return result


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    return two_gloo_ranks(__file__, tmp_path_factory.mktemp("ddp"), timeout=300)


def test_fused_accumulation_trains_like_eager_ddp(two_ranks) -> None:
    for result in two_ranks:
        assert result["plain"] == {"same_grads": True, "same_params": True,
                                   "grad_sums_equal": True}, result
        assert ".grad is another tensor than at capture" in result["bucket_view"], result


def test_r17_python_accumulator_hooks_inside_ddp_are_refused_at_the_forward(two_ranks) -> None:
    for result in two_ranks:
        assert result["python_hooks"].startswith(
            "callable 0 (Block) runs inside torch's DistributedDataParallel, whose "
            "gradient-ready hooks are registered from C++"), result
        assert "Capture with accumulator_hooks=True" in result["python_hooks"], result


def test_r17_no_accumulator_hooks_inside_ddp_are_refused_at_the_forward(two_ranks) -> None:
    """With accumulator_hooks=False no accumulator runs, so DDP's reducer, which hooks them,
    would reduce nothing: the ranks would diverge silently."""
    for result in two_ranks:
        assert result["no_hooks"] == (
            "callable 0 (Block) runs inside torch's DistributedDataParallel, whose reducer "
            "hooks the parameters' accumulators (from C++) to all-reduce their gradients; with "
            "accumulator_hooks=False no replay runs an accumulator, so DDP would never see the "
            "gradients, nothing would be reduced, and the ranks would silently diverge. Capture "
            "with accumulator_hooks=True under DDP"), result


if __name__ == "__main__":
    gloo_rank(_cases, "one rank of the fused-accumulation DDP test")
