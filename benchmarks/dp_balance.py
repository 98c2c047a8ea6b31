"""A `--dp 2` CPU job whose outputs end early at a stop string (so the ranks' static shares,
balanced by prompt + max tokens, drain unevenly): this tree against another checkout (`--tree`)
in the same run, each job in its own `speculant generate` process, alternating, medians of
wall time, and the job's steps (the `scheduler` line: every DP rank steps until all are done,
so rank 0's count is the job's) and `dp_moved_requests`.

    python benchmarks/dp_balance.py --tree OLD_CHECKOUT [--rows 64] [--new 96] [--rounds 3]
        [--max-num-seqs 4] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import run_info

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "assets" / "prompts" / "heldout_prompts.jsonl"


def run(tree: Path, prompts: Path, args: argparse.Namespace) -> dict:
    """One job with `tree` importable as `speculant`: wall seconds, steps, moved requests."""
    link = Path(tempfile.mkdtemp()) / "speculant"
    link.symlink_to(tree.resolve())
    env = dict(os.environ, PYTHONPATH=str(link.parent), OMP_NUM_THREADS="1")
    out = Path(tempfile.mkdtemp()) / "out.jsonl"
    cmd = [
        sys.executable, "-m", "speculant", "generate", "--device", "cpu", "--dp", "2",
        "--num-draft-tokens", "0", "--prompts", str(prompts), "--output", str(out),
        "--max-new-tokens", str(args.new), "--max-num-seqs", str(args.max_num_seqs),
        "--stop=\n\n",
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200,
                          cwd=tempfile.gettempdir())  # fmt: skip
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1])
    line = next(x for x in proc.stderr.splitlines() if x.startswith("scheduler"))
    stats = dict(re.findall(r"(\w+)=(\S+)", line))
    outputs = [json.loads(x) for x in out.read_text().splitlines()]
    return {
        "s": seconds,
        "steps": int(stats["steps"]),
        "moved": int(stats.get("dp_moved_requests", 0)),
        "tokens": sum(len(o["token_ids"]) for o in outputs),
        # the file holds outputs as they finish (on either rank): compared by prompt
        "ids": {o["index"]: o["token_ids"] for o in outputs},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", required=True, help="the checkout to compare with")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    lines = [x for x in PROMPTS.read_text().splitlines() if x.strip()][: args.rows]
    prompts = Path(tempfile.mkdtemp()) / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    trees = {"this": ROOT, "other": Path(args.tree)}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in list(trees)[:: 1 if r % 2 == 0 else -1]:
            runs[name].append(run(trees[name], prompts, args))
            print(name, {k: v for k, v in runs[name][-1].items() if k != "ids"}, flush=True)
    same = runs["this"][0]["ids"] == runs["other"][0]["ids"]
    summary: dict = {**run_info("cpu")}
    summary |= {
        name: {
            "median_s": round(statistics.median(x["s"] for x in rs), 2),
            "steps": rs[0]["steps"],
            "moved": rs[0]["moved"],
            "tokens": rs[0]["tokens"],
        }
        for name, rs in runs.items()
    }
    summary["speedup"] = round(summary["other"]["median_s"] / summary["this"]["median_s"], 3)
    summary["outputs_equal"] = same
    summary["args"] = vars(args)
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
