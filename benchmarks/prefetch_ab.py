"""Weight prefetch into L2 during a layer's small kernels (kernels/prefetch.py): the 8B-shape
graph decode step (dummy weights, `triton` backend, every row at `--context` tokens), bf16 and
block-wise FP8, at bs 1 and 64, per prefetch plan, graphs recaptured per plan in one engine and
the plans' order rotated each round; then graph replay == eager tokens with the fastest plan.

    python benchmarks/prefetch_ab.py --json OUT.json [--rounds 3] [--kinds bf16,fp8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

# FP8 routes at M = 1 (kernels/fp8_tuned.json): split-K GEMVs whose first programs read the
# first column slabs (qkv 1024 of 4096 columns, o 2048 of 4096, gate_up 512 of 4096, down
# 2048 of 14336); bf16: row-streaming GEMVs for qkv / o / down, cuBLAS for gate_up.
PLANS = {
    "fp8": {
        "none": {},
        "o": {"qkv": [("o", "cols", 0, 1)]},
        "o+gu8": {"qkv": [("o", "cols", 0, 1), ("gate_up", "cols", 0, 0.125)]},
        "chain": {
            "qkv": [("o", "cols", 0, 1), ("gate_up", "cols", 0, 0.125)],
            "o": [("gate_up", "cols", 0.125, 0.25)],
            "gate_up": [("down", "cols", 0, 1 / 7)],
            "down": [("next.qkv", "cols", 0, 0.25)],
        },
        "chain_big": {
            "qkv": [("o", "cols", 0, 1), ("gate_up", "cols", 0, 0.25)],
            "o": [("gate_up", "cols", 0.25, 0.375)],
            "gate_up": [("down", "cols", 0, 2 / 7)],
            "down": [("next.qkv", "cols", 0, 0.5)],
        },
        "chain_last": "chain",  # the chain with prefetch.global.L2::evict_last
    },
    "bf16": {
        "none": {},
        "o_half": {"qkv": [("o", "rows", 0, 0.5)]},
        "o": {"qkv": [("o", "rows", 0, 1)]},
        "chain": {
            "qkv": [("o", "rows", 0, 0.5)],
            "gate_up": [("down", "rows", 0, 0.25)],
            "down": [("next.qkv", "rows", 0, 0.25)],
        },
        "chain_gu": {
            "qkv": [("o", "rows", 0, 0.5), ("gate_up", "rows", 0, 0.1)],
            "gate_up": [("down", "rows", 0, 0.25)],
            "down": [("next.qkv", "rows", 0, 0.25)],
        },
        "chain_last": "chain",
    },
}


def plan_of(kind: str, name: str) -> tuple[dict, bool]:
    plan = PLANS[kind][name]
    if isinstance(plan, str):
        return PLANS[kind][plan], True
    return plan, False


def measure(kind: str, args) -> dict:
    from decode import build_engine, free, kernel_profile
    from fp8_gpu import targets
    from graphs import SHAPES, check_equal, live_rows, time_ms

    from speculant.kernels.prefetch import Prefetcher

    target = targets()[kind]
    engine = build_engine(target, "triton", args.context, [1, 64], piecewise=False)
    vocab = SHAPES["llama8b"]["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    layers = engine.model.model.layers
    names = list(PLANS[kind])
    out: dict = {"ms": {}, "bytes_per_layer": {}}
    prefetcher = None
    try:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                plan, last = plan_of(kind, name)
                if prefetcher is not None:
                    prefetcher.remove()
                prefetcher = Prefetcher(layers, plan, evict_last=last)
                out["bytes_per_layer"][name] = prefetcher.bytes_per_layer
                engine.clear_graphs()
                engine.capture_graphs()
                rows = live_rows(engine, 64, vocab, args.context, gen)
                for bs in (1, 64):
                    ms = time_ms(engine.graphs.graph("greedy", bs).replay, 30)
                    out["ms"].setdefault(name, {}).setdefault(str(bs), []).append(ms)
                if args.profile and r == args.rounds - 1 and name == order[-1]:
                    replay = engine.graphs.graph("greedy", 64).replay  # bs 64's kernels
                    out["profile_bs64"] = {"plan": name, **kernel_profile(replay, top=25)}
                for row in rows:
                    engine.kv.free(row)
                print(f"  {kind} round {r} {name}: "
                      + ", ".join(f"bs {b} {v[-1]:.3f}" for b, v in out["ms"][name].items()),
                      flush=True)  # fmt: skip
        med = {
            name: {bs: sorted(v)[len(v) // 2] for bs, v in per.items()}
            for name, per in out["ms"].items()
        }
        out["median_ms"] = med
        best = min(med, key=lambda n: med[n]["1"])
        out["best_bs1"] = best
        plan, last = plan_of(kind, best)
        prefetcher.remove()
        prefetcher = Prefetcher(layers, plan, evict_last=last)
        engine.clear_graphs()
        engine.capture_graphs()
        out["graph_equals_eager_with_best"] = check_equal(engine, vocab, sizes=(1, 3))
        for name, m in med.items():
            print(f"  {kind} {name}: bs 1 {m['1']:.3f} ms, bs 64 {m['64']:.3f} ms "
                  f"({out['bytes_per_layer'][name] / 1e6:.1f} MB/layer)", flush=True)  # fmt: skip
        print(f"  {kind} best {best}: graph == eager {out['graph_equals_eager_with_best']}")
    finally:
        if prefetcher is not None:
            prefetcher.remove()
        free(engine)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default="fp8,bf16")
    parser.add_argument("--profile", action="store_true", help="bs-64 kernel profile per kind")
    args = parser.parse_args()
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
        "context": args.context,
    }
    for kind in args.kinds.split(","):
        try:
            report[kind] = measure(kind, args)
        except Exception as exc:  # keep what the other kind gives
            import traceback

            traceback.print_exc()
            report[kind] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
