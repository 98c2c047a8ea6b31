#!/usr/bin/env bash
# Wave 34 (2026-12-07 fifteenth session): on an H200 (the #24 bars' GPU, not given in ten
# sessions) the bar's figures first (gpu_wave25d.sh, ~3 min: the 8B FP8 bs-1 / bs-64 graph
# steps with the FP8 target's launch modes against none, bf16, the bs-1 timeline); then, on any
# GPU, every GPU-marked test of this tree (CI has no GPU): the last whole run was wave 16's.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
case "$(cat "$OUT/gpu.txt")" in *H200*) bash benchmarks/gpu_wave25d.sh ;; esac
timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=12 tests 2>&1 \
    | tail -30 | tee "$OUT/wave34_pytest_gpu.log"
exit 0
