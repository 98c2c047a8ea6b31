#!/usr/bin/env bash
# One nvidia-h200 call for [adaptive] (wave 7): the realistic job with a dummy EAGLE-3 head that
# accepts nothing (benchmarks/workload.py, 1,000 requests, 8B shape: plain, auto, auto, plain),
# then the bundled bar once more (adaptive_gpu.py --parts bundled). Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/job.log"
timeout 330 python3 workload.py --out "$OUT/wl" --requests 1000 \
    --configs default,eagle3_auto,eagle3_auto,default --timeout 100 2>&1 \
    | grep -v Warning | tail -12 >> "$OUT/job.log"
timeout 240 python3 adaptive_gpu.py --json "$OUT/adaptive.json" --parts bundled 2>&1 \
    | grep -v Warning | tail -5 > "$OUT/adaptive.log"
python3 -c "
import json; d = json.load(open('$OUT/adaptive.json'))
print(json.dumps({k: v['auto_vs_best'] for k, v in d.get('bundled_verdict').items()}))"
