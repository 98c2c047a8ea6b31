#!/usr/bin/env bash
# One nvidia-h200 call: host time per decode step of the bundled model (benchmarks/host_overhead.py:
# packed inputs/outputs vs one copy per field, alternated), then benchmarks/bundled.py (tokens/s
# of the bundled models vs transformers) on the final code. Logs and JSON in $OUT.
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/spk && ln -sfn "$PWD" /tmp/spk/speculant
export PYTHONPATH=/tmp/spk
cd benchmarks
timeout 150 python3 host_overhead.py --json "$OUT/host_overhead.json" 2>&1 | grep -v "it/s\]" \
    | tee "$OUT/host_overhead.log" | tail -8
timeout 150 python3 bundled.py --json "$OUT/bundled.json" 2>&1 | grep -v "it/s\]" \
    | tee "$OUT/bundled.log" | tail -12
