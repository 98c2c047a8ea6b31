#!/usr/bin/env bash
# Wave 24, call 3 (2026-12-06): which small kernels should launch their successor before their
# own wait (PDL mode 2), per dtype: the 8B graph decode step at bs 1 / 64 with the norms, SiLU-
# and-mul and the attention merge at mode 2 alone and together (decode_ab.py --levers, graphs
# recaptured per variant, three rounds, order rotated). Results under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
cd benchmarks
timeout 420 python3 decode_ab.py --label kinds --json "$OUT/wave24c_kinds.json" --kinds fp8,bf16 \
    --levers "base;merge2;act2+merge2;norm2+merge2;norm2+act2+merge2;norm2+act2+merge2+attention2" \
    2>&1 | grep -v capturing | tee "$OUT/wave24c_kinds.log"
exit 0
