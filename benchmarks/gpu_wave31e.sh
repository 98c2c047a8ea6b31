#!/usr/bin/env bash
# Wave 31, call 5: top-k / top-p ranked by chunks of rows (the sort's memory) and the decode
# graphs' pool kept out of the KV cache: the jobs (greedy, sampled with top-p, EAGLE-3 k 3
# sampled: out of memory on an H100 before, calls 3-4) with their start-up memory figures,
# the sampler's cost (sampler_race.py), and the GPU tests of the sampler variants.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
(cd benchmarks && timeout 280 python3 workload.py --out "$OUT/job" \
    --configs default,sampled,eagle3_sampled --timeout 130 --debug 2>&1 | tail -6) \
    | tee "$OUT/job.log"
cp "$OUT/job/workload.json" "$OUT/wave31e_job.json" 2>/dev/null
grep -h "profiled\|KV cache:\|using\|ready" "$OUT"/job/stderr_*.log > "$OUT/memory.log"
rm -rf "$OUT/job"
timeout 80 python3 benchmarks/sampler_race.py --out "$OUT" --iters 20 2>&1 | tail -6 \
    | tee "$OUT/sampler_race.log"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sampler_variants.py \
    tests/test_min_p.py tests/test_race.py tests/test_draft_vocab.py 2>&1 | tail -4 \
    | tee "$OUT/wave31e_pytest_gpu.log"
exit 0
