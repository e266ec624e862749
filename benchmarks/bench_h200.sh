#!/usr/bin/env bash
# The benchmark runs quoted in docs/benchmarks.md, on one GPU.
# Usage: benchmarks/bench_h200.sh OUTDIR [all|compute|launch]
# Each run trains eager, torch, leangraph, leangraph-overlap, leangraph-fused,
# leangraph-fused-python, leangraph-fused-nohooks and whole-step (the whole step as one CUDA graph, the limit of the
# "x limit" column), then captures and times the graphed methods again, in turn, 5 times
# (--rounds), and last counts each method's launches per step (--launches: 3 steps under
# torch.profiler once all timing is done). Then the replay microbenchmark (torch's and
# leangraph's replay of one block, host time). "all" took 7.1 minutes on an H200 at e5a9e3e,
# before leangraph-fused-python and the launch-bound run with --grad-hooks; with them expect
# more than a 10-minute device call allows, so run "compute" (the 16- and 32-microbatch
# workloads) and "launch" (the launch-bound ones, without and with a gradient-ready hook on
# every parameter, and the microbenchmark) as two calls.
set -euo pipefail
out=${1:-bench-out}
part=${2:-all}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
run() { python3 -m leangraph bench --no-progress --launches --rounds 5 "$@"; }
[ "$part" = launch ] || for m in 16 32; do
  echo "== workload: rank 0 of PP4/VP2, 2 chunks x 4 blocks, hidden 1024, seq 2048, bf16, $m microbatches"
  run --pp 4 --vp 2 --rank 0 --microbatches "$m" --layers 4 --hidden 1024 --heads 16 \
      --sequence 2048 --dtype bf16 --json "$out/bench_m$m.json" --plot "$out/timeline_m$m.png" \
      --bars "$out/bars_m$m.png"
done
[ "$part" = compute ] && exit 0
echo "== launch-bound: hidden 256, seq 128, 8 microbatches"
# Host-bound steps vary more from capture to capture: more rounds, more steps per round.
run --pp 4 --vp 2 --rank 0 --microbatches 8 --layers 4 --hidden 256 --heads 4 --sequence 128 \
    --dtype bf16 --steps 50 --rounds 9 --json "$out/bench_launch.json"
echo "== launch-bound, a gradient-ready hook on every parameter (as Megatron-core's DDP registers)"
run --pp 4 --vp 2 --rank 0 --microbatches 8 --layers 4 --hidden 256 --heads 4 --sequence 128 \
    --dtype bf16 --steps 50 --rounds 9 --grad-hooks --json "$out/bench_launch_hooks.json"
echo "== replay microbenchmark: one launch-bound block (hidden 256, seq 128), torch vs leangraph"
python3 -m leangraph bench --no-progress --replay-micro --hidden 256 --heads 4 --sequence 128 \
    --dtype bf16 --json "$out/replay_micro.json"
