"""Real jobs ([batch-jobs]): a token budget per forward, chunked and packed prefill, mixed
prefill + decode steps, KV pages on demand with recompute preemption. Property tests
(hypothesis, bounded examples) compare against the one-request-at-a-time run: greedy output
equal token for token, seeded sampled output equal too, every page back in the pool."""

from __future__ import annotations

import math

import pytest
import torch
from helpers_dflash import write_random_dflash
from helpers_eagle import write_random_eagle3
from helpers_workload import prompt_of, run_with_arrivals, workload_strategy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speculant import Engine, SamplingParams
from speculant.errors import SpeculantError
from speculant.executor.scheduler import Scheduler

MAX_PROMPT, MAX_NEW, MAX_K = 40, 12, 4
SETTINGS = settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("batch_jobs")
    write_random_eagle3(root / "eagle3", llama_dir, draft_vocab=200, seed=7)
    write_random_dflash(root / "dflash", llama_dir, block_size=MAX_K + 1, target_layer_ids=[0, 1])
    return {"eagle3": root / "eagle3", "dflash": root / "dflash", "draft-model": llama_dir}


_engines: dict[tuple, Engine] = {}


def engine_for(llama_dir, drafts, algo, k, page_size, budget, pool) -> Engine:
    """Cached per configuration. `pool`: pages for about that many whole requests (below 2
    forces preemption once a few requests run)."""
    key = (algo, k, page_size, budget, pool)
    if key not in _engines:
        per_request = MAX_PROMPT + MAX_NEW + 2 * (MAX_K + 1)
        spec = {} if not k else dict(algo=algo, draft=str(drafts[algo]), num_draft_tokens=k)
        _engines[key] = Engine(
            str(llama_dir),
            device="cpu",
            max_num_seqs=4,
            max_model_len=MAX_PROMPT + MAX_NEW + 1,
            page_size=page_size,
            num_pages=1 + math.ceil(pool * per_request / page_size),
            max_num_batched_tokens=budget,
            **spec,
        )
    return _engines[key]


def one_at_a_time(engine: Engine, prompts, params) -> list[list[int]]:
    return [engine.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]


def assert_pool_whole(engine: Engine) -> None:
    kv = engine.kv
    assert len(kv.free_pages) == kv.num_pages - 1  # page 0 is the dummy page
    assert len(kv.free_rows) == kv.max_requests and not kv.pages_of_row
    assert not engine.scheduler.has_unfinished()


workloads = workload_strategy(MAX_PROMPT, MAX_NEW, max_arrival=5)


@SETTINGS
@given(
    workload=workloads,
    algo=st.sampled_from(["eagle3", "dflash", "draft-model"]),
    k=st.integers(0, MAX_K),
    page_size=st.sampled_from([1, 4, 16]),
    budget=st.sampled_from([5, 7, 16, 64]),
    pool=st.sampled_from([1.3, 2.5, 8.0]),
)
def test_chunked_preempted_greedy_equals_one_at_a_time(
    llama_dir, drafts, workload, algo, k, page_size, budget, pool
):
    engine = engine_for(llama_dir, drafts, algo, k, page_size, budget, pool)
    prompts = [prompt_of(n, s) for n, _, _, s in workload]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for _, m, _, _ in workload]
    alone = one_at_a_time(engine, prompts, params)
    together = run_with_arrivals(engine, prompts, params, [a for _, _, a, _ in workload])
    assert together == alone
    assert_pool_whole(engine)


@SETTINGS
@given(
    workload=workloads,
    algo=st.sampled_from(["eagle3", "dflash", "draft-model"]),
    k=st.integers(0, MAX_K),
    budget=st.sampled_from([5, 9, 32]),
    temperature=st.sampled_from([0.7, 1.0]),
)
def test_chunked_preempted_seeded_sampling_equals_one_at_a_time(
    llama_dir, drafts, workload, algo, k, budget, temperature
):
    engine = engine_for(llama_dir, drafts, algo, k, 4, budget, 1.3)
    prompts = [prompt_of(n, s) for n, _, _, s in workload]
    params = [
        SamplingParams(max_new_tokens=m, temperature=temperature, top_p=0.9, seed=s,
                       ignore_eos=True)  # fmt: skip
        for _, m, _, s in workload
    ]
    alone = one_at_a_time(engine, prompts, params)
    together = run_with_arrivals(engine, prompts, params, [a for _, _, a, _ in workload])
    assert together == alone
    assert_pool_whole(engine)


def test_preemption_happens_and_is_reported(llama_dir, drafts):
    """A pool for about 1.3 requests with 4 running forces preemptions; the outputs say so and
    equal the unconstrained run."""
    engine = engine_for(llama_dir, drafts, "eagle3", 3, 4, 16, 1.3)
    roomy = engine_for(llama_dir, drafts, "eagle3", 3, 4, 64, 8.0)
    prompts = [prompt_of(30 + i, i) for i in range(4)]
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert sum(o.stats["num_preemptions"] for o in outs) > 0
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate(prompts, params)]
    assert_pool_whole(engine)


def test_preempting_steps_admit_nothing_and_admissions_leave_decoders_a_page(llama_dir, drafts):
    """Under a pool that preempts constantly: a step that preempted admits no waiting request
    (it used to take back, in the same step, the pages its preemption freed, and be preempted
    again next step, its chunks computed again), and an admission leaves a free page for each
    decoding request's next step. Outputs equal the unconstrained run."""
    engine = engine_for(llama_dir, drafts, "eagle3", 3, 4, 16, 1.3)
    roomy = engine_for(llama_dir, drafts, "eagle3", 3, 4, 64, 8.0)
    prompts = [prompt_of(12 + 5 * i, i) for i in range(8)]
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    scheduler, seen = engine.scheduler, {"preempting": 0, "admitting": 0}
    schedule = scheduler.schedule

    def checked():
        waiting = {id(r) for r in scheduler.waiting}
        plan = schedule()
        waiting |= {id(r) for r in plan.preempted}  # waiting again, and to be admitted again
        admitted = [r for r in scheduler.running if id(r) in waiting]
        if plan.preempted:
            seen["preempting"] += 1
            assert not admitted, "a step that preempted admitted a waiting request"
        if admitted and plan.decode:
            seen["admitting"] += 1
            assert len(engine.kv.free_pages) >= len(plan.decode), "no page left for a decoder"
        return plan

    scheduler.schedule = checked
    try:
        outs = engine.generate(prompts, params)
    finally:
        del scheduler.schedule
    assert seen["preempting"] > 0 and seen["admitting"] > 0, seen
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate(prompts, params)]
    assert_pool_whole(engine)


def test_chunks_split_prompts_and_mix_with_decode_rows(llama_dir, drafts):
    """Under a small budget a long prompt is prefilled over several steps, while the requests
    already decoding keep verifying in the same forwards; a 1-token chunk occurs too."""
    engine = engine_for(llama_dir, drafts, "eagle3", 2, 4, 7, 8.0)
    plans = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        decode = [len(r.next_input) for r in plan.decode]
        plans.append((decode, [len(c.tokens) for c in plan.chunks]))
        return plan

    engine.scheduler.schedule = recording
    try:
        prompts = [prompt_of(3, 1), prompt_of(MAX_PROMPT, 2), prompt_of(8, 3)]
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    finally:
        del engine.scheduler.schedule
    mixed = [p for p in plans if p[0] and p[1]]
    assert mixed, plans  # decode rows and prefill chunks shared a forward
    assert all(3 * len(d) + sum(c) <= 7 for d, c in plans)  # never above the budget
    assert any(1 in c for _, c in plans)  # a 1-token chunk (the budget's remainder)
    assert [o.token_ids for o in outs] == one_at_a_time(
        engine, prompts, [SamplingParams(max_new_tokens=8, ignore_eos=True)] * 3
    )


def test_budget_below_one_verify_row_is_refused(llama_dir, drafts):
    with pytest.raises(SpeculantError, match="max_num_batched_tokens=3 .*k \\+ 1"):
        Engine(str(llama_dir), device="cpu", algo="eagle3", draft=str(drafts["eagle3"]),
               num_draft_tokens=3, max_num_batched_tokens=3)  # fmt: skip


def test_request_that_can_never_fit_is_refused_before_generation(llama_dir):
    engine = Engine(str(llama_dir), device="cpu", max_num_seqs=2, num_pages=3, page_size=4)
    ran = []
    engine.step = lambda: ran.append(1) or []
    with pytest.raises(SpeculantError, match=r"prompt 1 needs .*--num-pages \d+ or more"):
        engine.generate([[5, 6], [7] * 20], SamplingParams(max_new_tokens=4))
    assert not ran  # found before any step ran


def test_scheduler_takes_pages_on_demand(llama_dir):
    """A running request holds what it wrote plus one step's lookahead, not its whole length."""
    engine = Engine(str(llama_dir), device="cpu", max_num_seqs=2, page_size=4, max_model_len=200)
    request = engine.make_requests([[5] * 10], SamplingParams(max_new_tokens=150))[0]
    engine.scheduler.add(request)
    engine.step()
    held = len(engine.kv.pages_of_row[request.row])
    assert held == math.ceil((10 + engine.tokens_per_req) / 4)
    for _ in range(8):
        engine.step()
    assert len(engine.kv.pages_of_row[request.row]) > held
    assert len(engine.kv.pages_of_row[request.row]) < math.ceil(160 / 4)


def test_scheduler_rejects_bad_budget_directly(llama_dir):
    engine = Engine(str(llama_dir), device="cpu", max_num_seqs=2)
    with pytest.raises(SpeculantError):
        Scheduler(engine.kv, 2, 4, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_chunked_mixed_steps_equal_one_at_a_time(llama_dir, drafts, backend):
    """On CUDA, the Triton varlen kernel under mixed steps and graphs for pure decode steps."""
    engine = Engine(str(llama_dir), device="cuda", dtype="float32", max_num_seqs=8, page_size=4,
                    max_num_batched_tokens=24, num_pages=80, attention_backend=backend,
                    algo="eagle3", draft=str(drafts["eagle3"]), num_draft_tokens=3)  # fmt: skip
    prompts = [prompt_of(5 + 7 * i, i) for i in range(6)]
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True)] * 6
    together = [o.token_ids for o in engine.generate(prompts, params)]
    assert together == one_at_a_time(engine, prompts, params)
    assert engine.graphs.num_replays > 0
    assert torch.cuda.is_available()


@pytest.mark.parametrize(
    "algo, draft, k",
    [("draft-model", "assets/draft_lm", 3), ("eagle3", "assets/eagle3", 4),
     ("dflash", "assets/dflash", 7), (None, None, 0)],  # fmt: skip
)
def test_every_drafter_runs_to_the_length_limit(algo, draft, k):
    """[hardening] 1: at max_model_len the drafters write up to 2 (k + 1) positions past the
    newest token; tables, RoPE and pages are sized for it (an IndexError before), and the output
    equals plain decoding up to the limit."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = {} if algo is None else dict(algo=algo, draft=str(root / draft), num_draft_tokens=k)
    prompts = [[5, 9, 13], list(range(20, 60))]
    params = SamplingParams(max_new_tokens=10000, ignore_eos=True)
    plain = Engine(str(root / "assets/target"), device="cpu", max_model_len=64)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    engine = Engine(str(root / "assets/target"), device="cpu", max_model_len=64, page_size=4,
                    **spec)  # fmt: skip
    outs = engine.generate(prompts, params)
    assert [len(p) + len(o.token_ids) for p, o in zip(prompts, outs, strict=True)] == [64, 64]
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize(
    "algo, draft",
    [("eagle3", "assets/eagle3"), ("draft-model", "assets/draft_lm"), ("dflash", "assets/dflash")],
)
def test_overlap_near_the_limit_stays_within_the_rope_tables(algo, draft):
    """max_model_len 40, k = 4: the tables hold 40 + 2 (k + 1) = 50 positions, a row's pages of
    16 hold 64. The step launched ahead (overlap) near the limit was checked against the 64 and
    ran past the RoPE tables (IndexError: index 50); output equals plain decoding."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    prompts = [[(7 * i + 96) % 4000 + 5 for i in range(32)], list(range(20, 52))]
    params = SamplingParams(max_new_tokens=10000, ignore_eos=True)
    plain = Engine(str(root / "assets/target"), device="cpu", max_model_len=40)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    engine = Engine(str(root / "assets/target"), device="cpu", max_model_len=40, page_size=16,
                    algo=algo, draft=str(root / draft), num_draft_tokens=4)  # fmt: skip
    assert engine.kv.max_tokens_per_req == 64
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert engine.generate([prompt], params)[0].token_ids == tokens
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected


def test_text_prompt_with_a_lone_surrogate_is_one_clear_error():
    from pathlib import Path

    engine = Engine(str(Path(__file__).resolve().parents[1] / "assets/target"), device="cpu")
    with pytest.raises(SpeculantError, match="prompt 0 is not valid Unicode"):
        engine.generate(["def f(\udc80):"], SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_huge_engine_seed_still_samples(llama_dir, load_format):
    engine = Engine(str(llama_dir), device="cpu", seed=2**70, load_format=load_format)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=1.0))
    assert len(out[0].token_ids) == 3


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_a_numpy_engine_seed_is_the_int_it_holds(llama_dir, load_format):
    """Engine(seed=np.int64(S)) samples (and draws dummy weights) as Engine(seed=S): the seed is
    taken as a Python int (numpy's int64 arithmetic wrapped the per-request seeds of a large S,
    and a dummy load failed on S mod 2**64)."""
    import numpy as np

    params = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)
    outs = [
        [o.token_ids for o in Engine(str(llama_dir), device="cpu", seed=seed,
                                     load_format=load_format).generate([[5, 6, 7]] * 3, params)]
        for seed in (2**62 + 5, np.int64(2**62 + 5))
    ]  # fmt: skip
    assert outs[0] == outs[1]


def test_overlap_with_chunked_prefill_equals_synchronous(llama_dir, drafts):
    """`--overlap` under a small token budget (chunked prefill, mixed steps) runs ahead only
    while the batch cannot change (nothing waits, no prompt in progress, the pool gives two more
    steps' pages); tokens equal the synchronous run."""
    options = dict(device="cpu", max_num_seqs=4, page_size=4, max_model_len=MAX_PROMPT + 40,
                   max_num_batched_tokens=9, num_pages=60, eager_padding=True, algo="eagle3",
                   draft=str(drafts["eagle3"]), num_draft_tokens=2)  # fmt: skip
    ahead = Engine(str(llama_dir), overlap=True, **options)
    synchronous = Engine(str(llama_dir), overlap=False, **options)
    prompts = [prompt_of(n, n) for n in (5, 30, 12, 21, 3, 17)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    outs = ahead.generate(prompts, params)
    expected = [o.token_ids for o in synchronous.generate(prompts, params)]
    assert [o.token_ids for o in outs] == expected
    assert ahead.steps_ahead > 0 and synchronous.steps_ahead == 0
    assert_pool_whole(ahead)


def test_acceptance_counts_only_kept_tokens(llama_dir):
    """[formats] 4: a verify step's tokens past max_new_tokens are not counted (the target as
    its own draft model accepts every draft: k = 3 emits 4 a step; 6 new tokens = 1 at prefill,
    4, then 1 kept of 4)."""
    engine = Engine(str(llama_dir), device="cpu", algo="draft-model", draft=str(llama_dir),
                    num_draft_tokens=3)  # fmt: skip
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.stats["num_verify_steps"] == 2
    assert out.stats["accept_len"] == 2.5
    assert out.stats["per_position_acceptance"] == [0.5, 0.5, 0.5]
