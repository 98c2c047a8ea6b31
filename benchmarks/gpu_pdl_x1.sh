#!/usr/bin/env bash
# One nvidia-h200 call: programmatic dependent launch (kernels/runtime.py PDL_MODE) and the GEMV's
# L2 prefetch. First the PDL kernel tests (bit-exact against plain launches in a CUDA graph), then
# benchmarks/levers.py over the PDL variants of the 8B bs=1 graph step (one process; no_pdl first
# and last to see drift), then graphs.py (issue 3's table) on the defaults. Logs and JSON in $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py 2>&1 | tail -4 \
    | tee "$OUT/pytest_kernels.log"
cd benchmarks
VARIANTS=${VARIANTS:-no_pdl,pdl1_no_prefetch,pdl1_prefetch_16k,pdl1_prefetch_64k,pdl2_no_prefetch,pdl2_prefetch_16k,pdl2_prefetch_64k,no_pdl}
timeout 300 python3 levers.py --skip-gemv --variants "$VARIANTS" --json "$OUT/levers.json" 2>&1 \
    | grep -v "it/s\]" > "$OUT/levers.log"; grep -E "ms|error|Error" "$OUT/levers.log" | head -40
timeout 150 python3 graphs.py --json "$OUT/graphs.json" 2>&1 | grep -v "it/s\]" | tail -9
