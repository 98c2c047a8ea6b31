#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-04, wave 15a): where the realistic job's extend (mixed) steps
# spend their time (benchmarks/extend_step.py: one step of 185 decode rows at the job's
# contexts + the job's prompts up to the token budget, vs prompts alone, kernel families), and
# the 8B graph decode steps at bs 1 / 16 / 64 on this tree (benchmarks/graphs.py: the decode
# attention's RowPlan now takes bs 2..131). Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
(cd benchmarks && timeout 240 python3 extend_step.py --json "$OUT/extend_step.json" 2>&1 \
    | tee "$OUT/extend_step.log" | tail -30)
(cd benchmarks && timeout 200 python3 graphs.py --json "$OUT/graphs.json" --models llama8b 2>&1 \
    | tee "$OUT/graphs.log" | tail -20)
exit 0
