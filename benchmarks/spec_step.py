"""Speculative step on one GPU with graphs. `--algo eagle3`: a Llama-3.1-8B-shape dummy target
with an EAGLE-3-shape dummy head (1 layer, draft vocabulary 32000), k draft tokens. `--algo
dflash`: a Qwen3-8B-shape dummy target with a Qwen3-8B-DFlash-b16-shape dummy drafter (5 layers,
block 16, k = 15 unless --k lowers it). Checks graph replay against eager (bs 1, 5, 32) and times
the whole step, its verify half (target forward over k+1 tokens, verify) and the draft half
(whole - verify), next to the plain (k = 0) step, at bs 1, 16, 64 and context 512.

    python benchmarks/spec_step.py [--algo eagle3|dflash] [--json OUT.json] [--k K]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from graphs import SHAPES, check_equal, live_rows, time_ms, write_config

from speculant import Engine


def write_head(target: dict) -> str:
    path = Path(tempfile.mkdtemp())
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": 32000,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        **{
            k: target[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "max_position_embeddings",
            )
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def write_dflash(target: dict, block_size: int = 16, num_layers: int = 5) -> str:
    """A drafter config shaped like z-lab/Qwen3-8B-DFlash-b16 (weights: --load-format dummy)."""
    path = Path(tempfile.mkdtemp())
    n = target["num_hidden_layers"]
    config = {
        "architectures": ["DFlashDraftModel"],
        "num_hidden_layers": num_layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": target.get("rope_theta", 1000000.0),
        "block_size": block_size,
        "num_target_layers": n,
        "dflash_config": {
            "mask_token_id": target["vocab_size"] - 1,
            "target_layer_ids": [
                round(1 + i * (n - 4) / (num_layers - 1)) for i in range(num_layers)
            ],
        },
        "torch_dtype": "bfloat16",
        **{
            k: target[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "vocab_size",
                "max_position_embeddings",
            )
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def capture(fn):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


def timings(engine: Engine, vocab: int, context: int, k: int, batch_sizes=(1, 16, 64)) -> dict:
    out, gen = {}, torch.Generator().manual_seed(1)
    runner = engine.runner
    for bs in batch_sizes:
        rows = live_rows(engine, bs, vocab, context, gen)
        whole = engine.graphs.graph("greedy", bs)
        verify_only = capture(lambda b=bs: runner.verify_step(b, "greedy"))
        entry = {"step_ms": time_ms(whole.replay, 30), "verify_ms": time_ms(verify_only.replay, 30)}
        entry["draft_ms"] = entry["step_ms"] - entry["verify_ms"]
        out[bs] = entry
        for row in rows:
            engine.kv.free(row)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--algo", choices=["eagle3", "dflash"], default="eagle3")
    parser.add_argument("--k", type=int, default=None, help="default: 3 (eagle3), 15 (dflash)")
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    shape = SHAPES["qwen3_8b" if args.algo == "dflash" else "llama8b"]
    args.k = args.k or (15 if args.algo == "dflash" else 3)
    target = write_config(shape)
    common = dict(
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        max_num_seqs=64,
        max_model_len=args.context + 512,
        capture_sizes=[1, 5, 16, 32, 64],
    )
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "algo": args.algo,
        "k": args.k,
        "command": " ".join(["python"] + sys.argv),
    }
    plain = Engine(target, **common)
    report["plain"] = timings(plain, shape["vocab_size"], args.context, 0)
    del plain
    torch.cuda.empty_cache()
    draft = write_dflash(shape) if args.algo == "dflash" else write_head(shape)
    spec = Engine(target, algo=args.algo, draft=draft, num_draft_tokens=args.k, **common)
    report["graph_equals_eager"] = check_equal(spec, shape["vocab_size"], sizes=(1, 5, 32))
    report["spec"] = timings(spec, shape["vocab_size"], args.context, args.k)
    print(f"\n{report['gpu']}  torch {report['torch']}  {report['date']}  {args.algo} k={args.k}")
    print(
        "| bs | plain step ms | verify (k+1) ms | draft ms | spec step ms | verify/plain | "
        "draft/plain |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for bs, t in report["spec"].items():
        p = report["plain"][bs]["step_ms"]
        print(
            f"| {bs} | {p:.3f} | {t['verify_ms']:.3f} | {t['draft_ms']:.3f} | "
            f"{t['step_ms']:.3f} | {t['verify_ms'] / p:.2f} | {t['draft_ms'] / p:.2f} |"
        )
    print(f"spec graph == eager: {report['graph_equals_eager']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
