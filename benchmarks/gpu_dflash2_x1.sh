#!/usr/bin/env bash
# One nvidia-h200 call (under 2 minutes): DFlash2 on the Qwen3-8B shape, dummy weights, with a
# dummy DFlash2 drafter (5 layers, block 16, k = 15; selector rank 64, top-k 32, kernel 4,
# groups of 128): graph == eager token for token at bs 1 and 8 (greedy and seeded sampling), and
# the whole step's time, graph vs eager, greedy and sampled, at bs 1 and 8 (context 512), next to
# a DFLASH drafter of the same shape. Report in $OUT/dflash2_gpu.{log,json}.
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/dflash2_gpu.log"
(cd benchmarks && timeout 110 python3 dflash2_gpu.py --json "$OUT/dflash2_gpu.json") 2>&1 \
    | grep -v Warning | tee -a "$OUT/dflash2_gpu.log" | tail -20
exit "${PIPESTATUS[0]}"
