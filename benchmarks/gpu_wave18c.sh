#!/usr/bin/env bash
# Wave 18c (same warm H200 as 18b): prefix caching where requests are preempted (a 4,096-page
# pool: a resumed request takes its own prompt pages back) and under EAGLE-3 on the shared
# system-prompt job; then the CUDA parity / graph tests on the new KV bookkeeping.
set -u
source "$(dirname "$0")/gpu_env.sh"
mkdir -p "$OUT/tight" "$OUT/eagle"
(cd benchmarks && timeout 200 python3 workload.py --out "$OUT/tight" --requests 400 \
    --configs tight,tight_prefix --timeout 95 2>&1 | tee "$OUT/tight/workload.log" | tail -5)
(cd benchmarks && timeout 200 python3 workload.py --out "$OUT/eagle" --requests 400 \
    --shared-prefix 1024 --configs eagle3,eagle3_prefix --timeout 95 2>&1 \
    | tee "$OUT/eagle/workload.log" | tail -5)
rm -f "$OUT"/*/workload_*.jsonl
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tail -4 \
    | tee "$OUT/pytest_gpu.log"
exit 0
