#!/usr/bin/env bash
# Wave 31, call 3: where the EAGLE-3 k 3 sampled job ran out of memory on an H100 (the tree
# before the SCALED variant, `--temperature 0.8`, wave31.md call 2: "Tried to allocate 33 GiB"
# at the end of start-up): this tree's FULL variant (`--top-p 0.95`), with tracebacks.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
(cd benchmarks && timeout 200 python3 workload.py --out "$OUT/job" --configs eagle3_sampled \
    --timeout 180 --debug 2>&1 | tail -4) | tee "$OUT/job.log"
cp "$OUT/job/workload.json" "$OUT/wave31c_job.json" 2>/dev/null
cp "$OUT"/job/stderr_*.log "$OUT/" 2>/dev/null
rm -rf "$OUT/job"
exit 0
