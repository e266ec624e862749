"""Train a tiny GPT under torch.distributed.pipelining's own schedule, its blocks graphed.

Launch (two processes, one pipeline rank each)::

    python examples/pipelining_torch.py                        # spawns 2 processes: gloo, CPU
    torchrun --nproc-per-node 2 examples/pipelining_torch.py   # the same under torchrun
    torchrun --nproc-per-node 2 examples/pipelining_torch.py --device cuda   # NCCL, 2 GPUs
    python examples/pipelining_torch.py --schedule ScheduleZBVZeroBubble

What it does. The model is a token embedding, transformer blocks and a norm plus head, cut
into ``2 * stages_per_rank`` stages (two per rank for multi-stage schedules, one for
``ScheduleGPipe`` and ``Schedule1F1B``). The embedding is the first stage's ``pre`` and the
head the last stage's ``post``: glue that runs eagerly; the blocks are graphed, two per stage
(one in zero-bubble schedules, whose split backwards leangraph graphs one layer per stage).
Each rank calls ``graph_pipeline_stages`` once and hands the stages it returns to torch's
schedule (``GraphedPipeline.schedule``); the training loop is torch's own (``schedule.step``,
an optimizer step), unchanged.

Checks. Every rank also trains a deep copy of its stages, taken before capture, as plain
``PipelineStage`` objects under the same schedule class. Per-microbatch losses and ``step()``'s
merged output (on the rank of the last stage), and every parameter after training (on every
rank) must be bitwise equal (``torch.equal``); then ``GraphedPipeline.reset()`` before
``destroy_process_group``. Any mismatch on any rank exits 1 on every rank.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.nn import functional as F

from leangraph.integrations.pipelining import StageModules, graph_pipeline_stages, stage_placement
from leangraph.schedules import from_pipelining
from leangraph.cli.workloads import BlockShape, TransformerBlock

SHAPE = BlockShape(hidden=32, heads=4, sequence=16, micro_batch=2)
VOCAB = 64
LR = 0.5
SCHEDULES = [name for name in pipelining.__all__ if name.startswith("Schedule")]


def stage_layout(schedule_class: type, pp_size: int, microbatches: int) -> tuple[int, int]:
    """Stages per rank, and blocks per stage (one where the order splits backwards)."""
    per_rank = 1 if issubclass(schedule_class, PipelineScheduleSingle) else 2
    order = from_pipelining(schedule_class, pp_size, microbatches, 0, per_rank)
    split = any(not float(entry).is_integer() for entry in order)
    return per_rank, 1 if split else 2


def build_model(num_stages: int, blocks_per_stage: int, device: torch.device) -> list[StageModules]:
    """Every stage, the same weights on every rank (one seed, built in stage order)."""
    torch.manual_seed(0)
    stages = []
    for s in range(num_stages):
        pre = nn.Embedding(VOCAB, SHAPE.hidden) if s == 0 else None
        post = (nn.Sequential(nn.LayerNorm(SHAPE.hidden), nn.Linear(SHAPE.hidden, VOCAB))
                if s == num_stages - 1 else None)
        blocks = [TransformerBlock(SHAPE) for _ in range(blocks_per_stage)]
        stages.append(StageModules([b.to(device) for b in blocks],
                                   None if pre is None else pre.to(device),
                                   None if post is None else post.to(device)))
    return stages


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batches(steps: int, microbatches: int, device: torch.device) -> list[tuple[Any, Any]]:
    """One batch of token ids and next-token targets, the same on every rank, once per step
    (learning it, the loss falls from step to step)."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(VOCAB, (microbatches * SHAPE.micro_batch, SHAPE.sequence + 1),
                           generator=gen)
    return [(tokens[:, :-1].to(device), tokens[:, 1:].to(device))] * steps


def train(schedule: Any, modules: Sequence[nn.Module], data: Sequence[tuple[Any, Any]]
          ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Torch's loop: ``step()`` then the optimizer. Per-step losses and merged outputs."""
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=LR)
    losses, outputs = [], []
    for tokens, target in data:
        optimizer.zero_grad(set_to_none=True)
        step_losses: list[torch.Tensor] = []
        output = schedule.step(tokens, target=target, losses=step_losses)
        optimizer.step()
        losses.append(torch.stack(step_losses).detach() if step_losses else torch.zeros(0))
        outputs.append(None if output is None else output.detach().clone())
    return losses, outputs


def modules_of(specs: Sequence[StageModules]) -> list[nn.Module]:
    return [m for spec in specs for m in (spec.pre, *spec.layers, spec.post) if m is not None]


def same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b))


def run(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> bool:
    """Train eager and graphed copies of this rank's stages; whether they agree bitwise."""
    schedule_class = getattr(pipelining, args.schedule)
    per_rank, blocks = stage_layout(schedule_class, world, args.microbatches)
    model = build_model(world * per_rank, blocks, device)
    indices = stage_placement(schedule_class, world, rank, per_rank)
    mine = [model[i] for i in indices]
    eager_specs = copy.deepcopy(mine)  # the eager run: the same weights, parameters of its own
    # One microbatch's input per stage: token ids on the first, hidden states elsewhere.
    samples = [torch.randint(VOCAB, (SHAPE.micro_batch, SHAPE.sequence), device=device)
               if i == 0 else
               torch.randn(SHAPE.micro_batch, SHAPE.sequence, SHAPE.hidden, device=device)
               for i in indices]
    graphed = graph_pipeline_stages(mine, schedule_class, samples,
                                    num_microbatches=args.microbatches)
    eager_stages = [pipelining.PipelineStage(nn.Sequential(*modules_of([spec])), index,
                                             world * per_rank, device)
                    for spec, index in zip(eager_specs, indices)]
    eager = schedule_class(eager_stages if per_rank > 1 else eager_stages[0],
                           args.microbatches, loss_fn=loss_fn)
    data = batches(args.steps, args.microbatches, device)
    eager_losses, eager_outputs = train(eager, modules_of(eager_specs), data)
    graphed_losses, graphed_outputs = train(graphed.schedule(loss_fn), modules_of(mine), data)
    params = [p.detach() for m in modules_of(mine) for p in m.parameters()]
    eager_params = [p.detach() for m in modules_of(eager_specs) for p in m.parameters()]
    ok = same(params, eager_params) and same(graphed_outputs, eager_outputs)
    ok &= same(graphed_losses, eager_losses)
    if indices[-1] == world * per_rank - 1:  # this rank holds the last stage
        print(f"{'step':>4}  {'eager loss':>12}  {'graphed loss':>12}", flush=True)
        for step, (e, g) in enumerate(zip(eager_losses, graphed_losses)):
            print(f"{step:>4}  {float(e.mean()):12.6f}  {float(g.mean()):12.6f}", flush=True)
    graphed.reset()  # before the process group goes
    return ok


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--schedule", choices=SCHEDULES, default="ScheduleInterleaved1F1B")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    return parser.parse_args(argv)


def worker(args: argparse.Namespace) -> bool:
    """One rank: join the group (gloo on CPU, NCCL on cuda:LOCAL_RANK), run, tear down."""
    if args.device == "cuda":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ok = run(args, rank, world, device)
    verdict = torch.tensor([int(ok)], device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # any rank's mismatch fails every rank
    dist.destroy_process_group()  # after graphed.reset() in run()
    status = "OK" if int(verdict) else "FAILED" if not ok else "FAILED (on another rank)"
    print(f"rank {rank}: {status} ({args.schedule}, {args.steps} steps, "
          f"{args.microbatches} microbatches, {device})", flush=True)
    return bool(int(verdict))


def _spawned(rank: int, args: argparse.Namespace, world: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    if not worker(args):
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ:  # launched by torchrun: this process is one rank
        return 0 if worker(args) else 1
    with socket.socket() as sock:  # spawn two ranks, torchrun-style environment
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        mp.spawn(_spawned, args=(args, 2), nprocs=2)
    except mp.ProcessExitedException:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
