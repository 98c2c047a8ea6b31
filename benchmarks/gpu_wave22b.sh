#!/usr/bin/env bash
# Wave 22, calls 3 and 5 (2026-12-06): the realistic job (1,000 requests, 8B shape, through
# the CLI), this tree vs another (`.old_tree`, carried: call 3 the tree before the writer
# thread and one-pass log-probabilities, call 5 c46a269 before the relaxed run-ahead rule),
# the baseline last; CONFIGS / BASELINE pick the configurations (call 5:
# CONFIGS=default,logprobs5 BASELINE=default,logprobs5). Logs and JSON under $OUT.
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
