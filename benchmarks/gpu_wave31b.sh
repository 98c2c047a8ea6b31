#!/usr/bin/env bash
# Wave 31 (2026-12-07 twelfth session), call 2: the SCALED sampler variant (a batch whose sampled
# requests ask for neither top-k nor top-p skips filtered_probs' vocabulary sort). Run with
# carry [".old_tree"] = `git archive dfce2ee` (the tree before it) without tests/,
# benchmarks/results/ and assets/{target,draft_lm,eagle3,dflash}.
#  1. benchmarks/sampler_race.py: filtered_probs for temperature-only rows, FULL vs SCALED, at a
#     152k vocabulary (and SCALED's result checked equal to FULL's);
#  2. the job with `--temperature 0.8` (plain and EAGLE-3 k 3, dummy head), this tree vs the tree
#     before, in one call;
#  3. the GPU tests whose graphs now include the SCALED variant.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 100 python3 benchmarks/sampler_race.py --out "$OUT" --iters 30 2>&1 | tail -6 \
    | tee "$OUT/sampler_race.log"
warm_up_job
(cd benchmarks && timeout 330 python3 workload.py --out "$OUT/job" \
    --configs temperature,eagle3_temperature --tree ../.old_tree \
    --baseline-configs temperature,eagle3_temperature --timeout 150 2>&1 | tail -8) \
    | tee "$OUT/job.log"
cp "$OUT/job/workload.json" "$OUT/wave31_job.json" 2>/dev/null
rm -rf "$OUT/job"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sampler_variants.py \
    tests/test_min_p.py tests/test_race.py 2>&1 | tail -4 | tee "$OUT/wave31_pytest_gpu.log"
exit 0
