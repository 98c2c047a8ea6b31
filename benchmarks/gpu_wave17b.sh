#!/usr/bin/env bash
# One GPU call (2026-12-05, wave 17b): the scheduler's admission rules (no admission in a step
# that preempted; a free page per decoding row left by an admission) against the previous main
# (d1ab8e7, `.old_tree`, carried) on the realistic job under a tight KV pool (`--num-pages 4096`
# for 512 rows: preemption all the time), 400 requests, in both orders (previous main first,
# then last), after a 64-request warm-up. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
mkdir -p "$OUT/warm" "$OUT/first" "$OUT/last"
(cd benchmarks && timeout 80 python3 workload.py --out "$OUT/warm" --requests 64 \
    --configs tight --timeout 70 2>&1 | tail -1)
rm -rf "$OUT/warm"
for order in first last; do
    extra=""; [ "$order" = last ] && extra="--baseline-last"
    (cd benchmarks && timeout 240 python3 workload.py --out "$OUT/$order" --requests 400 \
        --configs tight --tree "$PWD/../.old_tree" --baseline-configs tight $extra \
        --timeout 110 2>&1 | tee "$OUT/$order/workload.log" | tail -5)
    rm -f "$OUT/$order"/workload_*.jsonl
done
exit 0
