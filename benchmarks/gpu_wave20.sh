#!/usr/bin/env bash
# GPU calls of wave 20 (2026-12-06; results/wave20.md). PHASE=a: the GPU tests of the files this
# wave touched (n completions sharing the prompt's pages, the scheduler, the attention backends'
# kv_len), then where `--logprobs 5` costs (benchmarks/logprobs_cost.py: the same batch through
# an engine without and one with log-probabilities, round-robin, then each under
# torch.profiler). PHASE=b: the realistic job's prompts with `--n 4` (four sampled completions
# each) on this tree vs the previous main (`.old_tree`, carried: `git archive c00a207`), and
# the default job on both, after a warm-up. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
PHASE=${PHASE:-a}
if [ "$PHASE" = a ]; then
    timeout 260 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
        tests/test_n.py tests/test_prefix_cache.py tests/test_batch_jobs.py 2>&1 \
        | tail -8 | tee "$OUT/pytest_gpu.log"
    timeout 280 python3 benchmarks/logprobs_cost.py --json "$OUT/logprobs_cost.json" \
        --rows 192 --prompt 512 --new 128 --logprobs 5 --rounds 3 2>&1 \
        | grep -v "Warning\|warn\|it/s\]" | tail -60 | tee "$OUT/logprobs_cost.log"
    exit 0
fi
warm_up_job
mkdir -p "$OUT/job"
(cd benchmarks && timeout 500 python3 workload.py --out "$OUT/job" --requests "${REQUESTS:-250}" \
    --configs "${CONFIGS:-n4,default}" --tree ../.old_tree \
    --baseline-configs "${BASELINE:-n4,default}" --timeout 150 2>&1 \
    | tee "$OUT/job/workload.log" | tail -10)
rm -f "$OUT"/*/workload_*.jsonl
exit 0
