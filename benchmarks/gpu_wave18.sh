#!/usr/bin/env bash
# One GPU call (2026-12-05, wave 18): this session's tree (stop strings, the random stream's
# position hashing, chat content parts) against the previous main (23be044, `.old_tree`,
# carried) on the realistic job at default flags, after a 64-request warm-up that compiles the
# Triton kernels both trees share; then the GPU tests: stop strings on CUDA (graphs, overlap),
# sampling, decode / verify steps, batch jobs. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
warm_up_job
(cd benchmarks && timeout 260 python3 workload.py --out "$OUT" --requests 1000 \
    --configs default --tree "$PWD/../.old_tree" --baseline-configs default \
    --timeout 100 2>&1 | tee "$OUT/workload.log" | tail -8)
rm -f "$OUT"/workload_*.jsonl
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_stop_strings.py \
    tests/test_sampling_audit.py tests/test_gpu.py tests/test_batch_jobs.py \
    tests/test_speculative.py 2>&1 | tail -8 | tee "$OUT/pytest_gpu.log"
exit 0
