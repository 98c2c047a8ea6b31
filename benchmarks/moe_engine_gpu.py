"""Qwen3-MoE speculative decoding with experts over every rank (EP = --world; default two GPUs,
DP=2), CUDA graphs, through DeepEP low-latency kernels and through the NCCL all-to-all, against
one GPU (the engine-level check of issues 8 and 12).

    timeout 560 python benchmarks/moe_engine_gpu.py --out $OUT                   # EP=2 (DP=2)
    timeout 560 python benchmarks/moe_engine_gpu.py --out $OUT --world 4 --tp 2  # DP2 x TP2
    timeout 300 python benchmarks/moe_engine_gpu.py --out $OUT --max-num-batched-tokens 24 \
        --num-pages 40                                        # chunked prefill, preemption

Run on two H200s on 2026-11-30 (benchmarks/results/moe_gpu.md); `--device cpu --quick` runs the
same phases on a tiny model with gloo, eager padded steps and the all2all backend only, to check
the script. The DeepEP phase needs `tokenspeed-deepep==1.2.1.post20251110` (see shared/GPU.md)
and is reported as skipped without it (exit status 2).

Model: a random float32 Qwen3-MoE written by transformers (hidden 2048, a size DeepEP supports;
4 sparse layers, 8 experts top-2, intermediate 768, vocab 4096), speculating k = 3 with, by
default (`--algo draft-model`), its dense twin as the draft model (the experts are one shared
MLP plus 10% noise each, tests/test_moe_parallel.save_upcycled_moe: the drafts are mostly
accepted, so a collapse of the acceptance length shows), or with `--algo eagle3` a random
EAGLE-3 head (acceptance about 1: an equality check only); graphs at bs 1, 2, 4, 8
(max_num_seqs 16: 8 request rows and 32 decode tokens per DP rank, DeepEP's
num_max_dispatch_tokens_per_rank). Phases, rank 0 reporting (OUT/moe_engine_gpu.json is
rewritten after each, so a run cut short keeps what it measured):
1. one GPU (rank 0, the others wait): greedy tokens of three prompt sets (five requests with a
   100-token prompt, one request, five uneven ones), plus per generated token the reference's
   top-1 minus top-2 logit gap (teacher-forced), and the prefill logits of a short and a long
   prompt;
2. EP = world, `--moe-backend all2all`, graphs; 3. the same with `--moe-backend deepep`
   (low-latency inside graphs and for short eager forwards, normal mode for the long prefills;
   the adapter sets low-latency mode and cleans the buffer before every replay). Each: tokens
   against one GPU, whether uniform steps replayed graphs, dummy steps of the idle rank, the
   relative error of the prefill logits, decode step time by bs (graph replay with the replay
   hooks, CUDA events, median), and for DeepEP the time of the hook (mode set + clean) alone.
With --max-num-batched-tokens N ([batch-jobs]) every engine, the one-GPU reference included,
runs under that token budget per forward (and --num-pages pages of 16 tokens, when given), and a
fourth prompt set `pressure` (eight prompts of 30-300 tokens) is added: prompts prefill in
chunks mixed into decode steps, and requests are preempted; every rank still runs one MoE
forward per step (the chunks are in the exchanged plan), pure decode steps replay graphs of one
uniform size on every rank, and with a budget up to DeepEP's 32 tokens per rank every forward,
eager mixed steps included, runs low-latency next to the replays (above it, normal mode for the
larger steps). Reported per set and rank: uniform steps, mixed steps, steps with a split prompt,
preemptions, and the mean host wall ms of the job's pure decode and extend steps (the replayed
step times need free pages for 8 rows of 464 positions: skipped, '-', when --num-pages is less).
Verdicts: `equal`; `rounding` when the first differing token sits where the reference's top-2
gap is below --gap-tol (DeepEP moves bfloat16: a float32 model's tokens are rounded on the wire);
else DIFFERENT. Exit status 0 only when every verdict is equal or rounding.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent / "tests")]  # _common.py, graphs.py, test_moe.py
import _common  # noqa: E402

_common.nvlink_multicast_off()  # before torch loads
import torch  # noqa: E402
from graphs import live_rows, time_ms  # noqa: E402

from speculant import Engine, SamplingParams  # noqa: E402
from speculant.comm.groups import ParallelContext  # noqa: E402
from speculant.executor.model_runner import SeqInput  # noqa: E402

K = 3
GPU_MODEL = dict(
    hidden_size=2048,
    intermediate_size=768,
    moe_intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=4096,
    max_position_embeddings=1024,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[],
    initializer_range=0.02,
)
CPU_MODEL = dict(num_hidden_layers=3, norm_topk_prob=True)  # test_moe.TINY_MOE otherwise
PROMPT_SETS = {  # name -> (lengths, seed)
    "five": ((5, 40, 1, 100, 17), 0),
    "one_request": ((33,), 1),  # the other DP ranks get none: they replay dummy batches
    "uneven": ((200, 4, 9, 2, 6), 2),
}
PRESSURE = ((300, 40, 180, 90, 250, 30, 120, 60), 3)  # with a budget: preemption on each rank
LOGIT_PROMPTS = (20, 120)  # DeepEP: low-latency (<= 32 tokens per rank) and normal mode
CAPTURE = [1, 2, 4, 8]
CONTEXT = 64  # tokens in the cache of each timed row
GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _common.rank_parser(__doc__, "moe_engine_gpu.json", "the tiny model (CPU check)")
    parser.add_argument("--algo", choices=["draft-model", "eagle3"], default="draft-model")
    parser.add_argument("--iters", type=int, default=50, help="timed replays per size")
    parser.add_argument("--gap-tol", type=float, default=0.05, help="see `rounding` above")
    parser.add_argument("--budget-s", type=float, default=520.0, help="kill the ranks after")
    parser.add_argument("--world", type=int, default=2, help="ranks (GPUs): EP = world")
    parser.add_argument("--tp", type=int, default=1, help="TP inside each DP rank (dp = world/tp)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="see above")
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages of 16 tokens")
    args = _common.parse_rank_args(parser, argv, cpu_iters=3)
    if args.world < 2 or args.world % args.tp:
        parser.error(f"--world {args.world} must be >= 2 and a multiple of --tp {args.tp}")
    return args


def write_checkpoints(folder: Path, quick: bool, algo: str) -> tuple[str, str]:
    """The float32 MoE target (transformers' random init) and its drafter."""
    from helpers_eagle import write_random_eagle3
    from test_moe import save_moe
    from test_moe_parallel import save_upcycled_moe

    shape, target, draft = CPU_MODEL if quick else GPU_MODEL, folder / "target", folder / "draft"
    target.mkdir()
    if algo == "draft-model":
        save_upcycled_moe(target, draft, noise=0.1, **shape)
    elif quick:
        save_moe(target, 0, False, **shape)
        write_random_eagle3(draft, target, draft_vocab=200, num_kv_heads=1, seed=1)
    else:  # 4 target layers: aux states entering layers 1, 2, 3 (eagle_config counts outputs)
        save_moe(target, 0, False, **shape)
        write_random_eagle3(draft, target, draft_vocab=1024, aux_ids=[0, 1, 2], num_heads=16,
                            num_kv_heads=4, seed=1)  # fmt: skip
    return str(target), str(draft)


def engine_options(args: argparse.Namespace, head: str, backend: str) -> dict:
    graphs = dict(eager_padding=True) if args.device == "cpu" else dict(capture_sizes=CAPTURE)
    return dict(
        dtype="float32",
        algo=args.algo,
        draft=head,
        num_draft_tokens=K,
        max_num_seqs=16,
        max_model_len=512,
        moe_backend=backend,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_pages=args.num_pages,
        **graphs,
    )


def prompt_sets(args: argparse.Namespace) -> dict[str, tuple]:
    """The prompt sets of this run (with a token budget, `pressure` too)."""
    chunked = args.max_num_batched_tokens is not None
    return {**PROMPT_SETS, **({"pressure": PRESSURE} if chunked else {})}


class StepCounter:
    """Counts this rank's steps by kind, from the plans its DP coordinator settles: uniform (a
    graph of one size on every rank), mixed (decode rows and prefill chunks in one forward),
    split (a chunk that continues a prompt), decode (pure decode) and extend (with chunks)."""

    def __init__(self, engine: Engine):
        self.counts = dict.fromkeys(("uniform", "mixed", "split", "decode", "extend"), 0)
        agree = engine.dp.agree

        def counted(plan, *args):
            plan = agree(plan, *args)
            sizes = plan.sizes
            uniform = plan.use_graph and sizes is not None and len(set(sizes.tokens_per_rank)) == 1
            self.counts["uniform"] += uniform
            self.counts["mixed"] += bool(plan.decode and plan.chunks)
            self.counts["split"] += any(c.start > 0 for c in plan.chunks)
            self.counts["decode"] += plan.is_pure_decode
            self.counts["extend"] += bool(plan.chunks)
            return plan

        engine.dp.agree = counted

    def take(self) -> dict[str, int]:
        counts = dict(self.counts)
        self.counts = dict.fromkeys(counts, 0)
        return counts


def prefill_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one eager prefill (every rank calls this alike; with no
    per-rank token counts given, the dispatcher asks the other ranks for theirs)."""
    row = engine.kv.allocate(len(ids) + 1)
    try:
        hidden, _, _ = engine.runner.forward_packed([SeqInput(row, 0, ids)])
        return engine.model.compute_logits(hidden).cpu()
    finally:
        engine.kv.free(row)


def top2_gaps(engine: Engine, prompt: list[int], tokens: list[int]) -> list[float]:
    """Teacher-forced top-1 minus top-2 logit gap before each generated token."""
    logits = prefill_logits(engine, prompt + tokens[:-1])[len(prompt) - 1 :]
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def time_step(engine: Engine, bs: int, iters: int, vocab: int) -> float | None:
    """Median ms of one decode step of bs live rows (graph replay with the replay hooks; the
    eager step on the CPU); None when --num-pages leaves too few pages for the rows. Every rank
    runs the same loop (the same pool on every rank): the collectives line up."""
    if bs * engine.kv.pages_for(CONTEXT + 400) > len(engine.kv.free_pages):  # live_rows' rows
        return None
    rows = live_rows(engine, bs, vocab, CONTEXT, torch.Generator().manual_seed(bs))
    graph = engine.graphs.graphs.get(("greedy", bs))

    def step():
        if graph is None:
            return engine.runner.decode_step(bs, "greedy")
        for hook in engine.graphs.hooks:
            hook.replay()
        graph.replay()

    try:
        return time_ms(step, iters, cuda=graph is not None)
    finally:
        for row in rows:
            engine.kv.free(row)


def run_engine(pctx, args, target: str, head: str, backend: str, reference: bool) -> dict:
    """One engine's tokens, records, prefill logits and step times (`reference`: also gaps)."""
    device = "cpu" if args.device == "cpu" else f"cuda:{torch.cuda.current_device()}"
    engine = Engine(target, pctx=pctx, device=device, **engine_options(args, head, backend))
    vocab = engine.model_config.vocab_size
    out = {
        "dispatcher": type(engine.model.dispatcher).__name__,
        "hooks": [type(h).__name__ for h in engine.graphs.hooks],
        "graphs": len(engine.graphs.graphs),
        "sets": {},
    }
    counter = StepCounter(engine)
    for name, (lengths, seed) in prompt_sets(args).items():
        prompts = _common.prompts_of(lengths, seed, vocab)
        engine.dp.dummy_steps = 0
        replays, preemptions = engine.graphs.num_replays, engine.scheduler.num_preemptions
        seconds = dict(engine.step_seconds)  # host wall time by kind of step
        outs = engine.generate(prompts, GREEDY)
        steps = counter.take()
        mean_ms = {}
        for kind in ("decode", "extend"):
            spent = engine.step_seconds[kind] - seconds[kind]
            mean_ms[kind] = round(1e3 * spent / steps[kind], 3) if steps[kind] else None
        record = {
            "tokens": {o.index: o.token_ids for o in outs},
            "accept_len": {o.index: o.stats["accept_len"] for o in outs},
            "uniform_steps": steps["uniform"],
            "mixed_steps": steps["mixed"],
            "split_steps": steps["split"],
            "preemptions": engine.scheduler.num_preemptions - preemptions,
            "step_ms_in_job": mean_ms,  # mean wall ms of its pure decode / extend steps
            "replays": engine.graphs.num_replays - replays,
            "dummy_steps": engine.dp.dummy_steps,
        }
        if reference:
            record["gaps"] = {o.index: top2_gaps(engine, prompts[o.index], o.token_ids)
                              for o in outs}  # fmt: skip
        out["sets"][name] = record
    out["logits"] = [
        prefill_logits(engine, _common.prompts_of((n,), 7, vocab)[0]) for n in LOGIT_PROMPTS
    ]
    out["step_ms"] = {bs: time_step(engine, bs, args.iters, vocab) for bs in CAPTURE}
    if engine.graphs.hooks and args.device == "cuda":  # the adapter's mode set + clean alone
        hooks = engine.graphs.hooks
        out["hook_ms"] = time_ms(lambda: [h.replay() for h in hooks], args.iters)
    del engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def verdict(ours: dict, ref: dict, tol: float) -> dict:
    """equal / rounding / DIFFERENT, with where the tokens first differ."""
    if ours["tokens"] == ref["tokens"]:
        return {"verdict": "equal"}
    index = min(i for i in ref["tokens"] if ours["tokens"].get(i) != ref["tokens"][i])
    pairs = zip(ours["tokens"].get(index, []), ref["tokens"][index], strict=False)
    at = next((j for j, (a, b) in enumerate(pairs) if a != b), 0)
    gap = ref["gaps"][index][at]
    return {
        "verdict": "rounding" if gap < tol else "DIFFERENT",
        "request": index,
        "token": at,
        "reference_top2_gap": gap,
    }


def rank_main(args: argparse.Namespace, target: str, head: str) -> None:
    dp = args.world // args.tp
    pctx = ParallelContext.from_env(args.tp, dp, args.device, timeout_s=args.budget_s)
    path = Path(args.out) / "moe_engine_gpu.json"
    report = {**header(args), "phases": {}} if pctx.rank == 0 else None

    def save(phase: str, result: dict) -> None:
        if report is not None:
            report["phases"][phase] = result
            path.write_text(json.dumps(report, indent=2, default=str))

    single = ParallelContext.single()
    ref = run_engine(single, args, target, head, "local", True) if pctx.rank == 0 else None
    pctx.barrier()  # the other ranks wait for the one-GPU reference
    if ref is not None:
        save("one_gpu", {k: v for k, v in ref.items() if k != "logits"})
    for backend in backends_of(args):
        if backend == "deepep" and not deep_ep_installed():
            save("deepep", {"skipped": "deep_ep is not installed"})
            continue
        ours = run_engine(pctx, args, target, head, backend, False)
        both = pctx.all_gather_object({k: v for k, v in ours.items() if k != "logits"})
        if ref is None:
            continue
        result = {k: ours[k] for k in ("dispatcher", "hooks", "graphs")}
        result["step_ms"] = {bs: slowest(b["step_ms"][bs] for b in both) for bs in CAPTURE}
        result["step_ms_one_gpu"] = ref["step_ms"]
        result["hook_ms"] = ours.get("hook_ms")
        result["logits_rel_err"] = [
            ((a - b).norm() / b.norm()).item()
            for a, b in zip(ours["logits"], ref["logits"], strict=True)
        ]
        for name in prompt_sets(args):
            ranks = [b["sets"][name] for b in both]
            result[name] = {
                **verdict(ranks[0], ref["sets"][name], args.gap_tol),
                "accept_len_ep": ranks[0]["accept_len"],
                "accept_len_one_gpu": ref["sets"][name]["accept_len"],
                "uniform_steps": ranks[0]["uniform_steps"],
                "uniform_steps_per_rank": [r["uniform_steps"] for r in ranks],
                "replays_per_rank": [r["replays"] for r in ranks],
                "dummy_steps_per_rank": [r["dummy_steps"] for r in ranks],
                "mixed_steps_per_rank": [r["mixed_steps"] for r in ranks],
                "split_steps_per_rank": [r["split_steps"] for r in ranks],
                "preemptions_per_rank": [r["preemptions"] for r in ranks],
                "step_ms_in_job_per_rank": [r["step_ms_in_job"] for r in ranks],
                "step_ms_in_job_one_gpu": ref["sets"][name]["step_ms_in_job"],
            }
        save(backend, result)
    pctx.close()


def slowest(times) -> float | None:
    times = list(times)
    return None if None in times else max(times)


def backends_of(args: argparse.Namespace) -> list[str]:
    return ["all2all"] if args.device == "cpu" else ["all2all", "deepep"]


def deep_ep_installed() -> bool:
    from speculant.comm.deepep import deep_ep_installed as installed

    return installed()


def header(args: argparse.Namespace) -> dict:
    return {
        **_common.run_header(args.device == "cuda"),
        "model": CPU_MODEL if args.quick else GPU_MODEL,
        "backends": backends_of(args),
        "algo": args.algo,
        "world": args.world,
        "tp": args.tp,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_pages": args.num_pages,
        "prompt_sets": list(prompt_sets(args)),
    }


def table(data: dict) -> tuple[str, bool]:
    """The summary printed last, and whether every check passed."""
    phases, ok = data.get("phases", {}), data.get("error") is None
    world, tp = data.get("world", 2), data.get("tp", 1)
    lines = [f"{data.get('gpu')} x{world}  torch {data.get('torch')}  NCCL {data.get('nccl')}"]
    lines += [f"EP={world} (DP={world // tp} x TP={tp}); algo {data.get('algo')}; accept_len: "
              f"mean over requests, EP={world} and one GPU"]  # fmt: skip
    cuda, chunked = data.get("gpu") not in (None, "cpu"), data.get("max_num_batched_tokens")
    if chunked:
        lines += [f"token budget {chunked} per forward, {data.get('num_pages')} KV pages"]
    lines += ["| backend | prompts | vs one GPU | accept_len | replays per rank | dummy steps | "
              "mixed steps | split-prompt steps | preemptions |"]  # fmt: skip
    lines += ["| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for backend in data.get("backends", ["all2all", "deepep"]):
        result = phases.get(backend)
        if result is None or "skipped" in result:
            lines.append(f"| {backend} | - | {'skipped' if result else 'not run'} | | | |")
            ok = False
            continue
        expected = {"all2all": "AllToAllDispatcher", "deepep": "DeepEPDispatcher"}[backend]
        if result["dispatcher"] != expected or (backend == "deepep") != bool(result["hooks"]):
            lines.append(f"{backend}: dispatcher {result['dispatcher']}, hooks {result['hooks']}")
            ok = False
        names = data.get("prompt_sets", list(PROMPT_SETS))
        for name in names:
            r = result[name]
            # uniform steps replayed graphs on every rank (on the CPU: ran eagerly at one size)
            graph_steps = r["replays_per_rank"] if cuda else r["uniform_steps_per_rank"]
            ok = ok and r["verdict"] in ("equal", "rounding") and min(graph_steps) > 0
            accept = [round(sum(a.values()) / len(a), 2) for a in
                      (r["accept_len_ep"], r["accept_len_one_gpu"])]  # fmt: skip
            lines.append(
                f"| {backend} | {name} | {r['verdict']} | {accept} | {r['replays_per_rank']} | "
                f"{r['dummy_steps_per_rank']} | {r['mixed_steps_per_rank']} | "
                f"{r['split_steps_per_rank']} | {r['preemptions_per_rank']} |"
            )
        in_job = "; ".join(
            f"{n} {pair(result[n]['step_ms_in_job_per_rank'][0])} vs "
            f"{pair(result[n]['step_ms_in_job_one_gpu'])}"
            for n in names
        )
        lines.append(f"{backend} mean ms of the job's steps (decode, extend), rank 0 vs one GPU: "
                     f"{in_job}")  # fmt: skip
        if chunked:  # chunks mixed into decode steps, split prompts, preemption on some rank
            mixed = sum(sum(result[n]["mixed_steps_per_rank"]) for n in names)
            split = sum(sum(result[n]["split_steps_per_rank"]) for n in names)
            preempted = result["pressure"]["preemptions_per_rank"]
            held = mixed > 0 and split > 0 and sum(preempted) > 0
            lines.append(f"{backend} under the budget: mixed steps {mixed}, split-prompt steps "
                         f"{split}, preemptions per rank {preempted} (pressure): "
                         f"{'held' if held else 'NOT held'}")  # fmt: skip
            ok = ok and held
        times = format_ms(result["step_ms"])
        lines.append(f"{backend} step ms ({times}); prefill logits rel err (short, long) "
                     f"{result['logits_rel_err']}; hook ms {result['hook_ms']}")  # fmt: skip
    one = phases.get("one_gpu")
    if one:
        lines.append(f"one GPU step ms ({format_ms(one['step_ms'])})")
    return "\n".join(lines), ok


def pair(mean_ms: dict) -> str:
    """'decode/extend' mean ms ('-' for a kind of step that did not run)."""
    values = (mean_ms[kind] for kind in ("decode", "extend"))
    return "/".join("-" if ms is None else f"{ms:.2f}" for ms in values)


def format_ms(step_ms: dict) -> str:
    """Step times by bs; '-' where the pool was too small to time (--num-pages)."""
    return ", ".join(f"bs {bs}: {'-' if ms is None else f'{ms:.3f}'}" for bs, ms in step_ms.items())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = _common.run_and_collect(
        rank_main,
        args,
        "moe_engine_gpu.json",
        lambda folder: write_checkpoints(folder, args.quick, args.algo),
        args.world,
    )
    summary, ok = table(data)
    print(summary)
    skipped = "skipped" in data.get("phases", {}).get("deepep", {})
    return 0 if ok else 2 if skipped and data["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
