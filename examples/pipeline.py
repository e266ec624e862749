"""A real pipeline: interleaved 1F1B over processes, each rank's layers graphed by leangraph.

Launch (one process per pipeline rank)::

    torchrun --nproc-per-node 2 examples/pipeline.py --device cpu    # gloo + CPU reference backend
    torchrun --nproc-per-node 2 examples/pipeline.py --device cuda   # NCCL + CUDA graphs

Layout. A stack of 8 transformer blocks (hidden 64, sequence 32) is cut into
``pp_size * vp_size`` stages (2 x 2 = 4 stages of 2 blocks) placed as Megatron-LM's
interleaved schedule places them: global stage ``s = chunk_index * pp_size + rank``, so rank 0
holds stages 0 and 2, rank 1 holds stages 1 and 3, and a microbatch travels 0 -> 1 -> 0 -> 1
forwards and back. The last stage (on rank ``pp_size - 1``) computes an MSE loss.
``pp_size`` is the world size (``--nproc-per-node 4`` gives 8 stages of 1 block).

Order convention. Rank ``r`` runs ``interleaved_1f1b(pp_size, vp_size, r, M)``: ``+c`` is
the forward of local chunk ``c`` (1-based, global stage ``(c - 1) * pp_size + r``) for its next
microbatch, ``-c`` the backward of chunk ``c``'s oldest outstanding forward. The rank's blocks
are graphed with that order: ``callables`` chunk by chunk, one sample per (chunk, microbatch,
layer) at ``Layout.graph_index(c, m, l) = prefix[c] * M + m * L_c + l``, and step (c, m) runs
``graphed[graph_index(c, m, l)]`` for ``l = 0 .. L_c - 1``.

Point to point, without deadlock:

* every message (an activation for stage ``s + 1``, a gradient for stage ``s - 1``) is sent
  with a non-blocking ``isend`` as soon as it exists and received (``irecv`` + ``wait``) when a
  step needs it; a step's sends are waited for at the end of the training step, before any
  graph replays again (a graphed output stays valid until its own graph's next replay);
* each direction ``src -> dst`` has its own process group. On NCCL a 2-rank group runs its p2p
  ops one after the other on one stream, so with a single group rank 0 would queue
  ``send act(stage 1, mb 1)`` before ``recv act(stage 2, mb 0)`` while rank 1 queues
  ``send act(stage 2, mb 0)`` before ``recv act(stage 1, mb 1)``: a cycle, which NCCL's
  internal p2p buffers happened to absorb in our runs (messages up to 16 MB) but do not
  promise to. With one group per direction a rank's stream
  of a link holds only sends and its peer's only receives, so nothing waits on anything that
  the schedule does not;
* NCCL matches a link's sends and receives in issue order (tags are ignored), so a rank posts
  its receives of a link in the sender's send order, computed from the sender's own order:
  needing a message, it first posts ``irecv`` for every earlier message of that link. (For
  Megatron's interleaved orders the two orders coincide; other orders need not);
* sends never block, so a rank only waits for messages that its peer sends earlier in a valid
  schedule; NCCL creates p2p communicators lazily, creation blocks both ends, so each link is
  opened by one blocking exchange, in a fixed sequence, before training.

Checks. Every rank trains three copies from the same initial weights on the same data: the
whole stack in one process (``leangraph.cli.local_pipeline.run_order``; this checks the message
plumbing), the pipeline with eager blocks (a deep copy taken before capture), and the pipeline
with graphed blocks. Losses (last stage) and parameters must be bitwise equal
(``torch.equal``). They are on CPU and, at this size, on CUDA (2 x H200, fp32): the graphs
replay the eager kernels on the same data in the same order. At larger sizes some CUDA kernels
are not run-to-run reproducible (at hidden 1024, sequence 2048 even the two eager runs differed
by ~6e-8); ``--deterministic`` (``torch.use_deterministic_algorithms``) made them bitwise equal
again, and ``--tolerance`` accepts a small difference instead. Then ``leangraph.reset_all``
before ``dist.destroy_process_group`` (``--teardown alive`` leaves the graphs alive until the
interpreter exits instead, after the group is gone); any mismatch on any rank exits 1 on every
rank.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

import leangraph
from leangraph.cli.local_pipeline import run_order
from leangraph.order import Layout, Step, StepKind, parse_order
from leangraph.schedules import gpipe, interleaved_1f1b
from leangraph.cli.workloads import BlockShape, TransformerBlock, make_blocks, sample_hidden

NUM_BLOCKS = 8
VP_SIZE = 2
SHAPE = BlockShape(hidden=64, heads=4, sequence=32, micro_batch=2)
LR = 0.05

Key = tuple[str, int, int]
"""A message: ``("act" | "grad", stage that receives it, microbatch)``."""
Layer = Callable[[int, int, int], Callable[[torch.Tensor], torch.Tensor]]
"""``(chunk, microbatch, layer) -> callable`` (chunk 1-based)."""
Links = dict[tuple[int, int], Any]
"""``(src, dst) -> process group`` of the links this rank is on."""


@dataclass(frozen=True)
class Pipeline:
    """Where everything sits: ``pp_size`` ranks x ``vp_size`` chunks x ``layers`` blocks."""

    pp_size: int
    rank: int
    microbatches: int
    device: torch.device
    vp_size: int = VP_SIZE

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.vp_size

    @property
    def layers(self) -> int:
        return NUM_BLOCKS // self.num_stages

    @property
    def layout(self) -> Layout:
        return Layout((self.layers,) * self.vp_size, self.microbatches)

    def stage(self, chunk: int, rank: int | None = None) -> int:
        """Global stage of local chunk ``chunk`` (1-based) of ``rank`` (default: this rank)."""
        return (chunk - 1) * self.pp_size + (self.rank if rank is None else rank)

    def order(self, rank: int | None = None) -> list[int]:
        rank = self.rank if rank is None else rank
        return interleaved_1f1b(self.pp_size, self.vp_size, rank, self.microbatches)

    def steps(self, rank: int | None = None) -> tuple[Step, ...]:
        """The order of ``rank`` as steps that know their microbatch."""
        _, steps = parse_order(self.order(rank), num_callables=self.vp_size,
                               num_samples=self.vp_size * self.microbatches,
                               num_layers_per_chunk=1)
        return steps

    def needed(self, step: Step) -> Key | None:
        """The message a step of this rank consumes."""
        stage = self.stage(step.chunk)
        if step.kind is StepKind.FORWARD:
            return ("act", stage, step.microbatch) if stage > 0 else None
        last = stage == self.num_stages - 1
        return None if last else ("grad", stage, step.microbatch)

    def produced(self, step: Step, rank: int | None = None) -> Key | None:
        """The message a step of ``rank`` sends."""
        stage = self.stage(step.chunk, rank)
        if step.kind is StepKind.FORWARD:
            last = stage == self.num_stages - 1
            return None if last else ("act", stage + 1, step.microbatch)
        return ("grad", stage - 1, step.microbatch) if stage > 0 else None

    def own(self, stack: Sequence[TransformerBlock]) -> list[TransformerBlock]:
        """This rank's blocks of the whole ``stack``, chunk by chunk (as graphing wants them)."""
        return [stack[self.stage(c) * self.layers + index]
                for c in range(1, self.vp_size + 1) for index in range(self.layers)]

    def sender(self, key: Key) -> int:
        kind, stage, _ = key
        return (stage - 1 if kind == "act" else stage + 1) % self.pp_size

    def receiver(self, key: Key) -> int:
        return key[1] % self.pp_size


def open_links(p: Pipeline) -> Links:
    """One process group per direction between neighbours, opened in a fixed sequence."""
    pairs = sorted({(r, (r + d) % p.pp_size) for r in range(p.pp_size) for d in (1, -1)})
    groups = {pair: dist.new_group(list(pair)) for pair in pairs}  # every rank, same sequence
    probe = torch.zeros(1, device=p.device)
    for (src, dst), group in groups.items():
        if p.rank == src:
            dist.send(probe, dst, group=group)
        elif p.rank == dst:
            dist.recv(probe, src, group=group)
    return {pair: group for pair, group in groups.items() if p.rank in pair}


class Mailbox:
    """One training step's point-to-point traffic of this rank (module docstring: why so)."""

    def __init__(self, p: Pipeline, links: Links) -> None:
        self._p, self._links = p, links
        self._expected: dict[int, deque[Key]] = defaultdict(deque)  # per sender, send order
        for peer in range(p.pp_size):
            for step in p.steps(peer):
                key = p.produced(step, peer)
                if key is not None and p.receiver(key) == p.rank:
                    self._expected[peer].append(key)
        self._posted: dict[Key, tuple[Any, torch.Tensor]] = {}
        self._sends: list[tuple[Any, torch.Tensor]] = []

    def send(self, key: Key, tensor: torch.Tensor) -> None:
        dst = self._p.receiver(key)
        tensor = tensor.detach()
        work = dist.isend(tensor, dst, group=self._links[(self._p.rank, dst)])
        self._sends.append((work, tensor))  # keep the tensor until the send is done

    def receive(self, key: Key) -> torch.Tensor:
        src = self._p.sender(key)
        queue = self._expected[src]
        while key not in self._posted:  # post receives in the sender's send order
            early = queue.popleft()
            buffer = torch.empty(SHAPE.micro_batch, SHAPE.sequence, SHAPE.hidden,
                                 device=self._p.device, dtype=SHAPE.dtype)
            work = dist.irecv(buffer, src, group=self._links[(src, self._p.rank)])
            self._posted[early] = (work, buffer)
        work, buffer = self._posted.pop(key)
        work.wait()
        return buffer

    def close(self) -> None:
        """Wait for this step's sends; every expected message must have been received."""
        for work, _ in self._sends:
            work.wait()
        left = [key for queue in self._expected.values() for key in queue] + list(self._posted)
        if left:
            raise RuntimeError(f"rank {self._p.rank}: messages never received: {left}")


def run_step(p: Pipeline, links: Links, layer: Layer, data: Sequence[torch.Tensor],
             targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run this rank's order once; the last stage's per-microbatch losses (else empty)."""
    mail = Mailbox(p, links)
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    heads: dict[tuple[int, int], torch.Tensor] = {}  # where each backward starts
    losses: list[torch.Tensor] = []
    for step in p.steps():
        c, m = step.chunk, step.microbatch
        need, make = p.needed(step), p.produced(step)
        if step.kind is StepKind.FORWARD:
            source = data[m] if need is None else mail.receive(need)
            hidden = inputs[(c, m)] = source.detach().requires_grad_(True)
            for index in range(p.layers):
                hidden = layer(c, m, index)(hidden)
            if make is None:  # the last stage
                hidden = F.mse_loss(hidden, targets[m]) / p.microbatches
                losses.append(hidden.detach())
            else:
                mail.send(make, hidden)
            heads[(c, m)] = hidden
        else:
            heads.pop((c, m)).backward(None if need is None else mail.receive(need))
            grad = inputs.pop((c, m)).grad
            if make is not None:
                assert grad is not None
                mail.send(make, grad)
    mail.close()
    return losses


def train(p: Pipeline, links: Links, layer: Layer, blocks: Sequence[torch.nn.Module],
          data: Sequence[Sequence[torch.Tensor]],
          targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """SGD over ``blocks`` for ``len(data)`` steps; per step the last stage's losses."""
    optim = torch.optim.SGD([q for block in blocks for q in block.parameters()], lr=LR)
    history = []
    for batch in data:
        optim.zero_grad(set_to_none=True)
        losses = run_step(p, links, layer, batch, targets)
        optim.step()
        history.append(torch.stack(losses) if losses else torch.empty(0))
    return history


def train_whole(blocks: Sequence[torch.nn.Module], data: Sequence[Sequence[torch.Tensor]],
                targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The reference: the whole stack in this process, one chunk, fill-then-drain."""
    optim = torch.optim.SGD([q for block in blocks for q in block.parameters()], lr=LR)
    count = len(targets)
    history = []
    for batch in data:
        optim.zero_grad(set_to_none=True)
        result = run_order(gpipe(count), [len(blocks)], lambda c, m, l: blocks[l], batch,
                           lambda out, m: F.mse_loss(out, targets[m]) / count)
        optim.step()
        history.append(torch.stack(result.losses))
    return history


def make_data(p: Pipeline, steps: int) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """The same inputs (per step and microbatch) and targets (per microbatch) on every rank."""
    gen = torch.Generator().manual_seed(1234)

    def draw() -> torch.Tensor:
        x = torch.randn(SHAPE.micro_batch, SHAPE.sequence, SHAPE.hidden, generator=gen)
        return x.to(p.device, SHAPE.dtype)

    data = [[draw() for _ in range(p.microbatches)] for _ in range(steps)]
    return data, [draw() for _ in range(p.microbatches)]


def say(text: str) -> None:
    """Print in one write, so the ranks' lines do not interleave mid-line."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def compare(p: Pipeline, what: str, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
            tolerance: float) -> bool:
    """Whether ``a`` and ``b`` are equal (within ``tolerance``); prints what differs."""
    exact = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    if exact:
        return True
    worst = max((float((x - y).abs().max()) for x, y in zip(a, b)), default=float("inf"))
    ok = len(a) == len(b) and worst <= tolerance
    say(f"rank {p.rank}: {what} differ, max |diff| {worst:.3e} "
        f"({'within' if ok else 'over'} tolerance {tolerance:g})")
    return ok


def loss_table(whole: Sequence[torch.Tensor], eager: Sequence[torch.Tensor],
               graphed: Sequence[torch.Tensor]) -> str:
    """Per-step mean loss (the per-microbatch losses are already divided by their count)."""
    lines = [f"{'step':>4}  {'whole model':>12}  {'eager':>12}  {'graphed':>12}"]
    for step, row in enumerate(zip(whole, eager, graphed)):
        lines.append(f"{step:>4}  " + "  ".join(f"{float(x.sum()):12.6f}" for x in row))
    return "\n".join(lines)


def setup(device_kind: str) -> tuple[int, int, torch.device]:
    """Join the process group: gloo on CPU, NCCL on ``cuda:LOCAL_RANK``."""
    if device_kind == "cuda":
        # Each link group carries one direction, so torch's warning that a 2-rank group's
        # unbatched p2p ops are serialized describes exactly what we rely on.
        os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
        device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if dist.get_world_size() < 2 or NUM_BLOCKS % (dist.get_world_size() * VP_SIZE):
        raise SystemExit(f"needs 2 or more ranks that split {NUM_BLOCKS} blocks into "
                         f"{VP_SIZE} chunks each")
    return dist.get_rank(), dist.get_world_size(), device


# With --teardown alive: graphed callables the interpreter tears down at exit.
_ALIVE_UNTIL_EXIT: list[object] = []


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--tolerance", type=float, default=0.0,
                        help="largest |difference| accepted where results are not bitwise equal")
    parser.add_argument("--teardown", choices=("reset", "alive"), default="reset",
                        help="reset: leangraph.reset_all before destroy_process_group, as the "
                             "docs prescribe; alive: leave the graphs alive until the "
                             "interpreter exits, after the process group is gone (what a "
                             "script that forgets reset_all does; it must not hang either)")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True), for bitwise equality "
                             "where CUDA kernels are not reproducible (larger shapes)")
    return parser.parse_args(argv)


def parameters(blocks: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    return [q.detach() for block in blocks for q in block.parameters()]


def check(p: Pipeline, runs: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]],
          tolerance: float) -> bool:
    """Compare the runs' (losses, parameters) pairwise; print the loss table on the last stage."""
    (whole_losses, whole_params), (eager_losses, eager_params), (graphed_losses, params) = (
        runs["whole"], runs["eager"], runs["graphed"])
    ok = compare(p, "eager and graphed parameters", eager_params, params, tolerance)
    ok &= compare(p, "whole-model and pipeline parameters", whole_params, eager_params,
                  tolerance)
    if p.rank == (p.num_stages - 1) % p.pp_size:
        ok &= compare(p, "eager and graphed losses", eager_losses, graphed_losses, tolerance)
        ok &= compare(p, "whole-model and pipeline losses", whole_losses, eager_losses,
                      tolerance)
        say(loss_table(whole_losses, eager_losses, graphed_losses))
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
        torch.use_deterministic_algorithms(True)
    rank, world, device = setup(args.device)
    p = Pipeline(world, rank, args.microbatches, device)
    links = open_links(p)
    layout = p.layout
    everything = make_blocks(NUM_BLOCKS, SHAPE, device, seed=0)  # the same weights everywhere
    mine = p.own(everything)
    data, targets = make_data(p, args.steps)
    whole = copy.deepcopy(everything)
    eager_blocks = copy.deepcopy(mine)  # taken before capture
    runs = {"whole": (train_whole(whole, data, targets), parameters(p.own(whole)))}
    runs["eager"] = (train(p, links, lambda c, m, l: eager_blocks[layout.callable_index(c, l)],
                           eager_blocks, data, targets), parameters(eager_blocks))
    samples = tuple((sample_hidden(SHAPE, device),) for _ in range(layout.num_graphs))
    graphed = leangraph.make_graphed_callables(tuple(mine), samples, order=p.order(),
                                               num_layers_per_chunk=p.layers)
    runs["graphed"] = (train(p, links, lambda c, m, l: graphed[layout.graph_index(c, m, l)],
                             mine, data, targets), parameters(mine))
    ok = check(p, runs, args.tolerance)
    if args.teardown == "reset":
        leangraph.reset_all(graphed)  # before the process group goes
    else:
        _ALIVE_UNTIL_EXIT.append(graphed)  # torn down at interpreter exit, after the group
    verdict = torch.tensor([int(ok)], device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # any rank's mismatch fails every rank
    dist.destroy_process_group()
    status = "OK" if int(verdict) else "FAILED" if not ok else "FAILED (on another rank)"
    say(f"rank {rank}: {status} ({len(runs['graphed'][1])} parameter tensors, "
        f"{args.steps} steps, {args.microbatches} microbatches, {device})")
    return 0 if int(verdict) else 1


if __name__ == "__main__":
    sys.exit(main())
