#!/usr/bin/env bash
# Everything that needs a GPU, in one call (device time is scarce): the CUDA and two-GPU test
# suites, then `make demo`. Usage on a GPU machine: benchmarks/verify_cuda.sh [OUTDIR]
set -uo pipefail
out=${1:-${OUT:-verify-out}}
mkdir -p "$out"
export PYTHONPATH=src:tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
python3 -m pytest -q -m "cuda or multigpu" -rs tests 2>&1 | tee "$out/cuda.log" | tail -25
status=${PIPESTATUS[0]}
make demo 2>&1 | tee "$out/demo.log" | tail -15
exit $(( status || PIPESTATUS[0] ))
