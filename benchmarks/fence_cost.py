"""The host cost of overlap_grad_accumulation's fence, apart from the replay (GPU only).

Before every backward replay, ``overlap_grad_accumulation=True`` makes the caller's stream wait
for the side stream's additions as they stood at the previous backward replay (one
``Stream.wait_event`` and one ``Event.record`` per call; ``runtime/overlap.py``). This times
:meth:`leangraph.runtime.overlap.AdditionFence.before_backward` alone, in µs of host time per
call (median of 7 rounds of 10000 calls, graphs taken in capture order, and out of it, where it
waits for the whole side stream instead), beside a bare ``wait_event`` + ``record`` pair and
``torch.cuda.current_stream()``, so that what the fence adds to a backward replay can be told
from what the side stream's per-parameter additions cost (``leangraph bench --replay-micro``:
leangraph-overlap against leangraph).
Usage: PYTHONPATH=src python3 benchmarks/fence_cost.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from leangraph.runtime.overlap import AdditionFence

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
    graphs = list(range(8))
    in_order = AdditionFence(graphs, device)
    out_of_order = AdditionFence(graphs, device)
    side = torch.cuda.Stream(device)
    event = torch.cuda.Event()
    caller = torch.cuda.current_stream(device)

    def bare_pair(_: int) -> None:
        caller.wait_event(event)
        event.record(side)

    figures = {
        "torch.cuda.current_stream(device)": host_us(lambda _: torch.cuda.current_stream(device)),
        "wait_event + record (bare)": host_us(bare_pair),
        "fence, in capture order": host_us(lambda i: in_order.before_backward(i % 8)),
        "fence, out of order (wait_stream)": host_us(lambda i: out_of_order.before_backward(0)),
    }
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    width = max(map(len, figures))
    for name, value in figures.items():
        print(f"{name.ljust(width)}  {value:6.2f} µs/call")


if __name__ == "__main__":
    main()
