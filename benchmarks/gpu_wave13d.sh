#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-03, wave 13): the padded-vocabulary draft model's CUDA test, then
# where the realistic job's decode step goes: decode attention at job-like mixed contexts (split
# counts forced vs the shipped plan) and the 8B graph step at bs 192 with job contexts vs
# uniform ones, with its kernel profile. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_draft_vocab.py -k cuda 2>&1 \
    | tail -6 | tee "$OUT/pytest_draft_vocab_gpu.log"
timeout 150 python3 benchmarks/attention_sweep.py --json "$OUT/attention_job.json" \
    --shapes 192xjob,192x573,64xjob --budget-s 120 2>&1 | grep -v "Warning\|warn" \
    | tee "$OUT/attention_job.log"
timeout 200 python3 benchmarks/job_step.py --json "$OUT/job_step.json" 2>&1 \
    | grep -v "Warning\|warn\|it/s\]" | tail -20 | tee "$OUT/job_step.log"
exit 0
