"""In-graph gradient accumulation under torch's DistributedDataParallel, 2 ranks over gloo
(CPU backend): DDP's reducer hooks (C++, on the parameters' accumulators) fire through the
relay and all-reduce the fused ``.grad``; training equals eager DDP bitwise, ``no_sync``
microbatches included. ``gradient_as_bucket_view=True`` makes DDP swap ``.grad`` for its
bucket, which the next replay refuses clearly. With ``accumulator_hooks="python"`` the replays
could not call DDP's hooks (C++), so a replay inside DDP's forward is refused (R17)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

import leangraph
from helpers import gloo_rank, two_gloo_ranks
from models import Block

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


def _cases(rank: int) -> dict[str, object]:
    result: dict[str, object] = {"plain": _train(rank, bucket_view=False)}
    try:
        _train(rank, bucket_view=True)
        result["bucket_view"] = "no error"
    except RuntimeError as exc:
        result["bucket_view"] = str(exc)
    try:
        result["python_hooks"] = _train(rank, bucket_view=False, hooks="python")
    except RuntimeError as exc:
        result["python_hooks"] = str(exc)
    return result


def test_fused_accumulation_trains_like_eager_ddp(tmp_path: Path) -> None:
    for result in two_gloo_ranks(__file__, tmp_path, timeout=300):
        assert result["plain"] == {"same_grads": True, "same_params": True,
                                   "grad_sums_equal": True}, result
        assert ".grad is another tensor than at capture" in result["bucket_view"], result
        assert "runs inside torch's DistributedDataParallel" in result["python_hooks"], result


if __name__ == "__main__":
    gloo_rank(_cases, "one rank of the fused-accumulation DDP test")
