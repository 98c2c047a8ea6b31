#!/usr/bin/env bash
# Wave 30 (2026-12-07 eleventh session): wave 29's checks of the exponential-race sampler on its
# first GPU, after this session's sampler changes (exponentials from all 32 bits of the hash,
# top-k / top-p ranked by logit, the drafters' id table): the race's cost per step against the
# inverse-CDF draw at a 152k vocabulary (benchmarks/sampler_race.py; it also checks the kernel's
# draws equal the torch reference's), the kernel tests, and the GPU tests running seeded sampled
# steps through graphs and eager (graph == eager, speculative graph == eager, the draft vocab's
# graphs, min-p, match verify in graphs == plain), CUDA parity with transformers.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
timeout 120 python3 benchmarks/sampler_race.py --out "$OUT" 2>&1 | tail -12 \
    | tee "$OUT/sampler_race.log"
timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_race.py tests/test_gpu.py \
    tests/test_draft_vocab.py tests/test_min_p.py 2>&1 | tail -8 | tee "$OUT/wave30_pytest_gpu.log"
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_adaptive.py \
    -k "gpu_match_verify" 2>&1 | tail -4 | tee -a "$OUT/wave30_pytest_gpu.log"
exit 0
