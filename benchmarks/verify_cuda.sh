#!/usr/bin/env bash
# Everything that needs a GPU, in one call (device time is scarce): the CUDA and two-GPU test
# suites, then `make demo` and the overlap race probe.
# Usage on a GPU machine: benchmarks/verify_cuda.sh [OUTDIR]
set -uo pipefail
out=${1:-${OUT:-verify-out}}
mkdir -p "$out"
export PYTHONPATH=src:tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
python3 -m pytest -q -m "cuda or multigpu" -rs tests 2>&1 | tee "$out/cuda.log" | tail -25
status=${PIPESTATUS[0]}
make demo 2>&1 | tee "$out/demo.log" | tail -15
demo=${PIPESTATUS[0]}
# The overlap race probe: every line must say 0 (a slow side-stream addition, made certain by
# the hook sleep, must still read its own gradient).
python3 benchmarks/overlap_race.py --width 4096 --rows 64 --layers 6 --steps 4 \
    --hook-sleep 2000000 2>&1 | tee "$out/overlap_race.log"
race=${PIPESTATUS[0]}
lines=$(grep -c "max |graphed" "$out/overlap_race.log")
raced=$(grep "max |graphed" "$out/overlap_race.log" | grep -vc "steps: 0$")
[ "$lines" -eq 2 ] && [ "$raced" -eq 0 ] || race=1
exit $(( status || demo || race ))
