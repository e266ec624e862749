"""The host cost of overlap_grad_accumulation's fence, apart from the replay (GPU only).

Before every backward replay, ``overlap_grad_accumulation=True`` makes the caller's stream wait
for the side stream's additions as they stood at the previous backward replay
(``AdditionFence.before_backward`` in ``src/leangraph/runtime/overlap.py``): it reads the current
stream, makes it wait for one event (for the whole side stream, out of capture order) and
records the event on the side stream again. This times those torch calls, as the fence makes
them, in µs of host time per call (median of 7 rounds of 10000 calls), beside
``torch.cuda.current_stream()`` alone and a bare ``wait_event`` + ``record`` pair, so that what
the fence adds to a backward replay can be told from what the side stream's per-parameter
additions cost (``leangraph bench --replay-micro``: leangraph-overlap against leangraph). It
imports no leangraph module (the tools stay on the public API; the fence is internal), so the
fence's own bookkeeping (a dict read and a comparison, well under a µs) is not in the figure.
Usage: python3 benchmarks/fence_cost.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

CALLS = 10000


def host_us(call: Callable[[int], object], rounds: int = 7) -> float:
    """Median over rounds of the host µs per ``call(i)``."""
    for i in range(100):
        call(i)
    figures = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for i in range(CALLS):
            call(i)
        figures.append((time.perf_counter_ns() - start) / CALLS / 1e3)
        torch.cuda.synchronize()
    return statistics.median(figures)


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    event = torch.cuda.Event()
    caller = torch.cuda.current_stream(device)

    def bare_pair(_: int) -> None:
        caller.wait_event(event)
        event.record(side)

    def fence_in_order(_: int) -> None:  # the calls of before_backward, in capture order
        torch.cuda.current_stream(side.device).wait_event(event)
        event.record(side)

    def fence_out_of_order(_: int) -> None:  # ... and out of it
        torch.cuda.current_stream(side.device).wait_stream(side)
        event.record(side)

    figures = {
        "torch.cuda.current_stream(device)": host_us(lambda _: torch.cuda.current_stream(device)),
        "wait_event + record (bare)": host_us(bare_pair),
        "fence's calls, in capture order": host_us(fence_in_order),
        "fence's calls, out of order (wait_stream)": host_us(fence_out_of_order),
    }
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    width = max(map(len, figures))
    for name, value in figures.items():
        print(f"{name.ljust(width)}  {value:6.2f} µs/call")


if __name__ == "__main__":
    main()
