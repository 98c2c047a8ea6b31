"""DFlash2 on one GPU: a Qwen3-8B-shape dummy target with a dummy DFlash2 drafter shaped like
z-lab/Qwen3-8B-DFlash-b16 (5 layers, block 16, k = 15) plus the selector and convolutions
(--rank, --top-k, --kernel, --group). Checks that graph replay emits the same tokens as eager
steps (bs 1 and 8; greedy, and seeded sampling whose drafts and q come from the selector), and
times the whole speculative step, graph and eager, greedy and sampled variants, at bs 1 and 8 and
context 512, next to the same step with a DFLASH drafter of the same shape (--no-compare: skip).

Only config.json files are written (a temp dir); the weights are random (--load-format dummy),
so nothing here needs the `dflash` package.

    python benchmarks/dflash2_gpu.py [--json OUT.json]
    python benchmarks/dflash2_gpu.py --smoke   # CPU: a small shape, eager only (a dry run)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from graphs import SHAPES, check_equal, live_rows, time_ms, write_config
from spec_step import write_dflash

from speculant import Engine, SamplingParams

BATCH_SIZES = (1, 8)


def write_dflash2(target: dict, rank: int, top_k: int, kernel: int, group: int, **kw) -> str:
    """The DFLASH drafter config with DFlash2's architecture and fields (dflash_config)."""
    path = Path(write_dflash(target, **kw))
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"].update(
        selector_rank=rank, selector_top_k=top_k, conv_kernel_size=kernel, conv_group_size=group
    )
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def make_engine(target: str, **options) -> Engine:
    """Fixed k every step (where the tree has adaptive speculation), so every step drafts."""
    try:
        return Engine(target, speculation="fixed", **options)
    except TypeError:  # a tree without --speculation
        return Engine(target, **options)


def graph_of(engine: Engine, variant: str, bs: int):
    graphs = engine.graphs
    if hasattr(graphs, "graph"):
        return graphs.graph(variant, bs)
    return graphs.graphs[(variant, bs)]


def sampled_buffers(engine: Engine, rows: list[int], vocab: int, gen) -> None:
    """The next step's inputs of `rows` as seeded sampled requests (temperature 0.8, top-p 0.9)."""
    bs = len(rows)
    ids = torch.randint(3, vocab, (bs, engine.tokens_per_req), generator=gen).tolist()
    engine.runner.buffers.fill(
        rows, ids, [0.8] * bs, [0] * bs, [0.9] * bs, list(range(1, bs + 1)), bs,
        engine.kv.sentinel_row,
    )  # fmt: skip


def step_times(engine: Engine, vocab: int, context: int, cuda: bool) -> dict:
    """Median whole-step ms per bs: graph replay and eager, greedy and sampled ("full")."""
    out, gen = {}, torch.Generator().manual_seed(1)
    for bs in BATCH_SIZES:
        rows = live_rows(engine, bs, vocab, context, gen)
        entry = {}
        for variant in ("greedy", "full"):
            if variant == "full":
                sampled_buffers(engine, rows, vocab, gen)
            if cuda:
                entry[f"{variant}_graph_ms"] = time_ms(graph_of(engine, variant, bs).replay, 30)
            entry[f"{variant}_eager_ms"] = time_ms(
                lambda b=bs, v=variant: engine.runner.decode_step(b, v), 10, cuda
            )
        out[bs] = entry
        for row in rows:
            engine.kv.free(row)
    return out


def check_sampled_equal(engine: Engine, vocab: int) -> dict:
    """Seeded sampled generation: graph replay == eager, token for token, per bs."""
    gen, result = torch.Generator().manual_seed(2), {}
    for bs in BATCH_SIZES:
        prompts = [
            torch.randint(3, vocab, (int(n),), generator=gen).tolist()
            for n in torch.randint(4, 64, (bs,), generator=gen)
        ]
        params = [
            SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True)
            for s in range(bs)
        ]
        runs = []
        for graphs in (True, False):
            engine.graphs.use_graphs = engine.graphs.pad = graphs
            runs.append([o.token_ids for o in engine.generate(prompts, params)])
        engine.graphs.use_graphs = engine.graphs.pad = True
        result[bs] = runs[0] == runs[1]
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--rank", type=int, default=64, help="selector_rank")
    parser.add_argument("--top-k", type=int, default=32, help="selector_top_k")
    parser.add_argument("--kernel", type=int, default=4, help="conv_kernel_size")
    parser.add_argument("--group", type=int, default=128, help="conv_group_size")
    parser.add_argument("--no-compare", action="store_true", help="skip the DFLASH drafter")
    parser.add_argument("--smoke", action="store_true", help="CPU dry run on a small shape")
    args = parser.parse_args()
    t0 = time.perf_counter()
    cuda = not args.smoke
    shape = dict(SHAPES["qwen3_8b"]) if cuda else {
        **SHAPES["small"], "architectures": ["Qwen3ForCausalLM"], "head_dim": 64,
    }  # fmt: skip
    vocab = shape["vocab_size"]
    if args.smoke:
        args.context, args.k = 32, 7
    target = write_config(shape)
    common = dict(
        device="cuda" if cuda else "cpu",
        dtype="bfloat16" if cuda else "float32",
        load_format="dummy",
        max_num_seqs=8,
        max_model_len=args.context + 512,
        capture_sizes=list(BATCH_SIZES),
        num_draft_tokens=args.k,
        algo="dflash",
    )
    layers = 5 if cuda else 2
    report = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke)",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "k": args.k,
        "context": args.context,
        "dflash2_sizes": dict(
            rank=args.rank, top_k=args.top_k, kernel=args.kernel, group=args.group
        ),
        "command": " ".join(["python"] + sys.argv),
    }
    draft = write_dflash2(
        shape, args.rank, args.top_k, args.kernel, args.group,
        block_size=args.k + 1, num_layers=layers,
    )  # fmt: skip
    spec = make_engine(target, draft=draft, **common)
    assert type(spec.drafter).__name__ == "DFlash2Drafter", type(spec.drafter)
    if cuda:
        report["graph_equals_eager_greedy"] = check_equal(spec, vocab, sizes=BATCH_SIZES)
        report["graph_equals_eager_sampled"] = check_sampled_equal(spec, vocab)
    report["dflash2_steps"] = step_times(spec, vocab, args.context, cuda)
    del spec
    if cuda:
        torch.cuda.empty_cache()
    if not args.no_compare:
        dflash = make_engine(
            target, draft=write_dflash(shape, block_size=args.k + 1, num_layers=layers), **common
        )
        report["dflash_steps"] = step_times(dflash, vocab, args.context, cuda)
        del dflash
    report["wall_s"] = round(time.perf_counter() - t0, 1)

    print(f"\n{report['gpu']}  torch {report['torch']}  {report['date']}  k={args.k}  "
          f"context {args.context}  DFlash2 {report['dflash2_sizes']}")  # fmt: skip
    cols = list(report["dflash2_steps"][BATCH_SIZES[0]])
    print("| drafter | bs | " + " | ".join(cols) + " |")
    print("| --- | --- |" + " --- |" * len(cols))
    for name, steps in (("DFlash2", report["dflash2_steps"]),
                        ("DFLASH", report.get("dflash_steps", {}))):  # fmt: skip
        for bs, t in steps.items():
            print(f"| {name} | {bs} | " + " | ".join(f"{t[c]:.3f}" for c in cols) + " |")
    for key in ("graph_equals_eager_greedy", "graph_equals_eager_sampled"):
        if key in report:
            print(f"DFlash2 {key}: {report[key]}")
    print(f"wall {report['wall_s']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    ok = all(
        v for key in ("graph_equals_eager_greedy", "graph_equals_eager_sampled")
        for k, v in report.get(key, {}).items() if not str(k).endswith("_detail")
    )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
