"""Adaptive speculation (`--speculation auto`, executor/speculation.py): a step drafts k or no
tokens. Forced switching patterns keep greedy output equal to plain decoding and seeded sampling
reproducible and distributed as the target's, for EAGLE-3, DFLASH and the draft model, in mixed
and chunked steps, with overlap, and under TP=2 and DP=2; the drafter's state after steps that
did not draft equals what drafting every step leaves; the chooser's decisions follow synthetic
cost tables and acceptance streams."""

from __future__ import annotations

import random

import pytest
import torch

from speculant import Engine, SamplingParams, bundled
from speculant.executor.sampling import VARIANTS
from speculant.executor.speculation import (
    AUTO,
    FIXED,
    AcceptanceEstimate,
    DraftLengthChooser,
    DraftShape,
    StepCosts,
    shapes_for,
    step_shape,
)
from speculant.launch.spawn import run_ranks

TARGET = bundled("target")
DRAFTERS = {
    "eagle3": dict(algo="eagle3", draft=str(bundled("eagle3")), num_draft_tokens=3),
    "dflash": dict(algo="dflash", draft=str(bundled("dflash")), num_draft_tokens=3),
    "draft-model": dict(algo="draft-model", draft=str(bundled("draft_lm")), num_draft_tokens=3),
}
ENGINE = dict(device="cpu", max_num_seqs=8, max_model_len=256, page_size=4)
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
LAUNCH_TIMEOUT_S = 150


def prompts_of(lengths, seed, vocab):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


REST = "rest"  # a forced pattern's step that rests the drafter


class ForcedChooser(DraftLengthChooser):
    """Drafts per step from a fixed pattern (or a seeded random choice of 0, k and rest),
    whatever the costs; REST entries rest the drafter (no drafts, no drafter work)."""

    def __init__(self, k: int, pattern: list | None = None, seed: int = 0):
        super().__init__(k, AUTO, StepCosts({(DraftShape(k, k), 1): 1.0}))
        self.pattern, self.rng, self.steps = pattern, random.Random(seed), 0

    def _choose(self, request_indices, bs, proposes=True):
        self.steps += 1
        if self.pattern is None:
            drafts = self.rng.choice([0, self.k, self.k, REST])
        else:
            drafts = self.pattern[(self.steps - 1) % len(self.pattern)]
        if drafts == REST:
            self.rest_steps += 1
            self.rests_now = True
            return 0
        return drafts


def forced_engine(drafter: str, pattern, **options) -> Engine:
    engine = Engine(TARGET, **{**ENGINE, **options}, **DRAFTERS[drafter], speculation=AUTO)
    engine.chooser = ForcedChooser(engine.chooser.k, pattern)
    return engine


@pytest.fixture(scope="module")
def plain():
    return Engine(TARGET, **ENGINE)


@pytest.fixture(scope="module")
def prompts(plain):
    return prompts_of((5, 23, 1, 40, 12), seed=3, vocab=plain.model_config.vocab_size)


PATTERNS = {"alternating": [3, 3, 0], "mostly-plain": [0, 0, 0, 3, 3], "random": None}


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_forced_switching_greedy_equals_plain(plain, prompts, drafter, pattern):
    engine = forced_engine(drafter, PATTERNS[pattern], eager_padding=True)
    ours = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    shapes = engine.chooser.summary()
    assert shapes.get(0) and shapes.get(3), shapes  # both lengths ran
    assert sum(o.stats["num_verify_steps"] for o in ours) > 0
    assert len(engine.kv.free_pages) == engine.kv.num_pages - 1


REST_PATTERN = [3, 3, REST, REST, REST, 0, 3, 3, REST, 0, 0, 3]


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
@pytest.mark.parametrize("pattern", ["random", "rests"])
def test_forced_switching_in_chunked_preempted_overlapped_jobs(plain, drafter, pattern):
    """Drafting, plain and rest steps (a resting drafter does no work: its state lags), seeded
    random or in runs, in a job with chunked prefill, preemption and overlap: greedy output
    equals plain."""
    vocab = plain.model_config.vocab_size
    prompts = prompts_of((30, 3, 50, 17, 8, 61), seed=9, vocab=vocab)
    tight = dict(max_num_batched_tokens=24, num_pages=40, overlap=True, catch_up_depth=3)
    engine = forced_engine(drafter, None if pattern == "random" else REST_PATTERN, **tight)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ours = engine.generate(prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(prompts, params)]
    stats = engine.stats()
    assert stats["extend_steps"] > 1 and stats["preemptions"] > 0, stats
    assert stats["rest_steps"] > 0 and stats["drafts_chosen"].get(3)
    assert sum(o.stats["num_verify_steps"] for o in ours) > 0


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_a_resting_drafter_does_no_work(plain, prompts, drafter, monkeypatch):
    """Resting every step: the drafter never runs (no propose over prefill chunks, no catch-up
    flush, nothing recorded for one: every decode step is the plain engine's step), every
    request is cold, and greedy output equals plain."""
    engine = forced_engine(drafter, [REST], catch_up_depth=2)
    calls = []
    for name in ("propose", "catch_up", "catch_up_entry"):
        original = getattr(engine.drafter, name)

        def counted(*args, _f=original, _name=name, **kwargs):
            calls.append(_name)
            return _f(*args, **kwargs)

        monkeypatch.setattr(engine.drafter, name, counted)
    cold = []
    forget = engine.chooser.forget
    engine.chooser.forget = lambda index: cold.append(index in engine.chooser.cold) or forget(index)
    launches, run = [], engine.graphs.run
    engine.graphs.run = lambda *args, **kw: launches.append(args[-1]) or run(*args, **kw)
    ours = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert calls == [] and engine.pending.flushes == 0
    assert cold == [True] * len(prompts)
    assert engine.chooser.summary() == {0: engine.stats()["rest_steps"]}  # every step rested
    assert launches and all(launches)  # every decode step launched with the drafter at rest
    assert engine.graphs.num_rest_steps == len(launches)


def test_no_cycle_of_a_rest_step_is_observed():
    """A rest's steps (its last one too) are the plain engine's: none of their cycles refines
    the costs (a rest step records no catch-up, so it is cheaper than a plain step of auto)."""
    engine = Engine(TARGET, **ENGINE, **DRAFTERS["eagle3"], speculation=AUTO)
    prompts = prompts_of((5, 23), seed=3, vocab=engine.model_config.vocab_size)
    launches, run = [], engine.graphs.run
    engine.graphs.run = lambda *args, **kw: launches.append(args[-1]) or run(*args, **kw)
    observed, observe = [], engine.chooser.costs.observe
    engine.chooser.costs.observe = lambda *a: observed.append(launches[-1]) or observe(*a)
    engine.chooser.rest_left = 20
    engine.generate(prompts, GREEDY)
    assert any(launches) and observed  # it rested, and cycles were observed after the rest
    assert not any(observed)  # none of a rest step


def test_a_resting_graphs_step_does_no_drafter_work():
    """What a `+rest` graph captures (GraphRunner._step_of) runs no drafter code at all."""
    from speculant.executor.cuda_graph import RESTING

    engine = Engine(TARGET, **ENGINE, **DRAFTERS["eagle3"], speculation=AUTO, catch_up_depth=2)
    calls = []
    for name in ("propose", "catch_up_entry"):
        original = getattr(engine.drafter, name)
        setattr(engine.drafter, name,
                lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))  # fmt: skip
    keys = [key for key in engine.graphs.capture_plan() if key[0].endswith(RESTING)]
    for key in keys:
        engine.runner.buffers.fill([], [], [], [], [], [], key[1], engine.kv.sentinel_row)
        engine.graphs._step_of(key, None)()
    assert keys and calls == []


def test_steps_that_can_rest_capture_resting_plain_graphs():
    """`auto` captures, per sampler variant and size, a plain graph with the drafter at rest
    besides the three draft shapes; fixed speculation and plain engines capture none."""
    from speculant.executor.cuda_graph import RESTING

    auto = Engine(TARGET, **ENGINE, **DRAFTERS["eagle3"], speculation=AUTO)
    plan = auto.graphs.capture_plan()
    resting = [key for key in plan if key[0].endswith(RESTING)]
    assert len(resting) == len(auto.graphs.variants) * len(auto.graphs.sizes)
    assert all(shape == DraftShape(0, 0) for _, _, shape in resting)
    fixed = Engine(TARGET, **ENGINE, **DRAFTERS["eagle3"], speculation=FIXED)
    assert not any(key[0].endswith(RESTING) for key in fixed.graphs.capture_plan())


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_auto_prefill_only_steps_propose_nothing_mixed_steps_do(plain, drafter):
    """Under auto a step of prefill chunks alone proposes no drafts (the drafter's eager
    per-sequence part is dearer than the (0, k) graph step after it) and only writes the
    drafter's state; a mixed step whose decode rows verify proposes for every sequence, so
    back-to-back mixed steps keep verifying; greedy output equals plain in a chunked job."""
    vocab = plain.model_config.vocab_size
    prompts = prompts_of((30, 3, 50, 17, 8, 61, 25), seed=5, vocab=vocab)
    engine = forced_engine(drafter, [3], max_num_batched_tokens=24, max_num_seqs=4)
    shapes, proposed = [], []
    extend, propose = engine.runner.extend, engine.drafter.propose

    def spy_extend(seqs, *args):
        shapes.append((args[3], sum(s.verify for s in seqs)))
        return extend(seqs, *args)

    def spy_propose(inputs, sampling, variant, num_drafts):
        proposed.append((inputs.batch.mode.name, num_drafts))
        return propose(inputs, sampling, variant, num_drafts)

    engine.runner.extend, engine.drafter.propose = spy_extend, spy_propose
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ours = engine.generate(prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(prompts, params)]
    prefill_only = [shape for shape, rows in shapes if rows == 0]
    mixed = [shape for shape, rows in shapes if rows]
    assert prefill_only and all(shape == DraftShape(0, 0) for shape in prefill_only), shapes
    assert mixed and all(shape.draft == 3 for shape in mixed), shapes
    assert DraftShape(3, 3) in mixed
    assert sum(1 for mode, n in proposed if mode != "DECODE" and n == 3) == len(mixed)
    assert sum(o.stats["num_verify_steps"] for o in ours) > 0


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_auto_prefill_only_steps_propose_where_their_drafting_is_graphed(plain, drafter):
    """Where a prefill-only step's per-sequence drafting runs through its row-count graphs
    (executor/propose_graphs.py: greedy steps; padded eagerly on the CPU), auto proposes there
    as fixed does, and greedy output equals plain; a step with sampled rows, which would draft
    eagerly, proposes nothing."""
    vocab = plain.model_config.vocab_size
    prompts = prompts_of((30, 3, 50, 17), seed=5, vocab=vocab)
    graphed = dict(piecewise=True, eager_padding=True, piecewise_sizes=[8, 16, 24])
    engine = forced_engine(drafter, [3], max_num_batched_tokens=24, max_num_seqs=4, **graphed)
    shapes, extend = [], engine.runner.extend

    def spy_extend(seqs, *args):  # (shape, verify rows, whether a chunk ends its context)
        shapes.append((args[3], sum(s.verify for s in seqs), any(s.samples for s in seqs)))
        return extend(seqs, *args)

    engine.runner.extend = spy_extend
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ours = engine.generate(prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(prompts, params)]
    ending = [shape for shape, rows, ends in shapes if rows == 0 and ends]
    assert ending and all(shape.draft == 3 for shape in ending), shapes
    # a step none of whose chunks ends its context samples nothing: it drafts nothing either
    middle = [shape for shape, rows, ends in shapes if rows == 0 and not ends]
    assert middle and all(shape == DraftShape(0, 0) for shape in middle), shapes
    drafting = sum(1 for shape, _, _ in shapes if shape.draft)  # each ran its sequences padded
    assert engine.piecewise.per_sequence.stats.padded_eager == drafting
    shapes.clear()
    sampled = [SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, seed=i)
               for i in range(len(prompts))]  # fmt: skip
    engine.generate(prompts, sampled)
    prefill_only = [shape for shape, rows, _ in shapes if rows == 0]
    assert prefill_only and all(shape == DraftShape(0, 0) for shape in prefill_only), shapes


def test_drafting_must_beat_plain_by_the_margin():
    """A modelled gain below MARGIN keeps plain steps (drafting pays costs outside its step
    cycles); a larger one drafts."""
    costs = StepCosts({(DraftShape(3, 3), 1): 2.0, (DraftShape(0, 0), 1): 1.0})
    chooser = DraftLengthChooser(3, AUTO, costs)
    margin = chooser.MARGIN
    assert margin > 1.0
    for gain, drafts in ((0.5 * (1 + margin), False), (1.1 * margin, True)):
        chooser.batch.expected = 2.0 * gain  # tokens per verify row: gain x plain's tokens/s
        chooser._last_key = None
        assert chooser.prefers_drafting([0], 1) is drafts, gain
        assert chooser.pays_at_smallest_batch() is drafts, gain


def test_a_prefill_only_step_starts_no_probe_and_no_plain_check():
    """The chooser at a step of prefill chunks alone (`proposes` False): a probe that is due
    waits for the next decode step; while drafting wins it answers 0, or k where the step drafts
    `cheaply` (its per-sequence drafting replays a graph), never counting towards a plain
    check."""
    costs = StepCosts({(DraftShape(3, 3), 1): 3.0, (DraftShape(0, 0), 1): 1.0})
    chooser = DraftLengthChooser(3, AUTO, costs)
    chooser.batch.rates = [0.0] * 3  # nothing accepted: plain wins
    chooser.batch.expected = chooser.batch._expected()
    for _ in range(chooser.FIRST_PROBE - 1):
        assert chooser.choose([0], 1) == 0
    assert chooser.choose([0], 1, proposes=False) == 0 and chooser.phase is None
    assert chooser.choose([0], 1) == 3 and chooser.phase is not None  # the probe, now
    good = DraftLengthChooser(3, AUTO, costs)
    good.batch.rates = [1.0] * 3  # everything accepted: drafting wins
    good.batch.expected = good.batch._expected()
    costs.learns = True
    streak = good.draft_streak
    assert [good.choose([0], 1, proposes=False) for _ in range(5)] == [0] * 5  # eagerly: none
    assert [good.choose([0], 1, proposes=False, cheaply=True) for _ in range(50)] == [3] * 50
    assert good.draft_streak == streak and good.summary() == {0: 5, 3: 50}


def test_a_probe_whose_verify_never_runs_is_abandoned_and_probes_go_on():
    """A probe started on the last decode step before a step of prefill chunks alone (or whose
    verify step ran plain: a row held no drafts, a DP peer chose plain) waits PROBE_WAITS steps
    for an outcome that never comes, then is abandoned: later probes still run (the chooser
    used to wait for ever, choosing 0 for the rest of the engine's life)."""
    costs = StepCosts({(DraftShape(3, 3), 8): 3.0, (DraftShape(0, 0), 8): 1.0})
    chooser = DraftLengthChooser(3, AUTO, costs)
    rows = list(range(8))
    drafts = None
    while chooser.phase is None:
        drafts = chooser.choose(rows, 8)
    assert drafts == 3  # the probe drafts on the wave's last decode step
    assert chooser.choose(list(range(8, 16)), 8, proposes=False) == 0  # the next wave's prefill
    assert chooser.phase is not None  # the probe still waits to verify
    later = [chooser.choose(rows, 8) for _ in range(100)]  # its verify step ran plain: no rows
    assert 3 in later[chooser.PROBE_WAITS + 2 :], later  # a later probe drafts again
    stuck = DraftLengthChooser(3, AUTO, costs)
    while stuck.phase is None:
        stuck.choose(rows, 8)
    stuck.choose(rows, 8)  # the probe's verify step, which the engine ran plain
    assert [stuck.choose(rows, 8) for _ in range(stuck.PROBE_WAITS)] == [0] * stuck.PROBE_WAITS
    assert stuck.choose(rows, 8) == 0 and stuck.phase is None


def test_waking_after_a_rest_empties_the_record_and_new_requests_are_warm(plain, prompts):
    """The first step after a rest empties every row's record (rest steps recorded on the
    device, unread); a request whose context starts after it is warm; output equals plain."""
    pattern = [REST] * 6 + [0, 0, 3, 3] * 100  # one rest, at the start
    engine = forced_engine("eagle3", pattern, max_num_seqs=2, catch_up_depth=4)
    warm, chooser = [], engine.chooser
    forget = chooser.forget
    chooser.forget = lambda index: warm.append(index not in chooser.cold) or forget(index)
    ours = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert any(warm) and not all(warm)
    assert int(engine.runner.catch_up.count.max()) <= engine.runner.catch_up.depth


@pytest.mark.parametrize("drafter", ["eagle3", "dflash"])
def test_after_a_rest_the_drafter_state_of_new_positions_is_right_again(prompts, drafter):
    """EAGLE-3's and DFLASH's K/V of a position depend on that position alone: a request that
    ran through a rest lags before it, but every position after the wake (caught up through the
    emptied record) holds what drafting every step leaves."""
    prompt, params = prompts[3], SamplingParams(max_new_tokens=60, ignore_eos=True)
    rest_steps = 10
    after = len(prompt) + rest_steps + 2  # past the rest's positions
    length = len(prompt) + params.max_new_tokens - 8
    states, tokens = [], []
    for pattern in ([3], [REST] * rest_steps + ([0] * 6 + [3, 3]) * 20):
        engine = forced_engine(drafter, pattern, max_num_seqs=1, catch_up_depth=4)
        kept = drafter_state_at_finish(engine, length)
        tokens.append(engine.generate([prompt], params)[0].token_ids)
        states.append(kept)
    assert engine.chooser.rest_steps == rest_steps and engine.pending.flushes > 2
    assert tokens[0] == tokens[1]
    lagging = 0
    for fixed, rested in zip(*states, strict=True):
        torch.testing.assert_close(rested[after:], fixed[after:], rtol=1e-5, atol=1e-5)
        lagging += not torch.allclose(rested[:after], fixed[:after])
    assert lagging  # the rest's positions were not written


def follows_plain_distribution(pattern, position: int, seed0: int) -> None:
    """The token a forced-pattern run emits at `position` follows the plain run's distribution
    over 300 seeds (chi-square over the tokens both see often enough)."""
    from scipy.stats import chisquare

    prompt = prompts_of((7,), seed=4, vocab=256)[0]
    n = 300
    params = [
        SamplingParams(max_new_tokens=position + 1, temperature=1.0, seed=seed0 + i,
                       ignore_eos=True)
        for i in range(n)
    ]  # fmt: skip
    forced = forced_engine("eagle3", pattern, max_num_seqs=64)
    plain = Engine(TARGET, **{**ENGINE, "max_num_seqs": 64})
    ours = [o.token_ids[position] for o in forced.generate([prompt] * n, params)]
    theirs = [o.token_ids[position] for o in plain.generate([prompt] * n, params)]
    tokens = sorted(set(ours) | set(theirs))
    counts = [ours.count(t) for t in tokens]
    expected = [max(theirs.count(t), 0.5) for t in tokens]
    scale = sum(counts) / sum(expected)
    common = [(c, e * scale) for c, e in zip(counts, expected, strict=True) if e * scale >= 5]
    assert len(common) >= 2
    c, e = zip(*common, strict=True)
    e = [x * sum(c) / sum(e) for x in e]
    assert chisquare(c, e).pvalue > 1e-3


def test_resting_sampled_output_follows_the_target_distribution():
    """Drafts from a lagging drafter are still verified exactly: the token a run with rest
    steps emits at a fixed position follows the plain run's distribution over seeds."""
    follows_plain_distribution([REST, REST, 3, 3, 3], position=4, seed0=2000)


@pytest.mark.parametrize("drafter", ["eagle3", "dflash"])
def test_seeded_switching_is_reproducible_and_batch_invariant_per_pattern(prompts, drafter):
    params = [
        SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=11 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    runs = [forced_engine(drafter, [0, 3, 3]).generate(prompts, params) for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    # k = 0 every step is plain sampling: the same tokens as the plain engine, seed for seed
    never = forced_engine(drafter, [0]).generate(prompts, params)
    plain = Engine(TARGET, **ENGINE).generate(prompts, params)
    assert [o.token_ids for o in never] == [o.token_ids for o in plain]


def seeded_params(n: int, **options) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_new_tokens=30,
            temperature=0.9,
            top_p=0.95,
            top_k=40,
            seed=7 + 3 * i,
            ignore_eos=True,
            **options,
        )  # fmt: skip
        for i in range(n)
    ]


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_match_verify_gives_seeded_output_equal_to_plain_fixed_and_any_switching(plain, drafter):
    """`sampled_verify="match"`: a sampled draft is accepted when it equals the token plain
    sampling draws at its position, so seeded output is the same for the plain engine, fixed-k
    speculation, and forced switching between drafting, plain and resting steps (in a chunked,
    preempted, overlapped job), while drafts are still accepted (the drafter draws with the
    same random number)."""
    vocab = plain.model_config.vocab_size
    prompts = prompts_of((30, 3, 50, 17, 8, 61), seed=9, vocab=vocab)
    params = seeded_params(len(prompts))
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    fixed = Engine(TARGET, **ENGINE, **DRAFTERS[drafter], sampled_verify="match")
    fixed_out = fixed.generate(prompts, params)
    assert [o.token_ids for o in fixed_out] == expected
    verified = sum(o.stats["num_verify_steps"] for o in fixed_out)
    emitted = sum(len(o.token_ids) - 1 for o in fixed_out)  # the first token is the prefill's
    assert verified and emitted > 1.2 * verified, (emitted, verified)  # drafts were accepted
    tight = dict(max_num_batched_tokens=24, num_pages=40, overlap=True, catch_up_depth=3)
    for pattern in (None, REST_PATTERN):
        engine = forced_engine(drafter, pattern, sampled_verify="match", **tight)
        ours = engine.generate(prompts, params)
        assert [o.token_ids for o in ours] == expected, pattern
        assert engine.stats()["preemptions"] > 0 and engine.chooser.summary().get(3)


def test_match_verify_emits_what_plain_sampling_draws_whatever_the_drafts():
    """executor/verify.py with `match`: for any drafts the emitted tokens are the plain sampler's
    at their positions; drafts equal to those are all accepted, others cut the run there."""
    from speculant.executor.forward_batch import SamplingInfo
    from speculant.executor.sampling import FULL, sample
    from speculant.executor.verify import verify

    gen = torch.Generator().manual_seed(0)
    bs, T, V = 6, 4, 50
    logits = torch.randn(bs, T, V, generator=gen) * 2
    info = SamplingInfo(
        torch.full((bs,), 0.8), torch.zeros(bs, dtype=torch.int64), torch.full((bs,), 0.9),
        torch.arange(bs, dtype=torch.int64) * 1000 + 5,
    )  # fmt: skip
    positions = torch.arange(T)[None, :] + torch.arange(bs)[:, None] * 7 + 10
    plain = torch.stack(
        [sample(logits[:, t], info, positions[:, t] + 1, FULL) for t in range(T)], dim=1
    )
    for drafts in (torch.randint(0, V, (bs, T - 1), generator=gen), plain[:, : T - 1].clone()):
        out, accept_len = verify(logits, drafts, None, info, positions, FULL, match=True)
        for row in range(bs):
            n = int(accept_len[row])
            assert out[row, :n].tolist() == plain[row, :n].tolist()
            run = 0
            while run < T - 1 and drafts[row, run] == plain[row, run]:
                run += 1
            assert n == run + 1
    assert (accept_len == T).all()  # the last drafts were the plain sampler's own tokens


def test_bad_sampled_verify_value_is_one_clear_error():
    from speculant import SpeculantError

    with pytest.raises(SpeculantError, match=r"sampled_verify='exact' must be 'rejection' or"):
        Engine(TARGET, **ENGINE, **DRAFTERS["eagle3"], sampled_verify="exact")


def test_switching_sampled_output_follows_the_target_distribution():
    """First tokens after a plain step and after a drafting step: the empirical distribution of
    the token a switching run emits at a fixed position matches the plain run's over seeds."""
    follows_plain_distribution([0, 3, 3], position=3, seed0=1000)


def drafter_state_at_finish(engine: Engine, length: int) -> list[torch.Tensor]:
    """Generate, keeping the drafter's K and V of the request's first `length` positions as
    they were when it finished (before its pages go back)."""
    kv, drafter, kept = engine.kv, engine.drafter, []
    free = kv.free

    def keep_then_free(row: int) -> None:
        rows = torch.full((1,), row, dtype=torch.long)
        slots = kv.slots(rows, torch.arange(length)[None]).reshape(-1)
        kept.extend(pool[slots].clone() for pool in drafter.k_pools + drafter.v_pools)
        free(row)

    kv.free = keep_then_free
    return kept


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_drafter_state_after_plain_steps_equals_drafting_every_step(prompts, drafter):
    """One request, greedy: its drafter K/V over every verified position is the same whether
    every step drafted or most did not (the plain steps' K/V-only catch-up)."""
    prompt = prompts[3]
    length = len(prompt) + GREEDY.max_new_tokens - 8  # verified in both runs
    states = []
    for pattern in ([3], [0, 0, 3]):
        engine = forced_engine(drafter, pattern, max_num_seqs=1)
        kept = drafter_state_at_finish(engine, length)
        engine.generate([prompt], GREEDY)
        if pattern != [3]:
            assert engine.chooser.summary().get(0)  # plain steps ran
        states.append(kept)
    assert states[0] and len(states[0]) == len(states[1])
    for fixed, switching in zip(*states, strict=True):
        assert fixed.abs().sum() > 0  # real K/V, not an empty page
        torch.testing.assert_close(switching, fixed, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
@pytest.mark.parametrize("depth", [1, 3, 8])
def test_deferred_catch_up_leaves_the_state_of_drafting_every_step(prompts, drafter, depth):
    """Plain steps record the drafter's inputs and a flush writes its K/V `depth` steps later
    (or before a step that drafts): long plain runs, flushed by depth and by drafting, leave
    the same K/V as drafting every step, and greedy output equals plain decoding."""
    prompt, params = prompts[3], SamplingParams(max_new_tokens=60, ignore_eos=True)
    length = len(prompt) + params.max_new_tokens - 8  # flushed in every run
    states, tokens = [], []
    for pattern in ([3], [0] * 10 + [3, 3]):
        engine = forced_engine(drafter, pattern, max_num_seqs=1, catch_up_depth=depth)
        kept = drafter_state_at_finish(engine, length)
        tokens.append(engine.generate([prompt], params)[0].token_ids)
        states.append(kept)
    assert engine.runner.catch_up.depth == depth and engine.pending.flushes > 2
    assert engine.stats()["catch_ups"] == engine.pending.flushes
    assert tokens[0] == tokens[1]
    for fixed, switching in zip(*states, strict=True):
        assert fixed.abs().sum() > 0
        torch.testing.assert_close(switching, fixed, rtol=1e-5, atol=1e-5)


def drafter_state_per_request(engine: Engine, margin: int) -> dict[int, torch.Tensor]:
    """Generate, keeping per request the drafter's K/V of its positions up to `margin` before
    its end, as they were when it finished."""
    kv, drafter, kept = engine.kv, engine.drafter, {}
    finish = engine.scheduler.finish

    def keep_then_finish(request) -> None:
        length = len(request.prompt_ids) + len(request.output_ids) - margin
        slots = kv.slots(torch.full((1,), request.row), torch.arange(length)[None]).reshape(-1)
        kept[request.index] = torch.cat([pool[slots] for pool in drafter.k_pools])
        finish(request)

    engine.scheduler.finish = keep_then_finish
    return kept


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_deferred_catch_up_in_a_job_with_reused_rows_chunks_and_overlap(plain, drafter):
    """Requests that finish while holding recorded entries, rows reused by new requests,
    chunked prefill and overlapped steps: every request's drafter K/V at its finish equal the
    fixed-speculation run's, and greedy output equals plain."""
    vocab = plain.model_config.vocab_size
    prompts = prompts_of((30, 3, 21, 17, 8, 26), seed=5, vocab=vocab)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (30, 14, 25, 9, 33, 20)]
    job = dict(max_num_seqs=2, max_num_batched_tokens=16, overlap=True, catch_up_depth=3)
    states, outs = [], []
    for pattern in ([3], [0] * 7 + [3, 3]):
        engine = forced_engine(drafter, pattern, **job)
        kept = drafter_state_per_request(engine, margin=10)
        outs.append([o.token_ids for o in engine.generate(prompts, params)])
        states.append(kept)
    assert engine.pending.flushes > 3 and engine.stats()["extend_steps"] > len(prompts)
    assert outs[0] == outs[1] == [o.token_ids for o in plain.generate(prompts, params)]
    assert sorted(states[1]) == list(range(len(prompts)))
    for index, fixed in states[0].items():
        assert fixed.abs().sum() > 0
        torch.testing.assert_close(states[1][index], fixed, rtol=1e-4, atol=1e-4)


def test_plain_steps_of_auto_run_ahead_as_often_as_a_plain_engine(prompts):
    """With overlap, a step is launched ahead unless a request could reach its length limit in
    the two steps: plain steps of adaptive speculation emit one token each, as a plain
    engine's, so they run ahead as often (they did not when the limit assumed k + 1 tokens)."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = Engine(TARGET, **ENGINE, overlap=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    engine = forced_engine("eagle3", [0], overlap=True)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert engine.steps_ahead == plain.steps_ahead > 0


def test_plain_decode_rows_take_one_token_of_the_step_budget(plain):
    """Under a token budget, a decode row that holds no drafts (adaptive plain steps) costs one
    token, not k + 1: prefill chunks get the rest, so the job takes the extend steps a plain
    engine takes (it took more while every row was counted as a verify row)."""
    prompts = prompts_of((30, 3, 50, 17, 8, 61, 25), seed=4, vocab=plain.model_config.vocab_size)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    tight = dict(max_num_batched_tokens=24, max_num_seqs=4)
    reference = Engine(TARGET, **ENGINE | tight)
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    engine = forced_engine("eagle3", [0], **tight)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert engine.stats()["extend_steps"] == reference.stats()["extend_steps"]


def test_catch_up_is_deferred_only_where_it_can_be(prompts):
    """EAGLE-3 (one layer), DFLASH and the draft model defer; fixed speculation and depth 0
    catch up in every plain step (no buffers); a bad depth is one clear error."""
    from speculant import SpeculantError

    for drafter in DRAFTERS:
        engine = forced_engine(drafter, [0])
        buffers = engine.runner.catch_up
        held = buffers.ids.nbytes + buffers.features.nbytes + buffers.count.nbytes
        assert held == engine._catch_up_bytes(engine.config) > 0  # kept out of the KV pool
    assert forced_engine("eagle3", [0], catch_up_depth=0).runner.catch_up is None
    fixed = Engine(TARGET, **ENGINE, **DRAFTERS["eagle3"], speculation=FIXED)
    assert fixed.runner.catch_up is None and fixed.pending is None
    with pytest.raises(SpeculantError, match=r"catch_up_depth=-1 must be an integer in 0\.\.256"):
        forced_engine("eagle3", [0], catch_up_depth=-1)


def test_auto_on_the_cpu_measures_costs_and_stays_lossless(plain, prompts):
    engine = Engine(TARGET, **ENGINE, **DRAFTERS["eagle3"], speculation=AUTO)
    table = engine.chooser.costs.table
    assert {shape for shape, _ in table} == set(shapes_for(3, AUTO))
    assert all(seconds > 0 for seconds in table.values())
    ours = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    stats = engine.stats()  # every step that ran a batch chose its drafts
    assert 0 < sum(stats["drafts_chosen"].values()) <= stats["steps"]


def test_fixed_speculation_captures_one_shape_and_drafts_every_step(prompts):
    engine = Engine(TARGET, **ENGINE, **DRAFTERS["eagle3"], speculation=FIXED)
    assert engine.graphs.shapes == [DraftShape(3, 3)]
    engine.generate(prompts[:2], GREEDY)
    assert not engine.chooser.adaptive and set(engine.chooser.summary()) == {3}


def test_bad_speculation_value_is_one_clear_error():
    from speculant import SpeculantError

    with pytest.raises(SpeculantError, match=r"speculation='sometimes' must be 'auto' or 'fixed'"):
        Engine(TARGET, **ENGINE, **DRAFTERS["eagle3"], speculation="sometimes")


# ------------------------------------------------------------------------------ TP=2 and DP=2


def switching_in_rank(tp: int, dp: int, drafter: str, prompts, params, **options) -> dict:
    from speculant.comm.groups import ParallelContext

    pctx = ParallelContext.from_env(tp, dp, "cpu", timeout_s=60)
    engine = Engine(
        str(TARGET), pctx=pctx, **ENGINE, **DRAFTERS[drafter], speculation=AUTO, **options
    )
    engine.chooser = ForcedChooser(engine.chooser.k, None, seed=pctx.dp_rank)
    source = pctx.rank == 0
    outs = engine.generate(prompts if source else None, params if source else None)
    pctx.close()
    return {o.index: o.token_ids for o in outs}, engine.chooser.rest_steps


@pytest.mark.parametrize("tp, dp", [(2, 1), (1, 2)])
def test_switching_under_tp2_and_dp2_equals_plain(plain, prompts, tp, dp):
    """Greedy random switching (rests included) of DFLASH under TP=2 and DP=2 equals plain
    (EAGLE-3's under both: the seeded match-verify test below)."""
    expected = {o.index: o.token_ids for o in plain.generate(prompts, GREEDY)}
    ranks = run_ranks(switching_in_rank, tp * dp, (tp, dp, "dflash", prompts, GREEDY),
                      timeout_s=LAUNCH_TIMEOUT_S)  # fmt: skip
    tokens, rest_steps = ranks[0]
    assert tokens == expected
    assert rest_steps > 0  # the drafter rested in some steps (on every TP rank alike)


def match_switching_in_rank(tp, dp, drafter, prompts, params):
    return switching_in_rank(tp, dp, drafter, prompts, params, sampled_verify="match")


@pytest.mark.parametrize("tp, dp", [(2, 1), (1, 2)])
def test_seeded_switching_with_match_verify_under_tp2_and_dp2_equals_plain(plain, prompts, tp, dp):
    """Seeded sampling with `sampled_verify="match"` and random switching (rests included)
    under TP=2 and DP=2: the plain engine's tokens, seed for seed."""
    params = seeded_params(len(prompts))
    expected = {o.index: o.token_ids for o in plain.generate(prompts, params)}
    ranks = run_ranks(match_switching_in_rank, tp * dp, (tp, dp, "eagle3", prompts, params),
                      timeout_s=LAUNCH_TIMEOUT_S)  # fmt: skip
    tokens, rest_steps = ranks[0]
    assert tokens == expected
    assert rest_steps > 0  # EAGLE-3 rested in some steps (on every TP rank alike)


# ------------------------------------------------------------------------------ the chooser


def costs(plain_s: float, spec_s: float, resume_s: float | None = None, sizes=(1, 64)):
    """A synthetic table: plain and speculative (k = 3) steps, the cost growing with bs."""
    table = {}
    for bs in sizes:
        scale = 1 + bs / 64
        table[(DraftShape(0, 0), bs)] = plain_s * scale
        table[(DraftShape(3, 3), bs)] = spec_s * scale
        table[(DraftShape(0, 3), bs)] = (resume_s or spec_s) * scale
    return StepCosts(table)


def feed(
    chooser: DraftLengthChooser, requests: list[int], accepted: int, steps: int, real=None
) -> list:
    """Run `steps` decisions; every verify step accepts `accepted` of 3 drafts per request;
    with `real`, every step's cycle is observed at its real cost (real[shape] seconds)."""
    chosen, holding = [], 3
    for _ in range(steps):
        drafts = chooser.choose(requests, len(requests))
        shape = step_shape(drafts, holding, 3)
        for index in requests:
            chooser.observe(index, shape.verify, min(accepted, shape.verify))
        if real is not None:
            chooser.costs.observe(shape, len(requests), real[shape])
        holding = shape.draft
        chosen.append(shape)
    return chosen


def test_chooser_drafts_when_acceptance_pays_for_the_verify():
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.3))
    chosen = feed(chooser, [0, 1], accepted=2, steps=50)
    assert all(s == DraftShape(3, 3) for s in chosen[1:])


def test_chooser_goes_plain_when_nothing_is_accepted_and_probes_less_and_less():
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.3))
    chooser.REST_AFTER = 100  # no rest: probes keep backing off
    chosen = feed(chooser, [0], accepted=0, steps=3000)
    plain = sum(s == DraftShape(0, 0) for s in chosen)
    assert plain / len(chosen) > 0.94  # a probe at bs 1 verifies PROBE_ROWS steps
    probes = [i for i, s in enumerate(chosen) if s == DraftShape(0, 3)]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # backing off
    assert all(chosen[i + 1] == DraftShape(3, 3) for i in probes)  # a probe is verified


def test_chooser_rests_the_drafter_when_acceptance_would_lose_even_at_batch_size_one():
    """Nothing accepted: after REST_AFTER lost probes the drafter rests REST_STEPS steps (no
    drafts, no probes, every step says so), then probes again, and one more lost probe starts
    a rest twice as long."""
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.3))
    chooser.REST_STEPS = 200
    chosen, rests = [], []
    holding = 3
    for _ in range(1000):
        drafts = chooser.choose([0], 1)
        rests.append(chooser.rests_now)
        shape = step_shape(drafts, holding, 3)
        chooser.observe(0, shape.verify, 0)
        holding, chosen = shape.draft, chosen + [shape]
    probes = [i for i, s in enumerate(chosen) if s == DraftShape(0, 3)]
    first = rests.index(True)
    assert len([p for p in probes if p < first]) == chooser.REST_AFTER
    assert rests[first : first + 201] == [True] * 200 + [False] and not any(rests[:first])
    assert all(chosen[i] == DraftShape(0, 0) for i in range(first, first + 200))
    after = [p for p in probes if p > first + 200]
    assert after  # awake: it probes; the probe loses and a rest of 400 steps follows its verify
    assert chosen[after[0] + 1 : after[0] + 1 + chooser.PROBE_ROWS] == [DraftShape(3, 3)] * 8
    second = rests.index(True, after[0])
    assert second == after[0] + 1 + chooser.PROBE_ROWS  # a bs-1 probe: PROBE_ROWS verify rows
    assert rests[second : second + 401] == [True] * 400 + [False]
    assert chooser.rest_steps == 600 + sum(rests[second + 401 :])


def test_a_rest_goes_on_while_every_request_is_cold():
    """Past a rest's length, steps whose requests all ran some of it (cold: nothing to probe
    with, nothing to record catch-up for) rest on; a request that starts warm ends it."""
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.3))
    chooser.REST_STEPS = 50
    for _ in range(400):  # nothing accepted: probes lose and a rest starts
        chooser.choose([0, 1], 2)
        if chooser.rests_now:
            break
        chooser.observe(0, 3, 0)
        chooser.observe(1, 3, 0)
    assert chooser.rests_now
    chooser.mark_cold([0, 1])  # as the engine does when a rest starts
    rests = []
    for _ in range(200):
        assert chooser.choose([0, 1], 2) == 0
        rests.append(chooser.rests_now)
    assert all(rests) and chooser.rest_left == 0  # 200 steps, past the rest's 50
    assert chooser.choose([0, 1, 2], 3) == 0 and not chooser.rests_now  # request 2 is warm
    chooser.rest_length = 0  # as when drafting last won: cold requests alone do not rest
    assert chooser.choose([0, 1], 2) == 0 and not chooser.rests_now


def test_a_held_on_drafting_step_without_new_figures_stops():
    """A lost comparison holds drafting on to see the next verify row; rows that teach nothing
    (all cold: their outcomes are ignored) bring none, and drafting stops within PROBE_WAITS
    more steps instead of going on for good."""
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.3))
    chooser.mark_cold([1, 2])  # they ran an earlier rest
    for _ in range(20):  # request 0 (warm) accepts everything: the batch drafts
        drafts = chooser.choose([0, 1, 2], 3)
        for index in (0, 1, 2):
            chooser.observe(index, 3, 3)
    assert drafts == 3 and chooser.rest_length == 0
    chooser.forget(0)  # it ends: the cold rows are left, drafting loses for them
    assert not chooser.prefers_drafting([1, 2], 2, chooser.STAY_MARGIN)
    chosen = []
    for _ in range(50):
        chosen.append(chooser.choose([1, 2], 2))
        for index in (1, 2):
            chooser.observe(index, 3, 0)  # ignored: cold
    assert chosen[0] == 3  # the one lost comparison STOP_AFTER tolerates
    assert sum(chosen) <= 3 * (1 + chooser.PROBE_WAITS) and chosen[-10:] == [0] * 10


def test_steps_that_sample_nothing_keep_a_rest_gone_past_its_length(plain, prompts):
    """A rest that went on past its length (every running request cold) goes on through steps
    of prefill chunks that sample nothing, unless a context starts in the step: a request whose
    context starts outside a rest's length is warm and ends it. Output equals plain."""

    def run(prompts, params):
        engine = Engine(TARGET, **{**ENGINE, "max_num_seqs": 2, "max_num_batched_tokens": 8},
                        **DRAFTERS["eagle3"], speculation=AUTO)  # fmt: skip
        chooser = engine.chooser
        chooser.rest_length = chooser.rest_left = 3  # a rest in progress
        chooser.lost_probes = chooser.REST_AFTER - 1
        steps, settle = [], engine._settle_catch_up

        def record(plan):
            bs = len(plan.decode) + sum(c.last for c in plan.chunks)
            starts = [c.request.index for c in plan.chunks if c.start == 0]
            settle(plan)
            steps.append((plan.rests, bs, starts, chooser.rest_left, set(chooser.cold)))

        engine._settle_catch_up = record
        ours = engine.generate(prompts, params)
        assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(prompts, params)]
        return steps, [
            i for i, step in enumerate(steps) if i and steps[i - 1][3] == 0 and step[3] == 0
        ]

    # a short request ends while a long prompt, started in the rest (cold), still prefills alone
    vocab = plain.model_config.vocab_size
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (4, 6)]
    steps, past = run(prompts_of((5, 100), seed=4, vocab=vocab), params)
    quiet = [i for i in past if steps[i][1] == 0 and not steps[i][2]]
    assert quiet and all(steps[i][0] and steps[i - 1][0] for i in quiet)  # the rest goes on
    steps, past = run(prompts, GREEDY)  # later requests start after the rest's length
    woke = [i for i in past if steps[i][2] and not steps[i][0]]
    assert woke and all(not set(steps[i][2]) & steps[i][4] for i in woke)  # started warm


def test_a_resumed_context_starts_warm_and_ends_a_rest_gone_past_its_length():
    """A request resumed after a preemption (cold: it ran a rest before) restarts its context
    outside the rest's length: it starts warm, so the step does not rest (a protocol check of
    Engine._choose_shape with a stand-in engine around a real chooser)."""
    from types import SimpleNamespace

    from speculant.executor.engine import Engine as RealEngine
    from speculant.executor.step_plan import Chunk, StepPlan

    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.3))
    chooser.rest_length, chooser.rest_left = 1024, 0  # a rest just ran out
    chooser.mark_cold([0, 1])  # both requests ran it
    row = lambda index: SimpleNamespace(index=index, next_input=[1], row=index)  # noqa: E731
    engine = SimpleNamespace(chooser=chooser, _resting=True, _drafts_cheaply=lambda plan: False)
    plan = RealEngine._choose_shape(engine, StepPlan(decode=[row(0)]))
    assert plan.rests  # every request cold: the rest goes on
    resumed = Chunk(row(1), 0, [5, 6], True, None, True)  # request 1's context starts again
    plan = RealEngine._choose_shape(engine, StepPlan(decode=[row(0)], chunks=[resumed]))
    assert not plan.rests and 1 not in chooser.cold


def test_when_no_request_runs_the_next_batch_starts_afresh():
    """The last running request ends: the drafting regime (the lower margin to stay, a lost
    comparison held) ends with it, so the next batch must win by MARGIN to draft."""
    from types import SimpleNamespace

    from speculant.executor.engine import Engine as RealEngine

    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.3))
    chooser.drafting, chooser.losses = True, 1
    done = SimpleNamespace(index=0, finish_reason="length")
    running = [done, SimpleNamespace(index=1, finish_reason=None)]
    scheduler = SimpleNamespace(running=running, finish=running.remove)
    engine = SimpleNamespace(chooser=chooser, scheduler=scheduler)
    assert RealEngine._finish_done(engine) == [done] and chooser.drafting  # one still runs
    running[0].finish_reason = "stop"
    RealEngine._finish_done(engine)
    assert not running and not chooser.drafting and chooser.losses == 0


def test_unlucky_first_rows_do_not_rest_a_good_drafter():
    """At bs 1 a probe verifies PROBE_ROWS steps: a head that accepts 3 of 4 drafts (worth
    drafting at bs 1) whose first two verify rows accept 1 is judged on the probe's rows, not on
    those two, and is never rested."""
    table = {(DraftShape(0, 0), 1): 1.0, (DraftShape(4, 4), 1): 2.3, (DraftShape(0, 4), 1): 2.0}
    chooser = DraftLengthChooser(4, AUTO, StepCosts(table))
    chosen, holding, rows = [], 4, 0
    for _ in range(300):
        drafts = chooser.choose([0], 1)
        shape = step_shape(drafts, holding, 4)
        if shape.verify:
            rows += 1
            chooser.observe(0, 4, 1 if rows <= 2 else 3)
        holding, chosen = shape.draft, chosen + [shape]
    assert chooser.rest_steps == 0
    assert chosen[-50:] == [DraftShape(4, 4)] * 50


def test_chooser_does_not_rest_when_batch_size_is_why_drafting_loses():
    """Acceptance that pays at bs 1 but not at bs 64: probes lose at bs 64, yet the drafter
    keeps its state (it will pay once the batch shrinks)."""
    table = {
        (DraftShape(0, 0), 1): 1.0, (DraftShape(3, 3), 1): 1.1, (DraftShape(0, 3), 1): 1.1,
        (DraftShape(0, 0), 64): 2.0, (DraftShape(3, 3), 64): 8.0, (DraftShape(0, 3), 64): 2.2,
    }  # fmt: skip
    chooser = DraftLengthChooser(3, AUTO, StepCosts(table))
    requests = list(range(64))
    chosen = feed(chooser, requests, accepted=1, steps=400)
    assert sum(s == DraftShape(0, 3) for s in chosen) >= 3 and chooser.rest_steps == 0
    assert feed(chooser, [0], accepted=1, steps=30)[-5:] == [DraftShape(3, 3)] * 5


def test_cold_requests_count_as_accepting_nothing_and_teach_nothing():
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.3))
    for _ in range(6):
        chooser.observe(0, 3, 3)
        chooser.observe(1, 3, 3)
    before = chooser.batch.expected_tokens()
    chooser.mark_cold([1])
    assert chooser.expected_tokens([1]) == 1.0 < chooser.expected_tokens([0])
    chooser.observe(1, 3, 0)  # a lagging drafter's miss says nothing about the drafter
    assert chooser.batch.expected_tokens() == before
    assert not chooser._any_warm([1]) and chooser._any_warm([0, 1])
    chooser.mark_warm(1)  # its context starts again (re-admitted after a preemption)
    assert chooser.expected_tokens([1]) > 1.0
    chooser.mark_cold([1])
    chooser.forget(1)
    assert not chooser.cold


def test_chooser_returns_to_drafting_when_acceptance_recovers():
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.3))
    chooser.REST_AFTER = 100  # no rest (a rest delays the return: the test above)
    feed(chooser, [0], accepted=0, steps=40)
    later = feed(chooser, [0], accepted=3, steps=80)
    assert later[-20:] == [DraftShape(3, 3)] * 20


def test_chooser_weighs_batch_size_through_the_cost_table():
    # verify is cheap at bs 1 and expensive at bs 64 (the measured H200 shape of the problem)
    table = {
        (DraftShape(0, 0), 1): 1.0, (DraftShape(3, 3), 1): 1.1, (DraftShape(0, 3), 1): 1.1,
        (DraftShape(0, 0), 64): 2.0, (DraftShape(3, 3), 64): 5.0, (DraftShape(0, 3), 64): 2.2,
    }  # fmt: skip
    chooser = DraftLengthChooser(3, AUTO, StepCosts(table))
    for index in range(64):
        for _ in range(5):
            chooser.observe(index, 3, 1)  # about 2 tokens per verify step
    assert chooser.prefers_drafting([0], 1)
    assert not chooser.prefers_drafting(list(range(64)), 64)


def test_chooser_uses_each_requests_own_acceptance():
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.5))
    for _ in range(12):  # the batch's rates count as OWN_PRIOR rows of each request's own
        chooser.observe(0, 3, 3)  # request 0 accepts everything
        chooser.observe(1, 3, 0)  # request 1 nothing
    assert chooser.expected_tokens([0]) > 3.0 > 1.5 > chooser.expected_tokens([1])
    assert chooser.prefers_drafting([0], 1) and not chooser.prefers_drafting([1], 1)


def test_a_batch_of_other_requests_is_decided_afresh():
    """The decision is kept while nothing was learnt, but only for the same requests: one
    request replaced by another of its own (lower) acceptance at the same size and with no new
    verify row is compared again."""
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.5))
    for _ in range(12):
        chooser.observe(0, 3, 3)
        chooser.observe(1, 3, 0)
    assert chooser.choose([1], 1) == 0
    assert chooser.choose([0], 1) == 3
    assert chooser.choose([1], 1) == 3  # drafting: a first lost comparison goes on (STOP_AFTER)
    chooser.observe(1, 3, 0)
    assert chooser.choose([1], 1) == 0  # the second, on a new row, stops it


def test_a_dip_of_two_rejected_rows_keeps_drafting_and_a_collapse_stops_it():
    """One request's acceptance swings from row to row: two rows accepting nothing inside a
    long run of full acceptance keep a bs-1 step drafting (the estimate remembers ~10 rows),
    while acceptance that stays at nothing turns it plain within ten rows."""
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 2.5))  # drafting needs > 3 tokens a row
    for i in range(40):
        chooser.observe(0, 3, 2 if i % 5 == 0 else 3)
    assert chooser.prefers_drafting([0], 1)
    chooser.observe(0, 3, 0)
    chooser.observe(0, 3, 0)
    assert chooser.prefers_drafting([0], 1)
    for _ in range(8):
        chooser.observe(0, 3, 0)
    assert not chooser.prefers_drafting([0], 1)


def test_a_new_estimate_follows_its_first_rows():
    """The starting rates count as one row of the batch's estimate: a drafter that accepts
    everything is believed after a few rows, not after the ~10 of the estimate's memory."""
    estimate = AcceptanceEstimate(3)
    for _ in range(3):
        estimate.observe(3, 3)
    assert estimate.expected_tokens() > 3.0  # the prior (0.5 a position) gave 1.875
    assert estimate.rates[0] == pytest.approx(1 - 0.5 / 4)


def test_observed_step_cycles_refine_the_start_up_table():
    plain, spec = DraftShape(0, 0), DraftShape(3, 3)
    costs = StepCosts({(plain, 8): 1.0, (spec, 8): 1.5, (plain, 16): 2.0, (spec, 16): 3.0})
    costs.observe(plain, 8, 1.4)
    assert costs(plain, 8) == 1.0  # one cycle is not enough
    costs.observe(plain, 8, 1.4)
    assert costs(plain, 5) == pytest.approx(1.4)  # padded to 8: the observed mean
    assert costs(spec, 8) == pytest.approx(1.9)  # the table plus the host share seen for plain
    assert costs(spec, 16) == 3.0 and costs(plain, 32) == 4.0  # other sizes keep the table
    costs.observe(spec, 8, 4.0)
    costs.observe(spec, 8, 4.0)
    assert costs(spec, 8) == pytest.approx(4.0)  # its own cycles once seen
    version = costs.version
    costs.observe(plain, 64, 9.0)  # past the largest size: not a cycle of any measured size
    assert costs.version == version and costs(plain, 64) == 8.0


def test_chooser_goes_plain_when_observed_steps_cost_more_than_their_replays():
    """The replays say drafting pays (two tokens per verify row for 1.3x a plain step), but
    the steps as run cost 3x (host work per emitted token): plain checks measure the plain
    step, and the chooser stops drafting."""
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.3, sizes=(8,)))
    chooser.costs.learns = True
    chooser.REST_AFTER = 10**6
    real = {DraftShape(0, 0): 1.0, DraftShape(3, 3): 3.0, DraftShape(0, 3): 3.0}
    requests = list(range(8))
    chosen = feed(chooser, requests, accepted=1, steps=400, real=real)
    assert chosen[1] == DraftShape(3, 3)  # drafting first, as the replays say
    assert sum(s == DraftShape(0, 0) for s in chosen[-200:]) > 190


def test_plain_checks_are_rare_while_drafting_really_wins():
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.3, sizes=(8,)))
    chooser.costs.learns = True
    real = {DraftShape(0, 0): 1.2, DraftShape(3, 3): 1.3 * 1.2, DraftShape(0, 3): 1.3 * 1.2}
    chosen = feed(chooser, list(range(8)), accepted=3, steps=3000, real=real)
    plain = [i for i, s in enumerate(chosen) if s == DraftShape(0, 0)]
    assert 4 <= len(plain) <= 30  # pairs of checks after 32, 64, ... 1024 drafting steps
    assert sum(s == DraftShape(3, 3) for s in chosen) > 0.97 * len(chosen)


def test_a_borrowed_host_share_shrinks_for_plain_steps_and_never_grows():
    """An unobserved shape's cost borrows the host share seen for another at that size: scaled
    down to the tokens a plain row emits (1 of a (3, 3) row's 4), never scaled up, so a drafting
    step never looks dearer than its replay plus the whole share (it would then never be tried,
    and never observed)."""
    plain, spec = DraftShape(0, 0), DraftShape(3, 3)
    costs = StepCosts({(plain, 8): 1.0, (spec, 8): 1.5, (plain, 16): 2.0, (spec, 16): 3.0})
    for _ in range(2):
        costs.observe(spec, 8, 2.3)  # (3, 3) at 8: a 0.8 host share
        costs.observe(plain, 16, 2.4)  # plain at 16: a 0.4 host share
    assert costs(plain, 8) == pytest.approx(1.0 + 0.8 / 4)
    assert costs(spec, 16) == pytest.approx(3.0 + 0.4)


def test_plain_checks_stay_rare_across_plain_stretches():
    """A plain stretch (here: the estimate dips below the margin for two steps in every 50, the
    second of which goes plain, see STOP_AFTER) does not start the checks' interval again: over
    3000 steps the checks stay a few (before, each dip brought one back after 32 drafting
    steps)."""
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.3, sizes=(8,)))
    chooser.costs.learns = True
    assert chooser.STOP_AFTER == 2
    dips = iter(i % 50 >= 48 for i in range(10**6))
    chooser.prefers_drafting = lambda indices, bs, margin=None: not next(dips)
    chosen = []
    for _ in range(3000):
        chooser.batch.samples += 1  # something learnt every step: each step compares anew
        chosen.append(chooser.choose(list(range(8)), 8))
    checks = chosen.count(0) - 3000 // 50  # plain steps not from a dip
    assert 0 < checks <= chooser.CHECK_STEPS * 8  # after 32, 64, ... drafting steps


def test_each_padded_size_gets_its_own_plain_checks():
    """Drafting that reaches a new size checks the plain step there after FIRST_CHECK drafting
    steps, however long the interval at another size has grown (its plain cost is otherwise
    the replay plus a host share lent by the drafting shape)."""
    chooser = DraftLengthChooser(3, AUTO, costs(1.0, 1.3, sizes=(1, 8)))
    chooser.costs.learns = True
    chooser.prefers_drafting = lambda indices, bs, margin=None: True
    at_one = [chooser.choose([0], 1) for _ in range(2000)]
    assert at_one.count(0) <= chooser.CHECK_STEPS * 7 and chooser.check_intervals[1] >= 1024
    chooser.draft_streak = 0  # as right after a check at size 1
    at_eight = [chooser.choose(list(range(8)), 8) for _ in range(chooser.FIRST_CHECK + 3)]
    assert at_eight.count(0) == chooser.CHECK_STEPS  # the first check at size 8, soon
    assert chooser.check_intervals[8] == 2 * chooser.FIRST_CHECK


def test_a_step_that_holds_drafts_keeps_drafting_above_the_lower_margin():
    """At one row, between ONE_ROW_STAY_MARGIN and MARGIN the last decision stays: drafting goes
    on (going plain drops the drafts and a (0, k) step must start again), plain stays plain; at
    two rows STAY_MARGIN (by default MARGIN) holds nothing."""
    costs = StepCosts({(DraftShape(3, 3), 1): 2.0, (DraftShape(0, 0), 1): 1.0})
    chooser = DraftLengthChooser(3, AUTO, costs)
    assert 1.0 < chooser.ONE_ROW_STAY_MARGIN < chooser.MARGIN
    chooser.STOP_AFTER = 1  # one lost comparison stops drafting (the margin alone decides)
    between = (chooser.ONE_ROW_STAY_MARGIN + chooser.MARGIN) / 2
    chooser.batch.expected = 2.0 * between  # gain `between` over plain steps
    assert chooser.choose([0], 1) == 0  # plain: not enough to start
    chooser.batch.expected = 2.0 * 1.1 * chooser.MARGIN
    chooser.batch.samples += 1
    assert chooser.choose([0], 1) == 3  # drafting
    chooser.batch.expected = 2.0 * between
    chooser.batch.samples += 1
    assert chooser.choose([0], 1) == 3  # drafting goes on
    chooser.batch.expected = 2.0 * 0.95 * chooser.ONE_ROW_STAY_MARGIN
    chooser.batch.samples += 1
    assert chooser.choose([0], 1) == 0  # below the lower margin: plain
    # two rows: the same gain between the margins stops drafting
    assert chooser.STAY_MARGIN == chooser.MARGIN
    two = StepCosts({(DraftShape(3, 3), 2): 2.0, (DraftShape(0, 0), 2): 1.0})
    chooser = DraftLengthChooser(3, AUTO, two)
    chooser.STOP_AFTER = 1
    chooser.batch.expected = 2.0 * 1.1 * chooser.MARGIN
    chooser.batch.samples += 1
    assert chooser.choose([0, 1], 2) == 3
    chooser.batch.expected = 2.0 * between
    chooser.batch.samples += 1
    assert chooser.choose([0, 1], 2) == 0


def test_drafting_stops_only_after_two_lost_comparisons_in_a_row():
    """A one-row dip of the estimate (one comparison lost on new figures) keeps a drafting
    step drafting; a second lost comparison in a row stops it, a won one in between starts the
    count again; a plain step is not held plain by it (one win starts drafting)."""
    costs = StepCosts({(DraftShape(3, 3), 1): 2.0, (DraftShape(0, 0), 1): 1.0})
    chooser = DraftLengthChooser(3, AUTO, costs)
    assert chooser.STOP_AFTER == 2
    win, lose = 2.0 * 1.1 * chooser.MARGIN, 2.0 * 0.9 * chooser.MARGIN

    def decide(expected):
        chooser.batch.expected = expected
        chooser.batch.samples += 1  # a verify row read back: new figures
        return chooser.choose([0], 1)

    assert decide(lose) == 0  # plain stays plain
    assert decide(win) == 3  # one win starts drafting
    assert decide(lose) == 3  # one lost comparison: drafting goes on
    assert chooser.choose([0], 1) == 3  # no new figures: the same decision
    assert decide(win) == 3
    assert decide(lose) == 3  # the count started again
    assert decide(lose) == 0  # two in a row: plain
    assert decide(lose) == 0


def test_with_overlap_a_cycle_counts_only_between_two_launches_of_one_shape(monkeypatch):
    """The time between two step starts holds one launch and, with overlap, the previous
    step's read-back: the plain step launched right after a drafting one waited for it, so its
    cycle is not the plain step's and is not counted; steady runs are."""
    import types

    import speculant.executor.engine as engine_module

    engine = Engine(TARGET, **ENGINE, **DRAFTERS["eagle3"], speculation=AUTO)
    costs, spec, plain = engine.chooser.costs, DraftShape(3, 3), DraftShape(0, 0)
    now = [0.0]
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    engine._cycle = None
    # step starts at these times, each launching one decode step of this shape (bs 1)
    steps = [(0, spec), (5, spec), (10, plain), (15, plain), (16, plain), (17, None)]
    for start, launched in steps:
        now[0] = float(start)
        engine._observe_cycle()
        engine._cycle = None if launched is None else (launched, 1)
    size = costs._size(plain, 1)[0]
    if costs.STEADY == 2:
        assert list(costs.cycles[(spec, size)]) == [5.0]
        assert list(costs.cycles[(plain, size)]) == [1.0, 1.0]  # not the 5 s it waited for spec
    else:  # STEADY steps in a row before one counts
        assert (spec, size) not in costs.cycles
        assert list(costs.cycles[(plain, size)]) == [1.0][: 4 - costs.STEADY]


def test_a_cycle_counts_only_after_steady_steps_in_a_row(monkeypatch):
    """With StepCosts.STEADY = 3 the second step after a change of shape does not count
    either (it may still wait on the steps before the change)."""
    import types

    import speculant.executor.engine as engine_module

    engine = Engine(TARGET, **ENGINE, **DRAFTERS["eagle3"], speculation=AUTO)
    costs, spec, plain = engine.chooser.costs, DraftShape(3, 3), DraftShape(0, 0)
    costs.STEADY = 3
    now = [0.0]
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    engine._cycle = None
    steps = [(0, spec), (5, spec), (6, spec), (8, plain), (12, plain), (13.5, plain), (14, plain),
             (15, None)]  # fmt: skip
    for start, launched in steps:
        now[0] = float(start)
        engine._observe_cycle()
        engine._cycle = None if launched is None else (launched, 1)
    size = costs._size(plain, 1)[0]
    assert list(costs.cycles[(spec, size)]) == [2.0]  # the third spec step's: 6 -> 8
    assert list(costs.cycles[(plain, size)]) == [0.5, 1.0]  # not 4 (8 -> 12) nor 1.5


def test_one_rank_engine_learns_its_step_cycles(plain, prompts):
    engine = Engine(TARGET, **ENGINE, **DRAFTERS["eagle3"], speculation=AUTO)
    assert engine.chooser.costs.learns  # one rank (several keep the shared table)
    ours = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    seen = engine.chooser.costs.seen
    assert seen and all(median > 0 for median in seen.values())


def test_step_costs_pad_up_and_extrapolate_and_average_over_ranks():
    shape = DraftShape(0, 0)
    table = StepCosts({(shape, 8): 2.0, (shape, 16): 3.0})
    assert table(shape, 1) == 2.0 and table(shape, 9) == 3.0 and table(shape, 32) == 6.0
    both = StepCosts.averaged([{(shape, 8): 1.0}, {(shape, 8): 3.0}])
    assert both(shape, 8) == 2.0


def test_shapes_and_step_shape():
    assert shapes_for(0, AUTO) == [DraftShape(0, 0)]
    assert shapes_for(3, FIXED) == [DraftShape(3, 3)]
    assert set(shapes_for(3, AUTO)) == {DraftShape(3, 3), DraftShape(0, 3), DraftShape(0, 0)}
    assert step_shape(3, 3, 3) == DraftShape(3, 3)
    assert step_shape(3, 0, 3) == DraftShape(0, 3)  # nothing held: draft, verify nothing
    assert step_shape(0, 3, 3) == DraftShape(0, 0)  # held drafts are dropped


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_gpu_graphs_of_every_shape_replay_and_switching_equals_plain(drafter):
    """With CUDA graphs (all three shapes captured), forced switching and auto both equal plain
    greedy, every decode step replays a graph, and seeded sampling repeats itself."""
    options = dict(device="cuda", dtype="float32", max_num_seqs=16, max_model_len=256)
    plain = Engine(TARGET, **options)
    prompts = prompts_of((5, 23, 1, 40, 12, 7, 30, 2), seed=8, vocab=plain.model_config.vocab_size)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    forced = Engine(TARGET, **options, **DRAFTERS[drafter], speculation=AUTO)
    defers = forced.runner.catch_up is not None  # one catch-up graph per size
    # three shapes and a resting plain graph per variant and size, the catch-up's per size
    variants = len(VARIANTS)
    assert len(forced.graphs.graphs) == (4 * variants + defers) * len(forced.graphs.sizes)
    forced.chooser = ForcedChooser(forced.chooser.k, None, seed=1)
    assert [o.token_ids for o in forced.generate(prompts, GREEDY)] == expected
    assert forced.graphs.num_replays > 0
    forced.chooser = ForcedChooser(forced.chooser.k, REST_PATTERN)  # rests replay their graph
    replays = forced.graphs.num_replays
    assert [o.token_ids for o in forced.generate(prompts, GREEDY)] == expected
    assert forced.graphs.num_rest_steps > 0 and forced.graphs.num_replays > replays
    assert forced.graphs.num_stand_ins == 0
    forced.chooser = ForcedChooser(forced.chooser.k, [0] * 11 + [3, 3])  # catch-ups by depth
    assert [o.token_ids for o in forced.generate(prompts, GREEDY)] == expected
    assert forced.graphs.num_catch_up_replays > 0 or not defers
    auto = Engine(TARGET, **options, **DRAFTERS[drafter], speculation=AUTO)
    assert [o.token_ids for o in auto.generate(prompts, GREEDY)] == expected
    sampled = [SamplingParams(max_new_tokens=24, temperature=0.8, seed=i, ignore_eos=True)
               for i in range(len(prompts))]  # fmt: skip
    runs = []
    for _ in range(2):
        forced.chooser = ForcedChooser(forced.chooser.k, [3, 3, 0])
        runs.append([o.token_ids for o in forced.generate(prompts, sampled)])
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_gpu_match_verify_in_graphs_gives_the_plain_seeded_output(drafter):
    """`sampled_verify="match"` baked into the graphs: seeded sampled output of fixed and of
    forced switching equals the plain engine's on the GPU (float32), drafts being accepted."""
    options = dict(device="cuda", dtype="float32", max_num_seqs=16, max_model_len=256)
    plain = Engine(TARGET, **options)
    prompts = prompts_of((5, 23, 1, 40, 12, 7, 30, 2), seed=8, vocab=plain.model_config.vocab_size)
    params = seeded_params(len(prompts))
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    fixed = Engine(TARGET, **options, **DRAFTERS[drafter], sampled_verify="match")
    out = fixed.generate(prompts, params)
    assert [o.token_ids for o in out] == expected and fixed.graphs.num_replays > 0
    assert sum(len(o.token_ids) - 1 for o in out) > 1.2 * sum(
        o.stats["num_verify_steps"] for o in out
    )
    forced = Engine(TARGET, **options, **DRAFTERS[drafter], speculation=AUTO,
                    sampled_verify="match")  # fmt: skip
    forced.chooser = ForcedChooser(forced.chooser.k, None, seed=2)
    assert [o.token_ids for o in forced.generate(prompts, params)] == expected


def test_moe_dp_ranks_agree_on_the_fewest_drafts():
    """Under DP with a MoE target every rank runs one shape: the fewest drafts any busy rank
    chose, and its forwards are sized with that shape's tokens per row."""
    from speculant.comm.groups import ParallelContext
    from speculant.config import GraphConfig
    from speculant.executor.dp import DECODE, IDLE, DPCoordinator
    from speculant.executor.step_plan import StepPlan

    class Graphs:
        sizes, cfg = [1, 2, 4], GraphConfig()

        def padded_bs(self, bs):
            return next(s for s in self.sizes if s >= bs)

    # rank 0 decodes 3 rows and drafts; rank 1 decodes 2 rows and chose none; rank 2 is idle
    exchanged = [
        [DECODE, 0, 3, 3, 1, 3, 3],
        [DECODE, 0, 2, 2, 1, 0, 0],
        [IDLE, 0, 0, 0, 0, 3, 3],
    ]
    plans = []
    for dp_rank, (mode, _, rows, *_rest) in enumerate(exchanged):
        pctx = ParallelContext(tp_size=1, dp_size=3, dp_rank=dp_rank)
        pctx.all_gather_dp = lambda row: [list(r) for r in exchanged]
        own = DraftShape(*exchanged[dp_rank][5:])
        plan = StepPlan(decode=[object()] * rows, tokens_per_req=own.tokens_per_req, shape=own)
        plans.append(DPCoordinator(pctx, Graphs(), 4, True).agree(plan, mode != IDLE))
    assert all(p.shape == DraftShape(0, 0) and p.tokens_per_req == 1 for p in plans)
    assert all(p.padded_bs == 4 and p.use_graph for p in plans)
    assert all(p.sizes.tokens_per_rank == [4, 4, 4] for p in plans)  # 4 rows x 1 token


@pytest.mark.needs("triton")
def test_catch_up_record_kernel_equals_its_reference():
    """The one-kernel record (Triton, interpreted on the CPU) writes what the torch ops do:
    entries at min(count, depth - 1), features from several parts, counts of live rows only
    (the sentinel, repeated by padding, stays at 0)."""
    from speculant.kernels.catch_up import record
    from speculant.kernels.reference import record_catch_up

    gen = torch.Generator().manual_seed(0)
    R, depth, sentinel = 6, 3, 5
    rows = torch.tensor([2, 0, 4, sentinel, sentinel])
    ids = torch.randint(0, 100, (5,), generator=gen)
    parts = [torch.randn(5, w, generator=gen) for w in (7, 5, 1300)]
    states = []
    for fn in (record, record_catch_up):
        buf_ids = torch.zeros(R, depth, dtype=torch.int64)
        buf = torch.zeros(R, depth, sum(p.shape[1] for p in parts))
        count = torch.tensor([0, 2, 3, 0, 1, 0])  # row 2 is full: its last entry is rewritten
        for step in range(2):
            fn(rows, ids + step, parts, buf_ids, buf, count, sentinel)
        states.append((buf_ids, buf, count))
    (ki, kb, kc), (ri, rb, rc) = states
    assert torch.equal(kc, rc) and kc.tolist() == [2, 2, 5, 0, 3, 0]
    assert torch.equal(ki[:sentinel], ri[:sentinel]) and torch.equal(kb[:sentinel], rb[:sentinel])
    assert torch.equal(kb[4, 1], torch.cat([p[2] for p in parts]))


COMPILE_RECORD_KERNEL = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from speculant.kernels.catch_up import _record_kernel

sig = {"rows_ptr": "*i64", "ids_ptr": "*i64", **{f"s{i}": "*bf16" for i in range(4)},
       **{f"stride{i}": "i32" for i in range(4)}, **{f"W{i}": "constexpr" for i in range(4)},
       "buf_ids_ptr": "*i64", "buf_ptr": "*bf16", "count_ptr": "*i64", "sentinel": "i32",
       **dict.fromkeys(("DEPTH", "WIDTH", "HAS_IDS", "NUM_SOURCES", "BLOCK"), "constexpr")}
for parts, has_ids in ((3, True), (2, False), (0, True), (4, False)):
    widths = [4096] * parts + [0] * (4 - parts)
    constants = {**{f"W{i}": w for i, w in enumerate(widths)}, "DEPTH": 8,
                 "WIDTH": sum(widths), "HAS_IDS": has_ids, "NUM_SOURCES": parts, "BLOCK": 1024}
    source = ASTSource(fn=_record_kernel, signature=sig, constexprs=constants)
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
print("compiled")
"""


@pytest.mark.needs("triton")
def test_catch_up_record_kernel_compiles_for_sm90():
    """The interpreter accepts code compiled Triton refuses (a reassigned constexpr did reach a
    GPU): compile the record kernel for sm_90 without a GPU, for each drafter's layout of
    feature parts (in a process without TRITON_INTERPRET, which the test session sets)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_RECORD_KERNEL], env=env, timeout=240,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]
