"""The ``leangraph`` command line."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["build_parser", "main", "progress_bar"]

MIB = 1024 * 1024


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo
    from .workloads import BlockShape

    config = DemoConfig(
        steps=args.steps,
        num_microbatches=args.microbatches,
        shape=BlockShape(hidden=args.hidden, sequence=args.sequence),
        device=args.device,
    )
    with progress_bar(not args.no_progress) as progress:
        result = run_demo(config, progress=progress)
    if result.device == "cpu":
        print(
            "No GPU found: running on leangraph's CPU reference backend (graph semantics "
            "emulated on the CPU)."
        )
    print(
        f"device: {result.device}; interleaved 1F1B order of rank {config.rank} "
        f"(pp={config.pp_size}, vp={config.vp_size}, {config.num_microbatches} microbatches):"
    )
    print(f"  {result.order}")
    print(f"{'step':>4}  {'eager loss':>12}  {'graphed loss':>12}  {'|diff|':>9}")
    for step, (e, g) in enumerate(zip(result.eager_losses, result.graphed_losses)):
        print(f"{step:>4}  {e:>12.6f}  {g:>12.6f}  {abs(e - g):>9.2e}")
    if result.memory:
        m = result.memory
        print(
            f"memory: before capture {m['before_capture'] / MIB:.1f} MiB, peak during "
            f"warm-up+capture {m['peak_capture'] / MIB:.1f} MiB, held after capture "
            f"{m['after_capture'] / MIB:.1f} MiB allocated / {m['reserved'] / MIB:.1f} MiB "
            "reserved"
        )
    else:
        print("memory: not measured on the CPU backend")
    worst = max(abs(e - g) for e, g in zip(result.eager_losses, result.graphed_losses))
    return 0 if worst <= 1e-5 * max(1.0, max(result.eager_losses)) else 1


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[Callable[[Any], None] | None]:
    """A rich progress bar over warm-up and capture, as a ``progress=`` callback.

    Yields None (no bar) when disabled, when rich is missing or stderr is not a terminal.
    """
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    except ImportError:
        enabled = False
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[graph]}"),
        transient=True,
    ) as bar:
        task = bar.add_task("warm-up", total=None, graph="")

        def update(event: Any) -> None:
            bar.update(
                task,
                completed=event.done,
                total=event.total,
                description=event.phase,
                graph=event.label,
            )

        yield update


def _workload_args(
    parser: argparse.ArgumentParser, *, microbatches: int, hidden: int, heads: int, sequence: int
) -> None:
    """The flags that describe one pipeline rank's transformer workload."""
    parser.add_argument("--pp", type=int, default=4, help="pipeline-parallel size")
    parser.add_argument("--vp", type=int, default=2, help="virtual chunks per rank")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--microbatches", type=int, default=microbatches)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks per chunk")
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--sequence", type=int, default=sequence)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")


def _shape(args: argparse.Namespace) -> Any:
    import torch

    from .workloads import BlockShape

    return BlockShape(
        hidden=args.hidden,
        heads=args.heads,
        sequence=args.sequence,
        micro_batch=args.micro_batch,
        dtype=getattr(torch, _DTYPES[args.dtype]),
    )


def _plan(args: argparse.Namespace) -> int:
    import importlib

    from leangraph import plan_memory

    if args.function:
        module_name, _, attr = args.function.partition(":")
        if not attr:
            raise SystemExit(f"--function must be module:function, got {args.function!r}")
        made = getattr(importlib.import_module(module_name), attr)()
        callables, sample_args, kwargs = made[0], made[1], (made[2] if len(made) > 2 else {})
        plan = plan_memory(callables, sample_args, **kwargs)
        print(f"memory plan of {args.function}:")
    else:
        from leangraph.schedules import interleaved_1f1b

        from .workloads import make_blocks, sample_hidden

        shape = _shape(args)
        order = interleaved_1f1b(args.pp, args.vp, args.rank, args.microbatches)
        blocks = make_blocks(args.vp * args.layers, shape, "meta")
        samples = tuple(
            (sample_hidden(shape, "meta"),)
            for _ in range(args.vp * args.layers * args.microbatches)
        )
        plan = plan_memory(tuple(blocks), samples, order=order, num_layers_per_chunk=args.layers)
        print(
            f"memory plan of rank {args.rank} (pp={args.pp}, vp={args.vp}, "
            f"{args.microbatches} microbatches, {args.layers} blocks per chunk, hidden "
            f"{args.hidden}, sequence {args.sequence}, {args.dtype}), computed on meta tensors:"
        )
    print(plan.describe())
    return 0


def _bench(args: argparse.Namespace) -> int:
    import json

    import torch

    from leangraph import plot_memory

    from .bench import BenchConfig, format_table, plot_bars, run_bench

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    methods = tuple(args.methods.split(","))
    if device == "cpu":
        print(
            "No GPU: benchmarking on the CPU reference backend; memory is not measured and "
            "torch's CUDA-only make_graphed_callables is left out."
        )
        methods = tuple(m for m in methods if m != "torch")
    config = BenchConfig(
        pp_size=args.pp,
        vp_size=args.vp,
        rank=args.rank,
        num_microbatches=args.microbatches,
        layers_per_chunk=args.layers,
        steps=args.steps,
        methods=methods,
        device=device,
        shape=_shape(args),
        rounds=args.rounds,
    )
    with progress_bar(not args.no_progress) as progress:
        result = run_bench(config, progress=progress)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result.to_json(), handle, indent=2)
    if args.plot and result.report is not None and device != "cpu":
        plot_memory(result.report, args.plot, title="leangraph: warm-up, capture, replay")
    if args.bars and device != "cpu":
        plot_bars(result, args.bars)
    return 0 if all(result.losses_agree.get(m, True) for m in ("leangraph",)) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leangraph", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="capture a small transformer stack and train it")
    demo.add_argument("--steps", type=int, default=5)
    demo.add_argument("--microbatches", type=int, default=4)
    demo.add_argument("--hidden", type=int, default=64)
    demo.add_argument("--sequence", type=int, default=32)
    demo.add_argument("--device", choices=["cpu", "cuda"], default=None)
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(handler=_demo)
    bench = sub.add_parser(
        "bench", help="eager vs torch.cuda.make_graphed_callables vs leangraph on one pipeline rank"
    )
    _workload_args(bench, microbatches=16, hidden=1024, heads=16, sequence=2048)
    bench.add_argument("--steps", type=int, default=5, help="timed steps per method")
    bench.add_argument("--methods", default="eager,torch,leangraph")
    bench.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="then capture and time the graphed methods again, in turn, this many times",
    )
    bench.add_argument("--device", choices=["cpu", "cuda"], default=None)
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--json", help="write the figures as JSON here")
    bench.add_argument("--plot", help="write leangraph's memory timeline PNG here")
    bench.add_argument("--bars", help="write a bar chart of the methods' memory here")
    bench.set_defaults(handler=_bench)
    plan = sub.add_parser("plan", help="print the memory plan of a workload, without a GPU")
    _workload_args(plan, microbatches=16, hidden=1024, heads=16, sequence=2048)
    plan.add_argument(
        "--function",
        help="module:function returning (callables, sample_args"
        "[, plan_memory keyword dict]) to plan instead of the built-in workload",
    )
    plan.set_defaults(handler=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``leangraph`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args))
