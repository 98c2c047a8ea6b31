#!/usr/bin/env bash
# One nvidia-h200 call for [batch-jobs]: the GPU-marked tests (chunked/mixed steps on the Triton
# varlen kernel included), the 8B-shape decode step (graphs.py, bs 1..64), then the realistic job
# (benchmarks/workload.py) through the CLI: the previous main (.old_tree, carried, run as
# `baseline`) and this tree in the same run. Logs and JSON under $OUT.
#   PHASE=tests|job|all (default all); CONFIGS / BASELINE override workload.py's lists.
set -u
source "$(dirname "$0")/gpu_env.sh"
PHASE=${PHASE:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$PHASE" != job ]; then
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests -x 2>&1 | tail -15 \
        | tee "$OUT/pytest_gpu.log"
    (cd benchmarks && timeout 180 python3 graphs.py --models llama8b --json "$OUT/graphs.json" \
        2>&1 | grep -v "it/s\]" | tail -14 | tee "$OUT/graphs.log")
fi
if [ "$PHASE" != tests ]; then
    TREE=()
    [ -n "${BASELINE:-}" ] && TREE=(--tree "$PWD/.old_tree" --baseline-configs "$BASELINE")
    (cd benchmarks && timeout 560 python3 workload.py --out "$OUT" --requests 1000 \
        --configs "${CONFIGS:-default,seqs256,eagle3}" "${TREE[@]}" --timeout 240 \
        2>&1 | tee "$OUT/workload.log" | tail -12)
    rm -f "$OUT"/workload_*.jsonl
fi
