"""Where capture time goes (GPU only): cProfile of torch's and leangraph's
``make_graphed_callables`` on the launch-bound benchmark workload, after one untimed call of
each so per-process set-up (cuBLAS handles, kernel loading) is paid already.

The graphs are built as in ``capture_phases.py``.
Usage: PYTHONPATH=src python3 scripts/profile_capture.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
from capture_phases import WORKLOADS, graph_blocks

from leangraph.workloads import make_blocks

SHAPE, MICROBATCHES = WORKLOADS["launch-bound"]


def graphed_by(method: str, **options: object):
    def run() -> object:
        blocks = make_blocks(8, SHAPE, "cuda")
        return graph_blocks(method, blocks, SHAPE, MICROBATCHES, **options)

    return run


def profile(name: str, run) -> None:
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


if __name__ == "__main__":
    profile("torch", graphed_by("torch"))
    profile("leangraph, check_memory=False", graphed_by("leangraph", check_memory=False))
    profile("leangraph, check_memory=True", graphed_by("leangraph", check_memory=True))
