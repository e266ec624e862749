"""Where a graphed training step spends host time (GPU only): torch's and leangraph's graphs
and the whole-step graph of the launch-bound benchmark workload (hidden 256, sequence 128, 8
microbatches), stepped in turn.

Per round and method it prints the median and minimum of 30 synchronised steps and the host
time per step of 30 unsynchronised ones (equal to the synchronised time when the host is the
bottleneck), then per method its launches per step (the bench's ``count_launches``, as
``leangraph bench --launches`` counts them) and a cProfile of 20 steps.
Usage: PYTHONPATH=src python3 benchmarks/profile_step.py
"""

from __future__ import annotations

import statistics
import time

import torch
from _cprofile import print_profile

from leangraph.cli.bench import LAUNCH_BOUND, BenchWorkload, count_launches, graph_methods


def main() -> None:
    work = BenchWorkload(LAUNCH_BOUND)
    graphed = graph_methods(work, untimed_steps=1)

    def synchronised(name: str) -> tuple[float, float]:
        times = []
        for _ in range(30):
            torch.cuda.synchronize()
            start = time.perf_counter()
            graphed[name].step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3, min(times) * 1e3

    def host(name: str) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(30):
            graphed[name].step()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed / 30 * 1e3

    for round_index in range(3):
        for name in graphed:
            median, least = synchronised(name)
            print(
                f"round {round_index} {name:<9} step median {median:.2f} ms, min {least:.2f} "
                f"ms; host per step {host(name):.2f} ms"
            )
    for name in graphed:
        launches = count_launches(graphed[name].step)
        print(
            f"== {name}: graph launches/step {launches.graph_launches:.0f}, kernels outside "
            f"graphs/step {launches.kernel_launches:.0f}"
        )
        print_profile(f"{name}, 20 steps", graphed[name].step, 20, 18)


if __name__ == "__main__":
    main()
