#!/usr/bin/env bash
# Wave 31, call 4: the FULL sampler in place (filtered_probs and the rejection's residuals
# without [rows, V] copies): the EAGLE-3 k 3 sampled job (`--temperature 0.8 --top-p 0.95`)
# that ran out of memory on an H100 (call 3), its start-up memory figures, then the sampler's
# cost (sampler_race.py) after the change.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
(cd benchmarks && timeout 240 python3 workload.py --out "$OUT/job" \
    --configs eagle3_sampled,sampled --timeout 150 --debug 2>&1 | tail -5) | tee "$OUT/job.log"
cp "$OUT/job/workload.json" "$OUT/wave31d_job.json" 2>/dev/null
cp "$OUT"/job/stderr_*.log "$OUT/" 2>/dev/null
rm -rf "$OUT/job"
timeout 100 python3 benchmarks/sampler_race.py --out "$OUT" --iters 30 2>&1 | tail -6 \
    | tee "$OUT/sampler_race.log"
exit 0
