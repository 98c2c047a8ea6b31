#!/usr/bin/env bash
# One nvidia-h200 call: overlap scheduling on one GPU. benchmarks/host_overhead.py (bundled model:
# overlap vs synchronous steps vs the per-field fill, alternated), every GPU-marked test (graph
# replay == eager and speculative equality now run with overlap on), then bundled.py (tokens/s).
# Logs and JSON in $OUT; each step has its own timeout.
set -u
source "$(dirname "$0")/gpu_env.sh"
(cd benchmarks && timeout 90 python3 host_overhead.py --json "$OUT/host_overhead.json" 2>&1 \
    | grep -v "it/s\]" | tee "$OUT/host_overhead.log" | tail -7)
timeout 130 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -4 \
    | tee "$OUT/pytest_gpu.log"
(cd benchmarks && timeout 80 python3 bundled.py --json "$OUT/bundled.json" 2>&1 \
    | grep -v "it/s\]" | tee "$OUT/bundled.log" | tail -10)
