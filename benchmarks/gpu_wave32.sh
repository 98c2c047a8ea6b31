#!/usr/bin/env bash
# Wave 32 (2026-12-07 thirteenth session), call 1: what wave 31 left unmeasured.
#  1. the piecewise capture on one side stream with the allocator's cache released (6130cf8):
#     its GPU tests and those of test_gpu.py;
#  2. the job at default flags, this tree vs the tree before that change (carry [".old_tree"] =
#     `git archive e8f931e` without tests/, benchmarks/results/ and assets/{target,draft_lm,
#     eagle3,dflash}): output tokens/s and each run's start-up memory (graphs_gib: the
#     piecewise pools, 2.63 GiB for this job before);
#  3. sampler_race.py: FULL's ranking by chunks of rows against one sort of every row;
#  4. on an H200 only, the #24 bar (gpu_wave25d.sh).
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_piecewise.py \
    tests/test_gpu.py 2>&1 | tail -5 | tee "$OUT/wave32_pytest_gpu.log"
warm_up_job
(cd benchmarks && timeout 200 python3 workload.py --out "$OUT/job" --configs default \
    --tree ../.old_tree --baseline-configs default --timeout 90 2>&1 | tail -6) \
    | tee "$OUT/job.log"
cp "$OUT/job/workload.json" "$OUT/wave32_job.json" 2>/dev/null
rm -rf "$OUT/job"
timeout 80 python3 benchmarks/sampler_race.py --out "$OUT" --iters 20 2>&1 | tail -6 \
    | tee "$OUT/sampler_race.log"
(cd benchmarks && timeout 60 python3 rank_graph.py --out "$OUT/rank_small" --sizes 2,8,16,32 --kernel-rows 1 --iters 30 2>&1 | tail -4)
bash benchmarks/gpu_h200_only.sh gpu_wave25d.sh
exit 0
