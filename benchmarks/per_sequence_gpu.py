"""[piecewise] on one GPU: the drafter's per-sequence part of extend steps (drafting from each
sequence's last position) replayed as graphs by row count (executor/propose_graphs.py) against
the same part run eagerly, in the same run, under fixed speculation (the default), where every
prefill step drafts.

The bundled target with its trained EAGLE-3 (k 4), DFLASH (k 7) and draft LM (k 4), greedy on
the held-out prompts at bs 1, 8, 32 and 64 (128 new tokens), and plain decoding beside them.
For each drafter two engines: `graphs` (the default) and `eager` (the same engine kind with its
per-sequence graphs detached, as before). Each size is timed round-robin over every engine
(ROUNDS rounds, the order rotated each round, one untimed generate per engine first); the
figures are median tok/s, the paired (within-round) ratio graphs / eager, the seconds spent in
extend steps per generate, the graphs' capture time and memory, and whether the greedy tokens
equal the eager engine's and plain's.

    python benchmarks/per_sequence_gpu.py --json OUT.json [--rounds 15] [--sizes 1,8,32,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from speculant import Engine, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = {  # name -> (algo, folder, k)
    "eagle3": ("eagle3", "eagle3", 4),
    "dflash": ("dflash", "dflash", 7),
    "draft-lm": ("draft-model", "draft_lm", 4),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", default="1,8,32,64")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    gpu = args.device.startswith("cuda")
    assets = ROOT / "assets"
    lines = (assets / "prompts" / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    while len(prompts) < 64:
        prompts = prompts + prompts
    params = SamplingParams(max_new_tokens=128 if gpu else 8, ignore_eos=True)
    common = dict(device=args.device, dtype="bfloat16" if gpu else "float32", max_num_seqs=64,
                  num_pages=4096)  # fmt: skip
    if not gpu:  # the CPU smoke run: eager padding stands in for the graphs
        common.update(eager_padding=True, capture_sizes=[1, 8])
    sizes = [int(s) for s in args.sizes.split(",")]
    report = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["python"] + sys.argv),
    }
    engines: dict[str, Engine] = {"plain": Engine(str(assets / "target"), **common)}
    for name, (algo, folder, k) in BUNDLED.items():
        options = dict(algo=algo, draft=str(assets / folder), num_draft_tokens=k)
        for mode in ("graphs", "eager"):
            engine = Engine(str(assets / "target"), **common, **options)
            if mode == "eager":
                engine.drafter.per_sequence = None  # the per-sequence part runs eagerly
            engines[f"{name} {mode}"] = engine
    startup = {}
    for name, engine in engines.items():
        graphs = engine.piecewise.per_sequence
        startup[name] = {
            "startup_s": round(engine.startup_seconds, 2),
            "piecewise_capture_s": round(engine.piecewise.total_capture_seconds, 2),
            **(
                {
                    "per_sequence_capture_s": round(graphs.capture_seconds, 3),
                    "per_sequence_gib": round(graphs.memory_bytes / 2**30, 4),
                    "per_sequence_sizes": graphs.sizes,
                }  # fmt: skip
                if graphs is not None and name.endswith("graphs")
                else {}
            ),
        }
    report["startup"] = startup
    names = list(engines)
    rows: dict[str, dict] = {name: {} for name in names}
    for bs in sizes:
        batch = prompts[:bs]
        for engine in engines.values():
            engine.generate(batch, params)  # untimed: first-use costs of this size
        rates = {name: [] for name in names}
        extend_before = {n: (e.step_seconds["extend"], e.extend_steps) for n, e in engines.items()}
        outs = {}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                if gpu:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                outs[name] = engines[name].generate(batch, params)
                if gpu:
                    torch.cuda.synchronize()
                tokens = sum(len(o.token_ids) for o in outs[name])
                rates[name].append(tokens / (time.perf_counter() - start))
        plain = [o.token_ids for o in outs["plain"]]
        for name, engine in engines.items():
            seconds, steps = extend_before[name]
            row = {
                "tok_s": round(statistics.median(rates[name]), 1),
                "rounds": [round(v) for v in rates[name]],
                "extend_ms_per_generate": round(
                    (engine.step_seconds["extend"] - seconds) * 1e3 / args.rounds, 3
                ),
                "extend_steps_per_generate": (engine.extend_steps - steps) / args.rounds,
                "equal_to_plain": [o.token_ids for o in outs[name]] == plain,
            }
            graphs = engine.piecewise.per_sequence
            if graphs is not None and name.endswith("graphs"):
                row["per_sequence_replays"] = graphs.stats.replays
            rows[name][bs] = row
        for drafter in BUNDLED:
            g, e = rates[f"{drafter} graphs"], rates[f"{drafter} eager"]
            rows[f"{drafter} graphs"][bs]["paired_vs_eager"] = round(
                statistics.median(a / b for a, b in zip(g, e, strict=True)), 3
            )
            rows[f"{drafter} graphs"][bs]["equal_to_eager"] = [
                o.token_ids for o in outs[f"{drafter} graphs"]
            ] == [o.token_ids for o in outs[f"{drafter} eager"]]
            rows[f"{drafter} graphs"][bs]["paired_vs_plain"] = round(
                statistics.median(a / b for a, b in zip(g, rates["plain"], strict=True)), 3
            )
    report["rows"] = rows
    Path(args.json).write_text(json.dumps(report, indent=1))
    summary = {
        name: {
            bs: (row["tok_s"], row.get("paired_vs_eager"), row["extend_ms_per_generate"])
            for bs, row in by_size.items()
        }  # fmt: skip
        for name, by_size in rows.items()
    }
    print(json.dumps({"startup": startup, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
