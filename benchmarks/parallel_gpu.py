"""Tensor and data parallelism on two GPUs, with CUDA graphs and NCCL, in one run:

1. TP=2 with graphs gives the greedy tokens of TP=1 with graphs (a float32 random Llama of
   hidden 256 and 8 layers, plain and with a random EAGLE-3 head), and every rank captured the
   same (variant, size) sequence;
2. DP=2 with graphs gives the tokens of DP=1, with one request (DP rank 1 has none: a dense
   target's idle DP rank sits the steps out, no dummy batches) and with five uneven ones; each
   DP rank of a dense target replays graphs of its own padded batch sizes (there is no uniform
   global size: only MoE EP ranks replay uniform sizes, benchmarks/moe_engine_gpu.py);
3. decode step time (graph replay, CUDA events, median after warm-up, context 512) of the
   Llama-3.1-8B-shape dummy bf16 target at TP=1 and TP=2, bs 1, 16, 64 (goal: TP=2 <= 0.6 of
   TP=1 at bs 1), TP=2 both with the default all-reduce (one-shot through symmetric memory for
   decode sizes, comm/all_reduce.py) and with every all-reduce on NCCL.

    timeout 500 python benchmarks/parallel_gpu.py --out OUT_DIR
    timeout 300 python benchmarks/parallel_gpu.py --out OUT_DIR --chunked --skip-steps

`--chunked` ([batch-jobs]): the equality engines of phases 1 and 2 run under a token budget of
--max-num-batched-tokens per forward and a pool of --num-pages pages, on the prompt sets plus
`pressure` (eight prompts of 30-300 tokens): prompts prefill in chunks mixed into decode steps
(the Triton varlen kernel, eager) while pure decode steps replay graphs, and requests are
preempted and recomputed; the one-GPU reference runs the same options, and is itself compared
with a one-GPU run at the default budget and pool. `--skip-steps` leaves out phase 3.

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
    parser.add_argument("--chunked", action="store_true", help="see above")
    parser.add_argument("--max-num-batched-tokens", type=int, default=48, help="with --chunked")
    parser.add_argument("--num-pages", type=int, default=40, help="with --chunked (16 tokens each)")
    parser.add_argument("--skip-steps", action="store_true", help="no step-time phase")
    return _common.parse_rank_args(parser, argv, cpu_iters=5)


PROMPT_SETS = {  # name -> (lengths, seed)
    "five": ((5, 40, 1, 100, 17), 0),
    "one_request": ((33,), 1),  # DP rank 1 gets none
    "uneven": ((200, 4, 9, 2, 6), 2),  # DP shares of 1 and 4 requests
}
# --chunked: pages for about two of these at once on each DP rank (preemption on both)
PRESSURE = ((300, 40, 180, 90, 250, 30, 120, 60), 3)


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


def engine_opts(device: str, chunked: dict | None = None) -> dict:
    """The equality engines' options; `chunked`: a token budget and page pool to add."""
    return dict(device=device, dtype="float32", max_num_seqs=16, max_model_len=512,
                **(chunked or {}))  # fmt: skip


def prompt_set(name: str) -> tuple[tuple[int, ...], int]:
    return PRESSURE if name == "pressure" else PROMPT_SETS[name]


def chunked_opts(args: argparse.Namespace) -> dict | None:
    if not args.chunked:
        return None
    return dict(max_num_batched_tokens=args.max_num_batched_tokens, num_pages=args.num_pages)


def run_cases(
    pctx, device: str, target: str, head: str, names: list[str], chunked: dict | None = None
) -> dict:
    """Tokens, capture order and this rank's step records (the padded sizes its decode steps
    ran, graph replays, dummy steps, preemptions, eager extend steps) of plain and EAGLE-3
    engines, per prompt set."""
    vocab = SMALL["vocab_size"]
    out = {}
    for algo in ("plain", "eagle3"):
        spec = {} if algo == "plain" else dict(algo="eagle3", draft=head, num_draft_tokens=3)
        engine = Engine(target, pctx=pctx, **engine_opts(device, chunked), **spec)
        for name in names:
            lengths, seed = prompt_set(name)
            engine.dp.decode_sizes, engine.dp.dummy_steps = [], 0  # this prompt set's records
            graphs, before = engine.graphs, engine.stats()
            replays = graphs.num_replays
            outs = engine.generate(_common.prompts_of(lengths, seed, vocab), GREEDY)
            sizes, after = engine.dp.decode_sizes, engine.stats()
            out[f"{algo}/{name}"] = {
                "tokens": {o.index: o.token_ids for o in outs},
                "capture_order": graphs.capture_order,
                "graphs": len(graphs.graphs),
                "decode_sizes": sizes,  # this rank's own (dense DP: not the global batch)
                "decode_steps_replay": all(graphs.will_replay(s) for s in sizes),
                "replays": graphs.num_replays - replays,
                "dummy_steps": engine.dp.dummy_steps,
                "preemptions": after["preemptions"] - before["preemptions"],
                "extend_steps": after["extend_steps"] - before["extend_steps"],
            }
        del engine
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def time_step(engine: Engine, bs: int, iters: int) -> float:
    """Median ms of one decode step of bs live rows: the graph replay when captured (CUDA
    events), else the eager step (wall clock, CPU)."""
    key = engine.graphs.key("greedy", bs)
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

    if not args.skip_steps:
        step_phase(args, tp2, report, tp1_step_times, shape)
    equality_phases(args, tp2, report, device, target, head)
    if not args.skip_steps:
        again = tp1_step_times()
        if report:
            report.add("tp1_steps_again", {bs: again[bs] for bs in STEP_SIZES})


def step_phase(args, tp2, report: Report | None, tp1_step_times, shape: str) -> None:
    """Phase 3's first part: the decode step at TP=1 and TP=2 (default and NCCL all-reduce)."""
    dev = args.device
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


def per_rank(both: list[dict], case: str, key: str) -> list:
    return [b[case][key] for b in both]


def equality_phases(args, tp2, report: Report | None, device: str, target, head) -> None:
    """Phases 1 and 2: TP=2 and DP=2 tokens against one GPU (rank 0; rank 1 waits)."""
    dev, chunked, single = args.device, chunked_opts(args), ParallelContext.single()
    extra = ["pressure"] if chunked else []
    names = list(PROMPT_SETS) + extra
    ref = run_cases(single, device, target, head, names, chunked) if report else None
    if report and chunked:  # the budget and the pool change no token on one GPU
        roomy = run_cases(single, device, target, head, names)
        report.add("one_gpu_chunked", {
            case: {"equals_default_budget": compare(ref[case]["tokens"], roomy[case]["tokens"]),
                   "preemptions": ref[case]["preemptions"],
                   "extend_steps": [ref[case]["extend_steps"], roomy[case]["extend_steps"]]}
            for case in ref
        })  # fmt: skip
    tp2.barrier()
    both = tp2.all_gather_object(run_cases(tp2, dev, target, head, ["five", *extra], chunked))
    if report:
        result = {}
        for case in both[0]:
            result[case] = {
                "tp2_equals_tp1": compare(both[0][case]["tokens"], ref[case]["tokens"]),
                "ranks_agree": both[0][case]["tokens"] == both[1][case]["tokens"],
                # TP peers run the same steps
                "decode_sizes_same": both[0][case]["decode_sizes"] == both[1][case]["decode_sizes"],
                "capture_order_same": both[0][case]["capture_order"]
                == both[1][case]["capture_order"],
                "capture_order": both[0][case]["capture_order"],
                "graphs": per_rank(both, case, "graphs"),
                "replays": per_rank(both, case, "replays"),
                "preemptions": per_rank(both, case, "preemptions"),
            }
        report.add("tp2", result)

    dp2 = ParallelContext.init(tp2.rank, WORLD, 1, 2, dev, tp2.local_rank, timeout_s=args.budget_s)
    cases = ["one_request", "uneven", *extra]
    both = dp2.all_gather_object(run_cases(dp2, dev, target, head, cases, chunked))
    if report:
        result = {}
        for case in both[0]:
            r0, r1 = both[0][case], both[1][case]
            result[case] = {
                "dp2_equals_dp1": compare(r0["tokens"], ref[case]["tokens"]),
                # a dense target's DP ranks each replay their own sizes; one with no requests
                # runs no step at all
                "own_sizes": own_sizes(both, case),
                "decode_steps": [len(r0["decode_sizes"]), len(r1["decode_sizes"])],
                "sizes_differ": r0["decode_sizes"] != r1["decode_sizes"],
                "decode_steps_replay": r0["decode_steps_replay"] and r1["decode_steps_replay"],
                "replays": [r0["replays"], r1["replays"]],
                "dummy_steps": [r0["dummy_steps"], r1["dummy_steps"]],
                "preemptions": [r0["preemptions"], r1["preemptions"]],
                "extend_steps": [r0["extend_steps"], r1["extend_steps"]],
                "capture_order_same": r0["capture_order"] == r1["capture_order"],
                "graphs": [r0["graphs"], r1["graphs"]],
            }
        report.add("dp2", result)


def own_sizes(both: list[dict], case: str) -> bool:
    """Dense DP: no dummy step on either rank, and a rank with no requests (DP rank 1 of
    `one_request`) ran no decode step."""
    if any(b[case]["dummy_steps"] for b in both):
        return False
    return not case.endswith("one_request") or both[1][case]["decode_sizes"] == []


def header(args: argparse.Namespace) -> dict:
    cuda = args.device == "cuda"
    head = _common.run_header(cuda, gpus=torch.cuda.device_count() if cuda else 0)
    return {**head, "chunked": chunked_opts(args), "skip_steps": args.skip_steps}


def table(data: dict) -> str:
    """The summary printed last."""
    phases, cuda = data.get("phases", {}), data.get("gpu") not in (None, "cpu")
    lines = [f"{data.get('gpu')} x{WORLD}  torch {data.get('torch')}  NCCL {data.get('nccl')}"]
    lines.append("| check | case | result |")
    lines.append("| --- | --- | --- |")
    for case, r in phases.get("one_gpu_chunked", {}).items():
        ok = r["equals_default_budget"]["equal"]
        detail = f"preemptions {r['preemptions']}, extend steps {r['extend_steps']}"
        lines.append(f"| one GPU: budget == default | {case} | {'yes' if ok else r}; {detail} |")
    for case, r in phases.get("tp2", {}).items():
        detail = f"replays per rank {r['replays']}, preemptions {r['preemptions']}"
        lines.append(f"| TP=2 graphs == TP=1 graphs | {case} | "
                     f"{'yes' if tp2_ok(r) else r}; {detail} |")  # fmt: skip
    for case, r in phases.get("dp2", {}).items():
        detail = (f"decode steps per rank {r['decode_steps']}, replays {r['replays']}, dummy "
                  f"steps {r['dummy_steps']}, preemptions {r['preemptions']}")  # fmt: skip
        verdict = "yes" if dp2_ok(r, cuda) else r
        lines.append(f"| DP=2 graphs == DP=1 | {case} | {verdict}; {detail} |")
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
    missing = {"tp2", "dp2"} | (set() if data.get("skip_steps") else {"steps", "tp1_steps_again"})
    if data.get("chunked"):
        missing.add("one_gpu_chunked")
        pressure = [r for case, r in phases.get("dp2", {}).items() if case.endswith("pressure")]
        preempted = all(min(r["preemptions"]) > 0 for r in pressure)
        lines.append(f"--chunked: preemption on both DP ranks (pressure): {preempted}")
    missing -= set(phases)
    if missing:
        lines.append(f"phases not finished: {sorted(missing)}")
    return "\n".join(lines)


def tp2_ok(r: dict) -> bool:
    return (
        r["tp2_equals_tp1"]["equal"]
        and r["ranks_agree"]
        and r["decode_sizes_same"]
        and r["capture_order_same"]
    )


def dp2_ok(r: dict, cuda: bool = False) -> bool:
    """Equal tokens, the dense DP rule (own sizes, no dummies), the same captures; on GPUs every
    decode step replayed a graph."""
    ok = r["dp2_equals_dp1"]["equal"] and r["own_sizes"] and r["capture_order_same"]
    return ok and (r["decode_steps_replay"] or not cuda)


def passed(data: dict, args: argparse.Namespace) -> bool:
    """Every phase finished and every check held (--chunked: the budget changed no token on one
    GPU and both DP ranks preempted on the pressure set)."""
    phases, cuda = data.get("phases", {}), args.device == "cuda"
    if data["error"] is not None or not {"tp2", "dp2"} <= set(phases):
        return False
    ok = all(tp2_ok(r) for r in phases["tp2"].values())
    ok = ok and all(dp2_ok(r, cuda) for r in phases["dp2"].values())
    if args.chunked:
        one_gpu = phases.get("one_gpu_chunked", {}).values()
        ok = ok and bool(one_gpu) and all(r["equals_default_budget"]["equal"] for r in one_gpu)
        pressure = [r for case, r in phases["dp2"].items() if case.endswith("pressure")]
        ok = ok and all(min(r["preemptions"]) > 0 for r in pressure)
    return ok and (args.skip_steps or "steps" in phases)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = _common.run_and_collect(rank_main, args, "parallel_gpu.json", write_checkpoints, WORLD)
    print(table(data))
    return 0 if passed(data, args) else 1


if __name__ == "__main__":
    sys.exit(main())
