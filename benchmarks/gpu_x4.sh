#!/usr/bin/env bash
# Issue 12 on nvidia-h200-x4 (4 GPUs), carry .whl (the DeepEP wheel), in two calls of < 10 min:
#   bash benchmarks/gpu_x4.sh dense-and-engine    # TP2 x DP2 EAGLE-3 vs one GPU; MoE EP=4 engine
#   bash benchmarks/gpu_x4.sh layers-and-torchrun # per-layer dispatch+combine on 4; MoE via torchrun
# Every step has its own timeout; logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh" deepep
case "${1:-}" in
dense-and-engine)
    mkdir -p "$OUT/dense"
    timeout 240 python3 benchmarks/launch_gpu.py --out "$OUT/dense" --layouts tp2dp2 \
        2>&1 | tee "$OUT/dense/launch_gpu.log" | tail -8
    timeout 300 python3 benchmarks/moe_engine_gpu.py --out "$OUT" --world 4 --tp 2 \
        --budget-s 280 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tee "$OUT/moe_engine_gpu.log" | tail -14
    ;;
layers-and-torchrun)
    timeout 230 torchrun --standalone --nproc-per-node 4 benchmarks/moe_gpu.py --out "$OUT" \
        --deadline 200 2>&1 | tee "$OUT/moe_gpu.log" | tail -50
    rm -f "$OUT"/moe_gpu_rank*.json
    mkdir -p "$OUT/moe"
    timeout 300 python3 benchmarks/launch_gpu.py --out "$OUT/moe" --layouts tp2dp2 --moe \
        --dtypes float32,bfloat16 --case-timeout-s 140 2>&1 | tee "$OUT/moe/launch_gpu.log" | tail -8
    ;;
*) echo "usage: bash benchmarks/gpu_x4.sh dense-and-engine|layers-and-torchrun" >&2; exit 2 ;;
esac
