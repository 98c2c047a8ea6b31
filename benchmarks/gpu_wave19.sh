#!/usr/bin/env bash
# GPU calls of wave 19 (2026-12-05; results/wave19.md):
# log-probabilities and min-p. The GPU tests of both (graph replays and steps run ahead vs
# eager, in float32), then the realistic job at default flags vs `--logprobs 5`
# (what computing them costs), EAGLE-3 with and without `--logprobs 5`, and sampled steps with
# and without `--min-p 0.05` (the filter runs in every sampled step's graph); after a
# 64-request warm-up. Logs and JSON under $OUT.
# PHASE=tests or PHASE=job runs one half; CONFIGS=a,b picks the job's configs (four fit one
# 600 s call); unset, all.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
PHASE=${PHASE:-all}
if [ "$PHASE" != job ]; then
    timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_logprobs.py \
        tests/test_min_p.py tests/test_stop_strings.py tests/test_prefix_cache.py 2>&1 \
        | tail -8 | tee "$OUT/pytest_gpu.log"
fi
[ "$PHASE" = tests ] && exit 0
warm_up_job
mkdir -p "$OUT/job"
(cd benchmarks && timeout 450 python3 workload.py --out "$OUT/job" --requests 1000 \
    --configs "${CONFIGS:-default,logprobs5,sampled,sampled_minp,eagle3,eagle3_logprobs5}" \
    --timeout 90 2>&1 \
    | tee "$OUT/job/workload.log" | tail -8)
rm -f "$OUT"/*/workload_*.jsonl
exit 0
