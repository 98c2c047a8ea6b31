#!/usr/bin/env bash
# Wave 24, call 2 (2026-12-06): the decode step's levers found by call 1's timeline, in one
# process per dtype (graphs recaptured per variant, three rounds, order rotated): paged
# attention loading older keys before its PDL wait (early), PDL mode 2 for the small kernels
# between projections (norm2, act2, merge2), 64-key attention splits (keys64); each variant's
# graph tokens against the first's. Then the timeline of one variant and the GPU tests of the
# changed kernels. Ran on a tree not committed: the `early` lever (paged attention loading its
# first block's older keys before the PDL wait) gained nothing and was reverted (wave24.md).
# Results under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
cd benchmarks
timeout 420 python3 decode_ab.py --label levers --json "$OUT/wave24b_levers.json" --kinds fp8,bf16 \
    --levers "base;early;early+norm2+act2;early+norm2+act2+merge2;early+keys64;early+norm2+act2+keys64" \
    2>&1 | grep -v capturing | tee "$OUT/wave24b_levers.log"
timeout 120 python3 step_timeline.py --json "$OUT/wave24b_timeline.json" --kinds fp8 --sizes 1 \
    --levers early+norm2+act2 2>&1 | grep -v capturing | tee "$OUT/wave24b_timeline.log"
cd ..
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
    -k "attention or pdl" 2>&1 | tail -3 | tee "$OUT/wave24b_pytest.log"
exit 0
