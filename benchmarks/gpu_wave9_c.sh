#!/usr/bin/env bash
# One nvidia-h200 call for [adaptive] (wave 9, final: STOP_AFTER, and a rest goes on while every
# running request is cold): the realistic job with a dummy EAGLE-3 head that accepts nothing
# (workload.py, 1,000 requests, 8B shape: plain, auto, plain, auto), the bundled bar
# (adaptive_gpu.py --parts bundled), then the 8B shape with the dummy head (--parts 8b, plain and auto).
# Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
source "$(dirname "$0")/gpu_bar_lib.sh"
cd "$(dirname "$0")"
BAR_TIMEOUT=105
LOG="$OUT/wave9_c.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG"
timeout 280 python3 workload.py --out "$OUT/wl" --requests 1000 \
    --configs default,eagle3_auto,default,eagle3_auto --timeout 100 2>&1 \
    | grep -v Warning | tail -8 | tee -a "$LOG"
bar 1 "$LOG"
EIGHTB_TIMEOUT=130 eightb "$LOG"
