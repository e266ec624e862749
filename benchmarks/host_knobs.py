"""What the host-bound launch-bound step responds to (GPU only): Python's garbage collector and
autograd's device threads, for torch's and leangraph's graphs and the whole-step graph.

The launch-bound workload (rank 0 of PP4/VP2, 2 chunks x 4 blocks, hidden 256, sequence 128, 8
microbatches) is graphed by each method once; then, in 5 rounds whose knob order rotates, each
method steps under each knob: ``step_anatomy.timed``'s 30 synchronised steps after 3 untimed
ones (median ms) and the median host ms to enqueue one (its losses left unread). Knobs:

- ``default``: as the bench runs;
- ``no-gc``: ``gc.disable()`` around the steps (Megatron-LM's ``--manual-gc`` does the like);
- ``one-thread``: ``torch.autograd.set_multithreading_enabled(False)``, so that the backward
  runs on the calling thread instead of autograd's device thread;
- ``both``.

Per method it then prints the garbage collections per step (by generation) under ``default``.
Usage: PYTHONPATH=src python3 benchmarks/host_knobs.py
"""

from __future__ import annotations

import contextlib
import gc
import statistics
from collections.abc import Callable, Iterator

import torch
from step_anatomy import timed, unread

from leangraph.cli.bench import FUSED_NO_HOOKS, LAUNCH_BOUND, BenchWorkload, graph_methods

METHODS = ("torch", "leangraph-fused-python", FUSED_NO_HOOKS, "whole-step")


@contextlib.contextmanager
def knob(name: str) -> Iterator[None]:
    """The knob ``name`` on, for the block."""
    was_enabled = gc.isenabled()
    threads = contextlib.nullcontext()
    if name in ("one-thread", "both"):
        threads = torch.autograd.set_multithreading_enabled(False)
    if name in ("no-gc", "both"):
        gc.disable()
    try:
        with threads:
            yield
    finally:
        if was_enabled:
            gc.enable()


def collections_per_step(step: Callable[[], object], steps: int = 30) -> list[float]:
    """Garbage collections per step of generations 0, 1 and 2."""
    counts = [0, 0, 0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            counts[info["generation"]] += 1

    gc.callbacks.append(count)
    try:
        for _ in range(steps):
            step()
    finally:
        gc.callbacks.remove(count)
    return [c / steps for c in counts]


def main() -> None:
    work = BenchWorkload(LAUNCH_BOUND)
    graphed = graph_methods(work, METHODS, untimed_steps=1)

    def unread_of(name: str) -> Callable[[], object]:
        captured = graphed[name]
        return captured.step if captured.lookup is None else unread(work, captured)

    knobs = ("default", "no-gc", "one-thread", "both")
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for round_index in range(5):
        order = knobs[round_index % len(knobs) :] + knobs[: round_index % len(knobs)]
        for knob_name in order:
            for name in METHODS:
                with knob(knob_name):
                    median, enqueue, _ = timed(unread_of(name))
                results.setdefault((name, knob_name), []).append((median, enqueue))
    print(f"{'method':<24} {'knob':<11} step ms median [min-max] of 5 rounds   enqueue ms")
    for (name, knob_name), rows in results.items():
        steps = [r[0] for r in rows]
        enq = [r[1] for r in rows]
        print(
            f"{name:<24} {knob_name:<11} {statistics.median(steps):7.2f} "
            f"[{min(steps):6.2f}-{max(steps):6.2f}]   {statistics.median(enq):7.2f}"
        )
    for name in METHODS:
        per_step = collections_per_step(graphed[name].step)
        print(
            f"{name:<24} gc collections per step (gen 0/1/2): "
            + " ".join(f"{c:.2f}" for c in per_step)
        )
    print(f"gc thresholds {gc.get_threshold()}, tracked objects {len(gc.get_objects())}")


if __name__ == "__main__":
    main()
