#!/usr/bin/env bash
# One nvidia-h200 call for [adaptive] (wave 9, HEAD of wave 8: plain checks per size, host shares scaled down only,
# STAY_MARGIN = MARGIN): the bundled bar three times (adaptive_gpu.py --parts
# bundled), EAGLE-3 at every size beside a hold-on margin of 1.1
# (adaptive_variants.py), and the 8B shape with a dummy EAGLE-3 head (--parts 8b).
# Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
source "$(dirname "$0")/gpu_bar_lib.sh"
cd "$(dirname "$0")"
BAR_TIMEOUT=110
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/wave9_a.log"
bar 1 "$OUT/wave9_a.log"
timeout 120 python3 adaptive_variants.py --json "$OUT/variants.json" --drafters eagle3 \
    --variant hold:STAY_MARGIN=1.1 2>&1 | grep -v Warning | tail -3 \
    >> "$OUT/wave9_a.log"
python3 -c "
import json; d = json.load(open('$OUT/variants.json'))
print(json.dumps(d['verdict']))" | tee -a "$OUT/wave9_a.log"
bar 2 "$OUT/wave9_a.log"
eightb "$OUT/wave9_a.log" plain,fixed,auto,auto_d0
bar 3 "$OUT/wave9_a.log"
