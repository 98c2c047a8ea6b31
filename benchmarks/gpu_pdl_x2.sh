#!/usr/bin/env bash
# One nvidia-h200-x2 call (carry .whl) re-checking, with programmatic dependent launch on (the
# default since 2026-11-30, kernels/runtime.py), what runs next to NCCL and DeepEP kernels:
# EP=2 MoE speculative decoding with graphs vs one GPU (all2all and DeepEP LL), torchrun TP=2 /
# DP=2 with graphs vs one GPU in float32, every GPU-marked test, then graphs.py (issue 3's table)
# on GPU 0. Logs and JSON in $OUT; each step has its own timeout.
set -u
source "$(dirname "$0")/gpu_env.sh" deepep
timeout 100 python3 benchmarks/moe_engine_gpu.py --out "$OUT" --budget-s 90 2>&1 \
    | tee "$OUT/moe_engine_gpu.log" | grep -E "^\||step ms|wall|Error|error" | tail -14
timeout 120 python3 benchmarks/launch_gpu.py --out "$OUT" --dtypes float32 --case-timeout-s 50 \
    2>&1 | tee "$OUT/launch_gpu.log" | grep -E "^\||equal|differ|Error|error" | tail -8
timeout 250 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -6 \
    | tee "$OUT/pytest_gpu.log"
(cd benchmarks && CUDA_VISIBLE_DEVICES=0 timeout 130 python3 graphs.py --json "$OUT/graphs.json") \
    2>&1 | grep -v "it/s\]" | tail -9
