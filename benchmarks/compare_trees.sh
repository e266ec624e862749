#!/usr/bin/env bash
# The launch-bound bench for several source trees on one machine, in turn, so that the host's
# spread from machine to machine does not pass for a change between commits.
# Usage: benchmarks/compare_trees.sh OUTDIR PASSES TREE...
# Each TREE is a directory holding a leangraph `src/` (make one for a commit with
# `mkdir -p old/C && git archive C src | tar -x -C old/C`; `.` is this checkout). Each pass runs
# `leangraph bench` once per tree (the trees' order rotating from pass to pass) on the
# launch-bound workload of docs/benchmarks.md with --rounds 3, and writes
# OUTDIR/launch_<tree>_<pass>.json; a summary of the rounds' medians per tree closes it.
set -euo pipefail
out=$1; passes=$2; shift 2
trees=("$@")
mkdir -p "$out"
export PYTHONUNBUFFERED=1
methods=${METHODS:-torch,leangraph-fused-nohooks,whole-step}  # in every tree since 9b397a1
for ((p = 0; p < passes; p++)); do
  n=${#trees[@]}
  for ((i = 0; i < n; i++)); do
    tree=${trees[$(((i + p) % n))]}
    name=$(basename "$(cd "$tree" && pwd)")
    echo "== pass $p, tree $tree"
    PYTHONPATH="$tree/src" python3 -m leangraph bench --no-progress --pp 4 --vp 2 --rank 0 \
      --microbatches 8 --layers 4 --hidden 256 --heads 4 --sequence 128 --dtype bf16 \
      --steps 50 --rounds 3 --methods "$methods" --json "$out/launch_${name}_$p.json" | tail -6
  done
done
python3 - "$out" <<'PY'
import json, pathlib, statistics, sys
from collections import defaultdict
rows = defaultdict(lambda: defaultdict(list))
for path in sorted(pathlib.Path(sys.argv[1]).glob("launch_*.json")):
    tree = path.stem[len("launch_"):].rsplit("_", 1)[0]
    data = json.loads(path.read_text())
    for method, times in data.get("rounds", {}).items():
        rows[tree][method] += [t * 1e3 for t in times["step_seconds"]]
print("tree, method: median of every round's step ms [min-max] (rounds)")
for tree, methods in rows.items():
    for method, times in methods.items():
        if times:
            print(f"{tree:>12} {method:<26} {statistics.median(times):6.2f} "
                  f"[{min(times):.2f}-{max(times):.2f}] ({len(times)})")
PY
