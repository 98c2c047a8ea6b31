#!/usr/bin/env bash
# One nvidia-h200 call: host time per decode step of the bundled model (benchmarks/host_overhead.py:
# packed inputs/outputs vs one copy per field, alternated). Log and JSON in $OUT. (The first run of
# this script also ran bundled.py: bundled_2026-11-30_session4.{json,log}.)
set -u
source "$(dirname "$0")/gpu_env.sh"
cd benchmarks
timeout 150 python3 host_overhead.py --json "$OUT/host_overhead.json" 2>&1 | grep -v "it/s\]" \
    | tee "$OUT/host_overhead.log" | tail -9
