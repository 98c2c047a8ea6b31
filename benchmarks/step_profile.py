"""Where a decode step's time goes on the bundled models (one GPU): host vs device per cycle.

For plain decoding, EAGLE-3 fixed, EAGLE-3 auto and EAGLE-3 auto held resting (its drafter
rests all the time: what plain steps of an adaptive engine cost without any drafter work),
at each batch size: output tokens/s (ROUNDS round-robin generates, median), then one generate
under cProfile (the host functions by own time: launching, filling inputs, waiting on the
read-back) and one under torch.profiler (GPU kernel time against wall time: the fraction of
a cycle the GPU is busy; the CUDA runtime calls by host time). Adaptive rows add their
observed step cycles per (shape, size) and the start-up table.

    python benchmarks/step_profile.py --json OUT.json [--sizes 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from speculant import Engine, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def prompts_of(n: int) -> list[str]:
    lines = (ROOT / "assets" / "prompts" / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    while len(prompts) < n:
        prompts = prompts + prompts
    return prompts[:n]


def host_profile(engine: Engine, prompts, params, top: int = 22) -> list[str]:
    profile = cProfile.Profile()
    profile.enable()
    engine.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()][-top - 1 :]


def device_profile(engine: Engine, prompts, params) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        engine.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    runtime = sorted(
        (e for e in events if e.key.startswith("cuda")), key=lambda e: -e.self_cpu_time_total
    )
    kernels = sorted(events, key=lambda e: -e.self_device_time_total)
    return {
        "wall_ms": round(wall * 1e3, 2),
        "gpu_busy_ms": round(gpu_us / 1e3, 2),
        "busy_fraction": round(gpu_us / 1e6 / wall, 3),
        "runtime_calls": [
            {"call": e.key, "count": e.count, "host_ms": round(e.self_cpu_time_total / 1e3, 2)}
            for e in runtime[:10]
        ],
        "top_device": [
            {"op": e.key[:80], "count": e.count, "ms": round(e.self_device_time_total / 1e3, 2)}
            for e in kernels[:12]
        ],
    }


def timeline(engine: Engine, prompts, params) -> dict:
    """One generate with every step's wall time (its shape, rows, extend or decode): the time
    before the first step and after the last, extend and decode steps by shape."""
    marks, original = [], engine.step

    def step():
        start, extends = time.perf_counter(), engine.extend_steps
        finished = original()
        launched = engine._launched
        shape = tuple(launched.shape) if launched is not None else None
        marks.append((start, time.perf_counter(), shape, engine.extend_steps != extends))
        return finished

    engine.step = step
    torch.cuda.synchronize()
    begin = time.perf_counter()
    engine.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    end = time.perf_counter()
    del engine.step
    by: dict[str, list[float]] = {}
    for start, stop, shape, extend in marks:
        kind = "extend" if extend else f"decode {shape}"
        by.setdefault(kind, []).append(stop - start)
    return {
        "total_ms": round((end - begin) * 1e3, 2),
        "before_first_ms": round((marks[0][0] - begin) * 1e3, 2) if marks else None,
        "after_last_ms": round((end - marks[-1][1]) * 1e3, 2) if marks else None,
        "steps": len(marks),
        "by_kind": {k: {"n": len(v), "sum_ms": round(sum(v) * 1e3, 2),
                        "median_ms": round(statistics.median(v) * 1e3, 3)} for k, v in by.items()},
    }  # fmt: skip


def phases(args, common, params) -> dict:
    """Plain vs adaptive engines held resting (DFLASH and the draft LM; one DFLASH engine that
    does not time its cycles): per generate, the wall time and the seconds in extend steps and
    in launching decode steps, ROUNDS round-robin generates per size, medians (no profiler)."""
    configs = {
        "plain": {},
        "dflash resting": dict(algo="dflash", draft=str(ROOT / "assets" / "dflash"),
                               num_draft_tokens=7, speculation="auto"),
        "dflash resting, no cycles": dict(algo="dflash", draft=str(ROOT / "assets" / "dflash"),
                                          num_draft_tokens=7, speculation="auto"),
        "draft-lm resting": dict(algo="draft-model", draft=str(ROOT / "assets" / "draft_lm"),
                                 num_draft_tokens=4, speculation="auto"),
    }  # fmt: skip
    engines = {}
    for name, options in configs.items():
        engine = engines[name] = Engine(str(ROOT / "assets" / "target"), **common, **options)
        if engine.chooser.adaptive:
            engine.chooser.rest_left = 10**9
            engine.chooser.costs.learns = not name.endswith("no cycles")
        engine.generate(prompts_of(1), params, use_tqdm=False)
    report = {}
    for bs in [int(s) for s in args.sizes.split(",")]:
        prompts = prompts_of(bs)
        rows = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                before = dict(engine.step_seconds), engine.num_steps
                torch.cuda.synchronize()
                start = time.perf_counter()
                engine.generate(prompts, params, use_tqdm=False)
                torch.cuda.synchronize()
                wall = time.perf_counter() - start
                rows[name].append((wall, engine.step_seconds["extend"] - before[0]["extend"],
                                   engine.step_seconds["decode"] - before[0]["decode"],
                                   engine.num_steps - before[1]))  # fmt: skip
        report[str(bs)] = {
            name: {
                "wall_ms": round(statistics.median(r[0] for r in runs) * 1e3, 3),
                "extend_ms": round(statistics.median(r[1] for r in runs) * 1e3, 3),
                "decode_launch_ms": round(statistics.median(r[2] for r in runs) * 1e3, 3),
                "steps": statistics.median(r[3] for r in runs),
                "paired_vs_plain": round(statistics.median(
                    p[0] / r[0] for p, r in zip(rows["plain"], runs, strict=True)), 4),
            }
            for name, runs in rows.items()
        }  # fmt: skip
        print(json.dumps(report[str(bs)], indent=1))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--sizes", default="8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mode", choices=["profile", "phases"], default="profile")
    args = parser.parse_args()
    if args.device == "cpu":  # a smoke run on a CPU host
        torch.cuda.synchronize = lambda: None
        torch.cuda.get_device_name = lambda: "cpu"
    sizes = [int(s) for s in args.sizes.split(",")]
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    common = dict(
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        max_num_seqs=64,
        num_pages=4096,
    )
    if args.mode == "phases":
        report = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
                  "command": " ".join(sys.argv), **phases(args, common, params)}  # fmt: skip
        Path(args.json).write_text(json.dumps(report, indent=1))
        return 0
    eagle = dict(algo="eagle3", draft=str(ROOT / "assets" / "eagle3"), num_draft_tokens=4)
    configs = {
        "plain": {},
        "eagle3 fixed": dict(eagle, speculation="fixed"),
        "eagle3 auto": dict(eagle, speculation="auto"),
        "eagle3 auto resting": dict(eagle, speculation="auto"),
        "draft-lm auto": dict(
            algo="draft-model",
            draft=str(ROOT / "assets" / "draft_lm"),
            num_draft_tokens=4,
            speculation="auto",
        ),  # fmt: skip
    }
    engines = {}
    for name, options in configs.items():
        engines[name] = Engine(str(ROOT / "assets" / "target"), **common, **options)
        engines[name].generate(prompts_of(1), params, use_tqdm=False)

    def hold_rest(name: str) -> None:
        if name.endswith("resting"):
            engines[name].chooser.rest_left = 10**9

    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv)}  # fmt: skip
    for bs in sizes:
        prompts = prompts_of(bs)
        rates = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                hold_rest(name)
                torch.cuda.synchronize()
                start = time.perf_counter()
                outs = engine.generate(prompts, params, use_tqdm=False)
                torch.cuda.synchronize()
                rates[name].append(
                    sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
                )
        rows = report.setdefault(str(bs), {})
        for name, engine in engines.items():
            hold_rest(name)
            steps_before = engine.num_steps
            row = rows[name] = {"tok_s": round(statistics.median(rates[name]), 1),
                                "rounds": [round(r) for r in rates[name]]}  # fmt: skip
            row["timeline"] = [timeline(engine, prompts, params) for _ in range(2)]
            hold_rest(name)
            row["device"] = device_profile(engine, prompts, params)
            row["steps_per_generate"] = engine.num_steps - steps_before
            row["device"]["ms_per_step"] = round(
                row["device"]["wall_ms"] / max(row["steps_per_generate"], 1), 4
            )
            row["host"] = host_profile(engine, prompts, params)
            costs = engine.chooser.costs
            if costs is not None:
                row["seen_ms"] = {
                    f"{tuple(s)}@{b}": round(t * 1e3, 3) for (s, b), t in costs.seen.items()
                }
                row["cycles_ms"] = {
                    f"{tuple(s)}@{b}": [round(t * 1e3, 3) for t in c]
                    for (s, b), c in costs.cycles.items()
                }
                row["table_ms"] = {
                    f"{tuple(s)}@{b}": round(t * 1e3, 3) for (s, b), t in costs.table.items()
                }
                row["drafts_chosen"] = engine.chooser.summary()
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(
            json.dumps(
                {name: {k: v for k, v in row.items() if k != "host"} for name, row in rows.items()},
                indent=1,
            )
        )
        for name, row in rows.items():
            print(f"--- host profile: {name} bs {bs}")
            print("\n".join(row["host"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
