"""Which method's capture or steps make torch's autograd warn that an accumulator runs on
another stream than the gradient it gets (GPU only; torch >= 2.9 warns).

torch gives each parameter's accumulator node the stream that was current when the node was
made. One made under the capture's side stream and kept alive past capture runs its gradient
additions there, behind a cross-stream wait, at every later backward, and torch says so once
per process (``The AccumulateGrad node's stream does not match ...``). So each method runs in a
fresh process: the launch-bound workload (rank 0 of PP4/VP2, 2 chunks x 4 blocks, hidden 256,
sequence 128, 8 microbatches, bf16) is graphed, then trained for 6 steps, every warning
recorded. Printed per method: how many warnings capture raised and the first step and the
later ones raised, and each distinct warning's start.
Usage: PYTHONPATH=src python3 benchmarks/stream_mismatch.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import torch

from leangraph.cli.bench import GRAPHED_METHODS, BenchConfig, BenchWorkload, capture_method
from leangraph.cli.workloads import BlockShape

METHODS = tuple(m for m in GRAPHED_METHODS if m != "whole-step")
MISMATCH = "The AccumulateGrad node's stream does not match"


def one_method(name: str) -> dict[str, object]:
    """Graph the workload with ``name`` and train it, counting warnings per phase."""
    shape = BlockShape(hidden=256, heads=4, sequence=128, dtype=torch.bfloat16)
    config = BenchConfig(num_microbatches=8, shape=shape, device="cuda", methods=("eager",))
    work = BenchWorkload(config)
    counts: dict[str, object] = {"method": name}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        captured = capture_method(work, name)
        counts["capture"] = len(caught)
        captured.step()
        torch.cuda.synchronize()
        counts["first step"] = len(caught) - counts["capture"]  # type: ignore[operator]
        for _ in range(5):
            captured.step()
        torch.cuda.synchronize()
        counts["later steps"] = len(caught) - counts["capture"] - counts["first step"]  # type: ignore[operator]
        starts = sorted({str(w.message)[:60] for w in caught})
    counts["stream mismatch"] = any(s.startswith(MISMATCH[:60]) for s in starts)
    counts["warnings"] = starts
    captured.release()
    return counts


def main(argv: list[str]) -> None:
    if argv:
        print(json.dumps(one_method(argv[0])))
        return
    print(f"torch {torch.__version__} {torch.cuda.get_device_name()}")
    for name in METHODS:
        run = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True)
        if run.returncode:
            print(f"{name}: failed: {run.stderr.strip().splitlines()[-1:]}")
            continue
        print(run.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main(sys.argv[1:])
