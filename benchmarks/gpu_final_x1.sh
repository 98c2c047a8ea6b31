#!/usr/bin/env bash
# One nvidia-h200 call on the session's final code: every GPU-marked test (one GPU), then
# benchmarks/levers.py alternating the default 8B bs=1 step with the Triton GEMV on gate_up
# too. Logs and JSON under $OUT; each step has its own timeout.
set -u
source "$(dirname "$0")/gpu_env.sh"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -6 \
    | tee "$OUT/pytest_gpu.log"
cd benchmarks
timeout 200 python3 levers.py --skip-gemv --variants default,gemv_gate_up,default,gemv_gate_up \
    --json "$OUT/levers.json" 2>&1 | grep -v "it/s\]" > "$OUT/levers.log"
grep -E " ms$|error" "$OUT/levers.log" | head -8
