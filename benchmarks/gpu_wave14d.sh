#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-03, wave 14d): decode attention's "auto" layout (a RowPlan for
# batches of fewer one-split programs than four a slot, rows longest first above;
# kernels/paged_attention.py `plans_rows`): the realistic job with this tree FIRST and the tree
# before (a71bdcd: rows longest first everywhere; `.old_tree`, carried) after it, so kernels the
# trees share are compiled in this tree's generate time (`--baseline-last`), then the GPU tests
# of decode / verify steps. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
(cd benchmarks && timeout 190 python3 workload.py --out "$OUT" --requests 1000 \
    --configs default --tree "$PWD/../.old_tree" --baseline-configs default --baseline-last \
    --timeout 90 2>&1 | tee "$OUT/workload.log" | tail -8)
rm -f "$OUT"/workload_*.jsonl
timeout 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_kernels.py \
    tests/test_batch_jobs.py tests/test_draft_vocab.py tests/test_adaptive.py -x 2>&1 | tail -8 \
    | tee "$OUT/pytest_gpu.log"
exit 0
