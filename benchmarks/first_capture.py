"""A process's first capture against its second, torch's and leangraph's (GPU only).

A first capture pays for imports that later ones do not: torch's own (the first
``torch.autograd.grad`` imports sympy through ``torch.fx``), and whatever the capturing tool
imports. So every measurement runs in a fresh process: a two-layer MLP (256 wide, batch 8) is
run eagerly once, then graphed twice; the first and second capture's wall times are printed
with whether ``torch._dynamo`` was imported by the end. Rounds alternate the methods so a
host's drift falls on all of them.

Usage: python3 benchmarks/first_capture.py [--rounds N] [TREE ...]
Each TREE is a directory holding the ``leangraph`` package (default ``src``); leangraph is
measured from each tree in turn, so an older tree (``git archive REV src | tar -x -C DIR``)
can be set beside the current one.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

_ONE_PROCESS = r"""
import sys, time
import torch
method, tree = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
import leangraph

def mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)
    ).cuda()

make = torch.cuda.make_graphed_callables if method == "torch" else leangraph.make_graphed_callables
x = torch.randn(8, 256, device="cuda", requires_grad=True)
first_module = mlp()
first_module(x).sum().backward()
torch.cuda.synchronize()
times = []
for module in (first_module, mlp()):
    start = time.perf_counter()
    make(module, (x,))
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
print(f"first capture {times[0]:.3f} s, second {times[1]:.3f} s, "
      f"dynamo imported {'torch._dynamo' in sys.modules}")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("trees", nargs="*", default=["src"])
    args = parser.parse_args()
    methods = [("torch", args.trees[0])] + [("leangraph", tree) for tree in args.trees]
    for _ in range(args.rounds):
        for method, tree in methods:
            done = subprocess.run(
                [sys.executable, "-c", _ONE_PROCESS, method, tree],
                capture_output=True,
                text=True,
                check=False,
            )
            line = done.stdout.strip() or f"failed: {done.stderr.strip()[-600:]}"
            label = "torch" if method == "torch" else f"leangraph from {tree}"
            print(f"{label:28s} {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
