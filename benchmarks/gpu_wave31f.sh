#!/usr/bin/env bash
# Wave 31, call 6 (the budget's rest): GPU tests whose graphs now include the `scaled` variant:
# every shape's graph count (test_adaptive.py) and the seeded graph == eager checks (test_gpu.py).
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_adaptive.py \
    -k "every_shape" tests/test_gpu.py 2>&1 | tail -5 | tee "$OUT/wave31f_pytest_gpu.log"
exit 0
