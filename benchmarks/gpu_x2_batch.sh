#!/usr/bin/env bash
# Issue 25's runs on nvidia-h200-x2 ([batch-jobs] features on two GPUs), by phase:
#   workload  benchmarks/workload.py, the 1,000-request job through the CLI on the 8B shape
#             (dummy bf16 weights, graphs): one GPU (`default`), `--tp 2`, `--dp 2`; tokens/s of
#             each, and how many requests' bf16 tokens equal the one-GPU run's (informational:
#             other batch shapes round differently);
#   equality  benchmarks/parallel_gpu.py --chunked --skip-steps: a float32 small Llama, plain and
#             EAGLE-3, TP=2 and DP=2 with graphs against one GPU, under a 48-token budget and a
#             40-page pool (chunked prefill mixed into decode steps, preemption on both DP
#             ranks), each dense DP rank replaying its own sizes (no dummy steps);
#   moe       benchmarks/moe_engine_gpu.py at EP=2 (DP=2) over all2all and DeepEP with graphs,
#             speculative (draft model, k = 3), 30 KV pages, token budgets 24 (every forward,
#             eager mixed steps included, in DeepEP low-latency mode next to the replays) and
#             96 (larger chunk steps in normal mode, switching back to low-latency for replays);
#   ray       the Ray launcher with two GPU actors at TP=2 (the local Ray instance the driver
#             starts), the bundled job, against torchrun TP=2 token for token.
# Files under $OUT (8 at most come back): workload.json/.log, parallel_gpu.json/.log,
# moe_engine_x2.json, moe.log, ray_x2.json/.log. The scripts' own outputs stay in /tmp.
#
# The tracked tree is ~35 MiB and a call carries 64 MiB at most, so DeepEP (11 MiB) and Ray
# (22 MiB) travel in different calls. Two calls:
#   run(command="PHASE=workload,moe bash benchmarks/gpu_x2_batch.sh", kind="nvidia-h200-x2",
#       carry=[".whl/tokenspeed_deepep-1.2.1.post20251110-<tags>.whl"])  (the name pip saved)
#   run(command="PHASE=equality,ray bash benchmarks/gpu_x2_batch.sh", kind="nvidia-h200-x2",
#       carry=[".whl/ray-2.35.0-cp312-cp312-manylinux2014_x86_64.whl",
#              ".whl/jsonschema-4.26.0-py3-none-any.whl",
#              ".whl/jsonschema_specifications-2025.9.1-py3-none-any.whl",
#              ".whl/referencing-0.37.0-py3-none-any.whl",
#              ".whl/rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"])
# (DeepEP's wheel: `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_28_x86_64 -d .whl tokenspeed-deepep==1.2.1.post20251110`, shared/GPU.md; Ray's as
# in gpu_ray_x1.sh.) Expected: ~4 and ~4.5 minutes. Without a GPU (a check of the script):
#   OUT=/tmp/x2 X2_DEVICE=cpu bash benchmarks/gpu_x2_batch.sh
# runs every phase small on the CPU (gloo, eager, the small shape, Ray with CPU actors).
set -u
source "$(dirname "$0")/gpu_env.sh"
DEVICE=${X2_DEVICE:-cuda}
PHASE=${PHASE:-workload,equality,moe,ray}
SPK=$PYTHONPATH
WORK=$(mktemp -d /tmp/x2_batch.XXXX)
trap 'rm -rf "$WORK"' EXIT
has() { [[ ",$PHASE," == *",$1,"* ]]; }
if [ "$DEVICE" = cuda ]; then
    SMALL=() QUICK=() REQUESTS=${REQUESTS:-1000}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
else
    SMALL=(--shape small) QUICK=(--device cpu --quick) REQUESTS=${REQUESTS:-12}
fi

if has workload; then
    LOG="$OUT/workload.log"
    timeout 540 python3 benchmarks/workload.py --out "$WORK/workload" --device "$DEVICE" \
        --requests "$REQUESTS" --configs "${CONFIGS:-default,tp2,dp2}" --timeout 170 \
        "${SMALL[@]}" > "$LOG" 2>&1
    echo "workload exit $?" | tee -a "$LOG"
    cp "$WORK/workload/workload.json" "$OUT/" 2> /dev/null
    python3 - "$WORK/workload" >> "$LOG" <<'EOF'
import json, sys
from pathlib import Path

folder = Path(sys.argv[1])
def tokens(name):
    path = folder / f"workload_{name}.jsonl"
    if not path.is_file():
        return None
    return {row["index"]: row["token_ids"] for row in map(json.loads, path.open())}
ref = tokens("default")
for name in ("tp2", "dp2"):
    got = tokens(name)
    if ref is None or got is None:
        print(f"{name}: no outputs to compare")
        continue
    same = sum(got.get(i) == t for i, t in ref.items())
    print(f"{name}: {same}/{len(ref)} requests' tokens equal one GPU's (bf16; informational)")
EOF
    grep -A12 "^job:" "$LOG"
fi

if has equality; then
    LOG="$OUT/parallel_gpu.log"
    timeout 240 python3 benchmarks/parallel_gpu.py --out "$WORK/par" --chunked --skip-steps \
        --budget-s 220 "${QUICK[@]}" > "$LOG" 2>&1
    echo "parallel_gpu exit $?" | tee -a "$LOG"
    cp "$WORK/par/parallel_gpu.json" "$OUT/" 2> /dev/null
    grep -v "it/s\]" "$LOG" | tail -24
fi

if has moe; then
    LOG="$OUT/moe.log"
    : > "$LOG"
    if [ "$DEVICE" = cuda ] && ls .whl/tokenspeed_deepep-*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site_deepep .whl/tokenspeed_deepep-*.whl >> "$LOG" 2>&1 \
            || echo "DeepEP wheel install failed" | tee -a "$LOG"
        export PYTHONPATH=/tmp/site_deepep:$SPK
    elif [ "$DEVICE" = cuda ]; then
        echo "no .whl/tokenspeed_deepep-*.whl carried: the DeepEP phase reports skipped" \
            | tee -a "$LOG"
    fi
    for BUDGET in ${MOE_BUDGETS:-24 96}; do
        echo "=== budget $BUDGET" >> "$LOG"
        timeout 170 python3 benchmarks/moe_engine_gpu.py --out "$WORK/moe$BUDGET" \
            --max-num-batched-tokens "$BUDGET" --num-pages 30 --budget-s 150 "${QUICK[@]}" \
            >> "$LOG" 2>&1
        echo "moe_engine_gpu budget $BUDGET exit $?" >> "$LOG"
    done
    export PYTHONPATH=$SPK
    python3 - "$WORK" "$OUT/moe_engine_x2.json" ${MOE_BUDGETS:-24 96} <<'EOF'
import json, sys
from pathlib import Path

work, out, budgets = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
merged = {}
for budget in budgets:
    path = work / f"moe{budget}" / "moe_engine_gpu.json"
    merged[f"budget{budget}"] = json.loads(path.read_text()) if path.is_file() else None
out.write_text(json.dumps(merged, indent=1, default=str) + "\n")
EOF
    grep -v "it/s\]" "$LOG" | grep -E "^\||budget|EP=|under the|step ms|mean ms|exit|error" \
        | tail -40
fi

if has ray; then
    LOG="$OUT/ray_x2.log"
    : > "$LOG"
    if ls .whl/ray-2.35.0-*.whl > /dev/null 2>&1 \
        && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site_ray .whl/ray-2.35.0-*.whl .whl/jsonschema-*.whl \
            .whl/jsonschema_specifications-*.whl .whl/referencing-*.whl .whl/rpds_py-*.whl \
            >> "$LOG" 2>&1 || { echo "Ray wheel install failed"; tail -20 "$LOG"; }
        export PYTHONPATH=/tmp/site_ray:$SPK
    fi
    export RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
    python3 -c 'import ray; print("ray", ray.__version__, ray.__file__)' 2>&1 | tee -a "$LOG"
    head -n "${NUM_PROMPTS:-8}" assets/prompts/heldout_prompts_small.jsonl > "$WORK/prompts.jsonl"
    JOB=(generate --device "$DEVICE" --tp 2 --prompts "$WORK/prompts.jsonl" --max-new-tokens
         "${MAX_NEW_TOKENS:-64}" --ignore-eos --dist-timeout 120)
    step() {  # step NAME SECONDS COMMAND...: run, log, and record its status and wall time
        local name=$1 seconds=$2
        shift 2
        echo "=== $name: $*" >> "$LOG"
        local start=$SECONDS
        timeout "$seconds" "$@" >> "$LOG" 2>&1
        local rc=$?
        echo "=== $name exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
        echo "$name $rc $((SECONDS - start))" >> "$WORK/status"
    }
    step ray_tp2 200 python3 -m speculant.launch.ray "${JOB[@]}" --output "$WORK/ray_tp2.jsonl"
    step torchrun_tp2 150 torchrun --standalone --nproc-per-node 2 -m speculant.launch.torchrun \
        "${JOB[@]}" --output "$WORK/torchrun_tp2.jsonl"
    export PYTHONPATH=$SPK
    python3 - "$WORK" "$LOG" "$DEVICE" "$OUT/ray_x2.json" <<'EOF'
import json, re, sys
from pathlib import Path

work, log, device, out = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
status = (work / "status").read_text().splitlines() if (work / "status").is_file() else []
runs = {name: {"rc": int(rc), "wall_s": int(s)} for name, rc, s in map(str.split, status)}
text = log.read_text(errors="replace")
for name in ("ray_tp2", "torchrun_tp2"):
    run = runs.setdefault(name, {"rc": None})
    path = work / f"{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    run["tokens"] = {row["index"]: row["token_ids"] for row in rows}
    part = text.split(f"=== {name}: ", 1)[-1].split(f"=== {name} exit", 1)[0]
    summary = [line for line in part.splitlines() if "requests=" in line]
    run["summary"] = summary[-1] if summary else None
    # rank 0 logs "captured N graphs ..."; Ray forwards an actor's lines as "(RankWorker pid=..)"
    run["captured"] = [line.strip() for line in part.splitlines() if "captured" in line]
ref, got = runs["torchrun_tp2"]["tokens"], runs["ray_tp2"]["tokens"]
differ = sorted(i for i in ref if got.get(i) != ref[i])
ok = runs["ray_tp2"]["rc"] == 0 and runs["torchrun_tp2"]["rc"] == 0 and bool(ref)
result = {
    "device": device,
    "ray_version": (re.findall(r"^ray (\S+)", text, re.M) or [None])[0],
    "ray_tp2_equals_torchrun_tp2": ok and set(got) == set(ref) and not differ,
    "differing_requests": differ,
    "ray_actor_captured_graphs": any("RankWorker" in l for l in runs["ray_tp2"]["captured"]),
    "runs": {name: {k: v for k, v in run.items() if k != "tokens"} for name, run in runs.items()},
}
out.write_text(json.dumps(result, indent=1) + "\n")
verdict = result["ray_tp2_equals_torchrun_tp2"]
if device == "cuda":
    verdict = verdict and result["ray_actor_captured_graphs"]
print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
print("RAY VERDICT", "ok" if verdict else "FAILED")
EOF
fi
