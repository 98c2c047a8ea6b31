"""Tokens/s of the bundled models on one GPU, with CUDA graphs: plain, EAGLE-3, DFLASH and draft-LM
decoding at bs 1 and 32 (greedy, held-out prompts, ignore EOS), and in the same run the peers a
user would reach for: `transformers` `generate` (bs 1 and 32) and its assisted generation with the
bundled draft LM as assistant (bs 1; transformers supports no larger batch there).

    python benchmarks/bundled.py [--assets assets] [--prompts assets/prompts/heldout_prompts.jsonl]
        [--max-new-tokens 128] [--json OUT.json]

Each row is wrapped: a failure is recorded in the JSON and the table, and the rest still runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from speculant import Engine, SamplingParams


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


ROOT = Path(__file__).resolve().parent.parent
REPEATS, PEER_REPEATS = 5, 3  # timed generates per row (ours, peers), median reported
RUNS = {  # name -> (algo, drafter folder, k)
    "plain": (None, None, 0),
    "eagle3 k=4": ("eagle3", "eagle3", 4),
    "dflash k=7": ("dflash", "dflash", 7),
    "draft-lm k=4": ("draft-model", "draft_lm", 4),
}


def read_prompts(path: Path, n: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows][:n]


def ours(assets: Path, prompts: list[str], max_new: int, name: str, device: str) -> dict:
    algo, folder, k = RUNS[name]
    engine = Engine(
        str(assets / "target"),
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        max_num_seqs=32,
        algo=algo,
        draft=str(assets / folder) if folder else None,
        num_draft_tokens=k,
    )
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    out = {}
    for bs in (1, 32):
        batch = prompts[:bs]
        engine.generate(batch, SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
        runs = []
        for _ in range(REPEATS):  # one generate is 30-100 ms here: take the median of a few
            sync()
            start = time.perf_counter()
            outputs = engine.generate(batch, params)
            sync()
            runs.append(time.perf_counter() - start)
        seconds = statistics.median(runs)
        tokens = sum(len(o.token_ids) for o in outputs)
        entry = {"tokens_per_s": tokens / seconds, "seconds": seconds, "runs_s": runs,
                 "tokens": tokens}  # fmt: skip
        if algo:
            steps = sum(o.stats["num_verify_steps"] for o in outputs)
            entry["accept_len"] = (
                sum(o.stats["accept_len"] * o.stats["num_verify_steps"] for o in outputs) / steps
            )
        out[bs] = entry
    del engine
    torch.cuda.empty_cache()
    return out


def peers(assets: Path, prompts: list[str], max_new: int, device: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets / "target")
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or "<|endoftext|>"
    load = dict(dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(assets / "target", **load).to(device).eval()
    assistant = AutoModelForCausalLM.from_pretrained(assets / "draft_lm", **load).to(device)
    out: dict = {}

    def timed(key, fn, tokens_fn):
        try:
            fn()  # warm-up
            runs = []
            for _ in range(PEER_REPEATS):
                sync()
                start = time.perf_counter()
                result = fn()
                sync()
                runs.append(time.perf_counter() - start)
            seconds = statistics.median(runs)
            out[key] = {"tokens_per_s": tokens_fn(result) / seconds, "seconds": seconds}
        except Exception as exc:  # a peer failing must not sink the run
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()

    gen = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    for bs in (1, 32):
        enc = tok(prompts[:bs], return_tensors="pt", padding=True).to(device)
        timed(
            f"transformers generate bs={bs}",
            lambda enc=enc: model.generate(**enc, **gen, pad_token_id=tok.pad_token_id),
            lambda r, enc=enc: (r.shape[1] - enc["input_ids"].shape[1]) * r.shape[0],
        )
    enc = tok(prompts[:1], return_tensors="pt").to(device)
    timed(
        "transformers assisted (draft LM) bs=1",
        lambda: model.generate(
            **enc, **gen, assistant_model=assistant, pad_token_id=tok.pad_token_id
        ),
        lambda r: r.shape[1] - enc["input_ids"].shape[1],
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--assets", default=str(ROOT / "assets"))
    parser.add_argument("--prompts", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda", help="cpu only to check the script")
    args = parser.parse_args()
    assets = Path(args.assets)
    prompts_path = Path(args.prompts or assets / "prompts" / "heldout_prompts.jsonl")
    prompts = read_prompts(prompts_path, 32)
    report = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python"] + sys.argv),
        "max_new_tokens": args.max_new_tokens,
        "ours": {},
    }
    for name in RUNS:
        try:
            report["ours"][name] = ours(assets, prompts, args.max_new_tokens, name, args.device)
        except Exception as exc:
            report["ours"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
    try:
        report["peers"] = peers(assets, prompts, args.max_new_tokens, args.device)
    except Exception as exc:
        report["peers"] = {"error": f"{type(exc).__name__}: {exc}"}
        traceback.print_exc()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(
        f"\n{report['gpu']}  torch {report['torch']}  {report['date']}  greedy, "
        f"{args.max_new_tokens} new tokens, held-out prompts"
    )
    print("| run | bs 1 tokens/s | bs 32 tokens/s | accept_len (bs 1 / 32) |")
    print("| --- | --- | --- | --- |")
    for name, entry in report["ours"].items():
        if "error" in entry:
            print(f"| {name} | error: {entry['error'][:60]} | | |")
            continue
        acc = (
            f"{entry[1]['accept_len']:.2f} / {entry[32]['accept_len']:.2f}"
            if "accept_len" in entry[1]
            else "-"
        )
        print(
            f"| speculant {name} | {entry[1]['tokens_per_s']:.0f} | "
            f"{entry[32]['tokens_per_s']:.0f} | {acc} |"
        )
    for name, entry in (report.get("peers") or {}).items():
        shown = entry.get("tokens_per_s")
        print(f"| {name} | {shown:.0f} |" if shown else f"| {name} | {entry} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
