"""Decode paged attention (kernels/paged_attention.py, T = 1) on the Llama-3.1-8B shape (32 query
heads, 8 KV heads, d 128, pages of 16 slots scattered over the pool): per launch configuration
(key block, warps, pipeline stages, splits), the per-layer time of 32 layers captured in one
CUDA graph (each layer its own pool, as in a step), against the KV bytes at the measured copy
bandwidth; every variant's output checked against the shipped configuration's.

    python benchmarks/attention_sweep.py --json OUT.json [--shapes 1x512,64x512,192xjob,...]

`shipped` is the kernel in batch order with the static split plan (what the engine ran before
wave 14), `ordered` the same with rows longest first, `planned` a step's RowPlan (the engine's
default). A shape's context `job`: every row its own length, as in a decode step of the
realistic job (`job_contexts`), with the job's reachable length (4,352 keys) setting the split
plan.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

HEADS, KV_HEADS, D, PAGE, LAYERS = 32, 8, 128, 16, 32


def job_contexts(bs: int, gen: torch.Generator) -> list[int]:
    """Contexts of `bs` rows of a decode step of benchmarks/workload.py's job: requests drawn in
    proportion to their output length (a step sees the long-running ones more often), each part
    way through its output (prompt lognormal median 220 sigma 1.0 in 16..3000, output median
    180 sigma 0.9 in 16..1200, as the job draws them)."""
    n = 20 * bs
    prompts = (torch.randn(n, generator=gen) * 1.0 + torch.log(torch.tensor(220.0))).exp()
    outputs = (torch.randn(n, generator=gen) * 0.9 + torch.log(torch.tensor(180.0))).exp()
    prompts, outputs = prompts.clamp(16, 3000).long(), outputs.clamp(16, 1200).long()
    pick = torch.multinomial(outputs.double(), bs, replacement=True, generator=gen)
    done = (torch.rand(bs, generator=gen) * outputs[pick]).long()
    return (prompts[pick] + done + 1).tolist()


def setup(bs: int, ctx: int | str, gen: torch.Generator) -> dict:
    """ctx an int (every row that long) or "job" (job_contexts; the pool sized as the job's
    graphs are, 4,352 keys a row reachable, each row's pages only for its own context)."""
    if ctx == "job":
        return setup_mixed(job_contexts(bs, gen), 4352, gen)
    return setup_mixed([ctx] * bs, -(-(ctx + 1) // 256) * 256, gen)


def setup_mixed(contexts: list[int], kv_len: int, gen: torch.Generator) -> dict:
    """Row i holds contexts[i] keys on pages scattered over the pool (only its own pages);
    kv_len keys reachable (the split plan's length); one pool per layer."""
    bs, dev = len(contexts), "cuda"
    need = [-(-c // PAGE) for c in contexts]
    pages = sum(need) + 1
    order = (torch.randperm(pages - 1, generator=gen) + 1).tolist()  # page 0: the sentinel
    table = torch.zeros(bs, kv_len // PAGE, dtype=torch.int32)
    at = 0
    for row, count in enumerate(need):
        table[row, :count] = torch.tensor(order[at : at + count], dtype=torch.int32)
        at += count
    shape = (pages * PAGE, KV_HEADS, D)
    pools = [
        (
            torch.randn(shape, device=dev, dtype=torch.bfloat16),
            torch.randn(shape, device=dev, dtype=torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]
    return {
        "q": torch.randn(bs, HEADS, D, generator=gen).to(dev, torch.bfloat16),
        "pools": pools,
        "table": table.to(dev),
        "rows": torch.arange(bs, dtype=torch.int64, device=dev),
        "positions": torch.tensor([c - 1 for c in contexts], dtype=torch.int64, device=dev),
        "kv_len": kv_len,
        "bytes": sum(contexts) * KV_HEADS * D * 2 * 2,
        "contexts": {"mean": sum(contexts) / bs, "max": max(contexts)},
    }


def run(case: dict, layer: int, splits, block_n, launch, layout=None):
    """One layer's launch; `layout` "ordered" (rows longest first) or "planned" (a RowPlan),
    made once per case as the engine makes them once a step."""
    from speculant.kernels.paged_attention import longest_first, paged_attention, row_plan

    k, v = case["pools"][layer]
    bs = len(case["rows"])
    if layout == "ordered" and "order" not in case:
        case["order"] = longest_first(case["positions"], bs, 1)
    if layout == "planned" and "plan" not in case:
        case["plan"] = row_plan(case["positions"], bs, 1, case["kv_len"], KV_HEADS)
    return paged_attention(
        case["q"], k, v, case["table"], case["rows"], case["positions"], PAGE, case["kv_len"], 1,
        num_splits=splits, block_n=block_n, launch=launch,
        row_order=case["order"] if layout == "ordered" else None,
        plan=case["plan"] if layout == "planned" else None,
    )  # fmt: skip


def time_variant(case: dict, splits, block_n, launch, layout=None) -> float:
    from graphs import time_ms

    for layer in range(2):
        run(case, layer, splits, block_n, launch, layout)  # compile, allocate
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            run(case, layer, splits, block_n, launch, layout)
    ms = time_ms(graph.replay, 20)
    del graph
    return ms * 1e3 / LAYERS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--shapes", default="1x512,64x512,192x512,64x2048,1x4096")
    parser.add_argument("--grid", action="store_true", help="also every key block x warps x stages")
    parser.add_argument("--budget-s", type=float, default=240)
    args = parser.parse_args()
    from graphs import copy_bandwidth

    start = time.perf_counter()
    bandwidth = copy_bandwidth()
    report = {
        "gpu": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "shapes": {},
    }
    configs = [("shipped", None, None, None), ("default_stages", None, None, (4, None))]
    # rows started longest first (row_order) and a step's RowPlan (the engine's default)
    configs += [("planned", None, None, None, "planned"), ("ordered", None, None, None, "ordered"),
                ("split2s2_ordered", 2, None, (4, 2), "ordered"),
                ("split4s2_ordered", 4, None, (4, 2), "ordered")]  # fmt: skip
    grid = itertools.product((32, 64, 128), (4, 8), (1, 2, 3)) if args.grid else ()
    for block_n, warps, stages in grid:
        configs.append((f"n{block_n}w{warps}s{stages}", None, block_n, (warps, stages)))
    for splits in (1, 2, 4, 8, 16, 32):
        configs.append((f"split{splits}", splits, None, None))
        configs.append((f"split{splits}s2", splits, None, (4, 2)))
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        bs, ctx = shape.split("x")
        case = setup(int(bs), ctx if ctx == "job" else int(ctx), gen)
        floor_us = case["bytes"] / bandwidth * 1e6
        want = run(case, 0, None, None, None).float()
        rows = {}
        for name, splits, block_n, launch, *layout in configs:
            if time.perf_counter() - start > args.budget_s:
                rows[name] = "skipped (budget)"
                continue
            try:
                got = run(case, 0, splits, block_n, launch, *layout).float()
                err = (got - want).abs().max().item()
                us = time_variant(case, splits, block_n, launch, *layout)
                rows[name] = {"us": round(us, 2), "err": err, "of_floor": round(floor_us / us, 3)}
            except Exception as exc:  # out of shared memory and the like: recorded
                rows[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
        timed = {n: r for n, r in rows.items() if isinstance(r, dict) and r["err"] < 2e-2}
        best = min(timed, key=lambda n: timed[n]["us"])
        report["shapes"][shape] = {"floor_us": round(floor_us, 2), "rows": rows, "best": best,
                                   "contexts": case.get("contexts")}  # fmt: skip
        print(f"{shape}: floor {floor_us:.1f} us, shipped {rows['shipped']['us']:.1f} us, "
              f"best {best} {timed[best]['us']:.1f} us", flush=True)  # fmt: skip
        top = sorted(timed, key=lambda n: timed[n]["us"])[:6]
        print("   " + ", ".join(f"{n} {timed[n]['us']:.1f}" for n in top), flush=True)
        del case
        torch.cuda.empty_cache()
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
