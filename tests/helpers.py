"""Assertion helpers and small samples shared by the tests."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from models import Block
from torch.utils._pytree import tree_map

import leangraph
from leangraph._call import CaptureOptions, validate_call
from leangraph.backends import CpuBackend
from leangraph.buffers import plan_buffers
from leangraph.build.builder import build_graphs
from leangraph.hooks import normalize_hooks
from leangraph.probe import probe

NOTES = sys.version_info >= (3, 11)  # exc.__notes__ / add_note
needs_notes = pytest.mark.skipif(not NOTES, reason="exception notes need Python >= 3.11")
mgc = leangraph.make_graphed_callables


@contextlib.contextmanager
def raises(kind: type[BaseException], *parts: str) -> Iterator[pytest.ExceptionInfo]:
    """Like ``pytest.raises(kind)``; also every part must appear, verbatim, in the message."""
    with pytest.raises(kind) as info:
        yield info
    message = str(info.value)
    for part in parts:
        assert part in message, f"{part!r} not in message {message!r}"


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", ()))


def sample(width: int = 4, requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(2, width, requires_grad=requires_grad)


def blocks(count: int = 3, width: int = 4) -> tuple[Block, ...]:
    torch.manual_seed(0)
    return tuple(Block(width) for _ in range(count))


def block_pair(width: int = 8, dtype: torch.dtype = torch.float32) -> tuple[Block, Block]:
    """An eager Block and an identical copy to graph."""
    torch.manual_seed(0)
    eager = Block(width).to(dtype)
    return eager, copy.deepcopy(eager)


def fused_after_one_step(module: torch.nn.Module, hooks: bool | str) -> tuple[
        torch.nn.Module, list[torch.Tensor]]:
    """``module`` graphed with fused accumulation after one full step, and a copy of each
    parameter's ``.grad`` then, for tests that change the module before the next backward."""
    graphed = mgc(module, (torch.randn(4, 8, requires_grad=True),),
                  fuse_grad_accumulation=True, accumulator_hooks=hooks)
    graphed(torch.randn(4, 8)).sum().backward()
    return graphed, [p.grad.clone() for p in module.parameters()]


def assert_grads_unchanged(module: torch.nn.Module, before: Sequence[torch.Tensor]) -> None:
    """A refused backward ran no graph: every ``.grad`` is what it was."""
    for p, grad in zip(module.parameters(), before, strict=True):
        assert torch.equal(p.grad, grad)


def graphed_blocks(count: int = 3, **kwargs) -> tuple[torch.nn.Module, ...]:
    layers = blocks(count)
    return mgc(layers, tuple((sample(),) for _ in layers), **kwargs)


class Doubling(torch.Tensor):
    """A subclass that changes what eager computes: it doubles every linear layer's output."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func is torch.nn.functional.linear else out


class Tagged(torch.Tensor):
    """A subclass with torch's default __torch_function__: eager's results stay Tagged."""


class Opaque:
    """Neither a tensor nor a constant a graph can hold."""


def scale(x: torch.Tensor, *, factor: torch.Tensor) -> torch.Tensor:
    return x * factor


def three_graphs():
    layers = tuple(Block(4) for _ in range(3))
    reference = [copy.deepcopy(layer) for layer in layers]
    samples = tuple((torch.randn(2, 4, requires_grad=True),) for _ in range(3))
    return reference, leangraph.make_graphed_callables(layers, samples)


def one_graph(**options):
    """One module graphed alone: its replays are the whole capture order. ``options`` go to
    ``make_graphed_callables``."""
    layer = Block(4)
    reference = [copy.deepcopy(layer)]
    graphed = leangraph.make_graphed_callables(
        layer, (torch.randn(2, 4, requires_grad=True),), **options)
    return reference, (graphed,)


def build_stage(callables, sample_args, *, order=None, num_layers_per_chunk=None,
                share_buffers=True, num_warmup_iters=1, backend=None, **options):
    """Validate, probe, plan the buffers and run the build stage on the CPU backend, as
    ``make_graphed_callables`` does; the validated call and the build's result."""
    call = validate_call(callables, sample_args, None, order, num_layers_per_chunk)
    facts = probe(call)
    buffer_plan = (
        plan_buffers(call.plan, [f.inputs for f in facts], [f.outputs for f in facts],
                     chainable=call.chainable())
        if share_buffers else None
    )
    options = CaptureOptions(
        num_warmup_iters=num_warmup_iters, allow_unused_input=False,
        retain_graph_in_backward=False, share_buffers=share_buffers, debug_outputs=False,
        check_memory=False, **options,
    )
    built = build_graphs(call, facts, buffer_plan, backend or CpuBackend(), options,
                         hooks=normalize_hooks(None, call.callables), progress=None)
    return call, built


def free_port() -> int:
    """A TCP port free on the loopback interface (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_reports(commands: Sequence[Sequence[str]], out: Path, *, env: Mapping[str, str],
                 cwd: Path, timeout: float) -> list[dict[str, Any]]:
    """Run one worker process per rank; each writes ``out/rank<r>.json``. Their reports, or a
    test failure naming the rank that failed (its ``"error"``, exit status and log tail) or the
    timeout."""
    procs = [subprocess.Popen(list(command), env=dict(env), cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for command in commands]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"the {len(procs)} rank(s) did not finish in {timeout} s (a hang in a "
                        "step)")
    reports = []
    for rank, proc in enumerate(procs):
        path = out / f"rank{rank}.json"
        report = json.loads(path.read_text()) if path.exists() else {}
        if proc.returncode != 0 or "error" in report:
            pytest.fail(f"rank {rank} failed (exit {proc.returncode}):\n"
                        f"{report.get('error', '')}\n{logs[rank][-4000:]}")
        reports.append(report)
    return reports


ROOT = Path(__file__).resolve().parents[1]


def two_ranks(script: str, out: Path, *, timeout: float,
              device: str = "cpu") -> list[dict[str, Any]]:
    """Run ``script`` as ranks 0 and 1 of a process group (its ``__main__`` calls
    :func:`rank_worker`): gloo on the CPU; on ``device="cuda"`` one GPU per rank, NCCL for
    CUDA tensors. Both ranks' reports, or a test failure naming the rank that failed."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                           os.environ.get("PYTHONPATH", "")]))
    commands = [[sys.executable, script, "--rank", str(rank), "--port", str(port), "--out",
                 str(out), "--device", device] for rank in (0, 1)]
    return rank_reports(commands, out, env=env, cwd=ROOT, timeout=timeout)


def two_gloo_ranks(script: str, out: Path, *, timeout: float) -> list[dict[str, Any]]:
    """:func:`two_ranks` on the CPU, for a ``script`` whose ``__main__`` calls
    :func:`gloo_rank`."""
    return two_ranks(script, out, timeout=timeout)


def rank_worker(run: Callable[[int, str], dict[str, Any]], description: str) -> None:
    """The worker side of :func:`two_ranks`: join the group as ``--rank`` of two (on CUDA,
    with GPU ``--rank`` current), and write ``run(rank, device)``'s report, or the traceback
    as its ``"error"``, to ``--out/rank<r>.json``."""
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(args.rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=2)
    path = args.out / f"rank{args.rank}.json"
    try:
        results = run(args.rank, args.device)
    except BaseException:
        path.write_text(json.dumps({"error": traceback.format_exc()}))
        os._exit(1)  # the peer may wait on this rank forever; its own error ends it
    path.write_text(json.dumps(results))
    dist.destroy_process_group()
    # The report is written and the group gone: skip the interpreter's teardown, where a
    # gloo thread still winding down once aborted a worker ("terminate called without an
    # active exception", exit -6) after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def gloo_rank(run: Callable[[int], dict[str, Any]], description: str) -> None:
    """:func:`rank_worker` for CPU-only cases: ``run(rank)``."""
    rank_worker(lambda rank, device: run(rank), description)


def assert_replays_like_eager(graphed, eager, make_input, replays=2):
    """``replays`` times: ``graphed`` and ``eager`` on the same fresh input (``make_input()``,
    a leaf that requires grad), outputs and input gradients of ``out.square().sum()`` bitwise
    equal (parameter gradients are the caller's to compare)."""
    for _ in range(replays):
        x = make_input()
        x_eager = x.detach().clone().requires_grad_(True)
        out, expected = graphed(x), eager(x_eager)
        assert torch.equal(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        assert torch.equal(x.grad, x_eager.grad)


def detached_copy(value: Any) -> Any:
    """A copy of ``value`` if it is a tensor (a graphed output is overwritten by later replays)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def backward_keeping(outputs: Any, loss: torch.Tensor) -> Any:
    """Copies of ``outputs``, then ``loss.backward()``: a graphed output's window ends at its
    backward (``debug_outputs`` refuses a later read)."""
    copies = tree_map(detached_copy, outputs)
    loss.backward()
    return copies


def sgd_history(params: Sequence[torch.Tensor], run_step: Callable[[int], Sequence[Any]],
                steps: int) -> list[list[Any]]:  # fmt: skip
    """``steps`` calls of ``run_step``, each from its own seed (the same dropout draws for eager
    and graphed) and followed by an SGD step; what every step returned, then the parameters."""
    optim = torch.optim.SGD(params, lr=0.1) if params else None
    history = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        history.append([detached_copy(v) for v in run_step(step)])
        if optim is not None:
            optim.step()
            optim.zero_grad()
    history.append([detached_copy(p) for p in params])
    return history
