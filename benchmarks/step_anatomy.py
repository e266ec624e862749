"""Where the launch-bound graphed step's time goes (GPU only), by taking pieces away.

The launch-bound workload of ``leangraph bench --launch-bound`` (rank 0 of PP4/VP2, 2 chunks x 4
blocks, hidden 256, sequence 128, 8 microbatches) is graphed by each method; then, per
variant, 30 synchronised steps (median ms) and the host ms per step of 30 unsynchronised ones:

- ``raw-graphs``: leangraph's forward and backward graphs replayed in the step's order with
  nothing else (no Python per layer, no autograd): the GPU floor of per-layer graphs;
- every graphed method of the bench as it runs them (torch, leangraph, leangraph-fused,
  leangraph-fused-nohooks), and the whole-step graph.

Then ``torch.profiler``'s CPU table of 5 leangraph-fused-nohooks steps (self CPU time by op).
Usage: PYTHONPATH=src python3 benchmarks/step_anatomy.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from leangraph.cli.bench import FUSED_NO_HOOKS, LAUNCH_BOUND, BenchWorkload, graph_methods
from leangraph.order import StepKind, parse_order


def timed(step: Callable[[], object]) -> tuple[float, float]:
    """Median synchronised ms per step, and host ms per step of unsynchronised ones."""
    for _ in range(3):
        step()
    times = []
    for _ in range(30):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(30):
        step()
    host = (time.perf_counter() - start) / 30
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3, host * 1e3


def main() -> None:
    work = BenchWorkload(LAUNCH_BOUND)
    graphed = graph_methods(work, untimed_steps=1)
    fused = graphed["leangraph-fused"].graphed
    assert fused is not None
    _, steps = parse_order(
        work.order,
        num_callables=work.layout.num_callables,
        num_samples=work.layout.num_graphs,
        num_layers_per_chunk=work.layers_per_chunk,
    )
    pairs = [g._record.pair for g in fused]  # a probe reads the private pair

    index = work.layout.graph_index

    def raw_step() -> None:
        for step in steps:
            layers = range(work.layers_per_chunk[step.chunk - 1])
            if step.kind is StepKind.FORWARD:
                for layer in layers:
                    pairs[index(step.chunk, step.microbatch, layer)].replay_forward()
            else:
                for layer in reversed(layers):
                    pairs[index(step.chunk, step.microbatch, layer)].replay_backward()

    rows = {"raw-graphs": raw_step}
    rows.update({name: captured.step for name, captured in graphed.items()})
    for name, step in rows.items():
        median, host = timed(step)
        print(f"{name:<16} step {median:7.2f} ms   host {host:7.2f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            graphed[FUSED_NO_HOOKS].step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
