#!/usr/bin/env bash
# One nvidia-h200 call (issue 24): benchmarks/fp8_sweep.py (every FP8 path and config per 8B
# projection shape and M, timed as CUDA-graph replays with the weights out of L2; the fastest
# written as $OUT/fp8_tuned.json; then the graph decode step at bs 1 and 64 with that table vs
# bf16), then the GPU-marked FP8 tests. Logs and JSON in $OUT; about 7 minutes at most.
set -u
source "$(dirname "$0")/gpu_env.sh"
timeout 290 python3 benchmarks/fp8_sweep.py --budget-s 240 --json "$OUT/fp8_sweep.json" \
    --table "$OUT/fp8_tuned.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/fp8_sweep.log" | tail -60
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_kernels.py \
    tests/test_fp8.py 2>&1 | tail -15 | tee "$OUT/pytest_fp8_gpu.log"
