"""Tensor and data parallelism on two GPUs, with CUDA graphs and NCCL, in one run:

1. TP=2 with graphs gives the greedy tokens of TP=1 with graphs (a float32 random Llama of
   hidden 256 and 8 layers, plain and with a random EAGLE-3 head), and every rank captured the
   same (variant, size) sequence;
2. DP=2 with graphs gives the tokens of DP=1, with one request (DP rank 1 idle: it replays
   dummy batches) and with five uneven ones;
3. decode step time (graph replay, CUDA events, median after warm-up, context 512) of the
   Llama-3.1-8B-shape dummy bf16 target at TP=1 and TP=2, bs 1, 16, 64 (goal: TP=2 <= 0.6 of
   TP=1 at bs 1), TP=2 both with the default all-reduce (one-shot through symmetric memory for
   decode sizes, comm/all_reduce.py) and with every all-reduce on NCCL.

    timeout 500 python benchmarks/parallel_gpu.py --out OUT_DIR

Writes OUT_DIR/parallel_gpu.json (rewritten after every phase, so a run cut short keeps what it
measured) and prints a table last. Ranks start through speculant.launch.spawn.run_ranks (one
process per GPU); each phase runs TP=1 on rank 0 while rank 1 waits at a barrier. Ranks end
with a barrier and os._exit: destroying NCCL groups after graph capture has hung on this host.
`--device cpu --quick` runs the same phases with gloo and eager steps (to check the script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent / "tests")]  # _common.py, graphs.py, helpers_*.py
import _common  # noqa: E402

_common.nvlink_multicast_off()  # before torch loads
import torch  # noqa: E402
from graphs import SHAPES, live_rows, time_ms, write_config  # noqa: E402

from speculant import Engine, SamplingParams  # noqa: E402
from speculant.comm.groups import ParallelContext  # noqa: E402

WORLD = 2
SMALL = dict(  # the equality model: float32, logits far apart so greedy is robust to rounding
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=4096,
    max_position_embeddings=2048,
)
GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)
STEP_SIZES = (1, 16, 64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _common.rank_parser(__doc__, "parallel_gpu.json", "small timing model (CPU check)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--iters", type=int, default=50, help="timed replays per size")
    parser.add_argument("--budget-s", type=float, default=460.0, help="kill the ranks after")
    return _common.parse_rank_args(parser, argv, cpu_iters=5)


PROMPT_SETS = {  # name -> (lengths, seed)
    "five": ((5, 40, 1, 100, 17), 0),
    "one_request": ((33,), 1),  # DP rank 1 gets none
    "uneven": ((200, 4, 9, 2, 6), 2),  # DP shares of 1 and 4 requests
}


def write_checkpoints(folder: Path) -> tuple[str, str]:
    """The float32 equality target (written by transformers) and a random EAGLE-3 head."""
    from helpers_ckpt import save_hf_model
    from helpers_eagle import write_random_eagle3

    target = save_hf_model(folder / "target", "llama", seed=0, **SMALL)
    write_random_eagle3(folder / "eagle3", target, draft_vocab=2000, num_kv_heads=1, seed=1)
    return str(target), str(folder / "eagle3")


class Report:
    """Rank 0's results, rewritten to disk after every phase."""

    def __init__(self, path: Path, header: dict):
        self.path, self.data = path, {**header, "phases": {}}
        self.save()

    def add(self, phase: str, result: dict) -> None:
        self.data["phases"][phase] = result
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2, default=str))


def compare(ours: dict, ref: dict) -> dict:
    """Token equality of two {index: tokens} maps, with where they first differ."""
    if ours == ref:
        return {"equal": True}
    bad = sorted(i for i in ref if ours.get(i) != ref[i])
    first = bad[0]
    pairs = zip(ours.get(first, []), ref[first], strict=False)
    at = next((j for j, (a, b) in enumerate(pairs) if a != b), -1)
    return {"equal": False, "requests_differing": bad, "first_token_index": at}


def engine_opts(device: str) -> dict:
    return dict(device=device, dtype="float32", max_num_seqs=16, max_model_len=512)


def run_cases(pctx, device: str, target: str, head: str, names: list[str]) -> dict:
    """Tokens, capture order and DP step records of plain and EAGLE-3 engines."""
    vocab = SMALL["vocab_size"]
    out = {}
    for algo in ("plain", "eagle3"):
        spec = {} if algo == "plain" else dict(algo="eagle3", draft=head, num_draft_tokens=3)
        engine = Engine(target, pctx=pctx, **engine_opts(device), **spec)
        for name in names:
            lengths, seed = PROMPT_SETS[name]
            engine.dp.uniform_sizes, engine.dp.dummy_steps = [], 0  # this prompt set's records
            outs = engine.generate(_common.prompts_of(lengths, seed, vocab), GREEDY)
            graphs, sizes = engine.graphs, engine.dp.uniform_sizes
            out[f"{algo}/{name}"] = {
                "tokens": {o.index: o.token_ids for o in outs},
                "capture_order": graphs.capture_order,
                "graphs": len(graphs.graphs),
                "uniform_sizes": sizes,
                "uniform_steps_replay": all(graphs.will_replay(s) for s in sizes),
                "dummy_steps": engine.dp.dummy_steps,
            }
        del engine
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def time_step(engine: Engine, bs: int, iters: int) -> float:
    """Median ms of one decode step of bs live rows: the graph replay when captured (CUDA
    events), else the eager step (wall clock, CPU)."""
    key = ("greedy", bs)
    if key in engine.graphs.graphs:
        fn = engine.graphs.graphs[key].replay
    else:

        def fn():
            return engine.runner.decode_step(bs, "greedy")

    return time_ms(fn, iters, cuda=engine.graphs.use_graphs)


def step_times(pctx, device: str, shape_name: str, context: int, iters: int) -> dict:
    shape = SHAPES[shape_name]
    engine = Engine(
        write_config(shape),
        pctx=pctx,
        device=device,
        dtype="bfloat16" if device.startswith("cuda") else "float32",
        load_format="dummy",
        max_num_seqs=64,
        max_model_len=context + 512,
        capture_sizes=list(STEP_SIZES),
    )
    gen, out = torch.Generator().manual_seed(1), {}
    for bs in STEP_SIZES:
        rows = live_rows(engine, bs, shape["vocab_size"], context, gen)
        out[bs] = time_step(engine, bs, iters)
        for row in rows:
            engine.kv.free(row)
    out["weight_GB_per_rank"] = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    out["weight_GB_per_rank"] /= 1e9
    out["dtype"] = str(engine.dtype)
    del engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def rank_main(args: argparse.Namespace, target: str, head: str) -> None:
    """Every phase, on both ranks. TP=1 / DP=1 references run on rank 0 while rank 1 waits.
    Step times come first (on GPUs no other phase has run yet), and TP=1 is timed again last
    to show whether the earlier phases changed it."""
    dev = args.device
    tp2 = ParallelContext.from_env(2, 1, dev, timeout_s=args.budget_s)
    report = Report(Path(args.out) / "parallel_gpu.json", header(args)) if tp2.rank == 0 else None
    device = f"cuda:{tp2.local_rank}" if dev == "cuda" else "cpu"
    single = ParallelContext.single()
    shape = "small" if args.quick else "llama8b"

    def tp1_step_times() -> dict | None:
        times = step_times(single, device, shape, args.context, args.iters) if report else None
        tp2.barrier()
        return times

    tp1_ms = tp1_step_times()
    tp2_ms = tp2.all_gather_object(step_times(tp2, dev, shape, args.context, args.iters))
    os.environ["SPECULANT_TP_ALL_REDUCE"] = "nccl"  # the same TP=2 step, every all-reduce on NCCL
    nccl_ms = tp2.all_gather_object(step_times(tp2, dev, shape, args.context, args.iters))
    os.environ.pop("SPECULANT_TP_ALL_REDUCE")
    if report:
        steps = {}
        for bs in STEP_SIZES:
            slowest = max(t[bs] for t in tp2_ms)
            steps[bs] = {
                "tp1_ms": tp1_ms[bs],
                "tp2_ms": slowest,
                "tp2_ms_per_rank": [t[bs] for t in tp2_ms],
                "ratio": slowest / tp1_ms[bs],
                "tp2_nccl_all_reduce_ms": max(t[bs] for t in nccl_ms),
            }
        dtypes = [tp1_ms["dtype"]] + [t["dtype"] for t in tp2_ms]
        report.add(
            "steps", {"shape": shape, "context": args.context, "dtype": dtypes, "by_bs": steps}
        )

    names = list(PROMPT_SETS)
    ref = run_cases(single, device, target, head, names) if report else None
    tp2.barrier()
    both = tp2.all_gather_object(run_cases(tp2, dev, target, head, ["five"]))
    if report:
        result = {}
        for case in both[0]:
            result[case] = {
                "tp2_equals_tp1": compare(both[0][case]["tokens"], ref[case]["tokens"]),
                "ranks_agree": both[0][case]["tokens"] == both[1][case]["tokens"],
                "capture_order_same": both[0][case]["capture_order"]
                == both[1][case]["capture_order"],
                "capture_order": both[0][case]["capture_order"],
                "graphs": [b[case]["graphs"] for b in both],
            }
        report.add("tp2", result)

    dp2 = ParallelContext.init(tp2.rank, WORLD, 1, 2, dev, tp2.local_rank, timeout_s=args.budget_s)
    both = dp2.all_gather_object(run_cases(dp2, dev, target, head, ["one_request", "uneven"]))
    if report:
        result = {}
        for case in both[0]:
            r0, r1 = both[0][case], both[1][case]
            result[case] = {
                "dp2_equals_dp1": compare(r0["tokens"], ref[case]["tokens"]),
                "uniform_sizes_same": r0["uniform_sizes"] == r1["uniform_sizes"],
                "uniform_steps": len(r0["uniform_sizes"]),
                "uniform_steps_replay": r0["uniform_steps_replay"] and r1["uniform_steps_replay"],
                "dummy_steps": [r0["dummy_steps"], r1["dummy_steps"]],
                "capture_order_same": r0["capture_order"] == r1["capture_order"],
                "graphs": [r0["graphs"], r1["graphs"]],
            }
        report.add("dp2", result)

    again = tp1_step_times()
    if report:
        report.add("tp1_steps_again", {bs: again[bs] for bs in STEP_SIZES})


def header(args: argparse.Namespace) -> dict:
    cuda = args.device == "cuda"
    return _common.run_header(cuda, gpus=torch.cuda.device_count() if cuda else 0)


def table(data: dict) -> str:
    """The summary printed last."""
    phases = data.get("phases", {})
    lines = [f"{data.get('gpu')} x{WORLD}  torch {data.get('torch')}  NCCL {data.get('nccl')}"]
    lines.append("| check | case | result |")
    lines.append("| --- | --- | --- |")
    for case, r in phases.get("tp2", {}).items():
        ok = r["tp2_equals_tp1"]["equal"] and r["ranks_agree"] and r["capture_order_same"]
        lines.append(f"| TP=2 graphs == TP=1 graphs | {case} | {'yes' if ok else r} |")
    for case, r in phases.get("dp2", {}).items():
        ok = r["dp2_equals_dp1"]["equal"] and r["uniform_sizes_same"] and r["capture_order_same"]
        detail = f"{r['uniform_steps']} uniform steps, dummy steps per rank {r['dummy_steps']}"
        lines.append(f"| DP=2 graphs == DP=1 | {case} | {'yes' if ok else r}; {detail} |")
    steps = phases.get("steps")
    if steps:
        lines.append("")
        lines.append(
            f"decode step, {steps['shape']} shape, context {steps['context']}, "
            f"dtype (TP=1, TP=2 ranks) {steps['dtype']}"
        )
        lines.append("| bs | TP=1 ms | TP=2 ms | TP=2 / TP=1 | TP=2, all-reduce on NCCL |")
        lines.append("| --- | --- | --- | --- | --- |")
        for bs, s in steps["by_bs"].items():
            nccl = s.get("tp2_nccl_all_reduce_ms", float("nan"))
            lines.append(
                f"| {bs} | {s['tp1_ms']:.3f} | {s['tp2_ms']:.3f} | {s['ratio']:.2f} | {nccl:.3f} |"
            )
        again = phases.get("tp1_steps_again")
        if again:
            lines.append(f"TP=1 timed again after the other phases (ms): {again}")
        bs1 = steps["by_bs"].get("1", steps["by_bs"].get(1))
        if bs1:
            verdict = "met" if bs1["ratio"] <= 0.6 else "not met"
            lines.append(f"goal TP=2 <= 0.6 x TP=1 at bs 1: {verdict} ({bs1['ratio']:.2f})")
    missing = {"tp2", "dp2", "steps", "tp1_steps_again"} - set(phases)
    if missing:
        lines.append(f"phases not finished: {sorted(missing)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = _common.run_and_collect(rank_main, args, "parallel_gpu.json", write_checkpoints, WORLD)
    print(table(data))
    ok = data["error"] is None and all(
        r["tp2_equals_tp1"]["equal"] for r in data.get("phases", {}).get("tp2", {}).values()
    )
    return 0 if ok and "steps" in data.get("phases", {}) else 1


if __name__ == "__main__":
    sys.exit(main())
