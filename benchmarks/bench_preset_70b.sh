#!/usr/bin/env bash
# The seed's A/B on one GPU: `leangraph bench --preset llama3-70b-pp4vp5` (rank 0 of PP4 x VP5,
# 20 Llama-3-70B decoder layers as one TP2 rank holds them, sequence 4096, 16 microbatches,
# bf16): eager, torch.cuda.make_graphed_callables, leangraph, and leangraph-fused where the
# installed leangraph has fuse_grad_accumulation. A method that runs out of memory is a row of
# the table. Writes OUTDIR/preset_70b[_norope].json and .log.
#
# Usage: benchmarks/bench_preset_70b.sh OUTDIR [rope|norope|both]   (default: rope)
# Each preset run takes about 3-4 minutes on an H200 (about 5 s per training step; eager 5
# steps, each leangraph method 3 warm-up passes and 5 steps, torch its warm-up until it runs
# out of memory in capture); `both` is about 7 minutes, so run rope and norope in separate
# calls where one call is limited to 10 minutes.
set -euo pipefail
out=${1:-bench-out}
which=${2:-rope}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
run() {  # run PRESET NAME
  echo "== preset $1 ($(date -u +%H:%M:%S) UTC)"
  python3 -m leangraph bench --no-progress --preset "$1" --json "$out/$2.json" 2>&1 \
    | tee "$out/$2.log"
}
python3 -c "import torch; p = torch.cuda.get_device_properties(0); \
print(f'{p.name}, {p.total_memory / 2**30:.1f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}')"
case "$which" in
  rope) run llama3-70b-pp4vp5 preset_70b ;;
  norope) run llama3-70b-pp4vp5-norope preset_70b_norope ;;
  both) run llama3-70b-pp4vp5 preset_70b; run llama3-70b-pp4vp5-norope preset_70b_norope ;;
  *) echo "bench_preset_70b.sh: error: second argument must be rope, norope or both, got $which" >&2
     exit 2 ;;
esac
