"""Where a graphed step's time goes (GPU only), by taking pieces away.

The launch-bound workload of ``leangraph bench --launch-bound`` (rank 0 of PP4/VP2, 2 chunks x 4
blocks, hidden 256, sequence 128, 8 microbatches), or with ``compute`` the bench's default
16-microbatch compute-bound one (hidden 1024, sequence 2048), is graphed by each method; then,
per variant, 30 synchronised steps (median ms), the host ms it takes to enqueue one of them
(from the synchronised start until the step returns, its losses not read: where that is close
to the step's time, the host, not the GPU, sets the pace; the whole-step graph reads them)
and the host ms per step of 30 unsynchronised ones:

- ``raw-graphs``: leangraph's forward and backward graphs replayed in the step's order with
  nothing else (no Python per layer, no autograd): the GPU floor of per-layer graphs;
- every graphed method of the bench as it runs them (torch, leangraph, leangraph-fused,
  leangraph-fused-nohooks), and the whole-step graph;
- the per-layer methods again, their losses read as the bench's step reads them.

Then, per method, the CUDA runtime calls per step other than kernels in graphs (graph
launches, kernel launches, copies, stream waits, event records: ``torch.profiler``, 3 steps),
and ``torch.profiler``'s CPU table of 5 leangraph-fused-nohooks steps (self CPU time by op).
Usage: PYTHONPATH=src python3 benchmarks/step_anatomy.py [compute]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

from leangraph.cli.bench import (
    FUSED_NO_HOOKS,
    LAUNCH_BOUND,
    BenchConfig,
    BenchWorkload,
    Captured,
    graph_methods,
)
from leangraph.order import StepKind, parse_order


def timed(step: Callable[[], object]) -> tuple[float, float, float]:
    """Median synchronised ms per step, the median host ms to enqueue one, and host ms per
    step of unsynchronised ones."""
    for _ in range(3):
        step()
    times, enqueued = [], []
    for _ in range(30):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        enqueued.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(30):
        step()
    host = (time.perf_counter() - start) / 30
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3, statistics.median(enqueued) * 1e3, host * 1e3


def unread(work: BenchWorkload, captured: Captured) -> Callable[[], object]:
    """``captured``'s step, its losses left unread (reading one waits for the GPU)."""
    lookup = captured.lookup
    assert lookup is not None
    return lambda: work.train_step(lookup, captured.blocks)


def main(argv: list[str]) -> None:
    work = BenchWorkload(BenchConfig(num_microbatches=16) if argv == ["compute"] else LAUNCH_BOUND)
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

    rows: dict[str, Callable[[], object]] = {}
    for name, captured in graphed.items():
        rows[name] = captured.step if captured.lookup is None else unread(work, captured)
    for name, captured in graphed.items():
        if captured.lookup is not None:  # the bench's step: its losses read at the end
            rows[f"{name}, read"] = captured.step
    rows["raw-graphs"] = raw_step  # last: it leaves the gradient buffers as no step would
    for name, step in rows.items():
        median, enqueue, host = timed(step)
        print(f"{name:<24} step {median:7.2f} ms   enqueue {enqueue:7.2f} ms   host {host:7.2f} ms")
    print(f"CUDA runtime calls per step ({', '.join(RUNTIME_CALLS)})")
    for name, captured in graphed.items():
        counts = runtime_calls(captured.step, steps=3)
        print(f"{name:<24} " + "  ".join(f"{counts[call]:7.0f}" for call in RUNTIME_CALLS))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            graphed[FUSED_NO_HOOKS].step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


# The calls that say what a step asks of the driver besides its graphs: stream waits and event
# records are the engine syncing streams (an accumulator made on another stream than the
# gradient that reaches it, say); each costs host time.
RUNTIME_CALLS = (
    "cudaGraphLaunch",
    "cudaLaunchKernel",
    "cudaMemcpyAsync",
    "cudaStreamWaitEvent",
    "cudaEventRecord",
)


def runtime_calls(step: Callable[[], object], steps: int) -> dict[str, float]:
    """Calls per step of each of :data:`RUNTIME_CALLS` in ``steps`` steps under the profiler."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    counts = {call: 0.0 for call in RUNTIME_CALLS}
    for event in prof.key_averages():
        if event.key in counts:
            counts[event.key] = event.count / steps
    return counts


if __name__ == "__main__":
    main(sys.argv[1:])
