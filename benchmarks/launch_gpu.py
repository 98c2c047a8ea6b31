"""torchrun on two GPUs with CUDA graphs against one GPU (issue 9's GPU acceptance).

    python3 benchmarks/launch_gpu.py --out $OUT [--prompts FILE] [--max-new-tokens 64]

Runs the bundled target with its EAGLE-3 head (the default `speculant generate` job), greedy,
CUDA graphs on (the default), on the same prompts:
  - one GPU:  `python3 -m speculant generate ...` with CUDA_VISIBLE_DEVICES=0;
  - TP=2 and DP=2: `torchrun --standalone --nproc-per-node 2 -m speculant.launch.torchrun
    generate --tp 2 | --dp 2 ...`;
in float32 (token-for-token equality is the check: TP's split matmuls and all-reduce only
reorder float32 sums) and in bfloat16 (reported, where a reordered sum can flip a near tie).
Each command has its own timeout; the outputs' token ids are compared per request, the
acceptance lengths too. Writes OUT/launch_gpu.json and prints one table last; exit 1 when a
float32 run differs from one GPU or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_case(name: str, launcher: list[str], extra: list[str], args, out: Path) -> dict:
    output = out / f"{name}.jsonl"
    cmd = launcher + ["--prompts", args.prompts, "--max-new-tokens", str(args.max_new_tokens),
                      "--ignore-eos", "--output", str(output), *extra]  # fmt: skip
    env = dict(os.environ)
    if launcher[0] == "python3":
        env["CUDA_VISIBLE_DEVICES"] = "0"
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.case_timeout_s)  # fmt: skip
        rc, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stderr = "timeout", (exc.stderr or b"").decode(errors="replace")
    wall = time.perf_counter() - start
    text = output.read_text() if output.is_file() else ""
    lines = [json.loads(line) for line in text.splitlines()]
    summary = [line for line in stderr.splitlines() if line.startswith("requests=")]
    print(f"[{name}] rc={rc} wall={wall:.1f}s {summary[-1] if summary else stderr[-600:]}",
          flush=True)  # fmt: skip
    return {
        "command": " ".join(cmd),
        "rc": rc,
        "wall_s": round(wall, 1),
        "summary": summary[-1] if summary else None,
        "tokens": {line["index"]: line["token_ids"] for line in lines},
        "accept_len": {line["index"]: line["accept_len"] for line in lines},
        "stderr_tail": None if rc == 0 else stderr[-2000:],
    }


def compare(case: dict, ref: dict) -> dict:
    if case["rc"] != 0 or ref["rc"] != 0:
        return {"verdict": "FAILED"}
    if not ref["tokens"] or set(case["tokens"]) != set(ref["tokens"]):
        return {"verdict": "DIFFERENT", "why": "requests missing"}
    differ = [i for i in sorted(ref["tokens"]) if case["tokens"][i] != ref["tokens"][i]]
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    result = {
        "verdict": "equal" if not differ else "DIFFERENT",
        "requests": len(ref["tokens"]),
        "differing_requests": differ,
        "accept_len": round(mean(case["accept_len"]), 4),
        "accept_len_one_gpu": round(mean(ref["accept_len"]), 4),
    }
    if differ:
        a, b = case["tokens"][differ[0]], ref["tokens"][differ[0]]
        pairs = enumerate(zip(a, b, strict=False))
        result["first_diff_token"] = next(j for j, (x, y) in pairs if x != y)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", default=str(ROOT / "tests/data/heldout_prompts.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--case-timeout-s", type=float, default=150.0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    one = ["python3", "-m", "speculant", "generate"]
    torchrun = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m",
                "speculant.launch.torchrun", "generate"]  # fmt: skip
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "cases": {}, "checks": {}}
    for dtype in args.dtypes.split(","):
        ref = run_case(f"one_gpu_{dtype}", one, ["--dtype", dtype], args, out)
        report["cases"][f"one_gpu_{dtype}"] = ref
        for layout in (["--tp", "2"], ["--dp", "2"]):
            name = f"torchrun_{layout[0][2:]}2_{dtype}"
            case = run_case(name, torchrun, ["--dtype", dtype, *layout], args, out)
            report["cases"][name] = case
            report["checks"][name] = compare(case, ref)
            (out / "launch_gpu.json").write_text(json.dumps(report, indent=1))
    for path in out.glob("*.jsonl"):
        path.unlink()  # the token ids are in the JSON
    print("\n| run | vs one GPU (graphs) | requests | accept_len (one GPU) | tokens/s line |")
    print("| --- | --- | --- | --- | --- |")
    ok = True
    for name, check in report["checks"].items():
        ok = ok and (check["verdict"] == "equal" or "bfloat16" in name)
        summary = report["cases"][name]["summary"] or "-"
        print(f"| {name} | {check['verdict']} {check.get('differing_requests', '')} | "
              f"{check.get('requests')} | {check.get('accept_len')} "
              f"({check.get('accept_len_one_gpu')}) | {summary} |")  # fmt: skip
    for name in report["cases"]:
        if name.startswith("one_gpu"):
            print(f"{name}: {report['cases'][name]['summary']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
