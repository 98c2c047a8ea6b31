#!/usr/bin/env bash
# One nvidia-h200 call for [adaptive] (wave 9: drafting stops only after two lost comparisons
# in a row, STOP_AFTER): the bundled bar (adaptive_gpu.py --parts bundled), EAGLE-3 at every size
# beside the wave-8 rule (old: STOP_AFTER=1, adaptive_variants.py), the realistic job with a
# dummy EAGLE-3 head that accepts nothing (workload.py, 1,000 requests, 8B shape: plain, auto,
# plain, auto), then the bar once more. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
source "$(dirname "$0")/gpu_bar_lib.sh"
cd "$(dirname "$0")"
BAR_TIMEOUT=105
LOG="$OUT/wave9_b.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG"
bar 1 "$LOG"
timeout 110 python3 adaptive_variants.py --json "$OUT/variants.json" --drafters eagle3 \
    --variant old:STOP_AFTER=1 2>&1 | grep -v Warning | tail -3 >> "$LOG"
python3 -c "
import json; d = json.load(open('$OUT/variants.json'))
print(json.dumps(d['verdict']))" | tee -a "$LOG"
timeout 280 python3 workload.py --out "$OUT/wl" --requests 1000 \
    --configs default,eagle3_auto,default,eagle3_auto --timeout 100 2>&1 \
    | grep -v Warning | tail -8 | tee -a "$LOG"
bar 2 "$LOG"
