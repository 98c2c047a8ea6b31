#!/usr/bin/env bash
# The second GPU call of wave 21 (2026-12-06, issue 24): the one-row FP8 `stream` GEMV against
# split-K in the 8B graph decode step. Two M = 1 sweeps on this GPU, merged into the shipped
# table at M = 1 only: split-K alone, and split-K or stream per shape; then the FP8 bs-1 / 64
# step with each table (graphs recaptured per table, three rounds with the order rotated). Last,
# benchmarks/logprobs_cost.py (pending since wave 20; SKIP_LOGPROBS=1: not). Logs and JSON under
# $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
for paths in splitk splitk,stream; do
    name=${paths//,/_}
    timeout 70 python3 benchmarks/fp8_sweep.py --ms 1 --merge --skip-decode --budget-s 55 \
        --paths "$paths" --json "$OUT/wave21b_sweep_$name.json" \
        --table "$OUT/wave21b_table_$name.json" 2>&1 | grep -v "it/s\]" \
        | tee "$OUT/wave21b_sweep_$name.log" | tail -6
done
timeout 220 python3 benchmarks/decode_ab.py --label w21b --kinds fp8 --rounds 3 \
    --fp8-tables "$OUT/wave21b_table_splitk.json;$OUT/wave21b_table_splitk_stream.json" \
    --json "$OUT/wave21b_decode_ab.json" 2>&1 | grep -v "Warning\|it/s\]\|warn" \
    | tee "$OUT/wave21b_decode_ab.log" | tail -8
[ -n "${SKIP_LOGPROBS:-}" ] && exit 0  # (gpu_wave23.sh: the FP8 part alone)
timeout 170 python3 benchmarks/logprobs_cost.py --json "$OUT/wave21b_logprobs_cost.json" \
    --rows 192 --prompt 512 --new 128 --logprobs 5 --rounds 2 2>&1 \
    | grep -v "Warning\|warn\|it/s\]" | tail -45 > "$OUT/wave21b_logprobs_cost.log"
tail -14 "$OUT/wave21b_logprobs_cost.log"
exit 0
