#!/usr/bin/env bash
# One nvidia-h200 call on the session's final code: every GPU-marked test, the CLI's first-run
# timing with a cold Triton cache (the start-up warm-up), DFLASH's step on the Triton backend,
# and benchmarks/decode.py (with the transformers peers), graphs.py and bundled.py. Logs and JSON
# under $OUT; each step has its own timeout.
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/spk && ln -sfn "$PWD" /tmp/spk/speculant
export PYTHONPATH=/tmp/spk
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -6 | tee "$OUT/pytest_gpu.log"
for run in 1 2; do  # a cold Triton cache, then a warm one: the timed generate should match
    TRITON_CACHE_DIR=/tmp/triton_cli timeout 90 python3 -m speculant generate \
        --prompts tests/data/heldout_prompts.jsonl --max-new-tokens 64 --ignore-eos \
        --output /tmp/cli$run.jsonl 2>&1 | grep "^requests=" | sed "s/^/cli run $run: /"
done | tee "$OUT/cli_first_run.log"
cmp -s /tmp/cli1.jsonl /tmp/cli2.jsonl && echo "cli runs: same outputs" | tee -a "$OUT/cli_first_run.log"
cd benchmarks
timeout 150 python3 spec_step.py --algo dflash --json "$OUT/spec_step_dflash.json" 2>&1 \
    | grep -v "it/s\]" | tail -8
timeout 300 python3 decode.py --budget-s 230 --json "$OUT/decode.json" 2>&1 | grep -v "it/s\]" \
    > "$OUT/decode.log"; tail -28 "$OUT/decode.log"
timeout 150 python3 graphs.py --json "$OUT/graphs.json" 2>&1 | grep -v "it/s\]" | tail -9
timeout 120 python3 bundled.py --json "$OUT/bundled.json" 2>&1 | grep -v "it/s\]" | tail -10
