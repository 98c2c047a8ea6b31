#!/usr/bin/env bash
# A record: it ran at 5f049ed (results/wave21.md); its --bf16-preload and --fuse-norm options
# went with the code they measured. One GPU call (2026-12-06, wave 21, issue 24): the one-row FP8 streaming GEMV (kernels/fp8.py
# `stream`: each program's whole rows, the first PRE_K columns loaded before the PDL wait, no
# split-K reduction tail), the norm computed inside one-row projections (kernels/norm.py's
# prologue: the bf16 GEMV, the FP8 stream GEMV) and the bf16 GEMV's register preload
# (kernels/gemv.py PRELOAD_K).
# 1. The M = 1 sweep (split-K, stream and the rest) of the four 8B projections, isolated,
#    merged into the shipped table at M = 1 only.
# 2. The 8B graph decode step (benchmarks/decode_ab.py, one engine per dtype, graphs recaptured
#    per variant, three rounds with the order rotated): FP8 bs 1 / 64 with the shipped table vs
#    the swept one; FP8 bs 1 with every M = 1 projection on one stream config, norms fused and
#    not; bf16 bs 1 per PRELOAD_K, norms fused and not; both without the SiLU-and-mul kernel
#    (timing only: what fusing it could give at most).
# 3. The GPU-marked tests of the kernels changed.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 130 python3 benchmarks/fp8_sweep.py --ms 1 --merge --skip-decode --budget-s 100 \
    --json "$OUT/wave21_fp8_sweep_m1.json" --table "$OUT/wave21_fp8_tuned_m1.json" 2>&1 \
    | grep -v "it/s\]" | tee "$OUT/wave21_fp8_sweep_m1.log" | tail -8
timeout 360 python3 benchmarks/decode_ab.py --label w21 --kinds fp8,bf16 --rounds 3 \
    --fp8-tables "shipped;$OUT/wave21_fp8_tuned_m1.json" \
    --fp8-m1 "table;stream:8,4096,512,8;stream:8,4096,512,8 unfused" \
    --bf16-preload "0,2048,4096" --fuse-norm "on;off" --free-ops "none;silu" \
    --json "$OUT/wave21_decode_ab.json" 2>&1 \
    | grep -v "Warning\|it/s\]\|warn" | tee "$OUT/wave21_decode_ab.log" | tail -20
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_kernels.py \
    tests/test_kernels.py -k "stream or capture or gemv or norm" 2>&1 | tail -4 \
    | tee "$OUT/wave21_pytest.log"
exit 0
