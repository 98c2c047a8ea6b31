#!/usr/bin/env bash
# Wave 28 (2026-12-07): on an H200, first the issue-24 bar (gpu_wave25d.sh: the 8B FP8 graph
# step, shipped launch modes vs none, bf16, the bs-1 timeline); on any GPU, then the GPU tests
# of this session's loader / config changes (top-level original_max_position_embeddings, KV-head
# bias replication under TP, Qwen3's head_dim default, drafter tensors refused) and of the
# host paths the hunts touched: CUDA parity with transformers for the published configs, graphs
# == eager, drafters, logprobs, stops, batch jobs. Logs under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
    *H200*) bash benchmarks/gpu_wave25d.sh ;;
esac
timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
    tests/test_draft_vocab.py tests/test_logprobs.py tests/test_stop_strings.py tests/test_n.py \
    tests/test_batch_jobs.py 2>&1 | tail -8 | tee "$OUT/wave28_pytest_gpu.log"
exit 0
