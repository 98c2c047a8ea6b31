#!/usr/bin/env bash
# Wave 22, call 5 (2026-12-06): the realistic job (1,000 requests, 8B shape, through the CLI)
# at default flags and with `--logprobs 5`, this tree (steps run ahead while requests wait for
# rows or end by length in the step in flight, and the logprobs changes) vs c46a269 (`.old_tree`,
# carried), the baseline last. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
warm_up_job
mkdir -p "$OUT/job"
(cd benchmarks && timeout 520 python3 workload.py --out "$OUT/job" \
    --requests "${REQUESTS:-1000}" --configs "${CONFIGS:-default,logprobs5}" --tree ../.old_tree \
    --baseline-configs "${BASELINE:-default,logprobs5}" --baseline-last --timeout 110 2>&1 \
    | tee "$OUT/job/workload.log" | tail -10)
rm -f "$OUT"/*/workload_*.jsonl
exit 0
