"""The realistic job ([batch-jobs]): N requests of mixed lengths through the CLI, as a user runs
them. Prompt lengths lognormal (median 220, sigma 1.0, clipped to 16..3000), output lengths
lognormal (median 180, sigma 0.9, clipped to 16..1200; prompt + output kept within the default
context), `--ignore-eos` with a per-request `max_new_tokens`, random token ids, seeded. The
target is a Llama-3.1-8B-shape config with dummy bf16 weights (`--shape small`: the bundled
model's shape, for a CPU check of the script); `eagle3` runs an EAGLE-3-shape dummy head, k = 3.

Each named configuration is one `speculant generate` process of this checkout (whatever else is
installed as `speculant`; start-up included in `wall_s`, not in `gen_s`, the generate call the
CLI's summary line times; one that fails or passes `--timeout` is recorded as an error and the
next one runs). workload.json records the command, date and machine. `--tree DIR` runs the same job
through another checkout's CLI as `baseline` (the code this replaces), in the same run, first
(`--baseline-last`: after; the first run compiles the Triton kernels both trees share during
its extend steps, ~2 s on an H200: results/job_step_wave14.md).

    python benchmarks/workload.py --out OUT [--requests 1000] [--configs default,seqs256,...]
        [--tree OLD_CHECKOUT [--baseline-last]] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import run_info  # noqa: E402
from graphs import SHAPES, write_config  # noqa: E402
from spec_step import write_head  # noqa: E402

EAGLE3_K3 = ["--algo", "eagle3", "--num-draft-tokens", "3"]
CONFIGS = {  # name: extra CLI flags
    "default": [],
    "seqs128": ["--max-num-seqs", "128"],
    "seqs256": ["--max-num-seqs", "256"],
    "seqs512": ["--max-num-seqs", "512"],
    # a KV pool of 4096 pages (65,536 positions) for 512 rows: preemption all the time
    "tight": ["--num-pages", "4096"],
    "eagle3": ["--algo", "eagle3", "--num-draft-tokens", "3"],  # --draft added below
    "eagle3_auto": ["--algo", "eagle3", "--num-draft-tokens", "3", "--speculation", "auto"],
    # auto with the drafter caught up in every plain step (what the deferred catch-up replaced)
    "eagle3_auto_d0": [
        "--algo",
        "eagle3",
        "--num-draft-tokens",
        "3",
        "--speculation",
        "auto",
        "--catch-up-depth",
        "0",
    ],  # fmt: skip
    "eager": ["--enforce-eager"],
    "nopiecewise": ["--piecewise-sizes", "none"],  # extend steps eager, decode graphs kept
    "lazypiecewise": ["--piecewise-capture", "lazy"],
    "overlap": ["--overlap"],
    "prefix": ["--enable-prefix-caching"],
    "tight_prefix": ["--num-pages", "4096", "--enable-prefix-caching"],
    "eagle3_prefix": ["--algo", "eagle3", "--num-draft-tokens", "3", "--enable-prefix-caching"],
    "sync": ["--no-overlap"],
    # every output token's log-probability (and those of the 5 most likely): what it costs
    "logprobs0": ["--logprobs", "0"],
    "logprobs5": ["--logprobs", "5"],
    # the steps compute 5 alternatives, no request keeps them: the device's part of the cost
    "max_logprobs5": ["--max-logprobs", "5"],
    "eagle3_logprobs5": ["--algo", "eagle3", "--num-draft-tokens", "3", "--logprobs", "5"],
    # sampled steps (the full sampler variant), and with min-p: what its filter costs
    "sampled": ["--temperature", "0.8", "--top-p", "0.95"],
    "temperature": ["--temperature", "0.8"],  # no top-k / top-p: the SCALED sampler variant
    "eagle3_sampled": EAGLE3_K3 + ["--temperature", "0.8", "--top-p", "0.95"],
    "eagle3_temperature": EAGLE3_K3 + ["--temperature", "0.8"],
    "sampled_minp": ["--temperature", "0.8", "--top-p", "0.95", "--min-p", "0.05"],
    # four completions of every prompt (their prompt pages shared: prefilled once)
    "n4": ["--n", "4", "--temperature", "0.8"],
    "n4_prefix": ["--n", "4", "--temperature", "0.8", "--enable-prefix-caching"],
    "tp2": ["--tp", "2"],  # two GPUs (gpu_x2_batch.sh)
    "dp2": ["--dp", "2"],  # two GPUs; --max-num-seqs counts over both DP ranks
}
CONTEXT = 4096  # the default --max-model-len of an 8B Llama (min(checkpoint, 4096))
ROOT = Path(__file__).resolve().parent.parent  # this tree: what the configurations run


def make_job(
    n: int, seed: int, vocab: int, scale: float = 1.0, shared_prefix: int = 0
) -> list[dict]:
    """The job's JSONL records (prompt_token_ids, max_new_tokens); `scale` shrinks lengths;
    `shared_prefix` tokens (the same for every request: a system prompt) start every prompt."""
    rng = np.random.default_rng(seed)
    prefix = np.random.default_rng(seed + 1).integers(3, vocab, shared_prefix).tolist()
    prompt_lens = np.clip(rng.lognormal(math.log(220 * scale), 1.0, n), 16 * scale, 3000 * scale)
    output_lens = np.clip(rng.lognormal(math.log(180 * scale), 0.9, n), 16 * scale, 1200 * scale)
    records = []
    for p, o in zip(prompt_lens.astype(int), output_lens.astype(int), strict=True):
        p = int(min(p, CONTEXT * scale - shared_prefix - 32))
        o = int(max(1, min(o, CONTEXT * scale - shared_prefix - p - 16)))
        ids = prefix + rng.integers(3, vocab, int(max(p, 1))).tolist()
        records.append({"prompt_token_ids": ids, "max_new_tokens": o})
    return records


SUMMARY = re.compile(r"requests=(\d+) prompt_tokens=(\d+) output_tokens=(\d+) time=([\d.]+)s")


def cli_env(tree: str | None) -> dict[str, str]:
    """The environment of one CLI run: `tree` (this one when None, not whatever `speculant` is
    installed) importable as `speculant` from a link folder put first on PYTHONPATH, the rest
    of PYTHONPATH kept, so this tree and the baseline run with the same other packages."""
    env = dict(os.environ)
    link = Path(tempfile.mkdtemp()) / "speculant"
    link.symlink_to(Path(tree).resolve() if tree is not None else ROOT)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(link.parent), env.get("PYTHONPATH")]))
    return env


def startup_memory(err: str) -> dict:
    """What the engine's start-up lines say about GPU memory (GiB): the profiled step
    activations, the KV cache, and each kind of graph's pool (`graphs_gib`, keyed by the
    words before "graphs" in its line: "decode", "piecewise", "drafter piecewise", ...)."""
    found = {}
    if m := re.search(r"profiled step activations at \d+ tokens: ([\d.]+) GiB", err):
        found["activations_gib"] = float(m.group(1))
    if m := re.search(r"KV cache: \d+ pages of \d+ tokens \(([\d.]+) MiB\)", err):
        found["kv_cache_gib"] = round(float(m.group(1)) / 1024, 2)
    graphs = {}
    for kind, gib in re.findall(r"captured \d+ ([\w ]*?)\s*graphs \(.*?using ([\d.]+) GiB", err):
        graphs[kind.strip() or "decode"] = float(gib)
    if graphs:
        found["graphs_gib"] = graphs
    return found


def run_config(name: str, flags: list[str], target: str, job: Path, args, tree: str | None):
    """One CLI run; returns its figures (or the error, a time-out included) as a dict."""
    out = Path(args.out) / f"workload_{name}.jsonl"
    profile = Path(args.out) / f"profile_{name}.prof"
    python = [sys.executable] + (["-m", "cProfile", "-o", str(profile)] if args.profile else [])
    cmd = [*python, "-m", "speculant", "generate", "--target", target,
           "--load-format", "dummy", "--dtype", "bfloat16", "--device", args.device,
           "--prompts", str(job), "--output", str(out), "--ignore-eos", *flags]  # fmt: skip
    if args.debug:
        cmd.append("--debug")
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=cli_env(tree), capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:  # killed (its ranks stop with it): the next one runs
        return {"config": name, "flags": flags, "tree": tree, "exit": None,
                "wall_s": round(time.perf_counter() - start, 2),
                "error": f"timed out after {args.timeout} s (--timeout)"}  # fmt: skip
    wall = time.perf_counter() - start
    err = proc.stderr
    log = Path(args.out) / f"stderr_{name}.log"  # the whole of it (a traceback with --debug)
    log.write_text(err)
    result = {"config": name, "flags": flags, "tree": tree, "exit": proc.returncode,
              "wall_s": round(wall, 2), "stderr_log": str(log)}  # fmt: skip
    match = SUMMARY.search(err)
    if proc.returncode != 0 or match is None:
        tail = [line for line in err.splitlines() if line.strip()][-3:]
        result["error"] = " | ".join(tail)[-600:]
        return result
    requests, prompt_tokens, output_tokens, gen_s = match.groups()
    gen_s = float(gen_s)
    result.update(
        requests=int(requests),
        prompt_tokens=int(prompt_tokens),
        output_tokens=int(output_tokens),
        gen_s=gen_s,
        output_tokens_per_s=round(int(output_tokens) / gen_s, 1),
        total_tokens_per_s=round((int(output_tokens) + int(prompt_tokens)) / gen_s, 1),
    )
    sched = re.search(r"scheduler: (.*)", err)
    if sched:
        for item in sched.group(1).split():
            key, _, value = item.partition("=")
            try:
                result[key] = float(value) if "." in value else int(value)
            except ValueError:  # drafts_chosen=0:120,3:880
                result[key] = value
    accept = re.search(r"accept_len=([\d.]+)", err)
    if accept:
        result["accept_len"] = float(accept.group(1))
    result.update(startup_memory(err))
    if args.profile and profile.exists():
        result["host_profile"] = host_profile(profile)
    return result


def host_profile(path: Path, top: int = 25) -> list[dict]:
    """The main thread's functions with the most own time in a cProfile dump (the host's side
    of the job; the profiler slows Python about twice, so compare configurations, not seconds)."""
    import pstats

    stats = pstats.Stats(str(path)).stats
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [
        {"function": f"{Path(file).name}:{line}:{func}", "calls": calls,
         "own_s": round(own, 3), "cumulative_s": round(cumulative, 3)}
        for (file, line, func), (_, calls, own, cumulative, _) in rows
    ]  # fmt: skip


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, scale: float) -> None:
    """Refuse, in one line and before anything runs, what the job would ignore or get wrong."""
    lists = {"--configs": args.configs, "--baseline-configs": args.baseline_configs}
    for option, names in lists.items():
        unknown = [n for n in (names or "").split(",") if n and n not in CONFIGS]
        if unknown:
            parser.error(f"{option}: unknown {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    if args.tree is None and (args.baseline_last or args.baseline_configs is not None):
        parser.error("--baseline-configs and --baseline-last need --tree (the baseline's checkout)")
    if args.tree is not None and not Path(args.tree).is_dir():
        parser.error(f"--tree {args.tree}: not a folder")
    longest = int(CONTEXT * scale) - 48  # make_job keeps 32 for the prompt and 16 for output
    if not 0 <= args.shared_prefix <= longest:
        parser.error(
            f"--shared-prefix {args.shared_prefix}: at most {longest} with --shape {args.shape} "
            "(each prompt keeps room for its own tokens and its output)"
        )
    if args.requests < 1 or args.timeout < 1:
        parser.error("--requests and --timeout must be at least 1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for workload.json and the outputs")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--configs",
        default="default,seqs256,seqs512,eagle3",
        help="comma-separated, of: " + ", ".join(CONFIGS),
    )
    parser.add_argument("--tree", default=None, help="another checkout, run as `baseline`")
    parser.add_argument(
        "--baseline-configs", default=None, help="with --tree: the baseline's (default: default)"
    )
    parser.add_argument(
        "--baseline-last",
        action="store_true",
        help="run the baseline after this tree's configurations: kernels both trees share are "
        "then compiled (Triton's cache) by this tree's first run, in its generate time, not the "
        "baseline's (the default order gives this tree that advantage)",
    )
    parser.add_argument("--shape", choices=["llama8b", "small"], default="llama8b")
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="N tokens (one draw) start every prompt, as a shared system prompt (config "
        "`prefix`: --enable-prefix-caching)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--timeout", type=int, default=400, help="seconds per configuration")
    parser.add_argument(
        "--debug", action="store_true", help="pass --debug (tracebacks) to every CLI run"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run each configuration under cProfile: its host functions with the most own "
        "time go into its result (`host_profile`)",
    )
    args = parser.parse_args(argv)
    scale = 1.0 if args.shape == "llama8b" else 0.1
    check_args(parser, args, scale)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    shape = dict(SHAPES[args.shape])
    shape["max_position_embeddings"] = max(shape.get("max_position_embeddings", 0), CONTEXT)
    target = write_config(shape)
    head = write_head(shape)
    head_config = json.loads((Path(head) / "config.json").read_text())
    head_config["draft_vocab_size"] = min(head_config["draft_vocab_size"], shape["vocab_size"])
    (Path(head) / "config.json").write_text(json.dumps(head_config))
    records = make_job(args.requests, args.seed, shape["vocab_size"], scale, args.shared_prefix)
    job = Path(args.out) / "workload_job.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in records))
    report = {
        **run_info(args.device, argv),
        "shape": args.shape,
        "requests": args.requests,
        "shared_prefix": args.shared_prefix,
        "job_prompt_tokens": sum(len(r["prompt_token_ids"]) for r in records),
        "job_output_tokens": sum(r["max_new_tokens"] for r in records),
        "runs": [],
    }
    runs = [(name, None) for name in args.configs.split(",") if name]
    if args.tree:
        names = (args.baseline_configs or "default").split(",")
        baseline = [(f"baseline_{n}", args.tree) for n in names if n]
        runs = runs + baseline if args.baseline_last else baseline + runs
    for name, tree in runs:
        flags = list(CONFIGS[name.removeprefix("baseline_")])
        if "eagle3" in name:
            flags += ["--draft", head]
        result = run_config(name, flags, target, job, args, tree)
        report["runs"].append(result)
        print(json.dumps(result), flush=True)
        (Path(args.out) / "workload.json").write_text(json.dumps(report, indent=2))
    print(
        f"\njob: {report['requests']} requests, {report['job_prompt_tokens']} prompt + "
        f"{report['job_output_tokens']} output tokens ({args.shape}, {report['date']})"
    )
    print("| config | output tok/s | total tok/s | generate s | wall s | peak GiB | preemptions "
          "| mean decode batch |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in report["runs"]:
        if "error" in r:
            print(f"| {r['config']} | error (exit {r['exit']}): {r['error'][:120]} |")
            continue
        print(f"| {r['config']} | {r['output_tokens_per_s']:.0f} | {r['total_tokens_per_s']:.0f} "
              f"| {r['gen_s']:.1f} | {r['wall_s']:.1f} | {r.get('peak_memory_gib', '-')} "
              f"| {r.get('preemptions', '-')} | {r.get('mean_decode_batch', '-')} |")  # fmt: skip
    return 0 if all("error" not in r for r in report["runs"] if r["tree"] is None) else 1


if __name__ == "__main__":
    sys.exit(main())
