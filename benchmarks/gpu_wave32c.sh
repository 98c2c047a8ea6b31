#!/usr/bin/env bash
# Wave 32 (2026-12-07 thirteenth session), call 2: the sort-free top-k / top-p rewritten after
# call 1 (one program per row was slower than torch's sort below ~128 rows: 2.89 vs 0.56 ms at
# one row). Now parts of 8,192 entries per row, one launch per digit, per-thread histograms.
# Carry [".old_tree2"] = `git archive d8a11b0` (the tree before the kernel) without tests/,
# benchmarks/results/ and assets/{target,draft_lm,eagle3,dflash}.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_rank_filter.py \
    tests/test_sampler_variants.py 2>&1 | tail -5 \
    | tee "$OUT/wave32c_pytest_gpu.log"
timeout 80 python3 benchmarks/sampler_race.py --out "$OUT" --iters 10 \
    --sizes 1x1,64x1,256x1 2>&1 | tail -6 | tee "$OUT/sampler_race.log"
warm_up_job
(cd benchmarks && timeout 170 python3 workload.py --out "$OUT/job" --configs sampled \
    --tree ../.old_tree2 --baseline-configs sampled --timeout 80 2>&1 | tail -4) \
    | tee "$OUT/job.log"
cp "$OUT/job/workload.json" "$OUT/wave32c_job.json" 2>/dev/null
rm -rf "$OUT/job"
exit 0
