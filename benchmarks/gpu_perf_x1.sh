#!/usr/bin/env bash
# One nvidia-h200 call for issue 10's table and the bundled models' tokens/s: benchmarks/decode.py
# (ours, triton and torch backends, plain and EAGLE-3 k=3, and the transformers peers, one
# process) then benchmarks/bundled.py (bundled target + drafters vs transformers). Logs and JSON
# under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
cd benchmarks
timeout 400 python3 decode.py --budget-s 320 --json "$OUT/decode.json" 2>&1 | grep -v "it/s\]" \
    | tee "$OUT/decode.log" | tail -40
echo "decode exit ${PIPESTATUS[0]}"
timeout 140 python3 bundled.py --json "$OUT/bundled.json" 2>&1 | grep -v "it/s\]" \
    | tee "$OUT/bundled.log" | tail -16
echo "bundled exit ${PIPESTATUS[0]}"
