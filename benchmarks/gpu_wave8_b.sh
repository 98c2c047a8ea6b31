#!/usr/bin/env bash
# One nvidia-h200 call for [adaptive] (wave 8, after the hold-on margin and the checks' fix): the
# bundled bar (adaptive_gpu.py --parts bundled), EAGLE-3 at bs 1/8 beside the wave-7 settings
# (adaptive_variants.py, `old`: DECAY 0.7, STAY_MARGIN 1.2), the realistic job with a dummy
# EAGLE-3 head that accepts nothing (workload.py, 1,000 requests, 8B shape: plain, auto, auto,
# plain), then the bar once more. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
cd "$(dirname "$0")"
verdict() {
    python3 -c "
import json; d = json.load(open('$1'))
print(json.dumps({k: v['paired_auto_vs_best'] for k, v in d.get('bundled_verdict').items()}))"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/wave8_b.log"
timeout 120 python3 adaptive_gpu.py --json "$OUT/adaptive_1.json" --parts bundled 2>&1 \
    | grep -v Warning | tail -3 >> "$OUT/wave8_b.log"
verdict "$OUT/adaptive_1.json" | tee -a "$OUT/wave8_b.log"
timeout 100 python3 adaptive_variants.py --json "$OUT/variants.json" --drafters eagle3 \
    --sizes 1,8 --variant old:DECAY=0.7,STAY_MARGIN=1.2 2>&1 | grep -v Warning | tail -3 \
    >> "$OUT/wave8_b.log"
python3 -c "
import json; d = json.load(open('$OUT/variants.json'))
print(json.dumps(d['verdict']))" | tee -a "$OUT/wave8_b.log"
timeout 300 python3 workload.py --out "$OUT/wl" --requests 1000 \
    --configs default,eagle3_auto,eagle3_auto,default --timeout 100 2>&1 \
    | grep -v Warning | tail -12 | tee -a "$OUT/wave8_b.log"
timeout 90 python3 adaptive_gpu.py --json "$OUT/adaptive_2.json" --parts bundled 2>&1 \
    | grep -v Warning | tail -3 >> "$OUT/wave8_b.log"
verdict "$OUT/adaptive_2.json" | tee -a "$OUT/wave8_b.log"
