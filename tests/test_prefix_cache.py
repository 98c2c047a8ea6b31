"""Prefix caching (`enable_prefix_caching`, `--enable-prefix-caching`; executor/prefix_cache.py):
pages of a prefilled context reused by later requests that start the same.

Checked: the page keys (whole pages ending before the context's last token, the token after a
page in its key, whole keys compared); the free set (never-cached pages first, cached ones
least-recently-freed first, forgotten when taken); greedy output with the cache equal to output
without it for plain decoding and every drafter, the drafters' acceptance equal too (their cached
K/V are exactly what the request would compute), with repeated and nested prompts, chunked
prefill, preemption (a resumed request takes its own pages back), adaptive speculation and no
overlap; every page returned after a run; `load_weights` forgets the cache; the CLI flag, and
`--dp 2` / `--tp 2` runs equal to one process."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import helpers_ckpt
import pytest
import torch

import speculant
from speculant import Engine, SamplingParams
from speculant.executor.kv_cache import PagedKVCache
from speculant.executor.prefix_cache import FreePages, PrefixCache
from speculant.launch import cli

PS = 4  # page size of the unit tests


def test_keys_cover_whole_pages_before_the_last_token():
    cache = PrefixCache(PS)
    context = list(range(100, 113))  # 13 tokens: pages end at 4, 8, 12 (12 <= 13 - 1)
    assert [k[1] for k in cache._keys(context, len(context))] == [
        tuple(context[0:4]), tuple(context[4:8]), tuple(context[8:12])]  # fmt: skip
    assert [k[2] for k in cache._keys(context, len(context))] == [104, 108, 112]
    assert len(list(cache._keys(context[:12], 12))) == 2  # 12 tokens: the last page is not shared
    assert len(list(cache._keys(context, 7))) == 1  # computed up to 7: one whole page


def test_match_and_register():
    cache = PrefixCache(PS)
    a = list(range(1, 14))
    cache.register([11, 12, 13, 14], a, computed=len(a))
    assert cache.match(a) == [11, 12, 13]
    assert cache.match(a[:9] + [99] * 4) == [11, 12]  # the token after page 2 differs
    assert cache.match(a[:8] + [99] + a[9:]) == [11]  # page 2 itself differs
    assert cache.match([0] + a[1:]) == []
    other = PrefixCache(PS)  # equal hashes of other tokens never match: keys compare whole
    other.page_of[(b"", (5, 6, 7, 8), 9)] = 40
    assert other.match([1, 2, 3, 4, 9]) == []
    cache.register([21, 22], a, computed=len(a))  # the same content in other pages: kept as is
    assert cache.match(a) == [11, 12, 13] and 21 not in cache.key_of
    cache.forget(12)
    assert cache.match(a) == [11]
    cache.clear()
    assert cache.match(a) == [] and not cache.key_of


def test_a_chain_is_given_back_from_its_end():
    """Under pressure the cached pages of a freed row go out last page first, so the start of
    its context still matches (evicting its first page would strand the rest)."""
    kv = PagedKVCache(1, 5, PS, 1, 2, torch.float32, "cpu", 2, 8, prefix_caching=True)
    context = list(range(100, 117))  # 17 tokens: 4 whole pages before the last token
    row = kv.allocate_row()
    assert kv.grow(row, 16)  # the 4 pages (the last token need not be computed here)
    kv.prefix.register(kv.pages_of_row[row], context, 16)
    chain = list(kv.pages_of_row[row])
    kv.free(row)
    other = kv.allocate_row()
    assert kv.grow(other, 1) and kv.pages_of_row[other] == [chain[-1]]
    assert kv.prefix.match(context) == chain[:3]


def test_free_pages_take_plain_pages_first_then_the_least_recently_freed():
    free = FreePages([3, 2, 1])
    for page in (7, 5, 6):
        free.give(page, cached=True)
    assert len(free) == 6 and sorted(free) == [1, 2, 3, 5, 6, 7]
    assert [free.take() for _ in range(3)] == [(1, False), (2, False), (3, False)]
    assert free.claim(5) and not free.claim(5)
    assert [free.take() for _ in range(2)] == [(7, True), (6, True)]


# ------------------------------------------------------------------ the engine

HEADER = (
    "# Copyright 2024 The Authors. All rights reserved.\n# Licensed under the Apache License, "
    "Version 2.0.\n\nimport os\nimport sys\nimport json\n\n"
)
BODIES = [
    "def fibonacci(n):", "class Cache:\n    def __init__(self):", "def main():\n    args",
    "import re\nPATTERN = re.compile(", "def load(path):\n    with open(path) as f:",
]  # fmt: skip


def prompts(rng: random.Random) -> list:
    """Shared headers of several lengths, repeated prompts, prompts that are others' prefixes,
    and token-id prompts that share pages exactly."""
    out = [HEADER + b for b in BODIES]
    out += [HEADER[: rng.randrange(20, len(HEADER))] + b for b in BODIES[:3]]
    out += [out[0], out[0][:40], out[2] + "\n    return 0"]
    ids = [rng.randrange(3, 500) for _ in range(48)]
    out += [ids, ids[:33], ids[:16] + [7] + ids[17:], ids + [9, 9, 9]]
    return out


def run(engine: Engine, batch: list, params: SamplingParams) -> list:
    return engine.generate(batch, params)


def assert_pool_whole(engine: Engine) -> None:
    kv = engine.kv
    assert len(kv.free_pages) == kv.num_pages - 1 and not kv.holders and not kv.pages_of_row


def equal_with_and_without_the_cache(batch: list, params: SamplingParams, **options) -> Engine:
    """Two runs of an engine with the cache (cold, then warm) equal one without it; the engine."""
    expected = run(Engine(speculant.bundled("target"), **options), batch, params)
    cached = Engine(speculant.bundled("target"), enable_prefix_caching=True, **options)
    for _ in range(2):
        outs = run(cached, batch, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
        assert_pool_whole(cached)
    assert cached.stats()["prefix_cache_hit_tokens"] > 0
    return cached


DRAFTERS = [(None, None), ("eagle3", "eagle3"), ("dflash", "dflash"), ("draft-model", "draft_lm")]


@pytest.mark.parametrize("algo, draft", DRAFTERS)
def test_greedy_output_and_acceptance_equal_without_the_cache(algo, draft):
    rng = random.Random(0)
    batch = prompts(rng)
    spec = {} if algo is None else {"algo": algo, "draft": speculant.bundled(draft)}
    common = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=96, **spec)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = Engine(speculant.bundled("target"), **common)
    cached = Engine(speculant.bundled("target"), enable_prefix_caching=True, **common)
    expected = run(plain, batch, params)
    for _ in range(2):  # cold (requests admitted later hit earlier ones' pages), then warm
        outs = run(cached, batch, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
        assert [o.stats["accept_len"] for o in outs] == [o.stats["accept_len"] for o in expected]
        assert_pool_whole(cached)
    hits = [o.stats["num_cached_tokens"] for o in outs]
    assert all(h % 16 == 0 and h < len(o.prompt_token_ids) for h, o in zip(hits, outs, strict=True))
    assert sum(hits) > 0.5 * sum(len(o.prompt_token_ids) for o in outs)
    stats = cached.stats()
    assert 0 < stats["prefix_cache_hit_rate"] < 1 and stats["prefix_cache_hit_tokens"] > 0
    assert "prefix_cache_hit_tokens" not in plain.stats()
    assert plain.stats()["prefill_tokens"] > stats["prefill_tokens"] / 2 * 1.5


@pytest.mark.parametrize(
    "options",
    [
        {"algo": "eagle3", "speculation": "auto", "catch_up_depth": 2},
        {"algo": "dflash", "overlap": False, "page_size": 8},
        {"algo": "draft-model", "max_num_batched_tokens": 24, "page_size": 4},
    ],
    ids=["eagle3-auto", "dflash-no-overlap", "draft-model-chunked"],
)
def test_other_modes_equal_without_the_cache(options):
    rng = random.Random(1)
    batch = prompts(rng)
    draft = {"eagle3": "eagle3", "dflash": "dflash", "draft-model": "draft_lm"}[options["algo"]]
    common = dict(device="cpu", max_num_seqs=3, draft=speculant.bundled(draft), **options)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    equal_with_and_without_the_cache(batch, params, **common)


def test_a_preempted_request_takes_its_own_pages_back():
    """A pool of about two requests' pages for four rows: requests are preempted and resumed;
    output equals a roomy run without the cache, and resumed requests find their pages."""
    batch = [HEADER + b + "\n" * 3 for b in BODIES[:4]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    roomy = Engine(speculant.bundled("target"), device="cpu", max_num_seqs=4)
    expected = run(roomy, batch, params)
    tight = Engine(speculant.bundled("target"), device="cpu", max_num_seqs=4, page_size=4,
                   num_pages=1 + 2 * 40, enable_prefix_caching=True)  # fmt: skip
    outs = run(tight, batch, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert tight.stats()["preemptions"] > 0
    resumed = [o for o in outs if o.stats["num_preemptions"]]
    assert resumed and any(o.stats["num_cached_tokens"] > 0 for o in resumed)
    assert_pool_whole(tight)


def test_load_weights_forgets_the_cache(llama_dir, tiny_tokenizer_dir, tmp_path):
    other = helpers_ckpt.save_hf_model(
        tmp_path / "other", "llama", seed=7, rope_scaling=helpers_ckpt.LLAMA3_ROPE,
        legacy_config=True, tokenizer_dir=tiny_tokenizer_dir,
    )  # fmt: skip
    batch = [[5, 6, 7, 8] * 6 + [i] for i in range(3)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = Engine(str(llama_dir), device="cpu", max_num_seqs=2, enable_prefix_caching=True)
    before = run(engine, batch, params)
    run(engine, batch, params)
    assert engine.kv.prefix.key_of
    engine.load_weights(str(other))
    assert not engine.kv.prefix.key_of and not engine.kv.free_pages.cached
    check_pool(engine.kv)
    after = run(engine, batch, params)
    fresh = run(Engine(str(other), device="cpu", max_num_seqs=2), batch, params)
    assert [o.token_ids for o in after] == [o.token_ids for o in fresh]
    assert [o.token_ids for o in after] != [o.token_ids for o in before]


def test_cli_flag_one_process_dp_and_tp(tmp_path):
    rng = random.Random(2)
    lines = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}
             for p in prompts(rng)]  # fmt: skip
    file = tmp_path / "p.jsonl"
    file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    base = ["generate", "--device", "cpu", "--prompts", str(file), "--max-new-tokens", "8",
            "--ignore-eos", "--algo", "eagle3", "--max-num-seqs", "4"]  # fmt: skip
    assert cli.main([*base, "--output", str(tmp_path / "plain")]) == 0

    def read(name):
        outs = {json.loads(line)["index"]: json.loads(line) for line in open(tmp_path / name)}
        return [outs[i]["token_ids"] for i in range(len(lines))]

    expected = read("plain")
    assert cli.main([*base, "--enable-prefix-caching", "--output", str(tmp_path / "one")]) == 0
    assert read("one") == expected
    for flag in ("--dp", "--tp"):
        proc = subprocess.run(
            [sys.executable, "-m", "speculant", *base, "--enable-prefix-caching", flag, "2",
             "--output", str(tmp_path / flag), "--dist-timeout", "60"],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert read(flag) == expected, flag
        assert "prefix_cache_hit_tokens=" in proc.stderr


@pytest.mark.parametrize("algo, draft", DRAFTERS[1:])
def test_cached_pages_hold_the_kv_a_request_computes_itself(algo, draft):
    """Y, then X: the same first page, another token after it (an EAGLE-3 head's K/V at the
    page's last position is made from that token). The pages X then finds in the cache hold,
    for the target and the drafter, the K/V X computes alone in a fresh engine."""
    head = list(range(40, 72))  # two pages of 16
    x, y = head + [5, 6, 7, 8, 9], head[:16] + [300] + head[17:] + [5, 6, 7, 8, 9]

    def engine():
        return Engine(speculant.bundled("target"), device="cpu", max_num_seqs=2, algo=algo,
                      draft=speculant.bundled(draft), enable_prefix_caching=True)  # fmt: skip

    def pools(eng):
        drafter = eng.runner.drafter
        return [*eng.kv.k, *eng.kv.v, *drafter.k_pools, *drafter.v_pools]

    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    shared = engine()
    run(shared, [y], params)
    run(shared, [x], params)
    alone = engine()
    run(alone, [x], params)
    mine, theirs = shared.kv.prefix.match(x), alone.kv.prefix.match(x)
    assert len(mine) == len(theirs) == 2
    for a, b in zip(pools(shared), pools(alone), strict=True):
        for page_a, page_b in zip(mine, theirs, strict=True):
            slots_a = slice(page_a * 16, page_a * 16 + 16)
            slots_b = slice(page_b * 16, page_b * 16 + 16)
            assert torch.equal(a[slots_a], b[slots_b])


def check_pool(kv) -> None:
    """Every page is free or held, never both; a held page's count is its rows'; a cached page's
    key leads back to it."""
    rows_of: dict[int, int] = {}
    for pages in kv.pages_of_row.values():
        for page in pages:
            rows_of[page] = rows_of.get(page, 0) + 1
    free = list(kv.free_pages)
    assert len(free) == len(set(free)) and not set(free) & set(rows_of)
    assert len(free) + len(rows_of) == kv.num_pages - 1
    assert {p: n for p, n in rows_of.items() if n > 1} == kv.holders
    assert all(kv.prefix.page_of[key] == page for page, key in kv.prefix.key_of.items())
    assert set(kv.free_pages.cached) <= set(kv.prefix.key_of)


@pytest.mark.parametrize("seed", range(4))
def test_shared_pages_under_pressure(seed):
    """Requests admitted while others that share their first pages still run (pages held by
    several rows), a pool small enough to preempt and to take cached pages back: output equals
    a roomy run without the cache, and the pool's books balance after every step."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 500) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    batch = [rng.choice(heads)[: rng.randrange(4, 41)] + [rng.randrange(3, 500)
             for _ in range(rng.randrange(1, 12))] for _ in range(14)]  # fmt: skip
    params = SamplingParams(max_new_tokens=rng.randrange(4, 20), ignore_eos=True)
    algo = rng.choice(DRAFTERS)
    spec = {} if algo[0] is None else {"algo": algo[0], "draft": speculant.bundled(algo[1])}
    expected = run(Engine(speculant.bundled("target"), device="cpu", max_num_seqs=8, **spec),
                   batch, params)  # fmt: skip
    k = 0 if algo[0] is None else 3 if algo[0] != "dflash" else 7
    longest = max(len(p) for p in batch) + params.max_new_tokens + 2 * (k + 1)
    engine = Engine(speculant.bundled("target"), device="cpu", max_num_seqs=3, page_size=4,
                    num_pages=1 + -(-int(1.6 * longest) // 4), max_num_batched_tokens=32,
                    enable_prefix_caching=True, **spec)  # fmt: skip
    step = engine.step

    def checked_step():
        finished = step()
        check_pool(engine.kv)
        return finished

    engine.step = checked_step
    outs = run(engine, batch, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert engine.kv.holders == {} and engine.stats()["prefix_cache_hit_tokens"] > 0
    check_pool(engine.kv)


@pytest.mark.parametrize("algo, draft", DRAFTERS[1:])
def test_cached_pages_are_never_written(algo, draft):
    """Adaptive speculation forced through drafting, plain and resting steps (a deferred
    catch-up writes the drafter's K/V of recorded plain steps later, into the row's pages), a
    pool that preempts: every cached page's target and drafter K/V stay as they were when it
    was registered, and output equals plain decoding."""
    from test_adaptive import ForcedChooser

    rng = random.Random(5)
    head = [rng.randrange(3, 500) for _ in range(48)]  # prompts of several 32-token chunks
    batch = [
        head[: rng.randrange(8, 49)] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 9))]
        for _ in range(12)
    ]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    expected = run(Engine(speculant.bundled("target"), device="cpu", max_num_seqs=8), batch, params)
    engine = Engine(speculant.bundled("target"), device="cpu", max_num_seqs=3, page_size=4,
                    num_pages=40, max_num_batched_tokens=32, algo=algo, catch_up_depth=3,
                    draft=speculant.bundled(draft), speculation="auto",
                    enable_prefix_caching=True)  # fmt: skip
    engine.chooser = ForcedChooser(engine.chooser.k, seed=1)
    drafter, kv = engine.runner.drafter, engine.kv
    pools = [*kv.k, *kv.v, *drafter.k_pools, *drafter.v_pools]
    seen: dict[tuple, list] = {}  # (page, key) -> the page's K/V when first seen cached
    cached_ever = set()
    step = engine.step

    def checked_step():
        finished = step()
        entries = set(kv.prefix.key_of.items())
        for entry in set(seen) - entries:  # forgotten: its page may hold anything now
            del seen[entry]
        for page, key in entries:
            now = [pool[page * 4 : page * 4 + 4].clone() for pool in pools]
            before = seen.setdefault((page, key), now)
            assert all(torch.equal(a, b) for a, b in zip(before, now, strict=True)), (page, key)
        cached_ever.update(entries)
        check_pool(kv)
        return finished

    contexts: dict[tuple, list[int]] = {}  # key -> a context it was registered from
    register = kv.prefix.register

    def recorded_register(pages, context, computed):
        register(pages, context, computed)
        for key in kv.prefix._keys(context, computed):
            contexts.setdefault(key, list(context))

    kv.prefix.register = recorded_register
    engine.step = checked_step
    settle, starts = engine._settle_catch_up, []

    def checked_settle(plan):  # a context that starts, after cached pages too, has no entries
        settle(plan)
        catch_up = engine.runner.catch_up
        for chunk in plan.chunks:
            if chunk.start == chunk.request.num_cached and catch_up is not None:
                starts.append(chunk.start)
                if not plan.rests:
                    assert int(catch_up.count[chunk.request.row]) == 0, chunk.request.index

    engine._settle_catch_up = checked_settle
    outs = run(engine, batch, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert engine.stats()["prefix_cache_hit_tokens"] > 0 and len(cached_ever) > 3
    assert engine.chooser.rest_steps > 0 and any(starts)  # some starts after cached pages
    # what is cached now is what the context computes alone (no cache used, drafting every
    # step): a page registered from a step that rested the drafter would hold no drafter K/V
    alone = Engine(speculant.bundled("target"), device="cpu", max_num_seqs=1, page_size=4,
                   num_pages=40, algo=algo, draft=speculant.bundled(draft),
                   enable_prefix_caching=True)  # fmt: skip
    drafter_pools = [*drafter.k_pools, *drafter.v_pools]
    for page, key in list(kv.prefix.key_of.items())[:12]:
        context = contexts[key]
        prefix = list(kv.prefix._keys(context, len(context)))
        upto = (prefix.index(key) + 1) * 4
        run(alone, [context[: upto + 1]], SamplingParams(max_new_tokens=1))
        theirs = alone.kv.prefix.match(context[: upto + 1])[-1]
        for mine_pool, their_pool in zip(
            drafter_pools,
            [*alone.runner.drafter.k_pools, *alone.runner.drafter.v_pools],
            strict=True,
        ):
            torch.testing.assert_close(mine_pool[page * 4 : page * 4 + 4],
                                       their_pool[theirs * 4 : theirs * 4 + 4])  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("algo, draft", [(None, None), ("eagle3", "eagle3"), ("dflash", "dflash")])
def test_prefix_caching_on_cuda(algo, draft):
    """On CUDA (graph replays, piecewise graphs of extend steps, the Triton backend), float32:
    output with the cache equals output without it; a page a request takes from the cache holds
    the K/V it computes alone."""
    spec = {} if algo is None else {"algo": algo, "draft": speculant.bundled(draft)}
    common = dict(device="cuda", dtype="float32", max_num_seqs=4, **spec)
    batch = prompts(random.Random(3))
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    cached = equal_with_and_without_the_cache(batch, params, **common)
    head = list(range(40, 72))
    x, y = head + [5, 6, 7], head[:16] + [300] + head[17:] + [5, 6, 7]
    run(cached, [y], params)
    run(cached, [x], params)
    alone = Engine(speculant.bundled("target"), enable_prefix_caching=True, **common)
    run(alone, [x], params)
    mine, theirs = cached.kv.prefix.match(x), alone.kv.prefix.match(x)

    def pools(e):
        drafter = [] if algo is None else [*e.runner.drafter.k_pools, *e.runner.drafter.v_pools]
        return [*e.kv.k, *e.kv.v, *drafter]

    for a, b in zip(pools(cached), pools(alone), strict=True):
        for page_a, page_b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a[page_a * 16 : page_a * 16 + 16],
                                       b[page_b * 16 : page_b * 16 + 16])  # fmt: skip


@pytest.mark.parametrize("caching", [True, False])
def test_an_interrupt_during_admission_leaves_the_pool_whole(caching):
    """Ctrl-C while a waiting request is being admitted (its row taken, cached pages attached,
    not yet running): the run stops, the pool is whole, the next run gives the same output."""
    engine = Engine(speculant.bundled("target"), device="cpu", max_num_seqs=2, page_size=4,
                    enable_prefix_caching=caching)  # fmt: skip
    batch = [[5, 6, 7, 8] * 5 + [i] for i in range(4)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    expected = [o.token_ids for o in run(engine, batch, params)]
    chunk, calls = engine.scheduler._chunk, []

    def interrupted(request, budget):
        calls.append(request.row)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return chunk(request, budget)

    engine.scheduler._chunk = interrupted
    with pytest.raises(KeyboardInterrupt):
        run(engine, batch, params)
    engine.scheduler._chunk = chunk
    assert calls[0] >= 0  # it held a row when stopped
    assert_pool_whole(engine)
    assert [o.token_ids for o in run(engine, batch, params)] == expected
    assert_pool_whole(engine)
