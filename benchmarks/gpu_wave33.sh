#!/usr/bin/env bash
# Wave 33 (2026-12-07 fourteenth session): the rank cut's passes pipelined (kernels/rank_filter.py:
# a constant trip count so Triton loads the next blocks by cp.async while one is binned; bins
# held [16, entries] so each thread bins its own entries, none converted through shared memory;
# sm_90 SASS offline: 115 vs 163 instructions an entry, 64 vs 139 registers). Carry
# [".old_tree2"] = `git archive 52f36c7` (the tree before) without tests/, benchmarks/results/
# and assets/{target,draft_lm,eagle3,dflash}.
#  1. the rank cut's GPU tests (compiled kernels vs the float64 cut);
#  2. rank_graph.py (graph replays of filtered_probs, top-p 0.95 and top-k 50 + top-p) on this
#     tree and on the tree before, same machine;
#  3. the job with `--temperature 0.8 --top-p 0.95` (sampled), then its EAGLE-3 form, against
#     the tree before.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_rank_filter.py 2>&1 \
    | tail -4 | tee "$OUT/wave33_pytest_gpu.log"
mkdir -p /tmp/spk_old && ln -sfn "$PWD/.old_tree2" /tmp/spk_old/speculant
(cd benchmarks && timeout 90 python3 rank_graph.py --out "$OUT/new" --iters 30 --noskip 2>&1 | tail -3)
(cd .old_tree2/benchmarks && PYTHONPATH=/tmp/spk_old timeout 90 python3 rank_graph.py \
    --out "$OUT/old" --iters 30 2>&1 | tail -3)
warm_up_job
for config in sampled eagle3_sampled; do  # (the call's limit may stop the second: the first kept)
    (cd benchmarks && timeout 220 python3 workload.py --out "$OUT/job" --configs $config \
        --tree ../.old_tree2 --baseline-configs $config --timeout 90 2>&1 | tail -4) \
        | tee "$OUT/job_$config.log"
    cp "$OUT/job/workload.json" "$OUT/wave33_job_$config.json" 2>/dev/null
    rm -rf "$OUT/job"
done
exit 0
