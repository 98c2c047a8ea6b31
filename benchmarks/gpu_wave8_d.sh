#!/usr/bin/env bash
# One nvidia-h200 call for [adaptive] (wave 8, final: plain checks of four steps, cycles counted
# after three launches in a row, the bar's rounds raised to 31): the bundled bar three times
# (adaptive_gpu.py --parts bundled), with EAGLE-3 beside a hold-on margin of 1.1 in between
# (adaptive_variants.py). Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
source "$(dirname "$0")/gpu_bar_lib.sh"
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/wave8_d.log"
bar 1 "$OUT/wave8_d.log"
timeout 100 python3 adaptive_variants.py --json "$OUT/variants.json" --drafters eagle3 \
    --variant hold:STAY_MARGIN=1.1 2>&1 | grep -v Warning | tail -3 >> "$OUT/wave8_d.log"
python3 -c "
import json; d = json.load(open('$OUT/variants.json'))
print(json.dumps(d['verdict']))" | tee -a "$OUT/wave8_d.log"
bar 2 "$OUT/wave8_d.log"
bar 3 "$OUT/wave8_d.log"
