#!/usr/bin/env bash
# One nvidia-h200 call (issue 24): benchmarks/fp8_sweep.py (every FP8 path and config per 8B
# projection shape and M, timed as CUDA-graph replays with the weights out of L2; the fastest
# written as $OUT/fp8_tuned.json; then the graph decode step at bs 1 and 64 with that table vs
# bf16), then the GPU-marked FP8 tests. Logs and JSON in $OUT; under 10 minutes.
# The split-K tensor-core paths (wave 4) made the sweep about 1,200 candidates: SWEEP_S (default
# 300) bounds it (what it does not reach takes the next measured M's row), and the tests run
# after it so they find Triton's cache warm.
set -u
source "$(dirname "$0")/gpu_env.sh"
sweep_s=${SWEEP_S:-300}
timeout $((sweep_s + 50)) python3 benchmarks/fp8_sweep.py --budget-s "$sweep_s" \
    --json "$OUT/fp8_sweep.json" --table "$OUT/fp8_tuned.json" 2>&1 | grep -v "it/s\]" \
    | tee "$OUT/fp8_sweep.log" | tail -60
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_kernels.py \
    tests/test_fp8.py 2>&1 | tail -15 | tee "$OUT/pytest_fp8_gpu.log"
