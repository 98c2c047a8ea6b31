#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-03, wave 14c): a step's RowPlan for decode attention (each row
# split by its own length, live items first, rows longest first; kernels/paged_attention.py
# `row_plan`, executor/triton_attention.py `row_layout = "plan"`): the GPU tests touching decode
# and verify steps first, then the attention sweep (planned / ordered / shipped), the 8B bs-192
# graph step per layout (two rounds, one engine), and the realistic job against the tree before
# (a71bdcd: rows longest first; `.old_tree`, carried) in the same run. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_kernels.py \
    tests/test_batch_jobs.py tests/test_adaptive.py tests/test_draft_vocab.py 2>&1 | tail -8 \
    | tee "$OUT/pytest_gpu.log"
timeout 75 python3 benchmarks/attention_sweep.py --json "$OUT/attention_plan.json" \
    --shapes 192xjob,64xjob,192x573,64x512,16xjob --budget-s 65 2>&1 | grep -v "Warning\|warn" \
    | tee "$OUT/attention_plan.log"
timeout 100 python3 benchmarks/job_step.py --json "$OUT/job_step_plan.json" \
    --row-layout plan,longest_first 2>&1 | grep -v "Warning\|warn\|it/s\]" | tail -22 \
    | tee "$OUT/job_step_plan.log"
(cd benchmarks && timeout 200 python3 workload.py --out "$OUT" --requests 1000 \
    --configs default --tree "$PWD/../.old_tree" --baseline-configs default --timeout 95 \
    2>&1 | tee "$OUT/workload.log" | tail -8)
rm -f "$OUT"/workload_*.jsonl
exit 0
