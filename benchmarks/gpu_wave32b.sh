#!/usr/bin/env bash
# Wave 32 (2026-12-07 thirteenth session), call 2: top-k / top-p without a sort on CUDA
# (kernels/rank_filter.py). Run with carry [".old_tree2"] = `git archive <the commit before it>`
# without tests/, benchmarks/results/ and assets/{target,draft_lm,eagle3,dflash}.
#  1. its GPU tests and those of the sampler (the engine's check, CPU == CUDA cuts, seeded
#     graph == eager with top-p);
#  2. benchmarks/sampler_race.py: filtered_probs with top-p 0.95 (and top-k 50 + top-p) by the
#     kernel against torch's sort (by chunks and in one sort), the rows cut alike;
#  3. the job with `--temperature 0.8 --top-p 0.95` (`sampled`; and EAGLE-3 k 3, dummy head:
#     `eagle3_sampled`), this tree vs the tree before, in one call.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_rank_filter.py \
    tests/test_sampler_variants.py tests/test_min_p.py tests/test_race.py \
    tests/test_sampling_audit.py 2>&1 | tail -5 | tee "$OUT/wave32b_pytest_gpu.log"
timeout 100 python3 benchmarks/sampler_race.py --out "$OUT" --iters 20 2>&1 | tail -6 \
    | tee "$OUT/sampler_race.log"
warm_up_job
(cd benchmarks && timeout 280 python3 workload.py --out "$OUT/job" \
    --configs sampled,eagle3_sampled --tree ../.old_tree2 \
    --baseline-configs sampled,eagle3_sampled --timeout 120 2>&1 | tail -8) \
    | tee "$OUT/job.log"
cp "$OUT/job/workload.json" "$OUT/wave32b_job.json" 2>/dev/null
rm -rf "$OUT/job"
exit 0
