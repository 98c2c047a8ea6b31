#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-03, wave 14a): row-aware decode-attention splits timed
# (kernels/paged_attention.py ROW_SPLIT_KEYS, off in this tree): decode attention at the job's
# mixed contexts and at uniform ones per split setting, then the 8B bs-192 graph step per
# setting (job contexts vs uniform, two rounds, one engine), then the GPU attention tests.
# Logs and JSON under $OUT. (job_step.py's --row-split-keys and ROW_SPLIT_KEYS were removed after this
# run measured them slower: results/job_step_wave14.md.)
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 170 python3 benchmarks/attention_sweep.py --json "$OUT/attention_rowsplit.json" \
    --shapes 192xjob,192x573,64xjob,64x512,16xjob --budget-s 150 2>&1 | grep -v "Warning\|warn" \
    | tee "$OUT/attention_rowsplit.log"
timeout 260 python3 benchmarks/job_step.py --json "$OUT/job_step_rowsplit.json" \
    --row-split-keys 0,512,1024,2048 2>&1 | grep -v "Warning\|warn\|it/s\]" | tail -24 \
    | tee "$OUT/job_step_rowsplit.log"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py -k attention 2>&1 \
    | tail -6 | tee "$OUT/pytest_attention_gpu.log"
exit 0
