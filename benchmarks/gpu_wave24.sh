#!/usr/bin/env bash
# Wave 24, call 1 (2026-12-06): where the 8B graph decode step's wall time goes, kernel by
# kernel (benchmarks/step_timeline.py: the critical path of a replay), FP8 and bf16, PDL as
# shipped (1), off (0: each kernel's own time) and chained (2). Results under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
cd benchmarks
timeout 240 python3 step_timeline.py --json "$OUT/wave24_timeline_pdl1.json" --kinds fp8,bf16 \
    --sizes 1,64 2>&1 | tee "$OUT/wave24_timeline_pdl1.log"
SPECULANT_PDL=0 timeout 150 python3 step_timeline.py --json "$OUT/wave24_timeline_pdl0.json" \
    --kinds fp8 --sizes 1,64 2>&1 | tee "$OUT/wave24_timeline_pdl0.log"
SPECULANT_PDL=2 timeout 150 python3 step_timeline.py --json "$OUT/wave24_timeline_pdl2.json" \
    --kinds fp8 --sizes 1 2>&1 | tee "$OUT/wave24_timeline_pdl2.log"
exit 0
