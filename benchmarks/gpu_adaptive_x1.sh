#!/usr/bin/env bash
# One nvidia-h200 call for [adaptive]: the GPU tests of tests/test_adaptive.py, then
# benchmarks/adaptive_gpu.py (8B shape with an EAGLE-3 head that accepts nothing, bs 1 and 64:
# plain vs fixed vs auto; the bundled models at bs 1/8/32/64: plain, fixed and auto for EAGLE-3,
# DFLASH and the draft LM). PARTS=8b,bundled (default both). Logs and JSON under $OUT.
# The realistic job with the dummy head is benchmarks/workload.py --configs default,eagle3,eagle3_auto.
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/adaptive.log"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_adaptive.py -x 2>&1 \
    | tail -8 | tee -a "$OUT/adaptive.log"
(cd benchmarks && timeout 330 python3 adaptive_gpu.py --json "$OUT/adaptive.json" \
    --parts "${PARTS:-8b,bundled}") 2>&1 | grep -v Warning | tail -60 | tee -a "$OUT/adaptive.log"
