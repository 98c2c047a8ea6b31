#!/usr/bin/env bash
# One nvidia-h200 call for [adaptive]'s resting drafter: the GPU tests of tests/test_adaptive.py,
# then the realistic job (benchmarks/workload.py, 1,000 requests, 8B shape) with a dummy EAGLE-3
# head that accepts nothing: plain (the first run is cold, not compared), auto, plain, auto.
# Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/rest.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_adaptive.py -x 2>&1 \
    | tail -8 | tee -a "$OUT/rest.log"
(cd benchmarks && timeout 420 python3 workload.py --out "$OUT/wl" --requests 1000 \
    --configs "${CONFIGS:-default,eagle3_auto,default,eagle3_auto}" --timeout 110) 2>&1 \
    | grep -v Warning | tail -30 | tee -a "$OUT/rest.log"
