"""Tensor and data parallelism on the CPU with real gloo process groups (one process per rank):
TP=2, DP=2 and TP2 x DP2 give the same tokens as one rank (TP=2 and DP=2 also under a token
budget and page pool small enough for chunked prefill, mixed steps and preemption on the ranks,
plain, EAGLE-3 and DFLASH), TP peers run the same steps while each DP rank of a dense target runs
its own batch sizes (an idle one sits the step out), every rank runs the same capture sequence,
and the `speculant generate --tp/--dp` launcher fails a run with a dead or stuck rank instead of
hanging.

What a rank ran is observed inside it, not read from the plan every rank derives from one
exchanged table: `DecodeRecorder` wraps ModelRunner.decode_step in the rank's process and logs
the rows each decode step really ran and how many of them were live (not on the sentinel row).
On the CPU there are no CUDA graphs: capture runs every (variant, size) once eagerly in
lockstep with barriers on each rank, and the recorder sees those runs (launch with graphs on a
GPU: benchmarks/parallel_gpu.py). Every multi-process run has bounded collective and launch
timeouts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers_eagle import write_random_eagle3

from speculant import Engine, SamplingParams, SpeculantError
from speculant.comm.groups import ParallelContext, check_world
from speculant.executor.dp import DPShares, assign_requests
from speculant.executor.model_runner import ModelRunner
from speculant.executor.request import Request
from speculant.executor.sampling import VARIANTS
from speculant.executor.step_plan import Move
from speculant.launch.spawn import RankFailure, run_ranks

COLLECTIVE_TIMEOUT_S = 60  # a rank waits this long for the others before failing
LAUNCH_TIMEOUT_S = 150  # every rank of a run_ranks launch is killed after this
ENGINE = dict(device="cpu", max_num_seqs=8, max_model_len=160, page_size=4)
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
# capture_sizes(GraphConfig(), 8, dp), written out: the sizes each rank captures per variant
CAPTURED = {1: [1, 2, 4, 7, 8], 2: [1, 2, 3, 4]}


def prompts_of(lengths, seed, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy requests and one seeded sampled request (the sampler's counter hash makes it
    independent of batching and of TP)."""
    sampled = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    return [GREEDY] * (n - 1) + [sampled]


class DecodeRecorder:
    """Wraps ModelRunner.decode_step in this process (a rank's own) and logs every decode step
    the runner really runs, seen from its input buffers: (DP exchange it follows, or None while
    the engine is built, rows run, live rows among them, variant). `take` returns the log so
    far and starts a new one."""

    def __init__(self):
        self.engine: Engine | None = None  # whose exchanges number the steps
        self.calls: list[tuple] = []
        inner = ModelRunner.decode_step

        def decode_step(runner, bs, variant, *args, **kwargs):
            rows = runner.buffers.req_pool_indices[:bs]
            live = int((rows != runner.kv.sentinel_row).sum())
            step = None if self.engine is None else self.engine.dp.exchanges
            self.calls.append((step, bs, live, variant))
            return inner(runner, bs, variant, *args, **kwargs)

        ModelRunner.decode_step = decode_step

    def take(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


class PlanLog:
    """Wraps an engine's DP coordinator to log, per step, the plan this rank ran: (decode rows,
    ((start, tokens) of each prefill chunk), requests preempted while it was scheduled)."""

    def __init__(self, engine: Engine):
        self.steps: list[tuple] = []
        agree = engine.dp.agree

        def logged_agree(plan, *args):
            plan = agree(plan, *args)
            chunks = tuple((c.start, len(c.tokens)) for c in plan.chunks)
            self.steps.append((len(plan.decode), chunks, len(plan.preempted)))
            return plan

        engine.dp.agree = logged_agree


def check_own_sizes(decodes: list[tuple], dp: int, padded: bool) -> None:
    """A dense target's DP rank runs its own decode batches (nothing in its forward crosses DP
    ranks): every step has live rows, padded (eager padding) to the smallest captured size."""
    for step, bs, live, _ in decodes:
        assert live > 0, f"a dummy decode step of {bs} rows after exchange {step}"
        expected = min(s for s in CAPTURED[dp] if s >= live) if padded else live
        assert bs == expected, (step, bs, live)


def expected_capture(dp: int) -> list[tuple]:
    """What the recorder sees capture run on every rank: each variant, largest size first, on
    sentinel rows only."""
    return [(None, bs, 0, v) for v in VARIANTS for bs in reversed(CAPTURED[dp])]


def generate_in_rank(tp: int, dp: int, cases: list[tuple]) -> dict:
    """The body of every rank: join the (dp, tp) mesh, then for each case (name, target,
    options, prompts, params) build an engine and generate. Only rank 0 passes the prompts."""
    pctx = ParallelContext.from_env(tp, dp, "cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
    recorder, seen = DecodeRecorder(), {}
    for name, target, options, prompts, params in cases:
        recorder.engine = None
        engine = Engine(str(target), pctx=pctx, **{**ENGINE, **options})
        capture, recorder.engine, plans = recorder.take(), engine, PlanLog(engine)
        ran, run = [], engine.run  # the (prompt, completion) keys of the outputs this rank ran

        def recorded_run(*args, run=run, ran=ran, **kwargs):
            outs = run(*args, **kwargs)
            ran.extend(out.key for out in outs)
            return outs

        engine.run = recorded_run
        is_source = pctx.rank == 0
        outs = engine.generate(prompts if is_source else None, params if is_source else None)
        seen[name] = dict(
            tokens={o.index: o.token_ids for o in outs},
            preempted={o.index: o.stats["num_preemptions"] for o in outs},
            preemptions=engine.scheduler.num_preemptions,  # this rank's own
            plans=plans.steps,
            capture=capture,
            decodes=recorder.take(),
            padded=bool(options.get("eager_padding")),
            dummy_steps=engine.dp.dummy_steps,
            pages_returned=len(engine.kv.free_pages) == engine.kv.num_pages - 1,
            dp_rank=pctx.dp_rank,
            by_key={o.key: o.token_ids for o in outs},  # (prompt, completion): with n > 1
            moved=engine.dp.moved,
            ran=ran,
        )
    pctx.close()
    return seen


def reference(cases: list[tuple]) -> dict[str, dict[int, list[int]]]:
    """Each case on one in-process rank."""
    out = {}
    for name, target, options, prompts, params in cases:
        outs = Engine(str(target), **{**ENGINE, **options}).generate(prompts, params)
        out[name] = {o.index: o.token_ids for o in outs}
    return out


def launch(tp: int, dp: int, cases: list[tuple]) -> list[dict]:
    return run_ranks(generate_in_rank, tp * dp, (tp, dp, cases), timeout_s=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, llama_dir):
    path = tmp_path_factory.mktemp("eagle3_tp")
    # one KV head: at tp=2 it is replicated on both ranks
    write_random_eagle3(path, llama_dir, draft_vocab=200, num_kv_heads=1, seed=3)
    return path


# ---------------------------------------------------------------------------------------- TP=2


@pytest.fixture(scope="module")
def tp_cases(llama_dir, llama_tied_dir, qwen3_dir, eagle_dir):
    prompts = prompts_of((3, 17, 1, 30, 9), seed=1)
    eagle = dict(algo="eagle3", draft=str(eagle_dir), num_draft_tokens=3)
    drafted = dict(algo="draft-model", draft=str(qwen3_dir), num_draft_tokens=2)
    return [
        ("plain", llama_dir, {}, prompts, mixed_params(5)),
        ("eagle3", llama_dir, eagle, prompts, mixed_params(5)),
        ("draft_model", llama_tied_dir, drafted, prompts, [GREEDY] * 5),
        ("eagle3_padded", llama_dir, {**eagle, "eager_padding": True}, prompts[:3], GREEDY),
    ]


@pytest.fixture(scope="module")
def tp2_run(tp_cases):
    return reference(tp_cases), launch(2, 1, tp_cases)


@pytest.mark.parametrize("case", ["plain", "eagle3", "draft_model", "eagle3_padded"])
def test_tp2_equals_tp1(tp2_run, case):
    expected, ranks = tp2_run
    assert ranks[0][case]["tokens"] == expected[case]
    assert ranks[1][case]["tokens"] == expected[case]  # every TP rank holds the same tokens
    assert all(rank[case]["pages_returned"] for rank in ranks)
    # the TP peers ran the same decode steps, each of its batch's size (padded when asked)
    assert ranks[0][case]["decodes"] == ranks[1][case]["decodes"]
    check_own_sizes(ranks[0][case]["decodes"], 1, ranks[0][case]["padded"])
    if case == "eagle3_padded":  # 3 requests run as 4 rows: padding really happened
        assert any(bs > live for _, bs, live, _ in ranks[0][case]["decodes"])


def test_dflash_tp2_equals_tp1(tmp_path, llama_dir):
    """DFLASH at TP=2 (its checkpoint writer lives in tests/helpers_dflash.py)."""
    if (
        importlib.util.find_spec("speculant.drafter.dflash") is None
        or not (Path(__file__).parent / "helpers_dflash.py").is_file()
    ):
        pytest.skip("DFLASH is not in this tree yet")
    from helpers_dflash import write_random_dflash

    write_random_dflash(
        tmp_path, llama_dir, num_layers=2, block_size=4, target_layer_ids=[1, 0], num_kv_heads=1
    )
    cases = [
        (
            "dflash",
            llama_dir,
            dict(algo="dflash", draft=str(tmp_path), num_draft_tokens=3),
            prompts_of((3, 17, 9), seed=7),
            GREEDY,
        )
    ]
    expected, ranks = reference(cases), launch(2, 1, cases)
    assert ranks[0]["dflash"]["tokens"] == ranks[1]["dflash"]["tokens"] == expected["dflash"]


# ---------------------------------------------------------------------------------------- DP=2


@pytest.fixture(scope="module")
def dp_cases(llama_dir, eagle_dir):
    eagle = dict(algo="eagle3", draft=str(eagle_dir), num_draft_tokens=3, eager_padding=True)
    return [
        # one request: DP rank 1 gets none and runs dummy batches until rank 0 is done
        ("one_request", llama_dir, dict(eager_padding=True), prompts_of((11,), seed=2), GREEDY),
        # one long request against four short ones: 1 and 4 requests
        ("uneven", llama_dir, eagle, prompts_of((60, 3, 5, 2, 4), seed=3), mixed_params(5)),
        ("unpadded", llama_dir, {}, prompts_of((7, 2, 19), seed=4), mixed_params(3)),
        ("empty", llama_dir, {}, [], GREEDY),
    ]


@pytest.fixture(scope="module")
def dp2_run(dp_cases):
    return reference(dp_cases), launch(1, 2, dp_cases)


@pytest.mark.parametrize("case", ["one_request", "uneven", "unpadded", "empty"])
def test_dp2_equals_dp1(dp2_run, case):
    expected, ranks = dp2_run
    assert ranks[0][case]["tokens"] == expected[case]  # all requests, none lost or duplicated
    assert all(rank[case]["pages_returned"] for rank in ranks)
    for rank in ranks:  # each DP rank ran its own batches, none a dummy
        check_own_sizes(rank[case]["decodes"], 2, rank[case]["padded"])


def test_dp2_shares_are_uneven_and_the_idle_rank_sits_out(dp2_run):
    """A dense target's DP ranks run their own sizes: the rank with no request runs no decode
    step at all, and two ranks decoding after the same exchange run different sizes."""
    _, ranks = dp2_run
    assert ranks[1]["one_request"]["tokens"] == {}  # DP rank 1 had no request ...
    assert ranks[1]["one_request"]["decodes"] == []  # ... and ran no decode step
    assert ranks[0]["one_request"]["decodes"] and ranks[1]["one_request"]["dummy_steps"] == 0
    # rank 0 returns every output; DP rank 1 took the four short requests
    assert sorted(ranks[1]["uneven"]["tokens"]) == [1, 2, 3, 4]
    assert sorted(ranks[0]["uneven"]["tokens"]) == [0, 1, 2, 3, 4]
    sizes = [{step: bs for step, bs, *_ in rank["uneven"]["decodes"]} for rank in ranks]
    both = sizes[0].keys() & sizes[1].keys()
    assert any(sizes[0][step] != sizes[1][step] for step in both)  # 1 row next to 4


@pytest.fixture(scope="module")
def moved_run(llama_dir):
    """DP rank 0's share (the even prompts: equal costs alternate) ends after one token each
    (every id a stop id), so rank 0 soon has free rows and nothing waiting while rank 1's queue
    (two rows a rank) still waits: requests rank 1 has not started move to rank 0. With n = 2
    a prompt's completions move together."""
    vocab = 512
    stop_early = SamplingParams(max_new_tokens=12, stop_token_ids=list(range(vocab)))
    full = SamplingParams(max_new_tokens=12, ignore_eos=True)
    options = dict(max_num_seqs=2, enforce_eager=True)
    cases = [
        ("moved", llama_dir, options, prompts_of([5] * 16, seed=8), [stop_early, full] * 8),
        (
            "moved_n",
            llama_dir,
            options,
            prompts_of([5] * 10, seed=9),
            [replace(stop_early, n=2), replace(full, n=2, temperature=0.8, seed=3)] * 5,
        ),
    ]
    expected = {}
    for name, target, options, prompts, params in cases:
        outs = Engine(str(target), **{**ENGINE, **options}).generate(prompts, params)
        expected[name] = {o.key: o.token_ids for o in outs}
    return expected, launch(1, 2, cases)


@pytest.mark.parametrize("case", ["moved", "moved_n"])
def test_dp2_moves_requests_a_rank_has_not_started_to_a_rank_with_nothing_waiting(moved_run, case):
    expected, ranks = moved_run
    assert ranks[0][case]["by_key"] == expected[case]  # every request once, as on one rank
    assert ranks[0][case]["moved"] == ranks[1][case]["moved"] > 0
    ran = [set(rank[case]["ran"]) for rank in ranks]
    assert not ran[0] & ran[1] and len(ran[0] | ran[1]) == len(expected[case])
    odd = {key for key in ran[0] if key[0] % 2}  # rank 1's share, run by rank 0
    assert odd, "no request moved to the rank with nothing waiting"
    for rank in ranks:
        assert rank[case]["pages_returned"]
        # a prompt's completions ran on one rank
        prompts = [key[0] for key in rank[case]["ran"]]
        assert all(prompts.count(p) == (2 if case == "moved_n" else 1) for p in prompts)


def test_dp_shares_move_half_the_surplus_from_the_tail_never_splitting_a_prompt():
    def requests(groups):
        return [Request(i, [1], SamplingParams(), 0, 4, frozenset(), prompt_index=g)
                for i, g in enumerate(groups)]  # fmt: skip

    shares = DPShares([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9]], requests(range(10)))
    # rank 0: 6 not started at its tail, 7 waiting, 1 row free; rank 1: nothing waiting
    moves = shares.plan_moves([(6, 7, 1), (0, 0, 2)])
    assert moves == [Move(0, 1, [5, 6, 7])] and shares.lists == [[0, 1, 2, 3, 4], [8, 9, 5, 6, 7]]
    assert shares.plan_moves([(3, 4, 4), (3, 3, 0)]) == []  # nobody waits past its free rows
    assert shares.plan_moves([(2, 2, 0), (0, 0, 0)]) == []  # no free row to take one into
    # a surplus of 1 moves it; the cut moves forward to a prompt's first completion
    # the cut moves forward to a prompt's first completion (n > 1), or nothing moves
    groups = [0, 0, 1, 1, 1, 2, 2, 2]
    shares = DPShares([list(range(8)), []], requests(groups))
    assert shares.plan_moves([(1, 2, 1), (0, 0, 2)]) == []  # 7 alone would split prompt 2
    assert shares.plan_moves([(8, 8, 0), (0, 0, 2)]) == [Move(0, 1, [5, 6, 7])]
    # several ranks with nothing waiting take from the largest surplus in turn
    shares = DPShares([list(range(12)), [], []], requests(range(12)))
    moves = shares.plan_moves([(12, 12, 0), (0, 0, 1), (0, 0, 1)])
    assert moves == [Move(0, 1, [6, 7, 8, 9, 10, 11]), Move(0, 2, [3, 4, 5])]
    # a prompt's completions waiting behind its first ones (started: they hold its pages) cannot
    # move: they are not counted as a surplus, so another rank's movable surplus moves
    shares = DPShares([list(range(8)), [8, 9, 10, 11], []], requests([0] * 8 + [1, 2, 3, 4]))
    shares.requests[0].row, shares.requests[1].row = 0, 1  # prompt 0's first two run on rank 0
    assert shares.unstarted_tail(0, 6) == 0 and shares.unstarted_tail(1, 4) == 4
    moves = shares.plan_moves([(0, 6, 0), (4, 4, 0), (0, 0, 2)])
    assert moves == [Move(1, 2, [10, 11])]
    # a largest surplus whose half would split a prompt does not keep the next from moving
    shares = DPShares([[0, 1, 2, 3], [4, 5, 6], []], requests([0, 1, 1, 1, 2, 3, 4]))
    assert shares.plan_moves([(4, 4, 0), (3, 3, 0), (0, 0, 2)]) == [Move(1, 2, [6])]


def test_assign_requests_balances_tokens():
    shares = assign_requests([100, 10, 20, 30, 5], dp=2)
    assert shares == [[0], [1, 2, 3, 4]]
    assert assign_requests([7], dp=3) == [[0], [], []]
    shares = assign_requests([5, 5, 5, 5, 5, 5, 5], dp=3)
    assert sorted(i for share in shares for i in share) == list(range(7))
    assert sorted(len(s) for s in shares) == [2, 2, 3]
    # a prompt's completions stay on one rank (they share its pages there) unless the group
    # costs more than half a rank's share: then they are balanced one by one
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    shares = assign_requests([10] * 12, dp=2, groups=groups)
    assert [sorted({groups[i] for i in share}) for share in shares] == [[0, 2], [1, 3]]
    assert assign_requests([10, 10, 10, 10, 1], dp=2, groups=[0, 0, 0, 0, 1]) == [
        [0, 2, 4], [1, 3]
    ]  # fmt: skip


# ------------------------------------------------------------------------------- DP progress bar


def progress_in_rank(target: str, calls: list[tuple]) -> list[tuple] | None:
    """The body of every rank: generate each call's (prompts, params, progress interval) with
    use_tqdm on one engine; rank 0 returns, per call, its bar's (total, counts it showed, count
    at close, text it last drew). The bar is engine.py's own tqdm, drawn into a buffer."""
    import io

    from speculant.executor import dp as dp_module
    from speculant.executor import engine as engine_module

    bars: list[tuple] = []

    class Recorded(engine_module.tqdm):
        def __init__(self, *args, **kwargs):
            self.text, self.counts = io.StringIO(), []
            super().__init__(*args, file=self.text, **kwargs)

        def update(self, n=1):
            super().update(n)
            self.counts.append(self.n)

        def close(self):
            shown = not self.disable  # close() disables the bar
            super().close()
            if shown:
                bars.append((self.total, self.counts, self.n, self.text.getvalue()))

    engine_module.tqdm = Recorded
    pctx = ParallelContext.from_env(1, 2, "cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
    engine = Engine(target, pctx=pctx, **ENGINE, enforce_eager=True)
    for prompts, params, interval in calls:
        dp_module.PROGRESS_INTERVAL_S = interval
        is_source = pctx.rank == 0
        engine.generate(prompts if is_source else None, params if is_source else None,
                        use_tqdm=is_source)  # fmt: skip
    pctx.close()
    return bars if pctx.rank == 0 else None


def interrupted_in_rank(target: str, stopper: int) -> dict:
    """The body of every rank of a DP=2 job that streams its outputs to rank 0 (on_output):
    rank `stopper` gets Ctrl-C's SIGINT (Python's default handler) right after its first step
    that finished requests, before that step's outputs are gathered. Returns the requests this
    rank finished, what rank 0's on_output got and the exception that ended generate."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    pctx = ParallelContext.from_env(1, 2, "cpu", timeout_s=20)
    engine = Engine(target, pctx=pctx, **ENGINE, enforce_eager=True)
    finished, written, step = [], [], engine.step

    def step_then_ctrl_c():
        done = step()
        finished.extend(r.index for r in done)
        if done and pctx.rank == stopper and len(finished) == len(done):
            signal.raise_signal(signal.SIGINT)
        return done

    engine.step = step_then_ctrl_c
    short = SamplingParams(max_new_tokens=2, ignore_eos=True)
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)
    # each DP rank one short and one long request of the same lengths: the short ones end in
    # the same step on both ranks
    prompts = prompts_of((5, 5, 5, 5), seed=11) if pctx.rank == 0 else None
    params = [short, short, long, long] if pctx.rank == 0 else None
    try:
        engine.generate(prompts, params, on_output=lambda out: written.append(out.index))
        ended = None
    except BaseException as exc:  # noqa: BLE001 - what ended it is the result
        ended = type(exc).__name__
    return dict(finished=finished, written=written, ended=ended)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stopper", [0, 1])
def test_ctrl_c_under_dp_keeps_what_any_rank_finished(llama_dir, stopper):
    """Ctrl-C reaching a DP rank between a step that finished requests there and that step's
    gather to rank 0 lost them: every rank now stops at the step boundary after the gather, so
    every request finished on either DP rank is in rank 0's on_output, once, and both ranks end
    with KeyboardInterrupt (the CLI then exits 130)."""
    ranks = run_ranks(interrupted_in_rank, 2, (str(llama_dir), stopper), timeout_s=200)
    assert [r["ended"] for r in ranks] == ["KeyboardInterrupt"] * 2, ranks
    finished = {i for r in ranks for i in r["finished"]}
    written = ranks[0]["written"]
    assert ranks[1]["finished"] and len(written) == len(set(written)), ranks
    assert set(written) == finished, ranks
    assert finished == {0, 1}  # one each, in the step of the stop


def test_dp2_progress_bar_counts_the_whole_job(llama_dir):
    """Under DP the bar on rank 0 counts every request of the job, not rank 0's share: its total
    is all requests, it advances as DP rank 1 finishes its four while rank 0's one long request
    still runs, and it closes at the total (no wait: rank 1 counts its last requests before it
    reports no work). A second generate on the engine counts from 0, under the default 0.2 s
    rate limit."""
    short = SamplingParams(max_new_tokens=3, ignore_eos=True)
    long = SamplingParams(max_new_tokens=24, ignore_eos=True)
    calls = [  # (prompts, params, seconds between reads): shares [0] and [1, 2, 3, 4] first
        (prompts_of((60, 3, 5, 2, 4), seed=3), [long] + [short] * 4, 0.0),
        (prompts_of((9, 4, 6), seed=8), short, 0.2),
    ]
    bars = run_ranks(progress_in_rank, 2, (str(llama_dir), calls), timeout_s=LAUNCH_TIMEOUT_S)[0]
    assert [(total, final) for total, _, final, _ in bars] == [(5, 5), (3, 3)]
    (_, counts, _, text), (_, _, _, text2) = bars
    assert counts == sorted(counts) and counts[-1] == 5
    assert 4 in counts  # rank 1's four counted while rank 0's request ran: before its own
    assert text.rstrip().split("\r")[-1].lstrip().startswith("requests: 100%")
    assert " 5/5 " in text.split("\r")[-1] and " 3/3 " in text2.split("\r")[-1]


class FakeStore:
    """A store's `add` and `delete_key`, logged."""

    def __init__(self):
        self.values: dict[str, int] = {}
        self.adds: list[int] = []

    def add(self, key: str, n: int) -> int:
        self.adds.append(n)
        self.values[key] = self.values.get(key, 0) + n
        return self.values[key]

    def delete_key(self, key: str) -> bool:
        return self.values.pop(key, None) is not None


def test_job_progress_touches_the_store_at_most_every_interval():
    """A rank adds at most every interval (batched), at once when it has no request left; rank 0
    reads every interval even when it finished nothing, and drops the key at the end."""
    from speculant.executor.dp import JobProgress

    now = [0.0]
    store = FakeStore()
    rank1 = JobProgress(store, "k", 6, reads=False, interval_s=0.2, clock=lambda: now[0])
    rank0 = JobProgress(store, "k", 6, reads=True, interval_s=0.2, clock=lambda: now[0])
    assert rank1.update(1, done=False) is None and store.adds == [1]  # the first: at once
    now[0] = 0.1
    assert rank1.update(2, done=False) is None and store.adds == [1]  # within the interval
    assert rank0.update(0, done=False) == 1  # rank 0's first read
    now[0] = 0.15
    assert rank0.update(0, done=False) is None and store.adds == [1, 0]
    assert rank1.update(1, done=True) is None and store.adds == [1, 0, 3]  # its last: at once
    assert rank1.update(0, done=True) is None and store.adds == [1, 0, 3]  # nothing left to add
    now[0] = 0.3
    assert rank0.update(2, done=True) == 6
    assert rank1.final() is None and rank0.final() == 6 and store.values == {}


STORE_SERVER = (
    "import datetime, sys, time, torch.distributed as dist\n"
    "store = dist.TCPStore('127.0.0.1', 0, 2, True, timeout=datetime.timedelta(seconds=30),\n"
    "                      wait_for_workers=False)\n"
    "print(store.port, flush=True)\n"
    "time.sleep(120)\n"
)


def _wait_stopped(pid: int, limit_s: float = 10.0) -> None:
    """Until the kernel reports `pid` stopped (state T in /proc/PID/stat)."""
    deadline = time.monotonic() + limit_s
    with open(f"/proc/{pid}/stat") as stat:
        while stat.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
            assert time.monotonic() < deadline, f"process {pid} did not stop in {limit_s} s"
            time.sleep(0.01)
            stat.seek(0)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="stops the store's process")
def test_job_progress_gives_up_on_a_store_that_stopped_answering(caplog):
    """A real TCPStore whose server process (rank 0, or torchrun's agent) is stopped: a client's
    add then never returns. The counter waits `call_s`, warns once and stops touching the store;
    the rank goes on (was: blocked in the progress update forever, never reaching the collective
    whose timeout would end the job)."""
    import datetime

    import torch.distributed as dist

    from speculant.executor.dp import JobProgress

    server = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        port = int(server.stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
        now = [0.0]
        progress = JobProgress(store, "k", 4, reads=True, interval_s=0.2, clock=lambda: now[0],
                               call_s=1.0)  # fmt: skip
        assert progress.update(1, done=False) == 1  # the store answers
        os.kill(server.pid, signal.SIGSTOP)
        _wait_stopped(server.pid)  # kill returns before a busy process stops (CI saw it answer)
        start = time.monotonic()
        now[0] = 1.0
        assert progress.update(2, done=False) is None
        assert progress.lost and 1.0 <= time.monotonic() - start < 5
        assert "did not answer a progress update in 1 s" in caplog.text
        start = time.monotonic()
        now[0] = 2.0
        assert progress.update(1, done=True) is None and progress.final() is None
        assert time.monotonic() - start < 0.5  # not touched again
        assert caplog.text.count("did not answer") == 1
    finally:
        server.kill()
        server.wait(10)


# ---------------------------------------------------------------------------------------- TP2 x DP2


@pytest.fixture(scope="module")
def mesh_cases(llama_dir, eagle_dir):
    prompts = prompts_of((23, 4, 9), seed=5)
    eagle = dict(algo="eagle3", draft=str(eagle_dir), num_draft_tokens=2, eager_padding=True)
    return [
        ("plain", llama_dir, dict(eager_padding=True), prompts, mixed_params(3)),
        ("eagle3", llama_dir, eagle, prompts, GREEDY),
    ]


@pytest.fixture(scope="module")
def mesh_run(mesh_cases):
    return reference(mesh_cases), launch(2, 2, mesh_cases)


@pytest.mark.parametrize("case", ["plain", "eagle3"])
def test_tp2_dp2_equals_one_rank(mesh_run, case):
    expected, ranks = mesh_run
    assert [rank[case]["dp_rank"] for rank in ranks] == [0, 0, 1, 1]  # TP innermost
    assert ranks[0][case]["tokens"] == expected[case]  # rank 0 gathers every output
    # the other ranks return their DP rank's share; TP peers hold the same tokens
    assert ranks[2][case]["tokens"] == ranks[3][case]["tokens"] != {}
    shares = [ranks[r][case]["tokens"] for r in (1, 2)]
    assert sorted(i for share in shares for i in share) == sorted(expected[case])
    assert all(expected[case][i] == t for share in shares for i, t in share.items())
    for peers in ((0, 1), (2, 3)):  # TP peers ran the same decode steps, their own sizes
        assert ranks[peers[0]][case]["decodes"] == ranks[peers[1]][case]["decodes"], peers
        check_own_sizes(ranks[peers[0]][case]["decodes"], 2, ranks[peers[0]][case]["padded"])


# ------------------------------------------------------------ chunked prefill and preemption

# Six prompts (116 tokens) under a token budget of a few tokens per forward and a pool of 23
# usable pages of 4 tokens (the longest request alone needs 16): every prompt above the budget
# is prefilled in chunks over several steps, decode rows and chunks share forwards, and requests
# are preempted and recomputed, in one process and on every DP share alike.
BUDGET_PROMPTS = ((37, 5, 22, 13, 30, 9), 11)  # (lengths, seed)
TIGHT = dict(num_pages=24)
BUDGETS = {"plain": 7, "eagle3": 11, "dflash": 9}  # max_num_batched_tokens; k = 3 drafts


@pytest.fixture(scope="module")
def dflash_dir(tmp_path_factory, llama_dir):
    if importlib.util.find_spec("speculant.drafter.dflash") is None:
        pytest.skip("DFLASH is not in this tree yet")
    from helpers_dflash import write_random_dflash

    path = tmp_path_factory.mktemp("dflash_tp")
    write_random_dflash(
        path, llama_dir, num_layers=2, block_size=4, target_layer_ids=[1, 0], num_kv_heads=1
    )
    return path


@pytest.fixture(scope="module")
def budget_cases(llama_dir, eagle_dir, dflash_dir):
    prompts = prompts_of(*BUDGET_PROMPTS)
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True)] * (len(prompts) - 1)
    params.append(SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=5,
                                 ignore_eos=True))  # fmt: skip
    specs = {
        "plain": {},
        # padded decode batches (as graphs would run them) next to eager chunks
        "eagle3": dict(algo="eagle3", draft=str(eagle_dir), num_draft_tokens=3, eager_padding=True),
        "dflash": dict(algo="dflash", draft=str(dflash_dir), num_draft_tokens=3),
    }
    cases = []
    for name, spec in specs.items():
        options = {**spec, **TIGHT, "max_num_batched_tokens": BUDGETS[name]}
        cases.append((name, llama_dir, options, prompts, params if name != "dflash" else GREEDY))
    return cases


def roomy(cases: list[tuple]) -> list[tuple]:
    """The same cases with the default budget and pool: no chunks, no preemption."""
    drop = ("num_pages", "max_num_batched_tokens")
    return [
        (name, target, {k: v for k, v in options.items() if k not in drop}, prompts, params)
        for name, target, options, prompts, params in cases
    ]


@pytest.fixture(scope="module")
def budget_reference(budget_cases):
    return reference(budget_cases), reference(roomy(budget_cases))


@pytest.fixture(scope="module")
def budget_tp2_run(budget_cases):
    return launch(2, 1, budget_cases)


@pytest.fixture(scope="module")
def budget_dp2_run(budget_cases):
    return launch(1, 2, budget_cases)


def check_chunked_and_preempted(ranks: list[dict], case: str, tp: int) -> None:
    """Every step kept to the budget; over the DP ranks some prompt was split into chunks, some
    forward mixed decode rows with chunks, and requests were preempted: the outputs rank 0
    gathered report every preemption the DP ranks' schedulers made."""
    budget, T = BUDGETS[case], 1 if case == "plain" else 4
    dp_ranks = ranks[::tp]  # one rank of each TP group
    plans = [step for rank in dp_ranks for step in rank[case]["plans"]]
    assert all(rows * T + sum(n for _, n in chunks) <= budget for rows, chunks, _ in plans)
    assert any(start > 0 for _, chunks, _ in plans for start, _ in chunks)  # a split prompt
    assert any(rows and chunks for rows, chunks, _ in plans)  # a mixed step
    preemptions = [rank[case]["preemptions"] for rank in dp_ranks]
    assert sum(preemptions) > 0, preemptions
    assert sum(ranks[0][case]["preempted"].values()) == sum(preemptions)
    assert sum(p for _, _, p in plans) == sum(preemptions)
    assert all(rank[case]["pages_returned"] for rank in ranks)


@pytest.mark.parametrize("case", ["plain", "eagle3", "dflash"])
def test_tp2_chunked_preempted_equals_one_process(budget_reference, budget_tp2_run, case):
    tight, unconstrained = budget_reference
    ranks = budget_tp2_run
    assert tight[case] == unconstrained[case]  # preemption and chunks change nothing
    assert ranks[0][case]["tokens"] == ranks[1][case]["tokens"] == tight[case]
    # the TP peers scheduled alike: the same chunks, decode rows and preemptions every step
    assert ranks[0][case]["plans"] == ranks[1][case]["plans"]
    assert ranks[0][case]["decodes"] == ranks[1][case]["decodes"]
    check_chunked_and_preempted(ranks, case, tp=2)


@pytest.mark.parametrize("case", ["plain", "eagle3", "dflash"])
def test_dp2_chunked_preempted_equals_one_process(budget_reference, budget_dp2_run, case):
    tight, unconstrained = budget_reference
    ranks = budget_dp2_run
    assert ranks[0][case]["tokens"] == tight[case] == unconstrained[case]
    assert ranks[1][case]["tokens"] and set(ranks[1][case]["tokens"]) < set(tight[case])
    check_chunked_and_preempted(ranks, case, tp=1)
    for rank in ranks:  # each DP rank of a dense target ran its own decode sizes
        check_own_sizes(rank[case]["decodes"], 2, case == "eagle3")
    # both DP ranks planned their own steps: their schedules differ
    assert ranks[0][case]["plans"] != ranks[1][case]["plans"]


# ---------------------------------------------------------------------------------------- capture


def test_every_rank_captures_every_size_in_the_same_order(tp2_run, dp2_run, mesh_run):
    """The decode steps each rank ran while its engine was built (capture's lockstep eager run):
    every variant at every size, largest first, on sentinel rows, the same on every rank."""
    for (_, ranks), dp in ((tp2_run, 1), (dp2_run, 2), (mesh_run, 2)):
        for case in ranks[0]:
            for rank, seen in enumerate(ranks):
                assert seen[case]["capture"] == expected_capture(dp), (case, rank)


def build_engine_in_rank(capture_sizes_by_rank: list[list[int] | None]) -> None:
    pctx = ParallelContext.from_env(2, 1, "cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
    target = os.environ["SPECULANT_TEST_TARGET"]
    Engine(target, pctx=pctx, **ENGINE, capture_sizes=capture_sizes_by_rank[pctx.rank])


def test_ranks_with_different_capture_sizes_fail_instead_of_hanging(llama_dir, monkeypatch):
    monkeypatch.setenv("SPECULANT_TEST_TARGET", str(llama_dir))
    with pytest.raises(RankFailure, match=r"rank 1 would capture graphs .* but rank 0"):
        run_ranks(build_engine_in_rank, 2, ([None, [1, 2]],), timeout_s=LAUNCH_TIMEOUT_S)


# ---------------------------------------------------------------------------------------- errors


def join_mesh(tp: int, dp: int) -> None:
    ParallelContext.from_env(tp, dp, "cpu", timeout_s=COLLECTIVE_TIMEOUT_S)


def test_world_size_must_equal_dp_times_tp(llama_dir, monkeypatch):
    with pytest.raises(RankFailure, match=r"world size 2 != dp 2 x tp 2"):
        run_ranks(join_mesh, 2, (2, 2), timeout_s=LAUNCH_TIMEOUT_S)
    with pytest.raises(SpeculantError, match=r"world size 3 != dp 1 x tp 2"):
        check_world(3, tp=2, dp=1)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SpeculantError, match=r"needs 2 processes .*speculant generate --tp 2"):
        Engine(str(llama_dir), tp=2, **ENGINE)


# ---------------------------------------------------------------------------------------- CLI


def cli(*args: object, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "speculant", "generate", "--device", "cpu", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def test_cli_tp2_and_dp2_match_one_rank(llama_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "def f(x):"}, {"prompt_token_ids": [5, 6, 7, 8]}, {"prompt": "import"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = {}
    for flags in ([], ["--tp", 2], ["--dp", 2]):
        out = tmp_path / f"out{len(results)}.jsonl"
        proc = cli("--target", llama_dir, "--prompts", prompts, "--output", out, "--ignore-eos",
                   "--max-new-tokens", 10, "--dist-timeout", 60, *flags)  # fmt: skip
        code, _, err = finish(proc)
        assert code == 0, err
        assert err.strip().splitlines()[-1].startswith("requests=3 ")  # rank 0's summary only
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        results[" ".join(map(str, flags))] = {line["index"]: line["token_ids"] for line in lines}
    assert results["--tp 2"] == results[""] and results["--dp 2"] == results[""]
    assert sorted(results[""]) == [0, 1, 2]


def engines_built(*args: object) -> tuple[subprocess.Popen, list[str], threading.Thread, float]:
    """`cli(*args)` started, returned once rank 0 has built its engine: the process, its stderr
    lines so far (a thread keeps reading them), that thread, and the start time."""
    proc = cli(*args)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    start = time.monotonic()
    while not any("KV cache" in line for line in lines):  # rank 0 has built its engine
        assert proc.poll() is None and time.monotonic() - start < 60, "".join(lines)
        time.sleep(0.02)
    return proc, lines, reader, start


def ended(proc: subprocess.Popen, lines: list[str], reader: threading.Thread) -> tuple[int, str]:
    """Wait (60 s at most, then kill) for an `engines_built` job: its status and stderr."""
    try:
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    reader.join(timeout=10)
    return code, "".join(lines)


def rank_pid(parent: int, rank: int, timeout: float = 60) -> int:
    """The pid of the child of `parent` whose environment says RANK=rank."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                env = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == parent and f"RANK={rank}".encode() in env:
                return int(entry.name)
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} of {parent} did not start")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the rank processes in /proc")
@pytest.mark.parametrize("how", ["dead", "stuck"])
def test_cli_fails_on_a_dead_or_stuck_rank(llama_dir, how):
    """Once the engines are built, rank 1 is killed (dead) or stopped (stuck: rank 0's next
    collective times out): the run ends with status 1 and a last line naming rank 1, long
    before the 490 tokens would be done (and well within the timeouts)."""
    proc, lines, reader, start = engines_built(
        "--target", llama_dir, "--prompt", "x", "--max-new-tokens", 490, "--ignore-eos",
        "--max-num-seqs", 1, "--tp", 2, "--dist-timeout", 5,
    )  # fmt: skip
    victim = rank_pid(proc.pid, 1)
    os.kill(victim, signal.SIGKILL if how == "dead" else signal.SIGSTOP)
    code, err = ended(proc, lines, reader)
    last = err.strip().splitlines()[-1]
    assert code == 1, err
    assert last.startswith("speculant: error: rank"), err
    expected = "rank 1 was killed by SIGKILL" if how == "dead" else "rank 1 stopped answering"
    assert expected in last, err
    if how == "dead":  # rank 0 ends by itself once it has named rank 1 (not killed as stuck)
        assert "did not exit" not in last, err
    assert "exceeds" not in err and "requests=1" not in err  # it failed, and for this reason
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("kind, code", [("error", 1), ("user", 2)])
def test_a_rank_that_fails_on_its_own_is_the_named_cause(llama_dir, tmp_path, kind, code):
    """Rank 1 alone fails once the engines are built (an exception of its own, as out of memory;
    or a user error, as a shard only it cannot read) while rank 0 goes on into its next
    collective and fails there: the last line names rank 1 and its error (not rank 0, whose
    exit status looks alike), rank 0's line names rank 1 as the cause, and the status is that
    of rank 1's failure (2 for a user error, as one process)."""
    out = tmp_path / "out.jsonl"
    proc = cli(
        "--target", llama_dir, "--prompt", "x", "--max-new-tokens", 200, "--ignore-eos",
        "--max-num-seqs", 2, "--n", 2, "--dp", 2, "--dist-timeout", 20, "--output", out,
        env={**os.environ, "SPECULANT_TEST_FAIL_RANK": f"1:{kind}"},
    )  # fmt: skip
    started = time.monotonic()
    got, _, err = finish(proc, timeout=90)
    lines = err.strip().splitlines()
    assert got == code, err
    assert lines[-1].startswith(f"speculant: error: rank 1 exited with status {code}: "), err
    assert "rank 1's test failure" in lines[-1], err
    assert any(
        line.startswith("speculant: error: rank 0: rank 1 failed first (") for line in lines
    ), err
    assert time.monotonic() - started < 60


def fails_on_rank1_in_rank() -> int:
    """A run_ranks function: rank 1 raises, rank 0 waits for it in a collective."""
    import torch.distributed as dist

    rank = ParallelContext.from_env(1, 2, "cpu", 20.0).rank
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(1))
    return rank


def closed_in_rank(target: str) -> tuple[list[int], bool]:
    """A run_ranks function: a tp=2 engine joined from the environment, used, then closed."""
    import torch.distributed as dist

    with Engine(target, device="cpu", tp=2) as engine:
        tokens = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=5))
    return tokens[0].token_ids if tokens else [], dist.is_initialized()


def test_close_leaves_the_groups_the_engine_joined(llama_dir):
    """An engine that joined the job's process groups itself (tp=2 from the environment) tears
    them down on close (with `with`), on every rank."""
    results = run_ranks(closed_in_rank, 2, (str(llama_dir),), timeout_s=LAUNCH_TIMEOUT_S)
    alone = Engine(llama_dir, device="cpu").generate([[5, 6, 7]], SamplingParams(max_new_tokens=5))
    assert results == [(alone[0].token_ids, False)] * 2, results


def test_run_ranks_names_the_rank_that_raised():
    """run_ranks' RankFailure names the rank whose function raised and its error, not rank 0,
    which failed afterwards in its collective with it."""
    with pytest.raises(RankFailure) as info:
        run_ranks(fails_on_rank1_in_rank, 2, timeout_s=LAUNCH_TIMEOUT_S)
    message = str(info.value)
    assert message.startswith("rank 1 exited with status 1"), message
    assert "ValueError: boom on rank 1" in message, message


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the rank processes in /proc")
def test_a_stuck_rank0_killed_by_the_launcher_leaves_no_empty_output(llama_dir, tmp_path):
    """Rank 0 stopped (SIGSTOP) before any request finished: the launcher kills it and fails
    the run naming it; the --output file rank 0 had created (and could not remove, killed) is
    removed, as one process leaves none when nothing finished."""
    out = tmp_path / "out.jsonl"
    proc, lines, reader, start = engines_built(
        "--target", llama_dir, "--prompt", "x", "--max-new-tokens", 490, "--ignore-eos",
        "--max-num-seqs", 2, "--dp", 2, "--dist-timeout", 5, "--output", out,
    )  # fmt: skip
    victim = rank_pid(proc.pid, 0)
    assert out.exists()  # rank 0 holds its lock on it
    os.kill(victim, signal.SIGSTOP)
    code, err = ended(proc, lines, reader)
    assert code == 1 and "rank 0" in err.strip().splitlines()[-1], err
    assert not out.exists(), out.read_text()


# ------------------------------------------------------------------ one-shot TP all-reduce


def test_one_shot_all_reduce_stays_off_where_it_cannot_run(monkeypatch):
    """No symmetric memory on one rank, on gloo, or when SPECULANT_TP_ALL_REDUCE=nccl; a bad
    value names itself and the choices."""
    from speculant.comm import all_reduce

    assert all_reduce.build_one_shot(ParallelContext.single(), torch.float32, "cpu") is None
    gloo = ParallelContext(tp_size=2, backend="gloo")
    assert all_reduce.build_one_shot(gloo, torch.float32, "cpu") is None
    monkeypatch.setenv("SPECULANT_TP_ALL_REDUCE", "nccl")
    assert all_reduce.build_one_shot(ParallelContext(tp_size=2, backend="nccl"), None, "") is None
    monkeypatch.setenv("SPECULANT_TP_ALL_REDUCE", "fast")
    with pytest.raises(ValueError, match="SPECULANT_TP_ALL_REDUCE=fast: use auto or nccl"):
        all_reduce.requested()


def test_all_reduce_tp_routes_small_tensors_to_the_one_shot_kernel(monkeypatch):
    """The routing protocol (a recording stand-in for the kernel): tensors it fits return its
    result; the rest go to the group's all_reduce in place."""
    import torch.distributed as dist

    class Recorder:
        calls: list = []

        def fits(self, x):
            return x.numel() <= 8

        def __call__(self, x):
            self.calls.append(x.numel())
            return x * 2

    nccl_calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: nccl_calls.append(x.numel()))
    pctx = ParallelContext(tp_size=2, backend="nccl", one_shot=Recorder())
    small, large = torch.ones(8), torch.ones(16)
    assert torch.equal(pctx.all_reduce_tp(small), torch.full((8,), 2.0))
    assert pctx.all_reduce_tp(large) is large
    assert Recorder.calls == [8] and nccl_calls == [16]


def one_shot_rank(sizes: list[int]) -> dict:
    """Rank body: one-shot sums vs NCCL's on the same random tensors, eagerly and replayed from
    a CUDA graph with fresh inputs, in bf16 and fp32."""
    import torch.distributed as dist

    from speculant.comm.all_reduce import OneShotAllReduce

    pctx = ParallelContext.from_env(2, 1, "cuda", timeout_s=COLLECTIVE_TIMEOUT_S)
    gen = torch.Generator().manual_seed(100 + pctx.rank)
    checks = {}
    for dtype in (torch.bfloat16, torch.float32):
        fast = OneShotAllReduce(pctx.tp_group, dtype, "cuda")
        for n in sizes:
            x = torch.randn(n, generator=gen).to(dtype=dtype, device="cuda")
            ref, before = x.clone(), x.clone()
            dist.all_reduce(ref, group=pctx.tp_group)
            eager = torch.equal(fast(x), ref) and torch.equal(x, before)
            static = torch.zeros_like(x)
            fast(static)  # first use outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fast(static)
            replays = []
            for _ in range(3):
                static.copy_(torch.randn(n, generator=gen).to(dtype=dtype, device="cuda"))
                ref = static.clone()
                dist.all_reduce(ref, group=pctx.tp_group)
                graph.replay()
                replays.append(torch.equal(out, ref))
            checks[f"{dtype} {n}"] = {"eager": eager, "graph": all(replays), "fits": fast.fits(x)}
    pctx.barrier()
    return checks


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_shot_all_reduce_equals_nccl_on_two_gpus():
    sizes = [4096, 16 * 4096, 128 * 4096]  # bs 1, 4 x 4 and 32 x 4 rows of hidden 4096 (fp32 fits)
    ranks = run_ranks(one_shot_rank, 2, (sizes,), device="cuda", timeout_s=LAUNCH_TIMEOUT_S)
    for rank, checks in enumerate(ranks):
        assert len(checks) == 6
        for name, check in checks.items():
            assert check == {"eager": True, "graph": True, "fits": True}, (rank, name)


def joined_nccl_rank() -> dict:
    """Rank body: the NCCL groups (made by init_process_group in the join's thread,
    comm.store_call.interruptible_call) used from the main thread, eagerly and in a graph."""
    import torch.distributed as dist

    pctx = ParallelContext.from_env(1, 1, "cuda", timeout_s=COLLECTIVE_TIMEOUT_S)
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    dist.all_reduce(x, group=pctx.tp_group)
    static = torch.ones(8, device="cuda")
    dist.all_reduce(static, group=pctx.tp_group)  # first use outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(static, group=pctx.tp_group)
    static.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    pctx.barrier()
    return {
        "eager": x.tolist() == list(range(8)),
        "graph": static.tolist() == [3.0] * 8,
        "backend": dist.get_backend(),
        "main": threading.current_thread() is threading.main_thread(),
        "device": torch.cuda.current_device(),
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_nccl_groups_joined_in_a_thread_run_on_the_main_thread():
    (checks,) = run_ranks(joined_nccl_rank, 1, (), device="cuda", timeout_s=LAUNCH_TIMEOUT_S)
    assert checks == {"eager": True, "graph": True, "backend": "nccl", "main": True, "device": 0}


def test_one_shot_all_reduce_stays_off_across_hosts(monkeypatch):
    """A TP group on two hosts cannot share a CUDA IPC buffer: every rank keeps NCCL, decided
    from the same gathered host list (no rank enters the buffer's rendezvous)."""
    from speculant.comm import all_reduce

    pctx = ParallelContext(tp_size=2, dp_size=2, backend="nccl")
    gathered = []
    monkeypatch.setattr(pctx, "all_gather_object", lambda obj: gathered.append(obj) or list("aabc"))
    assert all_reduce.build_one_shot(pctx, torch.bfloat16, "cuda") is None
    assert len(gathered) == 1  # the host names only: no buffer, no probe, no error exchange


def test_max_num_seqs_not_a_multiple_of_dp_is_said_once():
    """--max-num-seqs counts requests over all DP ranks and each rank takes its floor share:
    3 over dp=2 ran one request per rank, 2 in all, without a word; rank 0 now says so once."""
    run = subprocess.run(
        [sys.executable, "-m", "speculant", "generate", "--device", "cpu", "--dp", "2",
         "--max-num-seqs", "3", "--prompt", "x", "--max-new-tokens", "2", "--num-draft-tokens",
         "0", "--dist-timeout", "60"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    said = [line for line in run.stderr.splitlines() if "is not a multiple of dp=2" in line]
    assert len(said) == 1 and "max_num_seqs=3" in said[0] and "2 in all" in said[0], run.stderr


class Stopped(Exception):
    """What the `sigterm_raises` handler raises."""


@pytest.fixture
def sigterm_raises():
    """SIGTERM's handler for the test: raises Stopped (as the CLI's raises Terminated)."""

    def handler(signum, frame):
        raise Stopped(signum)

    saved = signal.signal(signal.SIGTERM, handler)
    try:
        yield handler
    finally:
        signal.signal(signal.SIGTERM, saved)


def test_deferred_stop_keeps_an_error_already_leaving(sigterm_raises):
    """executor/stops.py: a SIGTERM recorded while a step runs stops the block at its end (the
    process's own handler raises); an error leaving the block meanwhile (a collective that
    failed because a rank died, with the launcher's SIGTERM to the survivors close behind) is
    what the run reports, not the stop."""
    from speculant.executor.stops import DeferredStops

    with pytest.raises(Stopped), DeferredStops():
        signal.raise_signal(signal.SIGTERM)  # recorded, not raised here
        done = True
    assert done
    with pytest.raises(RuntimeError, match="rank 1 stopped answering"), DeferredStops():
        signal.raise_signal(signal.SIGTERM)
        raise RuntimeError("rank 1 stopped answering")
    assert signal.getsignal(signal.SIGTERM) is sigterm_raises  # put back either way


def test_a_stop_after_the_parent_died_is_not_deferred(monkeypatch, sigterm_raises):
    """A SIGTERM once the rank's parent (the launcher, torchrun's agent) is gone is the
    parent-death signal: the rank stops at once, as a killed rank does, so the other ranks'
    failed collective names it (test_launchers' node-killed case), not at the step's end."""
    from speculant.executor import stops

    deferred = stops.DeferredStops()
    with deferred:
        monkeypatch.setattr(stops.os, "getppid", lambda: deferred.parent + 1)  # reparented
        with pytest.raises(Stopped):
            signal.raise_signal(signal.SIGTERM)  # raised here, not recorded
        assert deferred.pending == 0
    assert signal.getsignal(signal.SIGTERM) is sigterm_raises
