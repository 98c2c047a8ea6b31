#!/usr/bin/env bash
# One GPU call of wave 20 (2026-12-06; results/wave20.md), most important first:
# 1. the realistic job's prompts (250) with `--n 4` (four sampled completions each: the prompt
#    now prefilled once) and the default job on this tree vs the previous main (`.old_tree`,
#    carried: `git archive c00a207`), the baseline last;
# 2. where `--logprobs 5` costs (benchmarks/logprobs_cost.py: one batch through an engine
#    without and one with log-probabilities, round-robin, then each under torch.profiler);
# 3. the GPU tests of the files this wave touched.
# Logs and JSON under $OUT. PHASE=job|logprobs|tests runs one part.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
PHASE=${PHASE:-all}
if [ "$PHASE" = all ] || [ "$PHASE" = job ]; then
    mkdir -p "$OUT/job"  # the baseline runs last: this tree's first run compiles the kernels
    (cd benchmarks && timeout 300 python3 workload.py --out "$OUT/job" \
        --requests "${REQUESTS:-250}" --configs "${CONFIGS:-n4,default}" --tree ../.old_tree \
        --baseline-configs "${BASELINE:-n4,default}" --baseline-last --timeout 120 2>&1 \
        | tee "$OUT/job/workload.log" | tail -8)
    rm -f "$OUT"/*/workload_*.jsonl
fi
if [ "$PHASE" = all ] || [ "$PHASE" = logprobs ]; then
    timeout 170 python3 benchmarks/logprobs_cost.py --json "$OUT/logprobs_cost.json" \
        --rows 192 --prompt 512 --new 128 --logprobs 5 --rounds 2 2>&1 \
        | grep -v "Warning\|warn\|it/s\]" | tail -45 > "$OUT/logprobs_cost.log"
    tail -12 "$OUT/logprobs_cost.log"
fi
if [ "$PHASE" = all ] || [ "$PHASE" = tests ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_n.py \
        tests/test_prefix_cache.py tests/test_stop_strings.py 2>&1 \
        | tail -6 | tee "$OUT/pytest_gpu.log"
fi
exit 0
