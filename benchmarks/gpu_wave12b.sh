#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-03, wave 12): two pipeline stages for unsplit decode attention
# (kernels/paged_attention.py UNSPLIT_LAUNCH). The attention sweep on this tree (shipped vs the
# default stages, split plans), the GPU-marked kernel tests, the 8B-shape graph decode step
# (bf16 and FP8, bs 1 / 64) on the previous tree (.old_tree: `git archive BASE kernels models
# executor drafter comm launch config.py errors.py __init__.py __main__.py tools`, carried) and
# this one, then the realistic job (benchmarks/workload.py, 1,000 requests, default flags):
# previous tree, this tree, this tree. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
LOG="$OUT/wave12b.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG"
timeout 100 python3 benchmarks/attention_sweep.py --json "$OUT/attention_sweep.json" \
    --shapes 1x512,8x1024,64x512,192x512,64x2048,1x4096 --budget-s 80 2>&1 \
    | grep -v "Warning\|warn" | tail -14 | tee -a "$LOG"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py 2>&1 | tail -3 \
    | tee "$OUT/pytest_kernels_gpu.log" | tee -a "$LOG"
mkdir -p /tmp/spk_old && ln -sfn "$PWD/.old_tree" /tmp/spk_old/speculant
for label in old new; do
    path=/tmp/spk; [ $label = old ] && path=/tmp/spk_old
    PYTHONPATH=$path timeout 150 python3 benchmarks/decode_ab.py --label $label --rounds 3 \
        --json "$OUT/ab_$label.json" 2>&1 | grep -v "Warning\|it/s\]\|warn" | tail -3 | tee -a "$LOG"
done
(cd benchmarks && timeout 300 python3 workload.py --out "$OUT" --requests 1000 \
    --configs default,default --tree "$PWD/../.old_tree" --baseline-configs default \
    --timeout 120 2>&1 | grep -v "Warning\|warn" | tail -8 | tee -a "$LOG")
rm -f "$OUT"/workload_*.jsonl
