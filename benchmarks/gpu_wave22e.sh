#!/usr/bin/env bash
# Wave 22, call 6 (2026-12-06): the job's mix on the small shape (host-bound steps), this tree
# (steps run ahead while requests wait for rows or end by length in the step in flight) twice
# vs c46a269 (`.old_tree`, carried), the baseline last. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
mkdir -p "$OUT/job"
(cd benchmarks && timeout 300 python3 workload.py --out "$OUT/job" --shape small \
    --requests "${REQUESTS:-1000}" --configs "default,overlap" --tree ../.old_tree \
    --baseline-configs default --baseline-last --timeout 90 2>&1 \
    | tee "$OUT/job/workload.log" | tail -7)
rm -f "$OUT"/*/workload_*.jsonl
exit 0
