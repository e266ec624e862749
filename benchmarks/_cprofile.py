"""The cProfile table the profiling scripts print (a helper of theirs, not a script).

On CUDA, autograd runs backward nodes on its device thread, and Python 3.12's profiler times
that thread's frames too: own times (``tottime``) stay meaningful, cumulative ones mix threads.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from collections.abc import Callable

import torch


def print_profile(title: str, run: Callable[[], object], repeats: int, lines: int) -> None:
    """Profile ``repeats`` calls of ``run`` (then a CUDA synchronise, when CUDA is there) and
    print its ``lines`` most expensive functions by own time under ``== title``."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(lines)
    table = text.getvalue().splitlines()
    start = next(i for i, line in enumerate(table) if line.lstrip().startswith("ncalls"))
    print(f"== {title}")
    print("\n".join(line for line in table[start:] if line.strip()))
