"""Where `--logprobs N` costs the job's time (one GPU): the same batch of requests through two
engines on the 8B shape (dummy bf16 weights), one computing no log-probabilities and one
computing N per token, round-robin. Per engine: the generate's wall time and its seconds in
decode and extend steps, its scheduler figures (both engines get the same KV pool), and under
torch.profiler the device kernels that differ most between the two (ms per generate).

    python benchmarks/logprobs_cost.py --json OUT.json [--rows 192] [--prompt 512] [--new 128]
        [--logprobs 5] [--rounds 3] [--shape llama8b] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from graphs import SHAPES, write_config  # noqa: E402

from speculant import Engine, SamplingParams  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(engine: Engine, prompts, params, device: str) -> dict:
    before = dict(engine.step_seconds)
    sync(device)
    start = time.perf_counter()
    engine.generate(prompts, params)
    sync(device)
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "decode_s": engine.step_seconds["decode"] - before["decode"],
        "extend_s": engine.step_seconds["extend"] - before["extend"],
    }


def kernels(engine: Engine, prompts, params, device: str) -> tuple[float, float, dict]:
    """(wall s, GPU busy s, {kernel: device ms}) of one generate under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.generate(prompts, params)
        sync(device)
        wall = time.perf_counter() - start
    by = {}
    for event in prof.key_averages():
        if event.self_device_time_total > 0:
            by[event.key[:90]] = by.get(event.key[:90], 0.0) + event.self_device_time_total / 1e3
    return wall, sum(by.values()) / 1e3, by


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rows", type=int, default=192)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    target = write_config(SHAPES[args.shape])
    # two engines in one process: the same KV pool each, sized for the whole batch (a pool
    # sized from free memory would leave the second engine fewer pages: preemptions)
    page = 16
    pages = args.rows * -(-(args.prompt + args.new + 16) // page) + 64
    common = dict(device=args.device, dtype="bfloat16" if cuda else "float32",
                  load_format="dummy", max_num_seqs=args.rows, num_pages=pages,
                  page_size=page)  # fmt: skip
    rng = np.random.default_rng(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [rng.integers(3, vocab, args.prompt).tolist() for _ in range(args.rows)]
    plain = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    asked = SamplingParams(max_new_tokens=args.new, ignore_eos=True, logprobs=args.logprobs)
    engines = {
        "none": (Engine(target, **common), plain),
        f"logprobs{args.logprobs}": (Engine(target, max_logprobs=args.logprobs, **common), asked),
    }
    for engine, params in engines.values():  # warm-up: Triton compiles, graphs replay once
        engine.generate(prompts[:8], params)
    runs = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, (engine, params) in engines.items():
            runs[name].append(timed(engine, prompts, params, args.device))
    report = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(sys.argv),
        "rows": args.rows, "prompt": args.prompt, "new": args.new,
        "engines": {},
    }  # fmt: skip
    profiled = {}
    for name, (engine, params) in engines.items():
        wall, busy, by = kernels(engine, prompts, params, args.device)
        profiled[name] = by
        report["engines"][name] = {
            **{key: round(statistics.median(r[key] for r in runs[name]), 3)
               for key in ("wall_s", "decode_s", "extend_s")},
            "output_tok_s": round(args.rows * args.new
                                  / statistics.median(r["wall_s"] for r in runs[name]), 1),
            "profiled_wall_s": round(wall, 3),
            "kernel_s": round(busy, 3),  # summed as recorded: overlapping kernels add up
            "stats": engine.stats(),
        }  # fmt: skip
    a, b = profiled.values()
    diff = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in a.keys() | b.keys()}
    report["kernels_that_differ_ms"] = {
        k: {"without": round(a.get(k, 0.0), 2), "with": round(b.get(k, 0.0), 2)}
        for k in sorted(diff, key=lambda k: -abs(diff[k]))[:15]
    }
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
