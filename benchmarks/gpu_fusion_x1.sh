#!/usr/bin/env bash
# One nvidia-h200 call comparing kernel changes on the decode step (results/fp8_wave5.md): the
# 8B-shape graph decode step, bf16 and block-wise FP8, bs 1 / 64, on a base tree (.old_tree:
# `git archive BASE kernels models executor drafter comm launch config.py errors.py __init__.py
# __main__.py tools | tar -x -C .old_tree`, carried) and on this tree, old / new / old in the
# same call (benchmarks/decode_ab.py), this tree's bs-1 FP8 step also with every M = 1
# projection routed to each of $VARIANTS ("table" or PATH:CONFIG; graphs recaptured for each);
# then the GPU-marked FP8 kernel tests. Logs and JSON under $OUT; ~7 min. Wave 5 ran it with
# BASE abcfba5 at fe3118c, whose one-row `gemv` path the variants named (reverted since).
set -u
source "$(dirname "$0")/gpu_env.sh"
LOG="$OUT/fusion.log"
VARIANTS=${VARIANTS:-"table;splitk:16,1024,4,atomic;splitk:16,2048,8,atomic;splitk:32,512,4,atomic"}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG"
mkdir -p /tmp/spk_old && ln -sfn "$PWD/.old_tree" /tmp/spk_old/speculant
ab() {  # label pythonpath [extra args]
    local label=$1 path=$2
    shift 2
    PYTHONPATH=$path timeout 280 python3 benchmarks/decode_ab.py --label "$label" \
        --json "$OUT/ab_$label.json" "$@" 2>&1 | grep -v "Warning\|it/s\]\|warn" | tail -12 \
        | tee -a "$LOG"
}
ab old1 /tmp/spk_old
ab new1 /tmp/spk --profile --fp8-m1 "$VARIANTS"
ab old2 /tmp/spk_old --kinds fp8
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_kernels.py 2>&1 \
    | tail -6 | tee "$OUT/pytest_fp8_gpu.log" | tee -a "$LOG"
