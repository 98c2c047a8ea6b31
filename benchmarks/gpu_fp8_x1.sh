#!/usr/bin/env bash
# One nvidia-h200 call (issue 24): benchmarks/fp8_gpu.py (FP8 kernels vs the torch reference and
# their times per M, tile sweep, graph decode step FP8 vs bf16 at bs 1 and 64, EAGLE-3 k=3 on the
# FP8 target, 2048-token prefill FP8 vs bf16, on a Llama-3.1-8B-shape dummy target), then the
# GPU-marked FP8 tests. Logs and JSON in $OUT; each step has its own timeout (about 4 minutes in
# all).
set -u
source "$(dirname "$0")/gpu_env.sh"
(cd benchmarks && timeout 200 python3 fp8_gpu.py --budget-s 165 --json "$OUT/fp8_gpu.json" 2>&1 \
    | grep -v "it/s\]" | tee "$OUT/fp8_gpu.log" | tail -30)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_kernels.py \
    tests/test_fp8.py 2>&1 | tail -15 | tee "$OUT/pytest_fp8_gpu.log"
