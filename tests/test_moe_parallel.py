"""Expert parallelism inside the engine on the CPU (gloo processes): a Qwen3-MoE target whose
experts are split over every rank gives the single-rank tokens at EP=2 (DP=2) and EP=4 (DP2 x
TP2), plain and with EAGLE-3, with uneven batches, prefills next to decodes and a DP rank with no
requests (after the start-up warm-up's prefills on every rank), and at EP=2 under a token budget
and page pool that force chunked prefill mixed into decode steps and preemption on both DP
ranks; every rank derives the same per-step table and runs the same number of MoE forwards; the
capture-uniformity regression (with an upcycled MoE whose dense twin drafts with real
acceptance); the per-step protocol and the dispatch plan as units; and `speculant generate --dp
2` on an MoE checkpoint.

Every multi-process run is bounded (collectives time out after COLLECTIVE_TIMEOUT_S, launches
are killed after LAUNCH_TIMEOUT_S). Checkpoints come from tests/test_moe.py's writer."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from helpers_eagle import write_random_eagle3
from safetensors.torch import load_file, save_file
from test_moe import TINY_MOE, prompts_of, save_moe
from test_parallel import DecodeRecorder

from speculant import Engine, SamplingParams, SpeculantError
from speculant.comm.groups import ParallelContext
from speculant.comm.moe_dispatch import AllToAllDispatcher
from speculant.config import GraphConfig
from speculant.executor.cuda_graph import DPStepSizes, GraphRunner, dp_capture_dummies
from speculant.executor.dp import DECODE, EXTEND, IDLE, DPCoordinator
from speculant.executor.model_runner import StepOutput
from speculant.executor.speculation import DraftShape
from speculant.executor.step_plan import Chunk, StepPlan
from speculant.launch.cli import build_parser
from speculant.launch.spawn import run_ranks

COLLECTIVE_TIMEOUT_S = 60
LAUNCH_TIMEOUT_S = 120
# 4 request rows per DP rank at dp=2; the default per-rank token limit is one decode step
# (4 * (k + 1)), so long prompts prefill in several chunks
ENGINE = dict(device="cpu", max_num_seqs=8, max_model_len=160, page_size=4)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


SAMPLED = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """3 layers (layer 1 dense), 8 experts top-2: 4 experts per rank at EP=2, 2 at EP=4."""
    path = tmp_path_factory.mktemp("moe_ep")
    save_moe(path, 0, False, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
    return path


def save_upcycled_moe(moe_dir, dense_dir, noise: float, seed: int = 0, **config) -> None:
    """An MoE target whose experts are one shared MLP plus `noise` x a random perturbation each
    (sparse upcycling: with renormalised top-k weights the MoE layer is that MLP plus a small
    routing-dependent term), and the dense Qwen3 holding the shared MLPs: a draft model the
    target mostly accepts, so a collapse of the acceptance length is visible. `config` overrides
    the tiny shape (test_moe.TINY_MOE, 3 layers, layer 1 dense)."""
    config = {"num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": True, **config}
    inter = config.get("moe_intermediate_size", TINY_MOE["moe_intermediate_size"])
    save_moe(moe_dir, seed, False, **{**config, "intermediate_size": inter})  # dense MLPs alike
    tensors = load_file(moe_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(seed + 1)
    dense = {}
    for name in sorted(tensors):
        expert = re.fullmatch(r"(.*\.mlp)\.experts\.\d+\.(\w+_proj\.weight)", name)
        if expert is None:
            if not name.endswith(".mlp.gate.weight"):  # the router has no dense counterpart
                dense[name] = tensors[name]
            continue
        mlp, proj = expert.groups()
        shared = dense.setdefault(f"{mlp}.{proj}", tensors[f"{mlp}.experts.0.{proj}"].clone())
        tensors[name] = shared + noise * shared.std() * torch.randn(shared.shape, generator=gen)
    save_file(tensors, str(moe_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((moe_dir / "config.json").read_text())
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    dense_dir.mkdir(parents=True, exist_ok=True)
    (dense_dir / "config.json").write_text(json.dumps(config))
    save_file(dense, str(dense_dir / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory):
    """(MoE target, its dense draft twin); the twin's drafts are accepted about 3 of 4."""
    root = tmp_path_factory.mktemp("upcycled")
    save_upcycled_moe(root / "moe", root / "dense", noise=0.1)
    return root / "moe", root / "dense"


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, moe_dir):
    path = tmp_path_factory.mktemp("moe_ep_eagle3")
    write_random_eagle3(path, moe_dir, draft_vocab=200, num_kv_heads=1, seed=4)
    return path


class StepLog:
    """Wraps an engine's DP coordinator to log, per step, what this rank scheduled (prefill
    chunks, decode rows; in `plans` also each chunk's (start, tokens) and the requests preempted
    while scheduling) and the per-rank sizes it derived from the exchange."""

    def __init__(self, engine: Engine):
        self.modes: list[tuple[int, int]] = []
        self.plans: list[tuple] = []
        self.sizes: list[tuple | None] = []
        agree = engine.dp.agree

        def logged_agree(plan, *args):
            self.modes.append((len(plan.chunks), len(plan.decode)))
            chunks = tuple((c.start, len(c.tokens)) for c in plan.chunks)
            self.plans.append((len(plan.decode), chunks, len(plan.preempted)))
            plan = agree(plan, *args)
            self.sizes.append(None if plan.sizes is None else tuple(map(tuple, plan.sizes)))
            return plan

        engine.dp.agree = logged_agree


def moe_rank(tp: int, dp: int, cases: list[tuple]) -> dict:
    """One rank: join the mesh, then per case (name, target, options, prompts, params) build an
    engine and generate (rank 0 passes the prompts), logging every step."""
    pctx = ParallelContext.from_env(tp, dp, "cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
    recorder, seen = DecodeRecorder(), {}
    for name, target, options, prompts, params in cases:
        recorder.engine = None
        engine = Engine(str(target), pctx=pctx, **ENGINE, **options)
        engine.warm_up((1, 9))  # what start-up runs on CUDA: MoE prefills on every rank at once
        recorder.take()
        recorder.engine, log = engine, StepLog(engine)
        source = pctx.rank == 0
        outs = engine.generate(prompts if source else None, params if source else None)
        seen[name] = dict(
            tokens={o.index: o.token_ids for o in outs},
            accept_len={o.index: o.stats["accept_len"] for o in outs},
            modes=log.modes,
            plans=log.plans,
            preempted={o.index: o.stats["num_preemptions"] for o in outs},
            preemptions=engine.scheduler.num_preemptions,  # this rank's own
            steps=log.sizes,
            moe_forwards=engine.model.dispatcher.num_forwards,
            backend=type(engine.model.dispatcher).__name__,
            on_ep_group=pctx.ep_group is not None
            and engine.model.dispatcher.group is pctx.ep_group,
            experts=engine.model.model.layers[0].mlp.experts.num_local,
            replays=engine.graphs.num_replays,
            stand_ins=engine.graphs.num_stand_ins,
            decodes=recorder.take(),
            dummy_steps=engine.dp.dummy_steps,
            pages_returned=len(engine.kv.free_pages) == engine.kv.num_pages - 1,
        )
    pctx.close()
    return seen


def reference(cases: list[tuple]) -> dict[str, dict]:
    """Each case on one in-process rank (every expert local)."""
    out = {}
    for name, target, options, prompts, params in cases:
        outs = Engine(str(target), **ENGINE, **options).generate(prompts, params)
        out[name] = {
            "tokens": {o.index: o.token_ids for o in outs},
            "accept_len": {o.index: o.stats["accept_len"] for o in outs},
        }
    return out


def launch(tp: int, dp: int, cases: list[tuple]) -> list[dict]:
    return run_ranks(moe_rank, tp * dp, (tp, dp, cases), timeout_s=LAUNCH_TIMEOUT_S)


def check_lockstep(ranks: list[dict], case: str) -> None:
    """Every rank derived the same per-step table and ran the same number of MoE forwards, and,
    as seen inside each rank's decode step: after every exchange in which every rank ran a
    decode step (all decode or idle within the captured sizes), they all ran the same rows."""
    first = ranks[0][case]
    for rank in ranks[1:]:
        assert rank[case]["steps"] == first["steps"], case
        assert rank[case]["moe_forwards"] == first["moe_forwards"], case
    assert all(rank[case]["pages_returned"] for rank in ranks), case
    ran = [{step: bs for step, bs, *_ in rank[case]["decodes"]} for rank in ranks]
    common = set.intersection(*(set(r) for r in ran))
    assert common, case  # some step decoded on every rank at once
    for step in sorted(common):
        assert len({r[step] for r in ran}) == 1, (case, step, [r[step] for r in ran])


# ---------------------------------------------------------------------------------------- EP=2


@pytest.fixture(scope="module")
def ep2_cases(moe_dir, eagle_dir, upcycled):
    eagle = dict(algo="eagle3", draft=str(eagle_dir), num_draft_tokens=3)
    # uneven shares (the 45-token prompt alone on one DP rank), more requests than request rows
    # on the other (admissions later prefill while the first rank decodes), ragged lengths
    lengths = (45, 3, 9, 2, 14, 6, 5)
    params = [greedy(n) for n in (12, 6, 9, 4, 11, 7, 8)]
    return [
        ("plain", moe_dir, {}, prompts_of(lengths, seed=1), [*params[:-1], SAMPLED]),
        ("eagle3", moe_dir, eagle, prompts_of(lengths, seed=1), params),
        # one request: DP rank 1 has none (eager one-row dummies while rank 0 prefills, padded
        # dummy batches while it decodes)
        ("one_request", moe_dir, dict(eager_padding=True), prompts_of((13,), seed=2), greedy(10)),
        (
            "eagle3_padded",
            moe_dir,
            {**eagle, "eager_padding": True},
            prompts_of((21, 4, 30, 7), seed=3),
            greedy(16),
        ),
        # the regression case: speculative greedy with padded graph sizes (eager on the CPU),
        # a drafter with real acceptance, DP rank 1's requests ending early (dummy batches)
        (
            "spec_padded",
            upcycled[0],
            draft_twin(upcycled[1]),
            prompts_of((10, 30, 25), seed=3),  # DP shares [0, 2] and [1]
            [greedy(24), greedy(4), greedy(8)],
        ),
    ]


def draft_twin(dense_dir) -> dict:
    return dict(algo="draft-model", draft=str(dense_dir), num_draft_tokens=3, eager_padding=True)


@pytest.fixture(scope="module")
def ep2_run(ep2_cases):
    spec = ep2_cases[-1]
    plain_of_spec = [("plain_greedy", spec[1], {}, spec[3], spec[4])]
    return reference(ep2_cases + plain_of_spec), launch(1, 2, ep2_cases)


@pytest.mark.parametrize("case", ["plain", "eagle3", "one_request", "eagle3_padded", "spec_padded"])
def test_ep2_equals_one_rank(ep2_run, case):
    expected, ranks = ep2_run
    assert ranks[0][case]["tokens"] == expected[case]["tokens"]
    assert all(rank[case]["backend"] == "AllToAllDispatcher" for rank in ranks)
    assert all(rank[case]["on_ep_group"] for rank in ranks)  # ParallelContext.ep_group
    assert all(rank[case]["experts"] == 4 for rank in ranks)  # 8 experts over 2 ranks
    check_lockstep(ranks, case)


def test_ep2_steps_mix_prefill_decode_and_idle(ep2_run):
    """One DP rank prefilled while the other decoded (both ran one MoE forward), uniform decode
    steps ran, a prefill took several dispatch chunks, and DP rank 1 of `one_request` ran only
    dummy forwards."""
    _, ranks = ep2_run
    modes = list(zip(ranks[0]["plain"]["modes"], ranks[1]["plain"]["modes"], strict=True))
    assert any(a[0] and b[1] or a[1] and b[0] for a, b in modes)  # prefill next to decode
    steps = [s for s in ranks[0]["plain"]["steps"] if s is not None]
    assert any(len(set(tokens)) == 1 for tokens, _ in steps)  # a uniform step
    assert any(max(tokens) > 4 * 4 for tokens, _ in steps)  # above the 16-token limit: chunks
    one = ranks[1]["one_request"]
    assert one["tokens"] == {} and one["dummy_steps"] > 0
    assert one["decodes"] and all(live == 0 for _, _, live, _ in one["decodes"])  # dummies
    assert ranks[0]["one_request"]["dummy_steps"] == 0
    # rank 1's one-row eager dummy while rank 0 prefilled: 13 prompt tokens and 1 token
    assert ((13, 1), (1, 1)) in ranks[0]["one_request"]["steps"]


def test_dp2_speculative_padded_graph_sizes_keep_output_and_acceptance(ep2_run):
    """The regression for capture sizing (a real system's accept rate fell to 0 under DP when
    the per-rank batch sizes at capture were left unset): speculative greedy under DP=2 with
    padded graph sizes equals plain greedy and keeps the single-rank acceptance length. Every
    padded step checks the step's per-rank sizes against those its graph was captured with
    (dp_capture_dummies); unset or non-uniform capture sizes fail the run."""
    expected, ranks = ep2_run
    ours = ranks[0]["spec_padded"]
    assert ours["tokens"] == expected["plain_greedy"]["tokens"]
    single = expected["spec_padded"]["accept_len"]
    # the drafter is mostly accepted (a short request's last step keeps fewer: kept tokens count)
    assert sum(single.values()) / len(single) > 2.0 and min(single.values()) > 1.2
    for index, accept_len in ours["accept_len"].items():
        assert accept_len == pytest.approx(single[index], rel=0.02), index
    for rank in ranks:  # no graphs on the CPU: eager steps stood in for replays
        assert rank["spec_padded"]["replays"] == 0 and rank["spec_padded"]["stand_ins"] > 0
    assert ranks[1]["spec_padded"]["dummy_steps"] > 0  # its requests ended first


# ------------------------------------------------------------ EP=2, chunked prefill, preemption

# Under a token budget of a few tokens per forward and a pool of 23 usable pages of 4 tokens,
# prompts prefill in chunks mixed into decode steps and requests are preempted on each DP rank,
# while every rank still runs one MoE forward per step (chunks in the exchanged plan).
MOE_BUDGETS = {"plain": 7, "eagle3": 11}  # max_num_batched_tokens; k = 3 drafts


@pytest.fixture(scope="module")
def ep2_budget_cases(moe_dir, eagle_dir):
    prompts = prompts_of((37, 5, 22, 13, 30, 9), seed=11)
    params = [greedy(16)] * 5 + [SAMPLED]
    eagle = dict(algo="eagle3", draft=str(eagle_dir), num_draft_tokens=3, eager_padding=True)
    cases = []
    for name, spec in (("plain", {}), ("eagle3", eagle)):
        options = {**spec, "num_pages": 24, "max_num_batched_tokens": MOE_BUDGETS[name]}
        cases.append((name, moe_dir, options, prompts, params))
    return cases


@pytest.fixture(scope="module")
def ep2_budget_run(ep2_budget_cases):
    drop = ("num_pages", "max_num_batched_tokens")
    roomy = [
        (name, target, {k: v for k, v in options.items() if k not in drop}, prompts, params)
        for name, target, options, prompts, params in ep2_budget_cases
    ]
    return reference(ep2_budget_cases), reference(roomy), launch(1, 2, ep2_budget_cases)


@pytest.mark.parametrize("case", ["plain", "eagle3"])
def test_ep2_chunked_preempted_equals_one_rank(ep2_budget_run, case):
    tight, unconstrained, ranks = ep2_budget_run
    assert tight[case]["tokens"] == unconstrained[case]["tokens"]
    assert ranks[0][case]["tokens"] == tight[case]["tokens"]
    check_lockstep(ranks, case)  # the same table and MoE forwards on every rank, every step
    T, budget = 1 if case == "plain" else 4, MOE_BUDGETS[case]
    plans = [step for rank in ranks for step in rank[case]["plans"]]
    assert all(rows * T + sum(n for _, n in chunks) <= budget for rows, chunks, _ in plans)
    assert any(start > 0 for _, chunks, _ in plans for start, _ in chunks)  # a split prompt
    assert any(rows and chunks for rows, chunks, _ in plans)  # chunks mixed into a decode step
    # a rank extending next to a rank in a pure decode step: both ran one (eager) MoE forward
    modes = zip(ranks[0][case]["modes"], ranks[1][case]["modes"], strict=True)
    assert any(a[0] and not b[0] and b[1] or b[0] and not a[0] and a[1] for a, b in modes)
    preemptions = [rank[case]["preemptions"] for rank in ranks]
    assert all(preemptions), preemptions  # on both DP ranks
    assert sum(ranks[0][case]["preempted"].values()) == sum(preemptions)
    assert sum(p for _, _, p in plans) == sum(preemptions)


# ---------------------------------------------------------------------------------------- EP=4


@pytest.fixture(scope="module")
def ep4_cases(moe_dir, eagle_dir):
    eagle = dict(algo="eagle3", draft=str(eagle_dir), num_draft_tokens=2, eager_padding=True)
    prompts = prompts_of((33, 4, 9), seed=5)
    return [
        ("plain", moe_dir, dict(eager_padding=True), prompts, [greedy(10), greedy(6), SAMPLED]),
        ("eagle3", moe_dir, eagle, prompts, greedy(12)),
        ("one_request", moe_dir, eagle, prompts_of((6,), seed=6), greedy(8)),
    ]


@pytest.fixture(scope="module")
def ep4_run(ep4_cases):
    return reference(ep4_cases), launch(2, 2, ep4_cases)


@pytest.mark.parametrize("case", ["plain", "eagle3", "one_request"])
def test_ep4_dp2_tp2_equals_one_rank(ep4_run, case):
    expected, ranks = ep4_run
    assert ranks[0][case]["tokens"] == expected[case]["tokens"]
    assert ranks[2][case]["tokens"] == ranks[3][case]["tokens"]  # TP peers agree
    assert all(rank[case]["experts"] == 2 for rank in ranks)  # 8 experts over 4 ranks
    check_lockstep(ranks, case)
    if case == "one_request":
        assert ranks[2][case]["tokens"] == {} and ranks[2][case]["dummy_steps"] > 0


# ---------------------------------------------------------------------------------------- CLI


def test_cli_generate_moe_dp2(moe_dir, tmp_path):
    prompts = prompts_of((17, 3, 8), seed=9)
    file = tmp_path / "prompts.jsonl"
    file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "speculant", "generate", "--target", str(moe_dir),
           "--device", "cpu", "--dp", "2", "--prompts", str(file), "--output", str(out),
           "--max-new-tokens", "8", "--ignore-eos", "--max-num-seqs", "4", "--max-model-len",
           "64", "--page-size", "4", "--moe-backend", "all2all", "--moe-max-tokens-per-rank",
           "8", "--dist-timeout", str(COLLECTIVE_TIMEOUT_S)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("requests=3 ")
    got = {row["index"]: row["token_ids"] for row in map(json.loads, out.read_text().splitlines())}
    engine = Engine(str(moe_dir), device="cpu", max_num_seqs=4, max_model_len=64, page_size=4)
    assert got == {o.index: o.token_ids for o in engine.generate(prompts, greedy(8))}


def test_cli_moe_flags_reach_the_engine_options():
    from speculant.launch.cli import _engine_kwargs

    flags = "generate --device cpu --moe-backend deepep --moe-max-tokens-per-rank 64".split()
    kwargs = _engine_kwargs(build_parser().parse_args(flags))
    assert (kwargs["moe_backend"], kwargs["moe_max_tokens_per_rank"]) == ("deepep", 64)
    defaults = _engine_kwargs(build_parser().parse_args(["generate", "--device", "cpu"]))
    assert (defaults["moe_backend"], defaults["moe_max_tokens_per_rank"]) == ("auto", None)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "--moe-backend", "nccl"])
    assert exc.value.code == 2


# ---------------------------------------------------------------------------------------- units


class FakeGraphs:
    """What DPCoordinator reads of the graph runner."""

    def __init__(self, sizes=(1, 2, 4)):
        self.sizes, self.cfg = list(sizes), GraphConfig()

    def padded_bs(self, bs: int) -> int:
        return next((s for s in self.sizes if s >= bs), bs)


def scheduled(mode: int, tokens: int, rows: int, tokens_per_req: int) -> StepPlan:
    """A rank's scheduled plan of that row of the table: rows decode rows, or rows prefill
    chunks of tokens / rows tokens each, or nothing."""
    if mode == DECODE:
        return StepPlan(decode=[object()] * rows, tokens_per_req=tokens_per_req)
    chunks = [Chunk(object(), 0, [0] * (tokens // rows), True, None, True) for _ in range(rows)]
    return StepPlan(chunks=chunks if mode == EXTEND else [], tokens_per_req=tokens_per_req)


def plans_of(table, tp=1, moe=True, tokens_per_req=4):
    """Every DP rank's plan from one exchanged table of (mode, tokens, rows, has_work), each
    drafting k = tokens_per_req - 1 (as DPCoordinator exchanges it: mode, chunk tokens, decode
    rows, rows, has_work, drafts verified, drafts proposed)."""
    plans, k = [], tokens_per_req - 1
    exchanged = [
        [m, 0 if m == DECODE else t, r if m == DECODE else 0, r, w, k, k] for m, t, r, w in table
    ]
    for dp_rank, (mode, tokens, rows, has_work) in enumerate(table):
        pctx = ParallelContext(tp_size=tp, dp_size=len(table), dp_rank=dp_rank)
        pctx.all_gather_dp = lambda row: [list(r) for r in exchanged]
        coordinator = DPCoordinator(pctx, FakeGraphs(), tokens_per_req, moe)
        plan = scheduled(mode, tokens, rows, tokens_per_req)
        plans.append(coordinator.agree(plan, bool(has_work)))
    return plans


def test_protocol_every_rank_derives_the_same_forwards():
    # rank 0 prefills 2 prompts (2 x 20 tokens), rank 1 decodes 3 requests, rank 2 is idle
    table = [(EXTEND, 40, 2, 1), (DECODE, 12, 3, 1), (IDLE, 0, 0, 0)]
    plans = plans_of(table, tp=2)
    sizes = DPStepSizes([40, 40, 12, 12, 4, 4], [2, 2, 3, 3, 1, 1])  # by global rank, TP inner
    assert all(plan.sizes == sizes and not plan.use_graph for plan in plans)
    assert [plan.padded_bs for plan in plans] == [0, 3, 1]  # the idle rank runs one dummy row
    assert [plan.dummy for plan in plans] == [False, False, True]
    dense = plans_of(table, moe=False)  # a dense target: each rank its own step, no dummy
    own = [(p.padded_bs, p.use_graph, p.dummy) for p in dense[1:]]
    assert own == [(4, True, False), (0, False, False)]


def test_protocol_uniform_decode_and_the_end():
    plans = plans_of([(DECODE, 12, 3, 1), (IDLE, 0, 0, 0)])
    assert [(p.padded_bs, p.use_graph) for p in plans] == [(4, True), (4, True)]
    assert all(p.sizes == dp_capture_dummies(4, 4, 2) for p in plans)  # what graph 4 baked in
    done = plans_of([(IDLE, 0, 0, 0), (IDLE, 0, 0, 0)])
    assert all(p.all_idle and p.sizes is None for p in done)
    # above the largest captured size: eager, each rank at its own size
    big = plans_of([(DECODE, 40, 10, 1), (DECODE, 8, 2, 1)])
    assert [p.padded_bs for p in big] == [10, 2] and not big[0].use_graph


def test_dispatcher_plans_from_the_step_sizes_without_a_collective():
    a2a = AllToAllDispatcher(8, ep_size=2, ep_rank=1, max_tokens_per_rank=16)
    a2a.begin_forward(9, [5, 9])  # no process group here: a collective would fail
    assert (a2a.num_chunks, a2a.block_tokens) == (1, 9)  # blocks of the largest count, not 16
    a2a.begin_forward(9, [40, 9])  # a prefill of 40 tokens on rank 0: 3 chunks of 16
    assert (a2a.num_chunks, a2a.chunk_tokens, a2a.block_tokens) == (3, 16, 16)
    with pytest.raises(SpeculantError, match=r"has 7 tokens but .* give EP rank 1 9"):
        a2a.begin_forward(7, [40, 9])  # a stale or non-uniform plan is an error, not garbage
    with pytest.raises(ValueError, match="3 token counts for 2 EP ranks"):
        a2a.begin_forward(9, [1, 2, 3])


def test_replay_with_sizes_other_than_captured_is_an_error():
    output = StepOutput(torch.zeros(2, 1), torch.ones(2), torch.zeros(2, 0))

    steps = []

    class FakeRunner:
        device = torch.device("cpu")

        class model:  # noqa: N801 - what GraphRunner reads of the model
            config = None

        def decode_step(self, bs, variant, tokens_per_rank=None, shape=None, rests=False, kv=None):
            steps.append(bs)
            return output

        def full_shape(self):
            return DraftShape(0, 0)

    graphs = GraphRunner(
        FakeRunner(), GraphConfig(capture_sizes=[2]), 4, ("greedy",), ParallelContext()
    )
    graphs.use_graphs = graphs.pad = graphs.plans_dispatch = True  # a MoE target's graphs
    replays = []

    class Graph:
        def replay(self):
            replays.append(1)

    graphs.graphs[graphs.key("greedy", 2)] = Graph()
    graphs.outputs[graphs.key("greedy", 2)] = output
    graphs.captured_sizes[graphs.key("greedy", 2)] = dp_capture_dummies(2, 1, 2)
    graphs.run(1, 2, "greedy", sizes=dp_capture_dummies(2, 1, 2))
    assert graphs.num_replays == len(replays) == 1 and graphs.num_stand_ins == 0
    with pytest.raises(RuntimeError, match=r"captured with per-rank sizes .* dp_capture_dummies"):
        graphs.run(1, 2, "greedy", sizes=DPStepSizes([2, 1], [2, 1]))  # rank 1: another size
    graphs.run(1, 2, "greedy", allow_graph=False)  # an eager step checks nothing
    assert graphs.num_replays == len(replays) == 1 and steps == [2]
    graphs.use_graphs = False  # eager padding: the step stands in for the replay, checked alike
    graphs.run(1, 2, "greedy", sizes=dp_capture_dummies(2, 1, 2))
    assert (graphs.num_replays, graphs.num_stand_ins, steps) == (1, 1, [2, 2])
    with pytest.raises(RuntimeError, match=r"captured with per-rank sizes"):
        graphs.run(1, 2, "greedy", sizes=DPStepSizes([2, 1], [2, 1]))
