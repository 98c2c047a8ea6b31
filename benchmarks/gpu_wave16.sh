#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-05, wave 16): the session's final tree (hardening: checkpoint and
# prompt checks, outputs kept out of checkpoints, --seed as the engine seed, overlapped steps'
# decode_time_s) against the previous main (1d31960, `.old_tree`, carried) on the realistic job
# at default flags, this tree first (`--baseline-last`, as wave 14d), then the GPU tests of
# decode / verify steps, kernels, batch jobs, piecewise graphs, draft vocabularies and FP8
# kernels. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
(cd benchmarks && timeout 200 python3 workload.py --out "$OUT" --requests 1000 \
    --configs default --tree "$PWD/../.old_tree" --baseline-configs default --baseline-last \
    --timeout 90 2>&1 | tee "$OUT/workload.log" | tail -8)
rm -f "$OUT"/workload_*.jsonl
timeout 360 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_kernels.py \
    tests/test_batch_jobs.py tests/test_piecewise.py tests/test_draft_vocab.py \
    tests/test_fp8_kernels.py -x 2>&1 | tail -8 | tee "$OUT/pytest_gpu.log"
exit 0
