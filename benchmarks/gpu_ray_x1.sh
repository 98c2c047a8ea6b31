#!/usr/bin/env bash
# One nvidia-h200 call: the Ray launcher on a GPU (issue 18, item 15). `python -m
# speculant.launch.ray generate` runs the bundled job (bundled target and its EAGLE-3 head,
# greedy, the first $NUM_PROMPTS prompts of assets/prompts/heldout_prompts_small.jsonl) with one
# GPU actor, CUDA graphs captured inside the actor, twice: on the local Ray instance the driver
# starts itself (ray_local), and on a cluster started first with `ray start --head --num-gpus 1`
# (ray_cluster, --ray-address; on the GPU host only: `ray stop --force` there ends every Ray
# process of the machine). The same job then runs under torchrun (one rank) and through the
# plain CLI, and the token ids are compared request by request with the CLI's. Writes under
# $OUT: ray_x1.json (verdicts, versions, the actor's graph-capture line), ray_x1.log (every
# command's output) and the output files; exit 1 when a run fails or the tokens differ.
#
# Ray is carried in .whl/ (the host has no package index): ray 2.35.0 for CPython 3.12, repacked
# without the parts this launcher never loads (Java jars, RLlib, Tune, Train, Data, Serve,
# Workflow, the dashboard's web build) and with LZMA-compressed members, 62 MiB -> 21 MiB, by
# .whl/slim_ray.py; plus the dependencies the host lacks (jsonschema, jsonschema-specifications,
# referencing, rpds-py). Run as:  run(command="bash benchmarks/gpu_ray_x1.sh", carry=[".whl"]).
# Without a GPU (a check of the script): OUT=/tmp/ray_x1 RAY_X1_DEVICE=cpu bash
# benchmarks/gpu_ray_x1.sh, with Ray importable (the carried cp312 wheels install only on 3.12).
set -u
source "$(dirname "$0")/gpu_env.sh"
DEVICE=${RAY_X1_DEVICE:-cuda}
NUM_PROMPTS=${NUM_PROMPTS:-4}
MAX_NEW=${MAX_NEW_TOKENS:-64}
LOG="$OUT/ray_x1.log"
: > "$LOG"
if ls .whl/ray-2.35.0-*.whl > /dev/null 2>&1 \
    && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/ray-2.35.0-*.whl .whl/jsonschema-*.whl \
        .whl/jsonschema_specifications-*.whl .whl/referencing-*.whl .whl/rpds_py-*.whl \
        >> "$LOG" 2>&1 || { echo "pip install failed"; tail -20 "$LOG"; exit 1; }
    export PYTHONPATH=/tmp/site:/tmp/spk
fi
export RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
python3 -c 'import ray; print("ray", ray.__version__, ray.__file__)' 2>&1 | tee -a "$LOG"

WORK=$(mktemp -d /tmp/ray_x1.XXXX)
head -n "$NUM_PROMPTS" assets/prompts/heldout_prompts_small.jsonl > "$WORK/prompts.jsonl"
JOB=(generate --device "$DEVICE" --prompts "$WORK/prompts.jsonl" --max-new-tokens "$MAX_NEW"
     --ignore-eos --dist-timeout 120)

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

trap 'rm -rf "$WORK"' EXIT
step ray_local 240 python3 -m speculant.launch.ray "${JOB[@]}" --output "$OUT/ray_local.jsonl"
RUNS="ray_local torchrun cli"
if [ "$DEVICE" = cuda ]; then
    RUNS="ray_local ray_cluster torchrun cli"
    ray_cmd() { python3 -m ray.scripts.scripts "$@"; }
    trap 'ray_cmd stop --force >> "$LOG" 2>&1; rm -rf "$WORK"' EXIT
    step ray_start 120 python3 -m ray.scripts.scripts start --head --port 6399 --num-gpus 1 \
        --num-cpus 4 --include-dashboard false --disable-usage-stats
    step ray_cluster 240 python3 -m speculant.launch.ray --ray-address 127.0.0.1:6399 \
        "${JOB[@]}" --output "$OUT/ray_cluster.jsonl"
    ray_cmd stop --force >> "$LOG" 2>&1
fi
step torchrun 200 torchrun --standalone --nproc-per-node 1 -m speculant.launch.torchrun \
    "${JOB[@]}" --output "$OUT/torchrun.jsonl"
step cli 200 python3 -m speculant "${JOB[@]}" --output "$OUT/cli.jsonl"

python3 - "$OUT" "$WORK/status" "$LOG" "$DEVICE" $RUNS <<'EOF'
import json, re, sys
from pathlib import Path

out, status, log, device = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
names = sys.argv[5:]
runs = {name: {"rc": int(rc), "wall_s": int(s)} for name, rc, s in
        (line.split() for line in status.read_text().splitlines())}
text = log.read_text(errors="replace")
for name in names:
    path = out / f"{name}.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    runs[name]["tokens"] = {row["index"]: row["token_ids"] for row in lines}
    runs[name]["accept_len"] = {row["index"]: row.get("accept_len") for row in lines}
    part = text.split(f"=== {name}: ", 1)[-1].split(f"=== {name} exit", 1)[0]
    summary = [line for line in part.splitlines() if "requests=" in line]
    runs[name]["summary"] = summary[-1] if summary else None
    # the engine logs "captured N graphs (sizes ..., variants ...)" on rank 0: in the Ray
    # actor's log, which Ray forwards to the driver prefixed "(RankWorker pid=...)"
    runs[name]["captured"] = [line.strip() for line in part.splitlines() if "captured" in line]
ref = runs["cli"]["tokens"]
result = {"device": device, "ray_version": (re.findall(r"^ray (\S+)", text, re.M) or [None])[0]}
ray_runs = [name for name in names if name.startswith("ray_")]
for name in [*ray_runs, "torchrun"]:
    got = runs[name]["tokens"]
    differ = sorted(i for i in ref if got.get(i) != ref[i])
    ok = runs[name]["rc"] == 0 and runs["cli"]["rc"] == 0 and ref and set(got) == set(ref)
    result[f"{name}_equals_cli"] = bool(ok and not differ)
    result[f"{name}_differing_requests"] = differ
for name in ray_runs:  # the capture line came from the actor (Ray prefixes its lines)
    result[f"{name}_actor_captured_graphs"] = any("RankWorker" in line
                                                  for line in runs[name]["captured"])
result["runs"] = {name: {k: v for k, v in run.items() if k != "tokens"} for name, run in runs.items()}
(out / "ray_x1.json").write_text(json.dumps(result, indent=1) + "\n")
verdict = all(result[f"{name}_equals_cli"] for name in [*ray_runs, "torchrun"])
if device == "cuda":
    verdict = verdict and all(result[f"{name}_actor_captured_graphs"] for name in ray_runs)
print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
print("VERDICT", "ok" if verdict else "FAILED")
sys.exit(0 if verdict else 1)
EOF
