#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-04, wave 15b): the packed-prefill attention launch swept in the
# job's extend step (benchmarks/extend_step.py --varlen: wave 15a found the step's attention at
# 17.8 of 191 ms, ~110 TFLOP/s on the prompts), then the GPU tests of adaptive speculation
# (gpu_pending item 0: never completed on the RowPlan tree). Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
(cd benchmarks && timeout 260 python3 extend_step.py --json "$OUT/extend_varlen.json" --iters 5 \
    --varlen 64:64:4:0,64:64:4:2,64:64:4:3,64:64:8:3,128:64:8:2,128:64:8:3,128:64:4:2,128:128:8:2,64:128:8:2,128:32:4:3 \
    2>&1 | grep -v capturing | tee "$OUT/extend_varlen.log" | tail -40)
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_adaptive.py -x 2>&1 \
    | tail -8 | tee "$OUT/pytest_adaptive_gpu.log"
exit 0
