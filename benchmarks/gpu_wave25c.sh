#!/usr/bin/env bash
# Wave 25, call 3 (2026-12-06): weights asked into L2 during each layer's attention chain on a
# side stream (kernels/prefetch.py; TritonOps.l2_prefetch_bytes, off as shipped): its GPU test
# (tokens with it == without, graphs), then the 8B graph decode step in one process per dtype,
# graphs recaptured per variant, order rotated: shipped vs pf16 / pf32 / pf48 (MB a layer:
# the o projection's weight, then gate_up's first rows), bf16 shipped vs pf32;
# the FP8 bs-1 timeline with pf32. Results under $OUT. Ran on tree fabfe7f: the lever was slower
# at every budget and was removed after (results/wave25.md, call 3); check out fabfe7f to rerun.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_prefetch.py 2>&1 | tail -3 \
    | tee "$OUT/wave25c_pytest.log"
cd benchmarks
timeout 150 python3 decode_ab.py --label pf --json "$OUT/wave25c_fp8.json" --kinds fp8 \
    --rounds 3 --levers "shipped;pf16;pf32;pf48" 2>&1 | grep -v capturing | tee "$OUT/wave25c_fp8.log"
timeout 100 python3 decode_ab.py --label pf --json "$OUT/wave25c_bf16.json" --kinds bf16 \
    --rounds 2 --levers "shipped;pf32" 2>&1 | grep -v capturing | tee "$OUT/wave25c_bf16.log"
timeout 60 python3 step_timeline.py --json "$OUT/wave25c_timeline.json" --kinds fp8 --sizes 1 \
    --levers pf32 2>&1 | grep -v capturing | tee "$OUT/wave25c_timeline.log"
exit 0
