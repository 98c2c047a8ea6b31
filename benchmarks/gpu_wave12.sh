#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-03, wave 12): weight prefetch into L2 during a layer's small
# kernels (kernels/prefetch.py) on the 8B-shape graph decode step, bf16 and block-wise FP8, bs 1
# and 64, per plan (benchmarks/prefetch_ab.py); then the GPU-marked tests of tests/test_gpu.py
# (CUDA parity with transformers, graph == eager) on this tree. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
LOG="$OUT/wave12.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG"
timeout 330 python3 benchmarks/prefetch_ab.py --json "$OUT/prefetch_ab.json" --rounds 3 --profile 2>&1 \
    | grep -v "Warning\|it/s\]\|warn" | tail -40 | tee -a "$LOG"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tail -8 \
    | tee "$OUT/pytest_test_gpu.log" | tee -a "$LOG"
