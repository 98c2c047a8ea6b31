#!/usr/bin/env bash
# One nvidia-h200-x2 call: issue 9's GPU acceptance (benchmarks/launch_gpu.py: torchrun TP=2 and
# DP=2 with graphs against one GPU) and, on GPU 0 alone, issue 3's graph-vs-eager table
# (benchmarks/graphs.py, the default attention backend). Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
timeout 330 python3 benchmarks/launch_gpu.py --out "$OUT" 2>&1 | tee "$OUT/launch_gpu.log"
echo "launch_gpu exit ${PIPESTATUS[0]}"
(cd benchmarks && CUDA_VISIBLE_DEVICES=0 timeout 200 python3 graphs.py --json "$OUT/graphs.json") \
    2>&1 | tee "$OUT/graphs.log" | tail -30
echo "graphs exit ${PIPESTATUS[0]}"
