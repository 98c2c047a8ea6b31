#!/usr/bin/env bash
# Wave 23, call 3 (2026-12-06): the GPU tests on this session's final tree (the log-probability
# kernels in every engine built with max_logprobs, stop strings by bytes): kernels, log-
# probabilities, stop strings, and the general GPU file. Log under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
    tests/test_logprobs.py tests/test_stop_strings.py tests/test_gpu.py 2>&1 | tail -8 \
    | tee "$OUT/wave23c_pytest_gpu.log"
exit 0
