#!/usr/bin/env bash
# Wave 23, call 2 (2026-12-06): the log-probability kernels' loop variants side by side
# (logprobs_kernel.py --variants), the best one (least total time at top 5, rows <= 256) set in
# this copy of the tree, its GPU tests, then the realistic job with `--logprobs 5` vs
# `.old_tree` (8fa7c6f, carried), after a warm-up job that compiles the kernels of both. On
# an H200, gpu_wave23.sh's FP8 branch instead of the job. Logs and JSON under $OUT.
# (Ran on tree 4d335eb; its `for` variants and CONSTANT_CHUNKS are gone since: results/wave23.md.)
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
timeout 200 python3 benchmarks/logprobs_kernel.py --json "$OUT/wave23b_logprobs_kernel.json" \
    --variants for:1024:4,while:1024:4,while:2048:8,while:4096:8 \
    2>&1 | tee "$OUT/wave23b_logprobs_kernel.log" | tail -22
best=$(python3 - "$OUT/wave23b_logprobs_kernel.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r["top"] == 5 and r["rows"] <= 256]
totals = {v: sum(r["variants"][v] for r in rows) for v in rows[0]["variants"]}
print(min(totals, key=totals.get))
PY
)
echo "chosen: $best" | tee "$OUT/wave23b_choice.txt"
IFS=: read -r loop block warps <<< "$best"
sed -i -e "s/^BLOCK = [0-9]*/BLOCK = $block/" -e "s/^WARPS = [0-9]*/WARPS = $warps/" \
    -e "s/^CONSTANT_CHUNKS = [A-Za-z]*/CONSTANT_CHUNKS = $([ "$loop" = for ] && echo True || echo False)/" \
    kernels/logprobs.py
grep -n "^BLOCK\|^WARPS\|^CONSTANT_CHUNKS" kernels/logprobs.py | tee -a "$OUT/wave23b_choice.txt"
timeout 150 python3 -m pytest -q -x -m gpu tests/test_kernels.py -k top_logprobs 2>&1 | tail -2 \
    | tee "$OUT/wave23b_pytest.log"
timeout 200 python3 -m pytest -q -x -m gpu tests/test_logprobs.py 2>&1 | tail -2 \
    | tee -a "$OUT/wave23b_pytest.log"
case "$name" in
    *H200*) exit 0 ;;
esac
mkdir -p "$OUT/warm"
(cd benchmarks && timeout 150 python3 workload.py --out "$OUT/warm" --requests 64 \
    --configs logprobs5 --tree ../.old_tree --baseline-configs logprobs5 --timeout 70 2>&1 \
    | tail -3)
rm -rf "$OUT/warm"
mkdir -p "$OUT/job"
(cd benchmarks && timeout 300 python3 workload.py --out "$OUT/job" --requests 1000 \
    --configs logprobs5,default --tree ../.old_tree --baseline-configs logprobs5,default \
    --timeout 70 2>&1 | tee "$OUT/job/workload.log" | tail -7)
rm -f "$OUT"/*/workload_*.jsonl
exit 0
