"""CPU generate time of the bundled models (what the test suite and CPU users run): plain,
EAGLE-3, DFLASH and the draft model, one batch of held-out prompts, this tree against another
checkout (`--tree`) in the same run, each in its own process, alternating, medians.

    python benchmarks/cpu_generate.py [--tree OLD_CHECKOUT] [--rows 8] [--new 64] [--rounds 3]
        [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import run_info

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "plain": "dict(num_draft_tokens=0)",
    "eagle3": "dict(algo='eagle3', draft=speculant.bundled('eagle3'))",
    "dflash": "dict(algo='dflash', draft=speculant.bundled('dflash'))",
    "draft-model": "dict(algo='draft-model', draft=speculant.bundled('draft_lm'))",
}
CHILD = """
import json, sys, time, torch, speculant
from speculant import Engine, SamplingParams
torch.set_num_threads(1)
rows, new = {rows}, {new}
lines = (speculant.bundled("target").parent / "prompts" / "heldout_prompts.jsonl").read_text()
prompts = [json.loads(x)["prompt"] for x in lines.splitlines() if x.strip()][:rows]
engine = Engine(speculant.bundled("target"), device="cpu", **{options})
params = SamplingParams(max_new_tokens=new, ignore_eos=True)
engine.generate(prompts[:2], params)
start = time.perf_counter()
outs = engine.generate(prompts, params)
print(json.dumps({{"s": time.perf_counter() - start, "file": speculant.__file__,
                  "tokens": sum(len(o.token_ids) for o in outs)}}))
"""


def run(options: str, tree: str | None, rows: int, new: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tree is not None:  # another checkout, importable as `speculant` from a link folder
        link = Path(tempfile.mkdtemp()) / "speculant"
        link.symlink_to(Path(tree).resolve())
        env["PYTHONPATH"] = str(link.parent)
    code = CHILD.format(rows=rows, new=new, options=options)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tempfile.gettempdir())  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=None, help="another checkout, run as `baseline`")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    unknown = [name for name in args.configs.split(",") if name not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    trees = {"this": str(ROOT)} | ({"baseline": args.tree} if args.tree else {})
    report = {**run_info("cpu"), "cpus": os.cpu_count(), "rows": args.rows, "new": args.new,
              "seconds": {}}  # fmt: skip
    for name in args.configs.split(","):
        times = {tree: [] for tree in trees}
        for _ in range(args.rounds):
            for tree, path in trees.items():
                times[tree].append(run(CONFIGS[name], path, args.rows, args.new)["s"])
        report["seconds"][name] = {t: round(statistics.median(v), 3) for t, v in times.items()}
        print(name, report["seconds"][name], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
