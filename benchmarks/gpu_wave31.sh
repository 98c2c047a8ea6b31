#!/usr/bin/env bash
# Wave 31 (2026-12-07 twelfth session), call 1: the FP8 kernel GPU tests with the engine-logits
# test pinned to the per-M paths (fixed on the CPU after wave 30's call 5), then, on an H200
# only, the #24 bar (gpu_wave25d.sh: the 8B FP8 bs-1 / bs-64 graph steps, launch modes, bf16,
# the bs-1 timeline).
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_kernels.py 2>&1 \
    | tail -6 | tee "$OUT/wave31_fp8_tests.log"
bash benchmarks/gpu_h200_only.sh gpu_wave25d.sh
exit 0
