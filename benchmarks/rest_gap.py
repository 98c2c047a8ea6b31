"""Where a resting adaptive engine loses its ~3% to plain decoding at bs 1 (bundled models, one
GPU; benchmarks/results/adaptive.md, wave 6: dflash and draft-LM auto, resting, ran 0.965-0.975
of plain in every round of two calls).

Engines: two plain engines (the spread between identical engines), and the draft-LM, DFLASH and
EAGLE-3 engines under `--speculation auto` held at rest. Four measurements, in this order
(the torch profiler, last, slows whatever runs after it):

1. output tokens/s, round-robin over the engines with the order rotated every round (ROUNDS
   rounds, median, and each engine's paired median ratio to the first plain engine);
2. the bs-1 graph a decode step replays (plain, or the resting graph): REPLAYS back-to-back
   replays timed with CUDA events (the GPU-bound step), and with a sync after each (latency);
3. the host's seconds per decode step in each part of `Engine.step` over one generate (wrapped
   methods), and the seconds spent waiting for the device;
4. the kernels of 20 replays of that graph under torch.profiler (count and device time).

    python benchmarks/rest_gap.py --json OUT.json [--device cpu --rounds 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from speculant import Engine, SamplingParams
from speculant.executor.sampling import GREEDY
from speculant.executor.speculation import PLAIN

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "assets"
ENGINES = {  # name -> options (auto engines are held at rest)
    "plain": {},
    "plain2": {},
    "draft-lm rest": dict(algo="draft-model", draft=str(ASSETS / "draft_lm"), num_draft_tokens=4),
    "dflash rest": dict(algo="dflash", draft=str(ASSETS / "dflash"), num_draft_tokens=7),
    "eagle3 rest": dict(algo="eagle3", draft=str(ASSETS / "eagle3"), num_draft_tokens=4),
}


def prompts_of(n: int) -> list[str]:
    lines = (ASSETS / "prompts" / "heldout_prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()][:n]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rates(engines: dict, prompts, params, rounds: int, device: str) -> dict:
    names = list(engines)
    seen = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync(device)
            start = time.perf_counter()
            outs = engines[name].generate(prompts, params)
            sync(device)
            seen[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    base = seen[names[0]]
    return {
        name: {
            "tok_s": round(statistics.median(values), 1),
            "paired_vs_plain": round(
                statistics.median(v / b for v, b in zip(values, base, strict=True)), 4
            ),
            "rounds": [round(v) for v in values],
        }
        for name, values in seen.items()
    }


def graph_key(engine: Engine):
    graphs = engine.graphs
    for key in graphs.graphs:
        variant, bs, shape = key
        if bs == 1 and shape == PLAIN and variant.startswith(GREEDY) and (
            variant.endswith("+rest") or not graphs.rests
        ):
            return key
    return None


def replay_times(engine: Engine, replays: int) -> dict:
    key = graph_key(engine)
    if key is None:
        return {"error": "no bs-1 plain graph (eager engine?)"}
    graph = engine.graphs.graphs[key]
    engine.runner.buffers.fill([], [], [], [], [], [], 1, engine.kv.sentinel_row)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    back_to_back = start.elapsed_time(end) * 1e3 / replays
    latency = []
    for _ in range(replays // 5):
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        latency.append(time.perf_counter() - t)
    return {
        "graph": f"{key[0]}@{key[1]}",
        "back_to_back_us": round(back_to_back, 2),
        "sync_latency_us": round(statistics.median(latency) * 1e6, 2),
    }


PARTS = (  # (object attribute path, method) wrapped to time the host's parts of a step
    ("", "_observe_cycle"), ("scheduler", "schedule"), ("", "_choose_shape"), ("dp", "agree"),
    ("", "_settle_catch_up"), ("runner.buffers", "fill"), ("graphs", "run"),
    ("readback", "start"), ("", "_read"), ("", "_apply_verify"), ("", "_finish_done"),
    ("", "_extend"), ("", "_can_run_ahead"),
)  # fmt: skip


def host_parts(engine: Engine, prompts, params, device: str) -> dict:
    """Seconds per decode step in each wrapped part (nested parts are counted in their callers
    too: _read holds the wait and _apply_verify)."""
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    restore = []

    def wrap(owner, name):
        method = getattr(owner, name)

        @functools.wraps(method)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t
                calls[name] += 1

        setattr(owner, name, timed)
        restore.append((owner, name))

    for path, name in PARTS:
        owner = functools.reduce(getattr, path.split("."), engine) if path else engine
        if owner is not None and hasattr(owner, name):
            wrap(owner, name)
    steps_before = engine.num_steps
    sync(device)
    start = time.perf_counter()
    engine.generate(prompts, params)
    sync(device)
    wall = time.perf_counter() - start
    for owner, name in restore:
        delattr(owner, name)
    steps = engine.num_steps - steps_before
    per_step = {name: round(s / steps * 1e6, 2) for name, s in sorted(spent.items())}
    return {"steps": steps, "wall_us_per_step": round(wall / steps * 1e6, 2),
            "us_per_step": per_step, "calls": dict(calls)}  # fmt: skip


def kernels(engine: Engine, replays: int = 20) -> dict:
    from torch.profiler import ProfilerActivity, profile

    key = graph_key(engine)
    if key is None:
        return {}
    graph = engine.graphs.graphs[key]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    return {
        "kernels_per_replay": round(sum(e.count for e in events) / replays, 1),
        "device_us_per_replay": round(sum(e.self_device_time_total for e in events) / replays, 2),
        "top": [
            {"kernel": e.key[:90], "per_replay": e.count / replays,
             "us_per_replay": round(e.self_device_time_total / replays, 2)}  # fmt: skip
            for e in events[:40]
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--replays", type=int, default=2000)
    args = parser.parse_args()
    gpu = args.device.startswith("cuda")
    common = dict(device=args.device, dtype="bfloat16" if gpu else "float32", max_num_seqs=64,
                  num_pages=4096)  # fmt: skip
    params = SamplingParams(max_new_tokens=128 if gpu else 16, ignore_eos=True)
    prompts = prompts_of(1)
    report = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["python"] + sys.argv),
    }
    engines = {}
    for name, options in ENGINES.items():
        auto = dict(options, speculation="auto") if options else {}
        engines[name] = Engine(str(ASSETS / "target"), **common, **auto)
        engines[name].generate(prompts, params)
        if options:
            engines[name].chooser.rest_left = 10**9  # held at rest
    report["rates"] = rates(engines, prompts, params, args.rounds, args.device)
    if gpu:
        report["replays"] = {n: replay_times(e, args.replays) for n, e in engines.items()}
    report["host"] = {n: host_parts(e, prompts, params, args.device) for n, e in engines.items()}
    report["rates_after"] = rates(engines, prompts, params, args.rounds, args.device)
    if gpu:
        report["kernels"] = {n: kernels(e) for n, e in engines.items()}
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("rates", "replays", "host") if k in report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
