#!/usr/bin/env bash
# Wave 18d (2026-12-05): the GPU-marked tests of the paths this session touched indirectly
# (Chunk.first for adaptive speculation, the free-page set, extend steps through piecewise
# graphs) on the final tree.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_adaptive.py \
    tests/test_piecewise.py tests/test_draft_vocab.py tests/test_prefix_cache.py 2>&1 \
    | tail -12 | tee "$OUT/pytest_gpu.log"
exit 0
