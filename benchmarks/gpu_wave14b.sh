#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-03, wave 14b): decode attention's rows started longest first
# (kernels/paged_attention.py `row_order`, executor/triton_attention.py `order_rows`): the
# attention sweep at the job's mixed contexts and uniform ones (`ordered` vs `shipped` = batch
# order), the 8B bs-192 graph step with the order on / off (two rounds, one engine), the realistic
# job through the CLI against the previous main (bb01383, `.old_tree`, carried) in the same run,
# then the GPU attention tests. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 110 python3 benchmarks/attention_sweep.py --json "$OUT/attention_order.json" \
    --shapes 192xjob,64xjob,192x573,16xjob --budget-s 95 2>&1 | grep -v "Warning\|warn" \
    | tee "$OUT/attention_order.log"
timeout 150 python3 benchmarks/job_step.py --json "$OUT/job_step_order.json" --row-order on,off \
    2>&1 | grep -v "Warning\|warn\|it/s\]" | tail -22 | tee "$OUT/job_step_order.log"
(cd benchmarks && timeout 260 python3 workload.py --out "$OUT" --requests 1000 \
    --configs default --tree "$PWD/../.old_tree" --baseline-configs default --timeout 120 \
    2>&1 | tee "$OUT/workload.log" | tail -8)
rm -f "$OUT"/workload_*.jsonl
timeout 70 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py -k attention \
    2>&1 | tail -4 | tee "$OUT/pytest_attention_gpu.log"
exit 0
