#!/usr/bin/env bash
# Wave 25, call 1 (2026-12-06, an H200: the #24 bar's GPU): the fused bs-1 attention chain
# (kernels/decode_attention.py, TritonPagedAttention.fuse_decode) first through its GPU tests,
# then the 8B graph decode step in one process per dtype, graphs recaptured per variant, order
# rotated: FP8 "base" (no launch modes of its own) / "shipped" (FP8_LAUNCH_MODES) / "fused"
# (shipped + the fused chain), bf16 unfused / fused; tokens compared per variant; then the
# FP8 bs-1 timelines shipped and fused. Results under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
    -k "fused_decode or fused_kernel" 2>&1 | tail -3 | tee "$OUT/wave25_pytest.log"
cd benchmarks
timeout 220 python3 decode_ab.py --label h200 --json "$OUT/wave25_fp8.json" --kinds fp8 \
    --rounds 3 --levers "base;shipped;fused" 2>&1 | grep -v capturing | tee "$OUT/wave25_fp8.log"
timeout 120 python3 decode_ab.py --label h200 --json "$OUT/wave25_bf16.json" --kinds bf16 \
    --rounds 2 --levers "unfused;fused" 2>&1 | grep -v capturing | tee "$OUT/wave25_bf16.log"
for lever in shipped fused; do
    timeout 60 python3 step_timeline.py --json "$OUT/wave25_timeline_$lever.json" --kinds fp8 \
        --sizes 1 --levers "$lever" 2>&1 | grep -v capturing | tee "$OUT/wave25_timeline_$lever.log"
done
exit 0
