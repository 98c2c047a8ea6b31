"""Host time per decode step of the bundled model on one GPU, where the tiny model's tokens/s are
decided: the wall time of a steady-state step (`generate` of one or 32 prompts, 128 new tokens,
divided by its steps) against its graph replay alone (CUDA events), alternated in one process for
three host paths: overlap (`overlap=True`: the next step is launched from device-side inputs
before the current one is read back), synchronous steps (the default: inputs packed into two
copies, results read back before the next launch), and synchronous steps with the earlier
one-copy-per-field input fill.

    python benchmarks/host_overhead.py [--json OUT.json] [--repeats 5]
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
from speculant.executor.input_buffers import InputBuffers

ROOT = Path(__file__).resolve().parent.parent
RUNS = {"plain": (None, None, 0), "eagle3 k=4": ("eagle3", "eagle3", 4)}


def fill_per_field(self, rows, input_ids, temperature, top_k, top_p, seed, padded_bs, sentinel):
    """The earlier InputBuffers.fill: one host-to-device copy per field."""
    pad = padded_bs - len(rows)
    self.req_pool_indices[:padded_bs].copy_(torch.tensor(rows + [sentinel] * pad))
    self.input_ids[:padded_bs].copy_(
        torch.tensor(input_ids + [[0] * self.tokens_per_req] * pad, dtype=torch.int64)
    )
    self.temperature[:padded_bs].copy_(torch.tensor(temperature + [0.0] * pad))
    self.top_k[:padded_bs].copy_(torch.tensor(top_k + [0] * pad))
    self.top_p[:padded_bs].copy_(torch.tensor(top_p + [1.0] * pad))
    self.seed[:padded_bs].copy_(torch.tensor(seed + [0] * pad, dtype=torch.int64))


PATHS = {  # name -> (overlap, InputBuffers.fill)
    "overlap": (True, InputBuffers.fill),
    "synchronous": (False, InputBuffers.fill),
    "synchronous_per_field": (False, fill_per_field),
}


def replay_ms(engine: Engine, bs: int) -> float:
    """The graph replay alone, on a dummy batch (every row on the sentinel row, as an idle DP
    rank runs it): the inputs must be filled before any replay."""
    padded = engine.graphs.padded_bs(bs)
    engine.runner.buffers.fill([], [], [], [], [], [], padded, engine.kv.sentinel_row)
    graph = engine.graphs.graph("greedy", padded)
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50


def step_ms(engine: Engine, prompts: list[str], path: str, repeats: int) -> tuple[float, int]:
    engine.overlap, InputBuffers.fill = PATHS[path]
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    per_step = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        torch.cuda.synchronize()
        steps = max(o.stats["num_verify_steps"] for o in outputs)
        per_step.append((time.perf_counter() - start) * 1e3 / steps)
    engine.overlap, InputBuffers.fill = PATHS["overlap"]
    return statistics.median(per_step), steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assets", default=str(ROOT / "assets"))
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    assets = Path(args.assets)
    rows = (assets / "prompts" / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(r)["prompt"] for r in rows if r.strip()]
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "command": " ".join(sys.argv), "runs": {}}  # fmt: skip
    for name, (algo, folder, k) in RUNS.items():
        # built with overlap so its graphs write the next inputs; the synchronous paths switch it
        # off between generates (their host fill then overwrites those inputs)
        engine = Engine(str(assets / "target"), device="cuda", dtype="bfloat16", max_num_seqs=32,
                        algo=algo, draft=str(assets / folder) if folder else None,
                        num_draft_tokens=k, overlap=True)  # fmt: skip
        for bs in (1, 32):
            entry: dict = {"replay_ms": replay_ms(engine, bs)}
            for path in [*PATHS] * 2:  # alternated: drift
                ms, steps = step_ms(engine, prompts[:bs], path, args.repeats)
                entry.setdefault(path, []).append(ms)
            entry["steps"] = steps
            report["runs"][f"{name} bs={bs}"] = entry
            print(name, bs, json.dumps(entry), flush=True)
        del engine
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\n{report['gpu']}  torch {report['torch']}  {report['date']}")
    print("| run | replay ms | step ms: " + " / ".join(PATHS) + " |")
    print("| --- | --- | --- |")
    for name, e in report["runs"].items():
        steps = " / ".join(f"{statistics.median(e[path]):.3f}" for path in PATHS)
        print(f"| {name} | {e['replay_ms']:.3f} | {steps} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
