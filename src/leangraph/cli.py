"""The ``leangraph`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]

MIB = 1024 * 1024


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo
    from .workloads import BlockShape

    config = DemoConfig(steps=args.steps, num_microbatches=args.microbatches,
                        shape=BlockShape(hidden=args.hidden, sequence=args.sequence),
                        device=args.device)
    result = run_demo(config)
    if result.device == "cpu":
        print("No GPU found: running on leangraph's CPU reference backend (graph semantics "
              "emulated on the CPU).")
    print(f"device: {result.device}; interleaved 1F1B order of rank {config.rank} "
          f"(pp={config.pp_size}, vp={config.vp_size}, {config.num_microbatches} microbatches):")
    print(f"  {result.order}")
    print(f"{'step':>4}  {'eager loss':>12}  {'graphed loss':>12}  {'|diff|':>9}")
    for step, (e, g) in enumerate(zip(result.eager_losses, result.graphed_losses)):
        print(f"{step:>4}  {e:>12.6f}  {g:>12.6f}  {abs(e - g):>9.2e}")
    if result.memory:
        m = result.memory
        print(f"memory: before capture {m['before_capture'] / MIB:.1f} MiB, peak during "
              f"warm-up+capture {m['peak_capture'] / MIB:.1f} MiB, held after capture "
              f"{m['after_capture'] / MIB:.1f} MiB allocated / {m['reserved'] / MIB:.1f} MiB "
              "reserved")
    else:
        print("memory: not measured on the CPU backend")
    worst = max(abs(e - g) for e, g in zip(result.eager_losses, result.graphed_losses))
    return 0 if worst <= 1e-5 * max(1.0, max(result.eager_losses)) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leangraph", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="capture a small transformer stack and train it")
    demo.add_argument("--steps", type=int, default=5)
    demo.add_argument("--microbatches", type=int, default=4)
    demo.add_argument("--hidden", type=int, default=64)
    demo.add_argument("--sequence", type=int, default=32)
    demo.add_argument("--device", choices=["cpu", "cuda"], default=None)
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``leangraph`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
