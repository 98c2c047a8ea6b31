#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-03, wave 12): split plan of decode attention with 64 keys per
# split at least (was 256): the 8B-shape graph decode step (bf16 and FP8, bs 1 / 64) on the
# previous tree (.old_tree, carried) and this one, old / new / old. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
LOG="$OUT/wave12c.log"
mkdir -p /tmp/spk_old && ln -sfn "$PWD/.old_tree" /tmp/spk_old/speculant
for label in old1 new old2; do
    path=/tmp/spk; [ $label != new ] && path=/tmp/spk_old
    PYTHONPATH=$path timeout 150 python3 benchmarks/decode_ab.py --label $label --rounds 3 \
        --json "$OUT/ab_$label.json" 2>&1 | grep -v "Warning\|it/s\]\|warn" | tail -3 | tee -a "$LOG"
done
