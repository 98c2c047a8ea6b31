#!/usr/bin/env bash
# One nvidia-h200 call ([piecewise], issue 21), by stage (the first argument; default target):
#   target:   the target's GPU tests of tests/test_piecewise.py (graph == eager tokens on a small
#             model, clear/recapture, load_weights), then benchmarks/piecewise_gpu.py on the 8B
#             shape (prefill 16/256/2048 and 64 decode rows + a 512 chunk: graphs vs eager time
#             and tokens; a 32-request job with and without; clear_graphs memory; start-up).
#   drafters: the drafters' GPU test (their N-token part replayed, tokens == eager, clear and
#             recapture), then piecewise_gpu.py --stage drafters: prefill-only extend steps of 16
#             and 256 tokens on the 8B target with an EAGLE-3 head, DFLASH and a Qwen3-0.6B-shape
#             draft model (dummy weights), the drafter's graphs on vs off (~3 minutes).
# Each step has its own timeout and log; piecewise*.json holds every item's figures or its error.
set -u
stage="${1:-target}"
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$stage" = drafters ]; then
    tests=(-k drafter) json=piecewise_drafters log=piecewise_drafters bench=(--stage drafters)
else
    tests=(-k "not drafter") json=piecewise log=piecewise bench=()
fi
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_piecewise.py "${tests[@]}" \
    2>&1 | tail -25 | tee "$OUT/pytest_${log}_gpu.log"
(cd benchmarks && timeout 240 python3 piecewise_gpu.py --json "$OUT/$json.json" --iters 10 \
    "${bench[@]}" > "$OUT/${log}_raw.log" 2>&1)
echo "piecewise_gpu.py exit: $?"
grep -v "it/s\]" "$OUT/${log}_raw.log" > "$OUT/$log.log" && rm "$OUT/${log}_raw.log"
grep -E "^(startup|prefill|mixed|generate|clear|eagle3|dflash|draft_model)|Error|error" \
    "$OUT/$log.log" | cut -c1-600 | head -40
