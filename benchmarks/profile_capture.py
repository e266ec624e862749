"""Where capture time goes (GPU only): cProfile of torch's and leangraph's
``make_graphed_callables`` on the launch-bound benchmark workload, after one untimed call of
each so per-process set-up (cuBLAS handles, kernel loading) is paid already.

The graphs are built as the bench builds them (``leangraph.cli.bench.capture_method``).
Usage: PYTHONPATH=src python3 benchmarks/profile_capture.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch

from leangraph.cli.bench import LAUNCH_BOUND, BenchWorkload, capture_method


def graphed_by(work: BenchWorkload, method: str, **options: Any) -> Callable[[], None]:
    """One capture of ``method`` over a fresh copy of the blocks, its graphs freed after."""

    def run() -> None:
        capture_method(work, method, **options).release()

    return run


def profile(name: str, run: Callable[[], None]) -> None:
    run()  # untimed
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    run()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(12)
    stats.sort_stats("cumulative").print_stats("leangraph|graphs.py", 20)
    stats.print_callees("capture_end")
    print(f"== {name}: {time.perf_counter() - start:.3f} s (second call, under cProfile)")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))


def main() -> None:
    work = BenchWorkload(LAUNCH_BOUND)
    profile("torch", graphed_by(work, "torch"))
    profile("leangraph, check_memory=False", graphed_by(work, "leangraph", check_memory=False))
    profile("leangraph, check_memory=True", graphed_by(work, "leangraph", check_memory=True))


if __name__ == "__main__":
    main()
