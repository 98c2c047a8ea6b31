#!/usr/bin/env bash
# One GPU call (2026-12-05, wave 18b): prefix caching. The realistic job with a 1,024-token
# system prompt starting every prompt (`workload.py --shared-prefix 1024`), default flags vs
# --enable-prefix-caching (config `prefix`), then the plain realistic job (nothing shared) with
# both, for the cache's cost when it never hits; after a 64-request warm-up. Then the GPU tests
# of prefix caching (graphs, piecewise extend graphs, Triton), stop strings, batch jobs and
# graph replays. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
warm_up_job
mkdir -p "$OUT/shared" "$OUT/plain"
(cd benchmarks && timeout 280 python3 workload.py --out "$OUT/shared" --requests 1000 \
    --shared-prefix 1024 --configs default,prefix --timeout 135 2>&1 \
    | tee "$OUT/shared/workload.log" | tail -5)
(cd benchmarks && timeout 200 python3 workload.py --out "$OUT/plain" --requests 1000 \
    --configs prefix,default --timeout 95 2>&1 | tee "$OUT/plain/workload.log" | tail -5)
rm -f "$OUT"/*/workload_*.jsonl
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_prefix_cache.py \
    tests/test_stop_strings.py tests/test_batch_jobs.py 2>&1 | tail -8 \
    | tee "$OUT/pytest_gpu.log"
exit 0
