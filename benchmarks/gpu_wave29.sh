#!/usr/bin/env bash
# Wave 29 (2026-12-07): the exponential-race sampler. Its cost per step against the inverse-CDF
# draw it replaced (benchmarks/sampler_race.py, same call), the kernel vs the torch reference
# (tests/test_race.py's cuda variants), and the GPU tests that run seeded sampled steps through
# graphs and eager (graph == eager, speculative graph == eager, match verify in graphs == plain).
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 120 python3 benchmarks/sampler_race.py --out "$OUT" 2>&1 | tail -8 \
    | tee "$OUT/sampler_race.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_race.py \
    tests/test_gpu.py -k "race or graph_replay" 2>&1 | tail -6 | tee "$OUT/wave29_pytest_gpu.log"
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_adaptive.py \
    -k "gpu_match_verify" 2>&1 | tail -4 | tee -a "$OUT/wave29_pytest_gpu.log"
exit 0
