#!/usr/bin/env bash
# Wave 25, call 2 (2026-12-06): the EAGLE-3 k=3 step on the FP8 target with the fused bs-1
# attention chain (the drafter's one-token steps) against the shipped kernels, then the
# realistic job with `--logprobs 5`, this tree vs `.old_tree` (carried: 8c196c7, before the
# host's log-probability change; baseline last), `default` the control. Results under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
(cd benchmarks && timeout 150 python3 decode_ab.py --label h200 --json "$OUT/wave25b_spec.json" \
    --kinds "" --rounds 2 --spec-levers "shipped;fused" 2>&1 | grep -v capturing \
    | tee "$OUT/wave25b_spec.log")
warm_up_job
mkdir -p "$OUT/job"
(cd benchmarks && timeout 330 python3 workload.py --out "$OUT/job" --requests 1000 \
    --configs logprobs5,default --tree ../.old_tree --baseline-configs logprobs5,default \
    --baseline-last --timeout 70 2>&1 | tee "$OUT/job/workload.log" | tail -12)
rm -f "$OUT"/*/workload_*.jsonl
exit 0
