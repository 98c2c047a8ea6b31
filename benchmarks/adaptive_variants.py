"""[adaptive] chooser variants on the bundled models, measured in one run (one GPU).

adaptive_gpu.py's bundled part (plain, fixed and auto for EAGLE-3, DFLASH and the draft LM at
bs 1, 8, 32, 64; one untimed generate per engine and size, then ROUNDS rounds in an order that
rotates every round) with auto in several chooser settings side by side, each set on its
engine's chooser after start-up. A variant is `NAME:ATTR=VALUE[,ATTR=VALUE...]`: chooser
attributes (`DECAY`, `MARGIN`, `CHECK_STEPS`, ...; `costs.STEADY` for the cost table's);
`auto` (always run) is the defaults.

Every auto engine also records its step cycles by (shape, size, place in a run of that shape:
1, 2, 3, 4+), to show how far the first steps after a change of shape are from steady ones.
The bar per variant: auto >= max(plain, fixed) - 3% at every size, read as in adaptive_gpu.py
from the paired ratio (the median over rounds of auto / max(plain, fixed) within the round).

    python benchmarks/adaptive_variants.py --json OUT.json [--rounds 15] [--sizes 1,8,32,64] \
        [--variant d9:DECAY=0.9 ...] [--drafters eagle3,dflash,draft-lm]
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


def parse_variant(spec: str) -> tuple[str, dict[str, float]]:
    """`NAME:ATTR=VALUE,...` -> ("auto NAME", {ATTR: VALUE})."""
    name, _, settings = spec.partition(":")
    values = {}
    for item in filter(None, settings.split(",")):
        attr, _, value = item.partition("=")
        values[attr] = float(value)
    return f"auto {name}", values


def configure(engine: Engine, settings: dict[str, float]) -> None:
    chooser = engine.chooser
    for attr, value in settings.items():
        owner, _, leaf = attr.rpartition(".")
        target = chooser.costs if owner == "costs" else chooser
        kind = type(getattr(target, leaf))
        setattr(target, leaf, kind(value))
    chooser.batch.decay = chooser.DECAY  # the estimate built at start-up


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
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", default="1,8,32,64")
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--drafters", default="eagle3,dflash,draft-lm")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cpu":  # a smoke run on a CPU host
        torch.cuda.synchronize = lambda: None
        torch.cuda.get_device_name = lambda: "cpu"
    sizes = [int(s) for s in args.sizes.split(",")]
    variants = [("auto", {})] + [parse_variant(spec) for spec in args.variant]
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
        for variant, settings in variants:
            configs.append((f"{name} {variant}", dict(options, speculation="auto"), settings))
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
    names = list(engines)
    for bs in sizes:
        rates = {name: [] for name in engines}
        for engine in engines.values():  # untimed: first-use costs of this size
            engine.generate(prompts[:bs], params)
        for r in range(args.rounds):  # the order rotates: no engine always follows the same one
            for name in names[r % len(names) :] + names[: r % len(names)]:
                rate, result = one_generate(engines[name], prompts[:bs], params)
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
        points, paired = {}, {}
        for bs in sizes:
            best = max(rates["plain"][bs]["tok_s"], rates[f"{drafter} fixed"][bs]["tok_s"])
            points[bs] = round(rates[name][bs]["tok_s"] / best, 3)
            rounds = zip(rates[name][bs]["rounds"], rates["plain"][bs]["rounds"],
                         rates[f"{drafter} fixed"][bs]["rounds"], strict=True)  # fmt: skip
            paired[bs] = round(statistics.median(a / max(p, f) for a, p, f in rounds), 3)
        report["verdict"][name] = {"auto_vs_best": points, "paired": paired,
                                   "met": sum(v >= 0.97 for v in paired.values())}  # fmt: skip
        report["cycles_ms"][name] = {
            key: {"n": len(v), "median": round(statistics.median(v) * 1e3, 3)}
            for key, v in sorted(cycles[name].items())
        }
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps({"verdict": report["verdict"], "rates": rates}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
