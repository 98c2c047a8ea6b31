#!/usr/bin/env bash
# One nvidia-h200 call (2026-12-04, wave 15c): the GPU tests on this session's final tree
# (decode / verify steps, kernels' attention, batch jobs, piecewise graphs, draft vocabularies),
# and the CLI with an absurd --max-num-seqs on a GPU (lowered to the rows memory holds, with a
# warning; was an allocation's traceback on the CPU). Logs under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 120 python3 -m speculant generate --max-num-seqs 100000000 --max-new-tokens 16 \
    > "$OUT/huge_seqs.out" 2> "$OUT/huge_seqs.err"; echo "rc=$?" >> "$OUT/huge_seqs.err"
tail -4 "$OUT/huge_seqs.err"
timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_kernels.py \
    tests/test_batch_jobs.py tests/test_piecewise.py tests/test_draft_vocab.py -x 2>&1 | tail -8 \
    | tee "$OUT/pytest_gpu.log"
exit 0
