#!/usr/bin/env bash
# One nvidia-h200 call for [adaptive] (wave 8): the bundled bar with the acceptance estimate's
# longer memory (adaptive_gpu.py --parts bundled), then EAGLE-3 at bs 1/8/32/64 with the new
# default beside the old memory (adaptive_variants.py, `d7`: DECAY 0.7), then [piecewise]'s
# drafters stage on the 8B shape (the per-sequence graphs against per_sequence_eager).
# Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/wave8_a.log"
timeout 250 python3 adaptive_gpu.py --json "$OUT/adaptive.json" --parts bundled 2>&1 \
    | grep -v Warning | tail -5 >> "$OUT/wave8_a.log"
python3 -c "
import json; d = json.load(open('$OUT/adaptive.json'))
print(json.dumps({k: v['paired_auto_vs_best'] for k, v in d.get('bundled_verdict').items()}))" \
    | tee -a "$OUT/wave8_a.log"
timeout 150 python3 adaptive_variants.py --json "$OUT/variants.json" --drafters eagle3 \
    --sizes 1,8 --variant d7:DECAY=0.7 2>&1 | grep -v Warning | tail -3 >> "$OUT/wave8_a.log"
python3 -c "
import json; d = json.load(open('$OUT/variants.json'))
print(json.dumps(d['verdict']))" | tee -a "$OUT/wave8_a.log"
timeout 170 python3 piecewise_gpu.py --json "$OUT/drafters.json" --stage drafters --iters 10 \
    2>&1 | grep -v Warning | tail -30 >> "$OUT/wave8_a.log"
