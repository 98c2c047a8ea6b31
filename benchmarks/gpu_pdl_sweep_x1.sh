#!/usr/bin/env bash
# One nvidia-h200 call: the PDL / L2-prefetch sweep of the 8B bs=1 graph step, each variant twice
# in alternation (benchmarks/levers.py, one process), then benchmarks/decode.py (issue 10's table,
# with the transformers peers) on the defaults. Logs and JSON in $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
cd benchmarks
ONE=no_pdl,pdl1_prefetch_8k,pdl1_prefetch_16k,pdl1_prefetch_32k,pdl2_prefetch_8k,pdl2_no_prefetch
timeout 200 python3 levers.py --skip-gemv --variants "$ONE,$ONE" --json "$OUT/levers.json" 2>&1 \
    | grep -v "it/s\]" > "$OUT/levers.log"; grep -E " ms$|error" "$OUT/levers.log" | head -14
timeout 330 python3 decode.py --budget-s 260 --json "$OUT/decode.json" 2>&1 | grep -v "it/s\]" \
    > "$OUT/decode.log"; tail -30 "$OUT/decode.log"
