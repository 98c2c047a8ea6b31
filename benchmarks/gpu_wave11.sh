#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-03): [adaptive]'s bundled bar twice on the tree after the wave-10
# review mends and InputBuffers.fill (gpu_pending.md item 1: they landed unmeasured), then the
# GPU-marked FP8 kernel and engine tests after the published-layout loader changes. Logs and JSON
# under $OUT; ~6 min.
set -u
source "$(dirname "$0")/gpu_env.sh"
source "$(dirname "$0")/gpu_bar_lib.sh"
LOG="$OUT/wave11.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG"
(cd benchmarks && BAR_TIMEOUT=110 bar 8 "$LOG" && BAR_TIMEOUT=110 bar 9 "$LOG")
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_kernels.py 2>&1 \
    | tail -6 | tee -a "$LOG"
