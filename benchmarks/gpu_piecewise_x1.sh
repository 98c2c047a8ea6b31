#!/usr/bin/env bash
# One nvidia-h200 call ([piecewise], issue 21): the GPU tests of tests/test_piecewise.py (graph ==
# eager tokens on a small model, clear/recapture, load_weights), then benchmarks/piecewise_gpu.py
# on the 8B shape (prefill 16/256/2048 and 64 decode rows + a 512 chunk: graphs vs eager time and
# tokens; a 32-request job with and without; clear_graphs memory; start-up). Each step has its
# own timeout and log; piecewise.json holds every item's figures or its error.
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_piecewise.py 2>&1 \
    | tail -25 | tee "$OUT/pytest_piecewise_gpu.log"
(cd benchmarks && timeout 240 python3 piecewise_gpu.py --json "$OUT/piecewise.json" --iters 10 \
    > "$OUT/piecewise_raw.log" 2>&1)
echo "piecewise_gpu.py exit: $?"
grep -v "it/s\]" "$OUT/piecewise_raw.log" > "$OUT/piecewise.log" && rm "$OUT/piecewise_raw.log"
grep -E "^(startup|prefill|mixed|generate|clear)|Error|error" "$OUT/piecewise.log" | cut -c1-600 | head -40
