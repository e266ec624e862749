"""In-graph gradient accumulation under torch's DistributedDataParallel, 2 ranks over gloo
(CPU backend): DDP's reducer hooks (C++, on the parameters' accumulators) fire through the
relay and all-reduce the fused ``.grad``; training equals eager DDP bitwise, ``no_sync``
microbatches included. ``gradient_as_bucket_view=True`` makes DDP swap ``.grad`` for its
bucket, which the next replay refuses clearly."""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent.parent
STEPS, MICROBATCHES = 3, 3


def _train(rank: int, bucket_view: bool) -> dict[str, object]:
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
    import leangraph
    from models import Block

    torch.manual_seed(0)
    eager_module = Block(16)
    graphed_module = copy.deepcopy(eager_module)
    leangraph.make_graphed_callables(
        graphed_module, (torch.randn(4, 16, requires_grad=True),), fuse_grad_accumulation=True)
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


def _worker(rank: int, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    result: dict[str, object] = {}
    try:
        result["plain"] = _train(rank, bucket_view=False)
        try:
            _train(rank, bucket_view=True)
            result["bucket_view"] = "no error"
        except RuntimeError as exc:
            result["bucket_view"] = str(exc)
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_fused_accumulation_trains_like_eager_ddp(tmp_path: Path) -> None:
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--port",
                               str(port), "--out", str(tmp_path)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    logs = [proc.communicate(timeout=300)[0] for proc in procs]
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, logs[rank]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["plain"] == {"same_grads": True, "same_params": True,
                                   "grad_sums_equal": True}, result
        assert ".grad is another tensor than at capture" in result["bucket_view"], result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    _worker(args.rank, args.port, args.out)
