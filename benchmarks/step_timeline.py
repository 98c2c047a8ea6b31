"""Where a graph decode step's wall time goes, kernel by kernel (Llama-3.1-8B shape, dummy
weights, `triton` backend): the critical path of one replay, not the kernels' summed device
time (under PDL a kernel starts while the one before it runs, so its own duration includes
waiting).

Each replay's kernels are ordered by start; a kernel's share of the step is how far it moves
the latest end seen so far (its end minus the previous latest end, 0 when it ends inside one
already running). The shares add up to the replay's span. Grouped by kernel name and the name
of the kernel before it (the two norms of a layer come after different kernels), averaged over
`--replays` replays, for each `--kinds` and `--sizes`:

    python benchmarks/step_timeline.py --json OUT.json [--kinds fp8,bf16] [--sizes 1,64]

SPECULANT_PDL (0 / 1 / 2) is read when the kernels are imported: run one process per setting
to compare them (benchmarks/gpu_wave24.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def short(name: str) -> str:
    """A kernel's name without template arguments and parameters."""
    name = name.split("(")[0].split("<")[0]
    return name.replace("void ", "").strip()[:60]


def kernel_events(fn, replays: int) -> list[list[dict]]:
    """The kernels of each of `replays` calls of fn (a graph replay): [{name, ts, end}] sorted
    by start, per call (split by the graph launches' count of kernels)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
            torch.cuda.synchronize()  # replays apart: one's kernels never mix with the next's
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        trace = json.loads(Path(tmp.name).read_text())
    kernels = [
        {"name": short(e["name"]), "ts": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"])}
        for e in trace["traceEvents"]
        if e.get("cat") == "kernel" and e.get("ph") == "X"
    ]
    kernels.sort(key=lambda k: k["ts"])
    per = len(kernels) // replays
    if per == 0 or per * replays != len(kernels):
        raise RuntimeError(f"{len(kernels)} kernels over {replays} replays")
    return [kernels[i * per : (i + 1) * per] for i in range(replays)]


def critical_path(replays: list[list[dict]]) -> dict:
    """Per (kernel, the kernel before it): calls, share of the span and own duration, us per
    replay; the span; the idle time (gaps when nothing runs)."""
    share: dict = defaultdict(float)
    own: dict = defaultdict(float)
    calls: dict = defaultdict(int)
    spans, idle = [], []
    for kernels in replays:
        latest = kernels[0]["ts"]
        gaps = 0.0
        prev = "start"
        for k in kernels:
            key = f"{k['name']} <- {prev}"
            if k["ts"] > latest:
                gaps += k["ts"] - latest
            share[key] += max(0.0, k["end"] - latest)
            own[key] += k["end"] - k["ts"]
            calls[key] += 1
            latest = max(latest, k["end"])
            prev = k["name"]
        spans.append(latest - kernels[0]["ts"])
        idle.append(gaps)
    n = len(replays)
    rows = [
        {
            "kernel": key,
            "calls": calls[key] / n,
            "share_us": share[key] / n,
            "own_us": own[key] / n,
            "share_per_call_us": share[key] / calls[key],
        }
        for key in share
    ]
    rows.sort(key=lambda r: r["share_us"], reverse=True)
    return {
        "span_us": sorted(spans)[n // 2],
        "idle_us": sorted(idle)[n // 2],
        "kernels_per_replay": len(replays[0]),
        "rows": rows,
    }


def measure(kind: str, args) -> dict:
    from decode import build_engine, free
    from decode_ab import apply_levers
    from fp8_gpu import targets
    from graphs import SHAPES, live_rows, time_ms

    sizes = [int(s) for s in args.sizes.split(",")]
    engine = build_engine(targets(args.shape)[kind], "triton", args.context, sizes, piecewise=False)
    out: dict = {}
    try:
        if args.levers:
            apply_levers(engine, args.levers, {})
            engine.clear_graphs()
            engine.capture_graphs()
        vocab = SHAPES[args.shape]["vocab_size"]
        gen = torch.Generator().manual_seed(1)
        for bs in sizes:
            rows = live_rows(engine, bs, vocab, args.context, gen)
            replay = engine.graphs.graph("greedy", bs).replay
            ms = time_ms(replay, 30)
            path = critical_path(kernel_events(replay, args.replays))
            path["graph_ms"] = ms
            out[str(bs)] = path
            print(f"  {kind} bs {bs}: {ms:.3f} ms replayed, span {path['span_us']:.1f} us, "
                  f"idle {path['idle_us']:.1f} us, {path['kernels_per_replay']} kernels",
                  flush=True)  # fmt: skip
            for row in path["rows"][: args.top]:
                print(f"    {row['share_us']:8.1f} us {row['calls']:5.0f} x "
                      f"{row['share_per_call_us']:6.2f} (own {row['own_us']:8.1f})  "
                      f"{row['kernel']}", flush=True)  # fmt: skip
            for row in rows:
                engine.kv.free(row)
    finally:
        free(engine)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--kinds", default="fp8,bf16")
    parser.add_argument("--sizes", default="1,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--replays", type=int, default=7)
    parser.add_argument("--top", type=int, default=24)
    parser.add_argument("--shape", default="llama8b", choices=("llama8b", "qwen3_8b"))
    parser.add_argument("--levers", default="", help="a decode_ab.py lever variant: norm2+act2")
    args = parser.parse_args()
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
        "pdl": os.environ.get("SPECULANT_PDL", "1"),
        "levers": args.levers or "shipped",
        "context": args.context,
    }
    for kind in args.kinds.split(","):
        try:
            report[kind] = measure(kind, args)
        except Exception as exc:  # keep what the other kind gives
            report[kind] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"  {kind}: {report[kind]['error']}", flush=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
