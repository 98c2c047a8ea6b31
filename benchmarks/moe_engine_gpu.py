"""Qwen3-MoE speculative decoding with experts over every rank (EP = --world; default two GPUs,
DP=2), CUDA graphs, through DeepEP low-latency kernels and through the NCCL all-to-all, against
one GPU (the engine-level check of issues 8 and 12).

    timeout 560 python benchmarks/moe_engine_gpu.py --out $OUT                   # EP=2 (DP=2)
    timeout 560 python benchmarks/moe_engine_gpu.py --out $OUT --world 4 --tp 2  # DP2 x TP2

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
        **graphs,
    )


def prefill_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one eager prefill (every rank calls this alike)."""
    engine.graphs.set_step_sizes(None)  # unplanned: the dispatcher asks the other ranks
    row = engine.kv.allocate(len(ids) + 1)
    try:
        hidden, _, _ = engine.runner.forward_prefill([row], [ids], [0])
        return engine.model.compute_logits(hidden).cpu()
    finally:
        engine.kv.free(row)


def top2_gaps(engine: Engine, prompt: list[int], tokens: list[int]) -> list[float]:
    """Teacher-forced top-1 minus top-2 logit gap before each generated token."""
    logits = prefill_logits(engine, prompt + tokens[:-1])[len(prompt) - 1 :]
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def time_step(engine: Engine, bs: int, iters: int, vocab: int) -> float:
    """Median ms of one decode step of bs live rows (graph replay with the replay hooks; the
    eager step on the CPU). Every rank runs the same loop: the collectives line up."""
    engine.graphs.set_step_sizes(None)
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
    for name, (lengths, seed) in PROMPT_SETS.items():
        prompts = _common.prompts_of(lengths, seed, vocab)
        engine.dp.uniform_sizes, engine.dp.dummy_steps = [], 0
        replays = engine.graphs.num_replays
        outs = engine.generate(prompts, GREEDY)
        record = {
            "tokens": {o.index: o.token_ids for o in outs},
            "accept_len": {o.index: o.stats["accept_len"] for o in outs},
            "uniform_steps": len(engine.dp.uniform_sizes),
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
        result["step_ms"] = {bs: max(b["step_ms"][bs] for b in both) for bs in CAPTURE}
        result["step_ms_one_gpu"] = ref["step_ms"]
        result["hook_ms"] = ours.get("hook_ms")
        result["logits_rel_err"] = [
            ((a - b).norm() / b.norm()).item()
            for a, b in zip(ours["logits"], ref["logits"], strict=True)
        ]
        for name in PROMPT_SETS:
            ranks = [b["sets"][name] for b in both]
            result[name] = {
                **verdict(ranks[0], ref["sets"][name], args.gap_tol),
                "accept_len_ep": ranks[0]["accept_len"],
                "accept_len_one_gpu": ref["sets"][name]["accept_len"],
                "uniform_steps": ranks[0]["uniform_steps"],
                "replays_per_rank": [r["replays"] for r in ranks],
                "dummy_steps_per_rank": [r["dummy_steps"] for r in ranks],
            }
        save(backend, result)
    pctx.close()


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
    }


def table(data: dict) -> tuple[str, bool]:
    """The summary printed last, and whether every check passed."""
    phases, ok = data.get("phases", {}), data.get("error") is None
    world, tp = data.get("world", 2), data.get("tp", 1)
    lines = [f"{data.get('gpu')} x{world}  torch {data.get('torch')}  NCCL {data.get('nccl')}"]
    lines += [f"EP={world} (DP={world // tp} x TP={tp}); algo {data.get('algo')}; accept_len: "
              f"mean over requests, EP={world} and one GPU"]  # fmt: skip
    lines += ["| backend | prompts | vs one GPU | accept_len | replays per rank | dummy steps |"]
    lines += ["| --- | --- | --- | --- | --- | --- |"]
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
        for name in PROMPT_SETS:
            r = result[name]
            ok = ok and r["verdict"] in ("equal", "rounding") and min(r["replays_per_rank"]) > 0
            accept = [round(sum(a.values()) / len(a), 2) for a in
                      (r["accept_len_ep"], r["accept_len_one_gpu"])]  # fmt: skip
            lines.append(
                f"| {backend} | {name} | {r['verdict']} | {accept} | {r['replays_per_rank']} | "
                f"{r['dummy_steps_per_rank']} |"
            )
        times = ", ".join(f"bs {bs}: {ms:.3f}" for bs, ms in result["step_ms"].items())
        lines.append(f"{backend} step ms ({times}); prefill logits rel err (short, long) "
                     f"{result['logits_rel_err']}; hook ms {result['hook_ms']}")  # fmt: skip
    one = phases.get("one_gpu")
    if one:
        times = ", ".join(f"bs {bs}: {ms:.3f}" for bs, ms in one["step_ms"].items())
        lines.append(f"one GPU step ms ({times})")
    return "\n".join(lines), ok


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
