"""[adaptive] policy replay on the CPU: the real engines (bundled target and drafters, real
acceptance) decide their steps as on the GPU, and each step is charged what it costs there.

Why: the bundled bar (adaptive_gpu.py) moves by 3-10% between GPU calls, too much to compare
chooser policies that differ by a few percent. Here the engine runs on the CPU, but its chooser
reads a cost table measured on an H200 (benchmarks/results/adaptive_bundled_2026-12-02_wave7_e_
auto_prefill.json: the observed cycles where present, the start-up table plus the host's share
elsewhere), and every step it takes is charged from the same table (extend steps from that
run's extend seconds per step). The token streams, the acceptance and every decision are the
engine's own; only time is modelled. So a policy change that wins here wins on the device only
as far as the table and the extend model are right: a GPU call still decides (gpu_pending.md).

    python benchmarks/adaptive_sim.py [--sizes 1,8] [--rounds 3] [--drafters eagle3,dflash,draft-lm]
        [--learn] [--variant NAME:ATTR=VALUE ...]

Without --learn the chooser's table is the observed cycles (no plain checks); with it, the
chooser starts from the replay table and learns the cycles as one GPU rank does.

Prints simulated tok/s per engine and size, and auto / max(plain, fixed) per drafter.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import run_info  # noqa: E402
from adaptive_variants import configure, parse_variant  # noqa: E402

from speculant import Engine, SamplingParams  # noqa: E402
from speculant.executor.cuda_graph import DEFAULT_SIZES  # noqa: E402
from speculant.executor.speculation import PLAIN, DraftShape, StepCosts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = {"eagle3": ("eagle3", "eagle3", 4), "dflash": ("dflash", "dflash", 7),
           "draft-lm": ("draft-model", "draft_lm", 4)}  # fmt: skip
# H200 cycles (ms) of the bundled engines at bs 1 / 8 / 32 / 64, host included (wave 7 call e):
# plain (0, 0), speculative (k, k), resuming (0, k); between sizes: linear in the padded size
CYCLES_MS = {
    "eagle3": {PLAIN: (0.171, 0.273, 0.391, 0.418), (4, 4): (0.48, 0.702, 0.945, 1.154),
               (0, 4): (0.384, 0.688, 0.897, 1.089)},
    "dflash": {PLAIN: (0.164, 0.256, 0.39, 0.421), (7, 7): (0.515, 0.76, 1.0, 1.07),
               (0, 7): (0.418, 0.74, 0.94, 0.98)},
    "draft-lm": {PLAIN: (0.169, 0.257, 0.39, 0.421), (4, 4): (0.521, 0.83, 1.06, 1.2),
                 (0, 4): (0.416, 0.817, 1.01, 1.09)},
}  # fmt: skip
# the start-up table of the same call (graph replays alone, no host share), for --learn
REPLAY_MS = {
    "eagle3": {PLAIN: (0.175, 0.263, 0.276, 0.284), (4, 4): (0.471, 0.53, 0.583, 0.616),
               (0, 4): (0.374, 0.516, 0.535, 0.551)},
    "dflash": {PLAIN: (0.182, 0.269, 0.282, 0.297), (7, 7): (0.52, 0.587, 0.707, 0.805),
               (0, 7): (0.423, 0.567, 0.648, 0.714)},
    "draft-lm": {PLAIN: (0.181, 0.268, 0.28, 0.289), (4, 4): (0.524, 0.655, 0.724, 0.81),
                 (0, 4): (0.419, 0.642, 0.678, 0.699)},
}  # fmt: skip
POINTS = (1, 8, 32, 64)
DTYPE = "bfloat16"  # as on the GPU: acceptance differs in float32
# extend steps (ms): plain 1.6 ms + 0.09 ms per row; drafting per sequence (graphs) adds
# 0.6 ms + 0.012 ms per row (the same call's extend seconds per extend step)
EXTEND_MS, EXTEND_ROW_MS, DRAFT_EXTEND_MS, DRAFT_EXTEND_ROW_MS = 1.6, 0.09, 0.6, 0.012


def cycle_ms(drafter: str, shape: DraftShape, bs: int, figures=CYCLES_MS) -> float:
    """The modelled cycle of a decode step of this shape at padded size bs."""
    points = figures[drafter][tuple(shape)]
    if bs <= POINTS[0]:
        return points[0]
    i = min(bisect.bisect_left(POINTS, bs), len(POINTS) - 1)
    lo, hi = POINTS[i - 1], POINTS[i]
    return points[i - 1] + (points[i] - points[i - 1]) * (bs - lo) / (hi - lo)


def padded(bs: int) -> int:
    return DEFAULT_SIZES[bisect.bisect_left(DEFAULT_SIZES, bs)]


class Clock:
    """Simulated device seconds of the steps an engine takes."""

    def __init__(self, engine: Engine, drafter: str):
        self.seconds, self.drafter, self.engine = 0.0, drafter, engine
        observe, extend = engine._observe_cycle, engine._extend

        def observe_cycle():
            cycle = engine._cycle
            if cycle is not None:
                self.seconds += cycle_ms(self.drafter, cycle[0], padded(cycle[1])) / 1e3
            observe()

        def extend_step(plan):
            rows = len(plan.decode) + len(plan.chunks)
            ms = EXTEND_MS + EXTEND_ROW_MS * rows
            if plan.shape.draft:
                ms += DRAFT_EXTEND_MS + DRAFT_EXTEND_ROW_MS * rows
            self.seconds += ms / 1e3
            return extend(plan)

        engine._observe_cycle, engine._extend = observe_cycle, extend_step


def build(
    drafter: str | None, mode: str, variant: dict | None = None, learn: bool = False
) -> tuple[Engine, Clock]:
    options = {}
    if drafter is not None:
        algo, folder, k = BUNDLED[drafter]
        options = dict(algo=algo, draft=str(ROOT / "assets" / folder), num_draft_tokens=k,
                       speculation=mode)  # fmt: skip
    engine = Engine(str(ROOT / "assets" / "target"), device="cpu", dtype=DTYPE,
                    max_num_seqs=64, num_pages=2048, **options)  # fmt: skip
    name = drafter or "eagle3"
    if engine.chooser.adaptive:  # the H200's cycles, as the engine would have learned them
        figures = REPLAY_MS if learn else CYCLES_MS
        table = {}
        for shape in figures[name]:
            for bs in DEFAULT_SIZES[: DEFAULT_SIZES.index(64) + 1]:
                table[(DraftShape(*shape), bs)] = cycle_ms(name, shape, bs, figures) / 1e3
        costs = engine.chooser.costs = StepCosts(table)
        if learn:  # start from the replays; each cycle the engine observes is the H200's
            costs.learns, observe = True, costs.observe
            costs.observe = lambda shape, bs, seconds: observe(
                shape, bs, cycle_ms(name, shape, padded(bs)) / 1e3
            )
        engine._drafts_cheaply = lambda plan: True  # greedy steps draft through graphs there
        configure(engine, variant or {})
    return engine, Clock(engine, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drafters", default="eagle3,dflash,draft-lm")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    parser.add_argument("--learn", action="store_true",
                        help="auto starts from the H200's replay table and learns its cycles "
                             "(plain checks, borrowed host shares) as on one GPU rank")  # fmt: skip
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME:ATTR=VALUE[,ATTR=VALUE] an auto engine with these chooser "
                             "settings beside the default one (adaptive_variants.py)")  # fmt: skip
    args = parser.parse_args()
    lines = (ROOT / "assets" / "prompts" / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    report: dict = run_info("cpu")
    for drafter in args.drafters.split(","):
        engines = {"plain": build(None, "fixed"), "fixed": build(drafter, "fixed"),
                   "auto": build(drafter, "auto", learn=args.learn)}  # fmt: skip
        for spec in args.variant:
            name, settings = parse_variant(spec)
            engines[name] = build(drafter, "auto", settings, learn=args.learn)
        engines["plain"][1].drafter = drafter
        for bs in sizes:
            rates, outs = {}, {}
            for name, (engine, clock) in engines.items():
                engine.generate(prompts[:bs], params)  # as the GPU bench's untimed generate
                tokens, start = 0, clock.seconds
                for _ in range(args.rounds):
                    result = engine.generate(prompts[:bs], params)
                    tokens += sum(len(o.token_ids) for o in result)
                    outs[name] = [o.token_ids for o in result]
                rates[name] = tokens / (clock.seconds - start)
            best = max(rates["plain"], rates["fixed"])
            row = {name: round(rate) for name, rate in rates.items()}
            for name in rates:
                if name.startswith("auto"):
                    row[f"{name} vs best"] = round(rates[name] / best, 3)
                    row[f"{name} equal plain"] = outs[name] == outs["plain"]
                    row[f"{name} chosen"] = engines[name][0].chooser.summary()
            report[f"{drafter}@{bs}"] = row
            print(f"{drafter}@{bs}", json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
