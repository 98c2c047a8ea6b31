#!/usr/bin/env bash
# Wave 25, the #24 bar on its GPU (run through gpu_h200_only.sh): the 8B FP8 graph decode step
# with the FP8 target's launch modes (shipped) against none (base), three rounds, order
# rotated, and bf16 as shipped, then the shipped FP8 bs-1 step's timeline; a short form of
# gpu_wave24d.sh for a small device budget.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
cd benchmarks
timeout 200 python3 decode_ab.py --label h200bar --json "$OUT/wave25d_ab.json" --kinds fp8,bf16 \
    --rounds 3 --levers "base;shipped" 2>&1 | grep -v capturing | tee "$OUT/wave25d_ab.log"
# where the shipped FP8 bs-1 step's time goes on this GPU (only H100 timelines so far)
timeout 120 python3 step_timeline.py --json "$OUT/wave25d_timeline.json" --kinds fp8 --sizes 1 \
    2>&1 | grep -v capturing | tee "$OUT/wave25d_timeline.log"
exit 0
