#!/usr/bin/env bash
# One nvidia-h200 call for [adaptive] (wave 6): where a resting adaptive engine's time differs from
# plain's (step_profile.py --mode phases: wall, extend and decode-launch seconds per generate,
# round-robin), then the bundled bar and the 8B dummy head (plain and auto only) with
# benchmarks/adaptive_gpu.py. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/phases.log"
timeout 120 python3 step_profile.py --mode phases --json "$OUT/phases.json" --sizes 1,8 \
    --rounds 15 2>&1 | grep -v Warning | tail -40 >> "$OUT/phases.log"
timeout 330 python3 adaptive_gpu.py --json "$OUT/adaptive.json" --parts bundled,8b \
    --runs-8b plain,auto 2>&1 | grep -v Warning | tail -30 > "$OUT/adaptive.log"
python3 -c "
import json; d = json.load(open('$OUT/adaptive.json'))
print(json.dumps(d.get('bundled_verdict')))
print({k: {b: v.get(b, {}).get('tok_s') for b in ('bs1', 'bs64')} for k, v in d.get('8b', {}).items()})"
