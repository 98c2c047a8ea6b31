#!/usr/bin/env bash
# Wave 22, call 3 (2026-12-06): the realistic job (1,000 requests, 8B shape, through the CLI)
# with `--logprobs 5` and at default flags, this tree (--output lines serialised by a writer
# thread, log-probabilities decoded once per request) vs the previous main (`.old_tree`,
# carried), the baseline last. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
warm_up_job
mkdir -p "$OUT/job"
(cd benchmarks && timeout 520 python3 workload.py --out "$OUT/job" \
    --requests "${REQUESTS:-1000}" --configs "${CONFIGS:-logprobs5,default}" --tree ../.old_tree \
    --baseline-configs "${BASELINE:-logprobs5,default}" --baseline-last --timeout 110 2>&1 \
    | tee "$OUT/job/workload.log" | tail -10)
rm -f "$OUT"/*/workload_*.jsonl
exit 0
