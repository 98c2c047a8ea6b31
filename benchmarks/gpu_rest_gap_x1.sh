#!/usr/bin/env bash
# One nvidia-h200 call for [adaptive] (wave 7): where a resting engine's ~3% at bs 1 goes
# (benchmarks/rest_gap.py: rotated round-robin rates, graph replay times, host time per part of
# a step, kernels per replay), then the bundled bar (adaptive_gpu.py --parts bundled, order
# rotated each round). Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/rest_gap.log"
timeout 200 python3 rest_gap.py --json "$OUT/rest_gap.json" 2>&1 | grep -v Warning \
    | tail -80 >> "$OUT/rest_gap.log"
timeout 330 python3 adaptive_gpu.py --json "$OUT/adaptive.json" --parts bundled 2>&1 \
    | grep -v Warning | tail -5 > "$OUT/adaptive.log"
python3 -c "
import json; d = json.load(open('$OUT/adaptive.json'))
print(json.dumps(d.get('bundled_verdict')))"
