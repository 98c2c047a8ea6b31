#!/usr/bin/env bash
# Wave 26 (2026-12-06): the GPU tests on this session's final tree: the general GPU file
# (CUDA parity with transformers for the published target configs, graphs == eager; not re-run
# since the config readings of 2026-12-06: dtype over torch_dtype, rope_theta in
# rope_parameters), n completions, prefix caching, batch jobs. Log under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_n.py \
    tests/test_prefix_cache.py tests/test_batch_jobs.py 2>&1 | tail -8 \
    | tee "$OUT/wave26_pytest_gpu.log"
exit 0
