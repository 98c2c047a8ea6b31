#!/usr/bin/env bash
# One nvidia-h200 call: the decode paged-attention launch sweep (benchmarks/attention_sweep.py,
# 8B shape, bs x context 1x512 ... 64x2048; per-layer us vs the KV bytes at copy bandwidth).
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/attention.log"
timeout 420 python3 benchmarks/attention_sweep.py --json "$OUT/attention_sweep.json" \
    --budget-s 380 --grid 2>&1 | grep -v "Warning\|warn" | tail -40 | tee -a "$OUT/attention.log"
