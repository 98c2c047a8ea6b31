#!/usr/bin/env bash
# One nvidia-h200-x2 call for issue 8's GPU acceptance (run from the repository root, with the
# DeepEP wheel carried in .whl/ and OUT set by the device tool):
#   1. benchmarks/moe_engine_gpu.py: EP=2 Qwen3-MoE speculative decoding with graphs, all2all and
#      DeepEP low-latency, against one GPU;
#   2. benchmarks/moe_gpu.py: per-layer dispatch+combine inside graphs, DeepEP vs all2all, and the
#      cost / necessity of the low-latency clean before each replay.
# Each step has its own timeout and logs under $OUT, so one failing leaves the other's results.
set -u
source "$(dirname "$0")/gpu_env.sh" deepep
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout "${MOE_ENGINE_S:-300}" python3 benchmarks/moe_engine_gpu.py --out "$OUT" \
    --budget-s $(( ${MOE_ENGINE_S:-300} - 20 )) 2>&1 | tee "$OUT/moe_engine_gpu.log" | grep -v "it/s\]$"
echo "moe_engine_gpu exit ${PIPESTATUS[0]}"
timeout "${MOE_LAYER_S:-260}" torchrun --standalone --nproc-per-node 2 benchmarks/moe_gpu.py \
    --out "$OUT" --deadline $(( ${MOE_LAYER_S:-260} - 30 )) 2>&1 | tee "$OUT/moe_gpu.log" | tail -60
echo "moe_gpu exit ${PIPESTATUS[0]}"
rm -f "$OUT"/moe_gpu_rank*.json
