"""Measure the two open figures of docs/benchmarks.md (GPU only): leangraph's warm-up taking
more cudaMalloc segments than torch's (185 against 37), and the 1-2% compute-bound step gap.

Part ``segments``, per workload (the compute-bound one of 16 microbatches, the launch-bound one)
and per run, counts what the caching allocator did in each phase of one call, from an allocator
emptied and with its counters reset (``torch.cuda.reset_accumulated_memory_stats``):

* runs: ``eager step`` (one training step, the reference: the schedule's own in-flight
  activations), ``torch`` and ``leangraph`` (``make_graphed_callables`` as the bench calls
  them), and both again with the cache ``pre-filled`` by one eager step that was dropped without
  emptying the cache (what a training script that ran eagerly first has);
* phases: leangraph's ``probe+check`` (to its ``pre_warmup_hook``), ``warm-up`` (to its
  ``post_warmup_hook``), ``capture`` (to the return: emptying the cache, the static buffers, the
  graphs); torch's ``warm-up`` (to its first ``CUDAGraph.capture_begin``) and ``capture``;
* per phase: segments taken from the device (``segment.all.allocated``, i.e. cudaMalloc calls;
  large and small pool apart), segments given back (``segment.all.freed``, cudaFree), allocation
  retries (``num_alloc_retries``: a cudaMalloc that failed and was retried after freeing the
  cache), peak allocated and reserved, seconds; and at each phase's end, from
  ``torch.cuda.memory_snapshot()``, the segments held by size class and by pool (the graph pool
  or the default one).

Part ``gap``, per workload (16 and 32 microbatches, launch-bound), captures torch, leangraph,
leangraph-fused (where the installed leangraph has it) and the whole-step graph in one process
and times their steps in alternating rounds: wall time (to the GPU's end) and host time (to the
return of the step's Python, no synchronisation inside the step, so host time below wall time
means the GPU is the bound). Then 3 steps of each under ``torch.profiler`` (its Chrome trace,
read back) give per step: the GPU's busy time (the union of its kernels, copies and sets) and
idle time (the rest of the profiled window), the idle gaps by what surrounds them (a graph's
work on both sides, a graph and work outside graphs, outside on both sides), graph launches and
the host time of each ``cudaGraphLaunch``, kernels, copies and sets outside graphs (by name),
the stream waits, event records and synchronising calls, and the ATen ops run outside graphs.
Idle gaps "within one graph launch" are the GPU's own between a graph's nodes; "graph -> next
graph" lie between two launches, and grow when the host or a stream wait holds the next back.

Writes ``explain.json`` (every figure) and ``summary.txt`` (the tables, and the differences,
leangraph minus torch, that the two figures are about) under ``--out`` (default: ``$OUT``, else
``explain-out``), printing the summary too. About 1-2 minutes on an H200 for both parts.

Usage: PYTHONPATH=src python3 benchmarks/explain_segments.py [--parts segments,gap] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import leangraph
from leangraph.cli.bench import (
    FUSED,
    LAUNCH_BOUND,
    BenchConfig,
    BenchWorkload,
    Captured,
    capture_method,
    fused_unavailable,
    profile_steps,
)

MIB = 1024 * 1024
SEGMENT_WORKLOADS = {
    "16 microbatches": BenchConfig(num_microbatches=16),
    "launch-bound": LAUNCH_BOUND,
}
GAP_WORKLOADS = {
    "16 microbatches": BenchConfig(num_microbatches=16),
    "32 microbatches": BenchConfig(num_microbatches=32),
    "launch-bound": LAUNCH_BOUND,
}
STATS = (
    "segment.all.allocated",
    "segment.large_pool.allocated",
    "segment.small_pool.allocated",
    "segment.all.freed",
    "num_alloc_retries",
    "num_device_alloc",
    "num_device_free",
)


# ------------------------------------------------------------------------------ segments


def _stats() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {key: int(stats.get(key, 0)) for key in STATS}


def _size_class(size: int) -> str:
    """The caching allocator's segment sizes: 2 MiB for requests up to 1 MiB (small pool),
    20 MiB for 1-10 MiB, the request rounded up to 2 MiB above that."""
    if size <= 2 * MIB:
        return "2 MiB (small pool)"
    if size == 20 * MIB:
        return "20 MiB (blocks of 1-10 MiB)"
    return "own size (blocks over 10 MiB)"


def _segments_held() -> dict[str, Any]:
    """Segments the allocator holds now, by size class and by pool (memory_snapshot)."""
    by_size: Counter[str] = Counter()
    by_pool: Counter[str] = Counter()
    free_segments = 0
    for segment in torch.cuda.memory_snapshot():
        by_size[_size_class(int(segment["total_size"]))] += 1
        pool = segment.get("segment_pool_id", (0, 0))
        by_pool["default" if tuple(pool) == (0, 0) else f"graph pool {tuple(pool)}"] += 1
        if int(segment.get("allocated_size", 0)) == 0:
            free_segments += 1
    return {"by_size": dict(by_size), "by_pool": dict(by_pool), "wholly_free": free_segments}


class Phases:
    """Marks the end of each phase of one run: counters, peaks, seconds, segments held."""

    def __init__(self) -> None:
        torch.cuda.synchronize()
        self.last_stats = _stats()
        self.last_time = time.perf_counter()
        self.start_allocated = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self.rows: dict[str, dict[str, Any]] = {}

    def mark(self, name: str) -> None:
        torch.cuda.synchronize()
        now, stats = time.perf_counter(), _stats()
        row: dict[str, Any] = {key: stats[key] - self.last_stats[key] for key in STATS}
        row["seconds"] = now - self.last_time
        row["peak_allocated_mib"] = (torch.cuda.max_memory_allocated() - self.start_allocated) / MIB
        row["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / MIB
        row["held_at_end"] = _segments_held()
        self.rows[name] = row
        torch.cuda.reset_peak_memory_stats()
        self.last_stats, self.last_time = _stats(), time.perf_counter()


@contextlib.contextmanager
def _first_capture_marks(phases: Phases, name: str) -> Iterator[None]:
    """Mark phase ``name`` at the first ``CUDAGraph.capture_begin`` inside the block (torch's
    make_graphed_callables has no hooks: it warms up every callable, then captures)."""
    original = torch.cuda.CUDAGraph.capture_begin
    seen = [False]

    def capture_begin(graph: torch.cuda.CUDAGraph, *args: Any, **kwargs: Any) -> Any:
        if not seen[0]:
            seen[0] = True
            phases.mark(name)
        return original(graph, *args, **kwargs)

    torch.cuda.CUDAGraph.capture_begin = capture_begin  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.cuda.CUDAGraph.capture_begin = original  # type: ignore[method-assign]


def _fresh_allocator() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_accumulated_memory_stats()


def _prefill(work: BenchWorkload) -> None:
    """One eager step on a throw-away copy, dropped without emptying the cache."""
    blocks = work.copy_blocks()
    work.step(work.eager_lookup(blocks), blocks)
    del blocks
    gc.collect()
    torch.cuda.synchronize()


def segment_run(work: BenchWorkload, run: str) -> dict[str, dict[str, Any]]:
    """One run of the segments part (see the module docstring); its phases' rows."""
    method, _, prefilled = run.partition(", ")
    blocks = work.copy_blocks()
    _fresh_allocator()
    if prefilled:
        _prefill(work)
    phases = Phases()
    if method == "eager step":
        work.step(work.eager_lookup(blocks), blocks)
        phases.mark("step")
    elif method == "torch":
        with _first_capture_marks(phases, "warm-up"):
            captured = capture_method(work, "torch", blocks)
        phases.mark("capture")
        del captured
    else:
        captured = capture_method(
            work,
            "leangraph",
            blocks,
            pre_warmup_hook=lambda: phases.mark("probe+check"),
            post_warmup_hook=lambda: phases.mark("warm-up"),
        )
        phases.mark("capture")
        captured.release()
        del captured
    del blocks
    _fresh_allocator()
    return phases.rows


SEGMENT_RUNS = ("eager step", "torch", "leangraph", "torch, pre-filled", "leangraph, pre-filled")


def segments_part(rounds: int) -> dict[str, Any]:
    """Every run of every segment workload, ``rounds`` times in turn (counts repeat exactly;
    the seconds vary, so the summary gives their median)."""
    out: dict[str, Any] = {}
    for name, config in SEGMENT_WORKLOADS.items():
        work = BenchWorkload(config)
        segment_run(work, "leangraph")  # untimed: per-process set-up (cuBLAS, autograd)
        segment_run(work, "torch")
        runs: dict[str, list[dict[str, Any]]] = {run: [] for run in SEGMENT_RUNS}
        for index in range(rounds):
            turn = (
                SEGMENT_RUNS[index % len(SEGMENT_RUNS) :]
                + SEGMENT_RUNS[: index % len(SEGMENT_RUNS)]
            )
            for run in turn:
                runs[run].append(segment_run(work, run))
        out[name] = {"runs": runs}
        del work
    return out


def _median_row(rows: list[dict[str, Any]], phase: str, key: str) -> float:
    return statistics.median(float(r[phase][key]) for r in rows if phase in r)


def segments_summary(data: dict[str, Any]) -> list[str]:
    lines = ["== Part 1: cudaMalloc segments per phase (counts exact; seconds: median of rounds)"]
    header = (
        f"{'run':<24} {'phase':<12} {'cudaMalloc':>10} {'(large':>7} {'small)':>7} "
        f"{'cudaFree':>8} {'retries':>7} {'peak alloc MiB':>14} {'seconds':>8}  "
        "segments held at end"
    )
    for workload, entry in data.items():
        lines += ["", f"-- {workload}", header, "-" * len(header)]
        for run, rows in entry["runs"].items():
            for phase in rows[0]:
                row = rows[0][phase]
                held = row["held_at_end"]
                sizes = ", ".join(f"{n} x {label}" for label, n in sorted(held["by_size"].items()))
                pools = ", ".join(f"{n} in {pool}" for pool, n in sorted(held["by_pool"].items()))
                lines.append(
                    f"{run:<24} {phase:<12} {row['segment.all.allocated']:>10} "
                    f"{row['segment.large_pool.allocated']:>7} "
                    f"{row['segment.small_pool.allocated']:>7} {row['segment.all.freed']:>8} "
                    f"{row['num_alloc_retries']:>7} {row['peak_allocated_mib']:>14.0f} "
                    f"{_median_row(rows, phase, 'seconds'):>8.3f}  {sizes}; {pools}; "
                    f"{held['wholly_free']} wholly free"
                )
        lines += _segments_reading(entry["runs"])
    return lines


def _count(rows: list[dict[str, Any]], phases: tuple[str, ...]) -> int:
    return sum(int(rows[0][p]["segment.all.allocated"]) for p in phases if p in rows[0])


def _segments_reading(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The comparisons the open figure is about, in words."""
    before = ("probe+check", "warm-up")
    eager = _count(runs["eager step"], ("step",))
    lean, torch_ = _count(runs["leangraph"], before), _count(runs["torch"], ("warm-up",))
    lean_pre = _count(runs["leangraph, pre-filled"], before)
    warm = _median_row(runs["leangraph"], "warm-up", "seconds")
    warm_pre = _median_row(runs["leangraph, pre-filled"], "warm-up", "seconds")
    probe = _count(runs["leangraph"], ("probe+check",))
    return [
        f"reading: before capture leangraph took {lean} segments ({probe} of them in the "
        f"probe and memory check), torch {torch_} (its phase includes the bench's one sample "
        f"per graph, as torch's API needs); one eager step from an empty cache takes "
        f"{eager}. With the cache pre-filled by an eager step leangraph took {lean_pre}, and its "
        f"warm-up ran {warm_pre:.3f} s against {warm:.3f} s from an empty cache.",
        "reading: leangraph's warm-up peak allocated "
        f"{runs['leangraph'][0]['warm-up']['peak_allocated_mib']:.0f} MiB, torch's "
        f"{runs['torch'][0]['warm-up']['peak_allocated_mib']:.0f} MiB, the eager step "
        f"{runs['eager step'][0]['step']['peak_allocated_mib']:.0f} MiB.",
    ]


# ----------------------------------------------------------------------------------- gap


def _queue_step(captured: Captured) -> Callable[[], object]:
    """One training step queued without synchronising (no loss read): graphed methods through
    the bench's train_step, the whole-step graph by copying its inputs in and replaying."""
    whole = captured.whole_step
    if whole is not None:
        graph = whole.graph
        assert graph is not None

        def replay() -> None:
            for static, batch in zip(
                whole.inputs + whole.targets, whole.work.inputs + whole.work.targets
            ):
                static.copy_(batch)
            graph.replay()

        return replay
    assert captured.lookup is not None
    lookup = captured.lookup
    return lambda: captured.work.train_step(lookup, captured.blocks)


def _time_steps(step: Callable[[], object], steps: int) -> tuple[list[float], list[float]]:
    walls, hosts = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        host = time.perf_counter()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
        hosts.append(host - start)
    return walls, hosts


def _trace_events(step: Callable[[], object], steps: int) -> list[dict[str, Any]]:
    prof = profile_steps(step, steps)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X"]


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")
WATCHED_CALLS = (
    "cudaGraphLaunch",
    "cudaLaunchKernel",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "cudaStreamWaitEvent",
    "cudaEventRecord",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
    "cudaStreamIsCapturing",
    "cudaMalloc",
    "cudaFree",
)


def _gap_kind(before: tuple[bool, Any], after: tuple[bool, Any]) -> str:
    """What an idle gap lies between: (in a graph, launch correlation id) on either side."""
    if before[0] and after[0]:
        return "within one graph launch" if before[1] == after[1] else "graph -> next graph"
    side = {True: "graph", False: "outside"}
    return f"{side[before[0]]} -> {side[after[0]]}"


def analyse_trace(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per-step figures of a profiled window (see the module docstring)."""
    runtime = [e for e in events if e.get("cat") in RUNTIME_CATEGORIES]
    graph_calls = {
        e.get("args", {}).get("correlation")
        for e in runtime
        if e["name"].startswith("cudaGraphLaunch")
    }
    gpu = sorted(
        (e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: float(e["ts"])
    )
    in_graph = [e.get("args", {}).get("correlation") in graph_calls for e in gpu]
    busy = idle = 0.0
    gaps: dict[str, float] = defaultdict(float)
    gap_counts: Counter[str] = Counter()
    end = float(gpu[0]["ts"]) if gpu else 0.0
    previous: tuple[bool, Any] = (in_graph[0], None) if gpu else (False, None)
    for event, graphed in zip(gpu, in_graph):
        start, stop = float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0))
        correlation = event.get("args", {}).get("correlation")
        if start > end:
            kind = _gap_kind(previous, (graphed, correlation))
            gaps[kind] += start - end
            gap_counts[kind] += 1
            idle += start - end
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, previous = stop, (graphed, correlation)
    outside = Counter(e["name"][:60] for e, g in zip(gpu, in_graph) if not g)
    outside_us: dict[str, float] = defaultdict(float)
    for e, g in zip(gpu, in_graph):
        if not g:
            outside_us[e["name"][:60]] += float(e.get("dur", 0))
    calls: Counter[str] = Counter()
    call_us: dict[str, float] = defaultdict(float)
    for e in runtime:
        for name in WATCHED_CALLS:
            if e["name"].startswith(name):
                calls[name] += 1
                call_us[name] += float(e.get("dur", 0))
    ops = Counter(
        e["name"] for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")
    )
    per = 1.0 / steps
    return {
        "steps": steps,
        "gpu_busy_ms": busy * per / 1e3,
        "gpu_idle_ms": idle * per / 1e3,
        "idle_ms_by_neighbours": {k: v * per / 1e3 for k, v in gaps.items()},
        "idle_gaps_by_neighbours": {k: v * per for k, v in gap_counts.items()},
        "gpu_ops_in_graphs": sum(in_graph) * per,
        "gpu_ops_outside_graphs": {k: v * per for k, v in outside.most_common(12)},
        "gpu_us_outside_graphs": {k: outside_us[k] * per for k, _ in outside.most_common(12)},
        "runtime_calls": {k: v * per for k, v in calls.items()},
        "runtime_call_host_us_each": {k: call_us[k] / calls[k] for k in calls},
        "aten_ops": {k: v * per for k, v in ops.most_common(15)},
    }


def gap_part(rounds: int, steps: int) -> dict[str, Any]:
    methods = (
        ["torch", "leangraph"] + ([FUSED] if fused_unavailable() is None else []) + ["whole-step"]
    )
    out: dict[str, Any] = {}
    for name, config in GAP_WORKLOADS.items():
        work = BenchWorkload(config)
        captured = {m: capture_method(work, m) for m in methods}
        queued = {m: _queue_step(c) for m, c in captured.items()}
        for m in methods:
            for _ in range(2):  # untimed: first replays
                captured[m].step()
        walls: dict[str, list[float]] = {m: [] for m in methods}
        hosts: dict[str, list[float]] = {m: [] for m in methods}
        for index in range(rounds):
            for m in methods[index % len(methods) :] + methods[: index % len(methods)]:
                wall, host = _time_steps(queued[m], steps)
                walls[m].append(statistics.median(wall))
                hosts[m].append(statistics.median(host))
        entry: dict[str, Any] = {}
        for m in methods:
            trace = analyse_trace(_trace_events(queued[m], 3), 3)
            launches = trace["runtime_calls"].get("cudaGraphLaunch", 0.0)
            entry[m] = {
                "wall_ms_rounds": [w * 1e3 for w in walls[m]],
                "host_ms_rounds": [h * 1e3 for h in hosts[m]],
                "wall_ms": statistics.median(walls[m]) * 1e3,
                "host_ms": statistics.median(hosts[m]) * 1e3,
                "host_us_per_graph_launch": (
                    statistics.median(hosts[m]) * 1e6 / launches if launches else None
                ),
                "profile": trace,
            }
        for c in captured.values():
            c.release()
        out[name] = entry
        del captured, queued, work
        gc.collect()
        torch.cuda.empty_cache()
    return out


def gap_summary(data: dict[str, Any]) -> list[str]:
    lines = [
        "== Part 2: the step gap (per step; wall and host: median of rounds; the rest from "
        "3 profiled steps)"
    ]
    header = (
        f"{'method':<16} {'wall ms':>8} {'host ms':>8} {'GPU busy':>9} {'GPU idle':>9} "
        f"{'launches':>8} {'us/launch':>9} {'outside ops':>11} {'waits':>6} {'records':>7} "
        f"{'syncs':>6}"
    )
    for workload, entry in data.items():
        lines += ["", f"-- {workload}", header, "-" * len(header)]
        for m, row in entry.items():
            p = row["profile"]
            calls = p["runtime_calls"]
            syncs = sum(calls.get(k, 0) for k in WATCHED_CALLS if "Synchronize" in k)
            per_launch = row["host_us_per_graph_launch"]
            lines.append(
                f"{m:<16} {row['wall_ms']:>8.2f} {row['host_ms']:>8.2f} {p['gpu_busy_ms']:>9.2f} "
                f"{p['gpu_idle_ms']:>9.2f} {calls.get('cudaGraphLaunch', 0):>8.0f} "
                f"{'-' if per_launch is None else f'{per_launch:.1f}':>9} "
                f"{sum(p['gpu_ops_outside_graphs'].values()):>11.0f} "
                f"{calls.get('cudaStreamWaitEvent', 0):>6.0f} "
                f"{calls.get('cudaEventRecord', 0):>7.0f} "
                f"{syncs:>6.0f}"
            )
        lines += _gap_reading(entry)
    return lines


def _diff(a: dict[str, float], b: dict[str, float]) -> str:
    keys = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, 0) - b.get(k, 0)))
    parts = [
        f"{k} {a.get(k, 0) - b.get(k, 0):+.3g}"
        for k in keys
        if abs(a.get(k, 0) - b.get(k, 0)) > 1e-9
    ]
    return "; ".join(parts[:8]) or "none"


def _gap_reading(entry: dict[str, Any]) -> list[str]:
    if "torch" not in entry or "leangraph" not in entry:
        return []
    t, l = entry["torch"], entry["leangraph"]
    tp, lp = t["profile"], l["profile"]
    busy = lp["gpu_busy_ms"] - tp["gpu_busy_ms"]
    idle = lp["gpu_idle_ms"] - tp["gpu_idle_ms"]
    lines = [
        f"reading: leangraph - torch: wall {l['wall_ms'] - t['wall_ms']:+.2f} ms, host "
        f"{l['host_ms'] - t['host_ms']:+.2f} ms, GPU busy {busy:+.3f} ms, GPU idle "
        f"{idle:+.3f} ms per step"
    ]
    for title, key in (
        ("idle ms by neighbours", "idle_ms_by_neighbours"),
        ("idle gaps by neighbours", "idle_gaps_by_neighbours"),
        ("GPU ops outside graphs", "gpu_ops_outside_graphs"),
        ("their GPU us", "gpu_us_outside_graphs"),
        ("runtime calls", "runtime_calls"),
        ("ATen ops", "aten_ops"),
    ):
        lines.append(f"  {title}: {_diff(lp[key], tp[key])}")
    return [
        *lines,
        "  (host < wall for both: the GPU is the bound, so a wall difference is GPU work or GPU "
        "idle, as split above; host >= wall: the host is the bound)",
    ]


# ---------------------------------------------------------------------------------- main


def _meta() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "total_memory_gib": props.total_memory / 1024**3,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "leangraph": leangraph.__version__,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "fused_method": fused_unavailable() or "available",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="segments,gap", help="comma-separated: segments, gap")
    parser.add_argument("--out", default=os.environ.get("OUT", "explain-out"), help="output folder")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per part (default: 3)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round in gap")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not torch.cuda.is_available() or any(p not in ("segments", "gap") for p in parts):
        why = (
            "needs a CUDA GPU" if not torch.cuda.is_available() else f"unknown part in {args.parts}"
        )
        print(f"explain_segments.py: error: {why} (parts: segments, gap)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"meta": _meta()}
    lines = [
        f"explain_segments.py on {data['meta']['device']}, torch {torch.__version__}, "
        f"allocator conf {data['meta']['PYTORCH_CUDA_ALLOC_CONF'] or '(default)'}",
        "",
    ]
    if "segments" in parts:
        data["segments"] = segments_part(args.rounds)
        lines += [*segments_summary(data["segments"]), ""]
    if "gap" in parts:
        data["gap"] = gap_part(args.rounds, args.steps)
        lines += gap_summary(data["gap"])
    (out / "explain.json").write_text(json.dumps(data, indent=2))
    text = "\n".join(lines) + "\n"
    (out / "summary.txt").write_text(text)
    print(text)
    print(f"wrote {out / 'explain.json'} and {out / 'summary.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
