#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-03, wave 13, issue 24): the FP8 projections at M = 64 (the bs-64
# decode step; with MS="64,1,4" also bs 1 and the EAGLE-3 bs-1 verify) swept over every stage
# count, tile and split count (`fp8_sweep.py --wide`; at f73e52e also W tiles by TMA; the
# shipped table kept at the other M), then the 8B FP8 graph decode step at bs 1 / 64 with the
# shipped table vs the swept one, graphs recaptured per table in one engine, three rounds with
# the order rotated. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
timeout 370 python3 benchmarks/fp8_sweep.py --ms "${MS:-64}" --wide --merge --skip-decode \
    --budget-s "${SWEEP_S:-300}" --json "$OUT/fp8_sweep_w13.json" --table "$OUT/fp8_tuned_w13.json" \
    2>&1 | grep -v "it/s\]" | tee "$OUT/fp8_sweep_w13.log" | tail -12
timeout 190 python3 benchmarks/decode_ab.py --label w13 --kinds fp8 --rounds 3 \
    --fp8-tables "shipped;$OUT/fp8_tuned_w13.json" --json "$OUT/ab_w13.json" 2>&1 \
    | grep -v "Warning\|it/s\]\|warn" | tee "$OUT/ab_w13.log" | tail -6
[ -n "${TESTS:-}" ] && timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_fp8_kernels.py -k "$TESTS" 2>&1 | tail -6 | tee "$OUT/pytest_w13.log"
exit 0
