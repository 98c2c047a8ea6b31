#!/usr/bin/env bash
# Wave 34 (2026-12-07 fifteenth session): where the job's large-batch decode step goes. The
# realistic job spends ~2/3 of its time in pure decode graph steps at a mean batch of ~186 rows
# (~12.8 ms a step, results/workload.md), twice the bs-64 step's 6.1 ms: the critical path of
# bf16 graph replays at 128 / 256 rows, contexts 512 and 1024 (the job's rows hold ~200-3000
# tokens), kernel by kernel (benchmarks/step_timeline.py). On an H200 gpu_wave25d.sh runs first.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
# on an H200 (the #24 bars' GPU, not given in ten sessions) first the bar's figures (~3 min)
case "$(cat "$OUT/gpu.txt")" in *H200*) bash benchmarks/gpu_wave25d.sh ;; esac
cd benchmarks
for context in 512 1024; do
    timeout 240 python3 step_timeline.py --json "$OUT/wave34_timeline_ctx$context.json" \
        --kinds bf16 --sizes 128,256 --context $context --top 28 2>&1 | grep -v capturing \
        | tee "$OUT/wave34_timeline_ctx$context.log"
done
exit 0
