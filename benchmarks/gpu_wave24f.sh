#!/usr/bin/env bash
# Wave 24, not run yet (the session's device time ran out): one launch for RoPE, the KV write,
# attention and the split merge at bs 1 (kernels/decode_attention.py, off by default:
# TritonPagedAttention.fuse_decode) against the three launches it replaces, the 8B graph decode
# step FP8 and bf16 in one process each (graphs recaptured per variant, two rounds, order
# rotated; graph == eager tokens per variant); first its GPU tests. Results under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
    -k "fused_decode or fused_kernel" 2>&1 | tail -3 | tee "$OUT/wave24f_pytest.log"
cd benchmarks
timeout 200 python3 decode_ab.py --label fused --json "$OUT/wave24f_ab.json" --kinds fp8,bf16 \
    --rounds 2 --levers "unfused;fused" 2>&1 | grep -v capturing | tee "$OUT/wave24f_ab.log"
exit 0
