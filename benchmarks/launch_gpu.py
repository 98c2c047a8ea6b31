"""torchrun with CUDA graphs on every rank against one GPU (issue 9's GPU acceptance; issue 12's
four-GPU runs with --layouts tp2dp2, and --moe for the MoE target over DeepEP).

    python3 benchmarks/launch_gpu.py --out $OUT [--layouts tp2,dp2] [--max-new-tokens 64]
    python3 benchmarks/launch_gpu.py --out $OUT --layouts tp2dp2             # 4 GPUs, dense
    python3 benchmarks/launch_gpu.py --out $OUT --layouts tp2dp2 --moe       # 4 GPUs, MoE EP=4

Runs the bundled target with its EAGLE-3 head (the default `speculant generate` job; with --moe
a random Qwen3-MoE of hidden 2048 and its dense twin as draft model, on token-id prompts),
greedy, CUDA graphs on (the default), on the same prompts:
  - one GPU:  `python3 -m speculant generate ...` with CUDA_VISIBLE_DEVICES=0;
  - each layout: `torchrun --standalone --nproc-per-node TP*DP -m speculant.launch.torchrun
    generate --tp TP --dp DP ...` (--moe: `--moe-backend deepep`, experts over every rank);
in float32 (token-for-token equality is the check: TP's split matmuls and all-reduce only
reorder float32 sums) and in bfloat16 (reported, where a reordered sum can flip a near tie).
Each command has its own timeout; the outputs' token ids are compared per request, the
acceptance lengths too. Writes OUT/launch_gpu.json and prints one table last; exit 1 when a run
fails or a dense float32 run differs from one GPU (DeepEP moves bfloat16, so an MoE float32 run
may differ after a near-tie: its verdict is reported).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import run_info

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


def parse_layout(text: str) -> tuple[int, int]:
    """'tp2' / 'dp2' / 'tp2dp2' -> (tp, dp)."""
    match = re.fullmatch(r"(?:tp(\d+))?(?:dp(\d+))?", text)
    if not text or match is None:
        raise SystemExit(f"bad layout {text!r}: write tpN, dpN or tpNdpM (e.g. tp2dp2)")
    return int(match.group(1) or 1), int(match.group(2) or 1)


def moe_job(folder: Path, vocab: int = 4096) -> tuple[list[str], str]:
    """A random float32 Qwen3-MoE in the published layout (hidden 2048: a DeepEP size; 8 experts
    top-2, 4 sparse layers) with its dense twin as the draft model (tests/test_moe_parallel's
    upcycling: drafts mostly accepted), and a prompts file of token ids. Returns the CLI
    arguments naming them and the prompts path."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from test_moe_parallel import save_upcycled_moe

    target, draft = folder / "moe_target", folder / "moe_draft"
    target.mkdir(parents=True, exist_ok=True)
    save_upcycled_moe(
        target, draft, noise=0.1, hidden_size=2048, intermediate_size=768,
        moe_intermediate_size=768, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, vocab_size=vocab, max_position_embeddings=1024,
        num_experts=8, num_experts_per_tok=2, mlp_only_layers=[],
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = folder / "moe_prompts.jsonl"
    with prompts.open("w") as f:
        for n in (5, 40, 1, 100, 17, 64, 3, 200):  # uneven; few enough to leave a DP rank short
            ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
            f.write(json.dumps({"prompt_token_ids": ids}) + "\n")
    job = ["--target", str(target), "--draft", str(draft), "--algo", "draft-model",
           "--num-draft-tokens", "3", "--max-num-seqs", "16", "--max-model-len", "512"]  # fmt: skip
    return job, str(prompts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", default=str(ROOT / "tests/data/heldout_prompts.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layouts", default="tp2,dp2", help="comma-separated tpN / dpN / tpNdpM")
    parser.add_argument(
        "--moe",
        action="store_true",
        help="a random Qwen3-MoE target (hidden 2048) instead of the bundled job",
    )
    parser.add_argument("--moe-backend", default="deepep", help="for --moe under torchrun")
    parser.add_argument("--case-timeout-s", type=float, default=150.0)
    args = parser.parse_args()
    layouts = [parse_layout(text) for text in args.layouts.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    job, job_ranks = [], []
    if args.moe:  # one rank keeps every expert; the ranks split them and move tokens
        job, args.prompts = moe_job(Path(tempfile.mkdtemp(prefix="launch-moe-")))
        job_ranks = ["--moe-backend", args.moe_backend]
    one = ["python3", "-m", "speculant", "generate", *job]
    report: dict = {**run_info("cuda"), "moe": args.moe, "cases": {}, "checks": {}}
    for dtype in args.dtypes.split(","):
        ref = run_case(f"one_gpu_{dtype}", one, ["--dtype", dtype], args, out)
        report["cases"][f"one_gpu_{dtype}"] = ref
        for tp, dp in layouts:
            torchrun = ["torchrun", "--standalone", "--nproc-per-node", str(tp * dp), "-m",
                        "speculant.launch.torchrun", "generate", *job, *job_ranks]  # fmt: skip
            name = f"torchrun_tp{tp}dp{dp}_{dtype}"
            layout = ["--tp", str(tp), "--dp", str(dp)]
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
        # bf16 and MoE (DeepEP moves bf16) may differ after a near-tie; float32 dense must not
        ok = ok and (check["verdict"] == "equal" or "bfloat16" in name or args.moe)
        ok = ok and check["verdict"] != "FAILED"
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
