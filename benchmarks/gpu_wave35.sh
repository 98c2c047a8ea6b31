#!/usr/bin/env bash
# Wave 35 (2026-12-07 sixteenth session): on an H200 (the #24 bars' GPU) the bar's figures
# first (gpu_wave25d.sh, ~3-5 min); then, on any GPU, the GPU-marked tests of the files wave 34's
# calls did not reach (tests/test_[p-z]*.py: parallel, piecewise, prefix cache, rank filter,
# sampler variants, stop strings), in what is left of the call's 600 s.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
case "$(cat "$OUT/gpu.txt")" in *H200*) bash benchmarks/gpu_wave25d.sh ;; esac
left=$((560 - SECONDS))
echo "pytest budget ${left}s" | tee -a "$OUT/gpu.txt"
timeout "$left" python3 -m pytest -q -p no:cacheprovider -m gpu --durations=12 -rf \
    ${FILES:-tests/test_[p-z]*.py} 2>&1 | tail -40 | tee "$OUT/wave35_pytest_gpu.log"
exit 0
