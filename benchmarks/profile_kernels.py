"""GPU time per training step by kernel (GPU only): torch's and leangraph's graphs and the
whole-step graph of the 16-microbatch benchmark workload, two steps each under
``torch.profiler``.

Prints each method's total self device time per step (graph kernels count twice: under the
replay and by kernel) and its 22 largest entries. Equal totals
mean the graphs do the same GPU work, so a step-time difference is idle time between launches.
Usage: PYTHONPATH=src python3 benchmarks/profile_kernels.py
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from leangraph.cli.bench import BenchConfig, BenchWorkload, graph_methods


def _self_device_us(event: Any) -> float:
    # torch 2.4 names it self_cuda_time_total; later versions self_device_time_total.
    value = getattr(event, "self_device_time_total", None)
    return float(event.self_cuda_time_total if value is None else value)


def main() -> None:
    work = BenchWorkload(BenchConfig(num_microbatches=16))
    for name, captured in graph_methods(work, untimed_steps=2).items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                captured.step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if _self_device_us(e) > 0]
        total = sum(_self_device_us(e) for e in events)
        print(f"== {name}: self device time per step {total / 2 / 1e3:.2f} ms")
        for event in sorted(events, key=_self_device_us, reverse=True)[:22]:
            print(
                f"{event.key[:70]:<70} calls/step {event.count / 2:>6.0f}  "
                f"ms/step {_self_device_us(event) / 2 / 1e3:8.3f}"
            )


if __name__ == "__main__":
    main()
