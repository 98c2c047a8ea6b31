#!/usr/bin/env bash
# One nvidia-h200 call: --overlap against synchronous steps on the GPU, token for token, with
# graphs: the bundled job (EAGLE-3, held-out prompts) and 200 requests of the workload job on the
# 8B shape with dummy weights (plain). Verdicts in $OUT/overlap_check.log.
set -u
source "$(dirname "$0")/gpu_env.sh"
P=assets/prompts/heldout_prompts.jsonl
for mode in sync overlap; do
    flag=(); [ $mode = overlap ] && flag=(--overlap)
    timeout 100 python3 -m speculant generate --prompts $P --max-new-tokens 96 "${flag[@]}" \
        --output "$OUT/bundled_$mode.jsonl" 2>&1 | tail -2
done
(cd benchmarks && timeout 200 python3 workload.py --out "$OUT/wl" --requests 200 \
    --configs default,overlap --timeout 150 | tail -4)
python3 - "$OUT" <<'PY' | tee "$OUT/overlap_check.log"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
def ids(path):
    rows = [json.loads(line) for line in open(path)]
    return {r["index"]: r["token_ids"] for r in rows}
for name, a, b in [("bundled eagle3", "bundled_sync.jsonl", "bundled_overlap.jsonl"),
                   ("8B workload x200", "wl/workload_default.jsonl", "wl/workload_overlap.jsonl")]:
    x, y = ids(out / a), ids(out / b)
    diff = [i for i in x if x[i] != y.get(i)]
    print(f"{name}: {len(x)} requests, overlap == sync: {not diff and len(x) == len(y)}, "
          f"differing {diff[:10]}")
PY
rm -f "$OUT"/*.jsonl "$OUT"/wl/*.jsonl
