#!/usr/bin/env bash
# One nvidia-h200-x2 call: the one-shot TP all-reduce (comm/all_reduce.py) on two H200s. Its
# GPU test (bit-equal to NCCL, eager and replayed from a graph), then benchmarks/parallel_gpu.py
# (TP=2 / DP=2 with graphs == one GPU; 8B-shape step at TP=1, TP=2, and TP=2 with every
# all-reduce on NCCL), then torchrun TP=2 on the bundled job against one GPU. Logs in $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_parallel.py 2>&1 | tail -4 \
    | tee "$OUT/pytest_one_shot.log"
timeout 330 python3 benchmarks/parallel_gpu.py --out "$OUT" --budget-s 300 2>&1 \
    | tee "$OUT/parallel_gpu.log" | grep -v "it/s\]" | tail -22
timeout 120 python3 benchmarks/launch_gpu.py --out "$OUT" --layouts tp2 --dtypes float32,bfloat16 \
    --case-timeout-s 50 2>&1 | tee "$OUT/launch_gpu.log" | grep -E "^\||Error|error" | tail -6
