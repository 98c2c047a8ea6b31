#!/usr/bin/env bash
# Wave 23 (2026-12-06, fourth session): the one-read log-probability kernels (kernels/logprobs.py)
# against torch's logsumexp + topk, isolated (benchmarks/logprobs_kernel.py) and in the
# realistic job with `--logprobs 5` (this tree vs `.old_tree`, carried: 8fa7c6f, the baseline
# last), and their GPU tests. On an H200 first the pending issue-24 measurement (gpu_wave21b.sh's
# stream vs split-K M = 1 rows in the FP8 step) instead of the job. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
timeout 150 python3 benchmarks/logprobs_kernel.py --json "$OUT/wave23_logprobs_kernel.json" \
    2>&1 | tee "$OUT/wave23_logprobs_kernel.log" | tail -24
timeout 100 python3 -m pytest -q -x -m gpu tests/test_kernels.py -k top_logprobs 2>&1 | tail -2 \
    | tee "$OUT/wave23_pytest.log"
timeout 150 python3 -m pytest -q -x -m gpu tests/test_logprobs.py 2>&1 | tail -2 \
    | tee -a "$OUT/wave23_pytest.log"
case "$name" in
    *H200*)
        SKIP_LOGPROBS=1 bash benchmarks/gpu_wave21b.sh
        ;;
    *)
        warm_up_job
        mkdir -p "$OUT/job"
        (cd benchmarks && timeout 300 python3 workload.py --out "$OUT/job" --requests 1000 \
            --configs logprobs5,default --tree ../.old_tree --baseline-configs logprobs5,default \
            --baseline-last --timeout 70 2>&1 | tee "$OUT/job/workload.log" | tail -10)
        rm -f "$OUT"/*/workload_*.jsonl
        ;;
esac
exit 0
