#!/usr/bin/env bash
# Wave 22, call 4 (2026-12-06): where `--logprobs 5` costs the job (1,000 requests, 8B shape,
# through the CLI): default flags, `--max-logprobs 5` (the steps compute them, no request keeps
# them: the device's part), `--logprobs 0` (no top-k), `--logprobs 5`, default again. One tree.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
mkdir -p "$OUT/job"
(cd benchmarks && timeout 560 python3 workload.py --out "$OUT/job" \
    --requests "${REQUESTS:-1000}" \
    --configs "${CONFIGS:-default,max_logprobs5,logprobs0,logprobs5}" --tree .. \
    --baseline-configs default --baseline-last --timeout 110 2>&1 \
    | tee "$OUT/job/workload.log" | tail -9)
rm -f "$OUT"/*/workload_*.jsonl
exit 0
