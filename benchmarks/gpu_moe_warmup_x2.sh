#!/usr/bin/env bash
# One nvidia-h200-x2 call (carry .whl): MoE targets under expert parallelism now warm up at start
# like every other CUDA engine. torchrun DP=2 / TP=2 with DeepEP through the CLI against one GPU
# (the summary's time= no longer includes Triton's compilation), then the EP=2 engine check
# (engines built, hence warmed up, on both ranks). Logs and JSON in $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh" deepep
for backend in deepep all2all; do
    mkdir -p "$OUT/$backend"
    timeout 200 python3 benchmarks/launch_gpu.py --out "$OUT/$backend" --layouts dp2,tp2 --moe \
        --moe-backend $backend --dtypes float32 --case-timeout-s 80 2>&1 \
        | tee "$OUT/launch_gpu_moe_$backend.log" | grep -E "wall=|^\|" | tail -8
done
timeout 100 python3 benchmarks/moe_engine_gpu.py --out "$OUT" --budget-s 90 2>&1 \
    | tee "$OUT/moe_engine_gpu.log" | grep -E "^\||step ms|wall|Error|error" | tail -14
