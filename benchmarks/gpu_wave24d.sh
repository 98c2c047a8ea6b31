#!/usr/bin/env bash
# Wave 24, call 4 (2026-12-06): the shipped tree (an FP8 target's own PDL modes, models/fp8.py
# FP8_LAUNCH_MODES) against no modes of its own ("base"), in one process per engine: the 8B
# graph decode step (FP8 and bf16, bs 1 / 64) and the EAGLE-3 k=3 step on the FP8 target; the
# timeline of the shipped FP8 bs-1 step; the GPU tests of the change. Results under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
cd benchmarks
timeout 420 python3 decode_ab.py --label final --json "$OUT/wave24d_ab.json" --kinds fp8,bf16 \
    --levers "base;shipped" --spec-levers "base;shipped" 2>&1 | grep -v capturing \
    | tee "$OUT/wave24d_ab.log"
timeout 120 python3 step_timeline.py --json "$OUT/wave24d_timeline.json" --kinds fp8 --sizes 1 \
    2>&1 | grep -v capturing | tee "$OUT/wave24d_timeline.log"
cd ..
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_kernels.py \
    tests/test_kernels.py -k "launch_modes or capture or routes or pdl" 2>&1 | tail -3 \
    | tee "$OUT/wave24d_pytest.log"
exit 0
