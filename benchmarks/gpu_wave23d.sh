#!/usr/bin/env bash
# Wave 23, call 5 (2026-12-06): the log-probability kernels' GPU tests after the review fix (a
# tie's lower ids kept when a larger value takes a slot), and the engine's log-probability
# tests. Log under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
    -k top_logprobs 2>&1 | tail -2 | tee "$OUT/wave23d_pytest_gpu.log"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_logprobs.py 2>&1 \
    | tail -2 | tee -a "$OUT/wave23d_pytest_gpu.log"
exit 0
