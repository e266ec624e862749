"""Where capture time goes (GPU only): cProfile of torch's and leangraph's
``make_graphed_callables`` on the launch-bound benchmark workload, after one untimed call of
each so per-process set-up (cuBLAS handles, kernel loading) is paid already.

Usage: PYTHONPATH=src python3 scripts/profile_capture.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

import leangraph
from leangraph.schedules import interleaved_1f1b
from leangraph.workloads import BlockShape, make_blocks, sample_hidden

SHAPE = BlockShape(hidden=256, heads=4, sequence=128, dtype=torch.bfloat16)
ORDER = interleaved_1f1b(4, 2, 0, 8)
GRAPHS = 2 * 4 * 8


def with_torch() -> object:
    blocks = make_blocks(8, SHAPE, "cuda")
    # torch graphs each module once: one wrapper per graph over the shared block.
    wrappers = tuple(torch.nn.Sequential(blocks[(g // 32) * 4 + g % 4]) for g in range(GRAPHS))
    return torch.cuda.make_graphed_callables(
        wrappers, tuple((sample_hidden(SHAPE, "cuda"),) for _ in wrappers)
    )


def with_leangraph(check: bool) -> object:
    blocks = make_blocks(8, SHAPE, "cuda")
    sample = sample_hidden(SHAPE, "cuda")
    return leangraph.make_graphed_callables(
        tuple(blocks), tuple((sample,) for _ in range(GRAPHS)), order=ORDER,
        num_layers_per_chunk=4, check_memory=check,
    )


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
    profile("torch", with_torch)
    profile("leangraph, check_memory=False", lambda: with_leangraph(False))
    profile("leangraph, check_memory=True", lambda: with_leangraph(True))
