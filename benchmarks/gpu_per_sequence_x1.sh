#!/usr/bin/env bash
# One nvidia-h200 call for [piecewise] (wave 7): the GPU tests of tests/test_piecewise.py and
# tests/test_adaptive.py, then benchmarks/per_sequence_gpu.py (the drafters' per-sequence part of
# extend steps as graphs by row count vs eager, fixed speculation, bundled models, bs 1/8/32/64).
# Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/per_sequence.log"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_piecewise.py \
    tests/test_adaptive.py 2>&1 | tail -8 | tee -a "$OUT/per_sequence.log"
(cd benchmarks && timeout 300 python3 per_sequence_gpu.py --json "$OUT/per_sequence.json") \
    2>&1 | grep -v Warning | tail -80 | tee -a "$OUT/per_sequence.log"
