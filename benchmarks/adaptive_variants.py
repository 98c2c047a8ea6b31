"""[adaptive] chooser variants on the bundled models, measured in one run (one GPU).

adaptive_gpu.py's bundled part (plain, fixed and auto for EAGLE-3, DFLASH and the draft LM at
bs 1, 8, 32, 64, round-robin, median of ROUNDS) with auto in several chooser settings side by
side, each set on its engine's chooser after start-up:

- `auto`: the defaults;
- `auto steady`: a cycle counts only after STEADY_VARIANT same-shape steps in a row, and a
  plain check runs CHECK_VARIANT steps (so it yields steady cycles);
- `auto margin`: drafting must beat plain by MARGIN_VARIANT;
- `auto steady+margin`: both;
- `auto steady+batch`: steady, and the batch-wide acceptance estimate decays by BATCH_DECAY per
  verify row (a memory of ~1 / (1 - BATCH_DECAY) rows instead of the last few rows of a step).

Every auto engine also records its step cycles by (shape, size, place in a run of that shape:
1, 2, 3, 4+), to show how far the first steps after a change of shape are from steady ones.
The bar per variant: auto >= max(plain, fixed) - 3% at every size.

    python benchmarks/adaptive_variants.py --json OUT.json [--rounds 7] [--sizes 1,8,32,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from adaptive_gpu import one_generate  # noqa: E402

from speculant import Engine, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DRAFTERS = {  # name -> (algo, folder, k)
    "eagle3": ("eagle3", "eagle3", 4),
    "dflash": ("dflash", "dflash", 7),
    "draft-lm": ("draft-model", "draft_lm", 4),
}
STEADY_VARIANT, CHECK_VARIANT, MARGIN_VARIANT, BATCH_DECAY = 3, 4, 1.4, 0.97


def configure(engine: Engine, variant: str) -> None:
    chooser = engine.chooser
    if variant in ("auto steady", "auto steady+margin", "auto steady+batch"):
        chooser.costs.STEADY = STEADY_VARIANT
        chooser.CHECK_STEPS = CHECK_VARIANT
    if variant in ("auto margin", "auto steady+margin"):
        chooser.MARGIN = MARGIN_VARIANT
    if variant == "auto steady+batch":
        chooser.batch.decay = BATCH_DECAY


def record_cycles(engine: Engine, log: dict) -> None:
    """Wrap the engine's cycle observation: every completed cycle by (shape, size, place)."""
    original = engine._observe_cycle

    def observe() -> None:
        last = engine._cycle
        if last is not None:
            place = 1
            for key in reversed(engine._cycles_before):
                if key != last or place >= 4:
                    break
                place += 1
            seconds = time.perf_counter() - engine._cycle_start
            log.setdefault(f"{tuple(last[0])}@{last[1]} #{place}", []).append(seconds)
        original()

    engine._observe_cycle = observe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sizes", default="1,8,32,64")
    parser.add_argument("--variants", default="auto,auto steady,auto margin")
    parser.add_argument("--drafters", default="eagle3,dflash,draft-lm")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cpu":  # a smoke run on a CPU host
        torch.cuda.synchronize = lambda: None
        torch.cuda.get_device_name = lambda: "cpu"
    sizes = [int(s) for s in args.sizes.split(",")]
    variants = args.variants.split(",")
    lines = (ROOT / "assets" / "prompts" / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    while len(prompts) < max(sizes):
        prompts = prompts + prompts
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    common = dict(device=args.device, dtype=dtype, max_num_seqs=64, num_pages=4096)
    configs = [("plain", {}, None)]
    for name in args.drafters.split(","):
        algo, folder, k = DRAFTERS[name]
        options = dict(algo=algo, draft=str(ROOT / "assets" / folder), num_draft_tokens=k)
        configs.append((f"{name} fixed", dict(options, speculation="fixed"), None))
        for variant in variants:
            configs.append((f"{name} {variant}", dict(options, speculation="auto"), variant))
    engines, cycles = {}, {}
    for name, options, variant in configs:
        engine = Engine(str(ROOT / "assets" / "target"), **common, **options)
        if variant is not None:
            configure(engine, variant)
            record_cycles(engine, cycles.setdefault(name, {}))
        engine.generate(prompts[:1], params)  # warm-up
        engines[name] = engine
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
              "rates": {}, "verdict": {}, "cycles_ms": {}, "drafts_chosen": {}}  # fmt: skip
    outs = {}
    for bs in sizes:
        rates = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                rate, result = one_generate(engine, prompts[:bs], params)
                rates[name].append(rate)
                outs[(name, bs)] = [o.token_ids for o in result]
        for name in engines:
            report["rates"].setdefault(name, {})[bs] = {
                "tok_s": round(statistics.median(rates[name]), 1),
                "rounds": [round(r) for r in rates[name]],
                "equal_to_plain": outs[(name, bs)] == outs[("plain", bs)],
            }
        for name, _options, variant in configs:
            if variant is not None:
                report["drafts_chosen"].setdefault(name, {})[bs] = engines[name].chooser.summary()
        Path(args.json).write_text(json.dumps(report, indent=1))
    rates = report["rates"]
    for name, _options, variant in configs:
        if variant is None:
            continue
        drafter = name.split(" ")[0]
        points = {}
        for bs in sizes:
            best = max(rates["plain"][bs]["tok_s"], rates[f"{drafter} fixed"][bs]["tok_s"])
            points[bs] = round(rates[name][bs]["tok_s"] / best, 3)
        report["verdict"][name] = {"auto_vs_best": points,
                                   "met": sum(v >= 0.97 for v in points.values())}  # fmt: skip
        report["cycles_ms"][name] = {
            key: {"n": len(v), "median": round(statistics.median(v) * 1e3, 3)}
            for key, v in sorted(cycles[name].items())
        }
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps({"verdict": report["verdict"], "rates": rates}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
