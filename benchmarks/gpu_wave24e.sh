#!/usr/bin/env bash
# Wave 24, call 5 (2026-12-06): the host's keeping and writing of log-probabilities without an
# object per token (executor/logprobs.py KeptLogprobs, RequestOutput.json_line) in the
# realistic job with `--logprobs 5`, this tree vs `.old_tree` (carried: 8c196c7, the tree
# before it; baseline last), `default` the control. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
warm_up_job
mkdir -p "$OUT/job"
(cd benchmarks && timeout 330 python3 workload.py --out "$OUT/job" --requests 1000 \
    --configs logprobs5,default --tree ../.old_tree --baseline-configs logprobs5,default \
    --baseline-last --timeout 70 2>&1 | tee "$OUT/job/workload.log" | tail -12)
rm -f "$OUT"/*/workload_*.jsonl
exit 0
