#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-03, wave 12, end of session): the GPU-marked tests of
# tests/test_gpu.py and the drafters' GPU tests on the final tree (engine hardening, drafter
# config readings). Logs under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
    tests/test_eagle_layout.py tests/test_dflash.py tests/test_engine.py 2>&1 | tail -6 \
    | tee "$OUT/pytest_gpu_final.log"
