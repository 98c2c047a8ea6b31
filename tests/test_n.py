"""Several completions of one prompt (`SamplingParams.n`, `--n`, a --prompts line's "n"; vLLM's
n): each is its own request with its own seed (completion 0 keeps the prompt's, so n = 1 runs
are unchanged), outputs come n per prompt in a row (`sample_index` 0..n-1).

Checked: completion 0 equals the n = 1 run; sampled completions differ from each other and a
seeded call repeats exactly; greedy completions all equal plain greedy decoding, speculative or
not; `match` verification keeps plain sampling's completions for every drafter; a pool that
preempts, prefix caching and stop strings per completion; later completions take the prompt's
pages from completion 0 (the prompt prefilled once); the CLI (lines, printing, `--dp 2`) and
the refusals."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers_io import dp2_run, refused_in_one_line
from test_prefix_cache import assert_pool_whole

import speculant
from speculant import Engine, SamplingParams, SpeculantError
from speculant.launch import cli

TARGET = speculant.bundled("target")
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:"]
DRAFTERS = {
    "eagle3": {"algo": "eagle3", "draft": speculant.bundled("eagle3")},
    "dflash": {"algo": "dflash", "draft": speculant.bundled("dflash")},
    "draft-model": {"algo": "draft-model", "draft": speculant.bundled("draft_lm")},
}


def sampled(n: int, seed: int | None = None, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=20, n=n, temperature=1.0, seed=seed, ignore_eos=True,
                          **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def plain():
    return Engine(TARGET, device="cpu", num_draft_tokens=0)


def test_completions_come_n_per_prompt():
    """(Unseeded requests count on over an engine's calls: each comparison of calls runs them on
    engines of the same seed, each at its first call.)"""

    def fresh() -> Engine:
        return Engine(TARGET, device="cpu", num_draft_tokens=0)

    params = [sampled(3), sampled(1, seed=7), sampled(4, seed=9)]
    plain = fresh()
    outputs = plain.generate(PROMPTS, params)
    assert [o.key for o in outputs] == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1), (2, 2),
                                        (2, 3)]  # fmt: skip
    assert [o.n for o in outputs] == [3, 3, 3, 1, 4, 4, 4, 4]
    assert [o.to_json().get("sample_index") for o in outputs] == [0, 1, 2, None, 0, 1, 2, 3]
    singles = fresh().generate(PROMPTS, [sampled(1), sampled(1, seed=7), sampled(1, seed=9)])
    for single in singles:  # completion 0 is the n = 1 run: the same seed
        first = next(o for o in outputs if o.key == (single.index, 0))
        assert first.token_ids == single.token_ids
    for index in (0, 2):  # independent draws: no two completions of a prompt alike
        completions = [tuple(o.token_ids) for o in outputs if o.index == index]
        assert len(set(completions)) == len(completions)
        assert all(o.prompt_token_ids == outputs[0 if index == 0 else 4].prompt_token_ids
                   for o in outputs if o.index == index)  # fmt: skip
    again = fresh().generate(PROMPTS, params)  # a seeded call repeats exactly
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]
    seen = []
    plain.generate(PROMPTS[:1], sampled(3), on_output=seen.append)
    assert sorted(o.key for o in seen) == [(0, 0), (0, 1), (0, 2)]


@pytest.mark.parametrize("drafter", ["eagle3", "dflash", "draft-model"])
def test_speculative_completions_equal_plain(plain, drafter):
    """Greedy completions are all plain greedy decoding's; with `match`, every sampled
    completion is plain sampling's with the same (derived) seed."""
    greedy = SamplingParams(max_new_tokens=20, n=3, ignore_eos=True)
    engine = Engine(TARGET, device="cpu", sampled_verify="match", **DRAFTERS[drafter])
    base = plain.generate(PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
    outputs = engine.generate(PROMPTS, greedy)
    assert [o.token_ids for o in outputs] == [b.token_ids for b in base for _ in range(3)]
    params = [sampled(3, seed=s) for s in range(len(PROMPTS))]
    ours = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(PROMPTS, params)]


def test_completions_under_preemption_prefix_caching_and_stops(plain):
    """A pool too small for every completion at once (preemption), prefix caching (the
    completions share the prompt's pages) and stop strings, each completion its own."""
    params = [sampled(4, seed=s, stop=["\n"]) for s in range(len(PROMPTS))]
    expected = plain.generate(PROMPTS, params)
    assert any(o.finish_reason == "stop" for o in expected)
    for out in expected:
        assert "\n" not in out.text and (out.finish_reason == "stop") == (out.stop_reason == "\n")
    long = [SamplingParams(max_new_tokens=48, n=6, ignore_eos=True)]
    tight = Engine(TARGET, device="cpu", max_num_seqs=6, page_size=4, num_pages=40,
                   **DRAFTERS["eagle3"])  # fmt: skip
    outs = tight.generate(PROMPTS, long * len(PROMPTS))
    base = plain.generate(PROMPTS, SamplingParams(max_new_tokens=48, ignore_eos=True))
    assert [o.token_ids for o in outs] == [b.token_ids for b in base for _ in range(6)]
    assert tight.stats()["preemptions"] > 0
    # one row: the completions run one after another, each later one taking the prompt's
    # whole pages from the cache
    cached = Engine(TARGET, device="cpu", num_draft_tokens=0, enable_prefix_caching=True,
                    max_num_seqs=1, page_size=4)  # fmt: skip
    prompt = "# a prompt of several pages\n" * 4 + PROMPTS[0]
    outs = cached.generate([prompt], sampled(3, seed=1))
    alone = plain.generate([prompt], sampled(3, seed=1))
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    whole_pages = (len(outs[0].prompt_token_ids) - 1) // 4 * 4  # pages ending before its last
    assert cached.stats()["prefix_cache_hit_tokens"] >= 2 * whole_pages > 0


LONG = ["# a prompt of several pages\n" * 3 + prompt for prompt in PROMPTS]


@pytest.mark.parametrize("drafter", [None, "eagle3", "dflash", "draft-model"])
def test_later_completions_take_the_prompt_pages_of_completion_0(plain, drafter):
    """Without prefix caching the prompt is prefilled once, not n times: a later completion
    waits for completion 0's prefill and takes its whole pages; tokens unchanged (sampled with
    `match`: plain sampling's)."""
    kwargs = DRAFTERS[drafter] if drafter else {"num_draft_tokens": 0}
    engine = Engine(TARGET, device="cpu", page_size=4, sampled_verify="match", **kwargs)
    params = [sampled(4, seed=s) for s in range(len(LONG))]
    outs = engine.generate(LONG, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(LONG, params)]
    lengths = [len(o.prompt_token_ids) for o in outs[::4]]
    whole = [(n - 1) // 4 * 4 for n in lengths]  # positions in pages ending before the last
    stats = engine.stats()
    assert stats["shared_prompt_tokens"] == 3 * sum(whole) > 0
    once = sum(4 * n - 3 * w for n, w in zip(lengths, whole, strict=True))
    assert stats["prefill_tokens"] == once
    assert_pool_whole(engine)
    if drafter is None:  # a DP rank given completions 1..3 alone: 1 prefills for 2 and 3
        before = engine.stats()["shared_prompt_tokens"]
        share = engine.make_requests(LONG[:1], params[:1])[1:]
        assert [o.token_ids for o in engine.run(share)] == [o.token_ids for o in outs[1:4]]
        assert engine.stats()["shared_prompt_tokens"] - before == 2 * whole[0]


def greedy_completions_of_long(engine: Engine, plain: Engine, n: int, new: int) -> dict:
    """Checks that the engine's n greedy completions of each LONG prompt are all plain greedy
    decoding's and that every page came back; returns its stats."""
    outs = engine.generate(LONG, SamplingParams(max_new_tokens=new, n=n, ignore_eos=True))
    base = plain.generate(LONG, SamplingParams(max_new_tokens=new, ignore_eos=True))
    assert [o.token_ids for o in outs] == [b.token_ids for b in base for _ in range(n)]
    assert_pool_whole(engine)
    return engine.stats()


def test_prompt_prefilled_once_when_rows_are_scarce(plain):
    """Fewer rows than the completions waiting: a later completion whose completion 0 is still
    prefilling keeps a row rather than letting the next prompt take it (it then waited until
    completion 0 had ended and freed its pages, and prefilled the prompt again)."""
    engine = Engine(TARGET, device="cpu", page_size=4, max_num_seqs=2, num_draft_tokens=0)
    params = SamplingParams(max_new_tokens=2, n=2, ignore_eos=True)
    outs = engine.generate(LONG, params)
    base = plain.generate(LONG, SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert [o.token_ids for o in outs] == [b.token_ids for b in base for _ in range(2)]
    whole = [(len(o.prompt_token_ids) - 1) // 4 * 4 for o in outs[::2]]
    assert engine.stats()["shared_prompt_tokens"] == sum(whole) > 0
    assert_pool_whole(engine)


def test_prompt_prefilled_once_under_a_small_token_budget(plain):
    """A budget below the prompts' lengths and short outputs: later completions are admitted
    as soon as completion 0 has prefilled the prompt, not after the next prompt's prefill,
    by when completion 0 had ended and freed the pages (each prefilled the prompt again)."""
    engine = Engine(TARGET, device="cpu", page_size=4, max_num_batched_tokens=16,
                    num_draft_tokens=0)  # fmt: skip
    params = SamplingParams(max_new_tokens=2, n=4, ignore_eos=True)
    outs = engine.generate(LONG, params)
    base = plain.generate(LONG, SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert [o.token_ids for o in outs] == [b.token_ids for b in base for _ in range(4)]
    whole = [(len(o.prompt_token_ids) - 1) // 4 * 4 for o in outs[::4]]
    assert engine.stats()["shared_prompt_tokens"] == 3 * sum(whole) > 0
    assert_pool_whole(engine)


def test_completions_waiting_for_pages_leave_the_prompts_in_progress_the_budget(plain):
    """Completions ready to take completion 0's prompt pages were held the whole token budget
    even when the pool had no page for them: with every running request still prefilling,
    each step was empty and the job never ended. The prompts in progress now take the budget
    (preempting a later completion when they need its pages)."""
    engine = Engine(TARGET, device="cpu", num_draft_tokens=0, max_model_len=48, page_size=16,
                    num_pages=5, max_num_seqs=3, max_num_batched_tokens=2)  # fmt: skip
    prompt = [3 + i * 7 % 250 for i in range(47)]  # pool: one request's 4 pages
    params = SamplingParams(max_new_tokens=1, n=3, ignore_eos=True)
    requests = engine.make_requests([prompt], params)
    for request in requests:  # as Engine.run does, stepped here to bound the steps
        request.first_completion = None if request is requests[0] else requests[0]
        engine.scheduler.add(request)
    done = []
    for _ in range(500):  # 47 prompt tokens, 2 a step, 3 times at most: about 80 steps
        done += engine.step()
        if not engine.scheduler.has_unfinished():
            break
    assert not engine.scheduler.has_unfinished(), "no step made progress"
    expected = plain.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))
    assert [r.output_ids for r in done] == [expected[0].token_ids] * 3
    assert_pool_whole(engine)


def test_completions_sharing_pages_under_preemption(plain):
    """A pool that preempts completion 0 and later ones while they share the prompt's pages:
    every page comes back, the tokens are plain greedy decoding's."""
    tight = Engine(TARGET, device="cpu", max_num_seqs=4, page_size=4, num_pages=48,
                   **DRAFTERS["eagle3"])  # fmt: skip
    stats = greedy_completions_of_long(tight, plain, 4, 40)
    assert stats["preemptions"] > 0 and stats["shared_prompt_tokens"] > 0, stats


@pytest.mark.parametrize("drafter", ["eagle3", "dflash"])
def test_shared_prompt_pages_are_never_written(plain, drafter):
    """Adaptive speculation forced through drafting, plain and resting steps (a completion 0
    one of whose chunks ran while the drafter rested shares nothing), a pool that preempts:
    while a page is held by more than one completion its target and drafter K/V stay as they
    were when it was first shared and its drafter K/V are those the prompt computes alone
    (drafting every step), every page comes back, tokens are plain greedy's."""
    from test_adaptive import ForcedChooser

    engine = Engine(TARGET, device="cpu", max_num_seqs=4, page_size=4, num_pages=40,
                    max_num_batched_tokens=24, speculation="auto", catch_up_depth=3,
                    **DRAFTERS[drafter])  # fmt: skip
    engine.chooser = ForcedChooser(engine.chooser.k, seed=3)
    kv, drafter_state = engine.kv, engine.runner.drafter
    drafter_pools = [*drafter_state.k_pools, *drafter_state.v_pools]
    pools = [*kv.k, *kv.v, *drafter_pools]
    seen: dict[int, list] = {}  # a shared page -> its K/V when first seen shared
    first_shared = []  # (prompt, page's column, its drafter K/V) when first seen shared
    step = engine.step

    def checked_step():
        finished = step()
        for page in set(seen) - set(kv.holders):  # one holder or free again: may change
            del seen[page]
        for page in kv.holders:
            now = [pool[page * 4 : page * 4 + 4].clone() for pool in pools]
            if page not in seen:
                request = next(r for r in engine.scheduler.running
                               if page in kv.pages_of_row[r.row])  # fmt: skip
                column = kv.pages_of_row[request.row].index(page)
                first_shared.append((tuple(request.prompt_ids), column, now[-len(drafter_pools) :]))
            before = seen.setdefault(page, now)
            assert all(torch.equal(a, b) for a, b in zip(before, now, strict=True)), page
        return finished

    engine.step = checked_step
    stats = greedy_completions_of_long(engine, plain, 3, 24)
    assert stats["shared_prompt_tokens"] > 0 and stats["rest_steps"] > 0, stats
    alone = Engine(TARGET, device="cpu", page_size=4, enable_prefix_caching=True,
                   **DRAFTERS[drafter])  # fmt: skip
    theirs = alone.runner.drafter
    for prompt, column, mine in first_shared:  # a page of a rested chunk would hold no K/V
        alone.generate([list(prompt)], SamplingParams(max_new_tokens=1))
        page = alone.kv.prefix.match(list(prompt))[column]
        for a, b in zip(mine, [*theirs.k_pools, *theirs.v_pools], strict=True):
            torch.testing.assert_close(a, b[page * 4 : page * 4 + 4], rtol=1e-4, atol=1e-4)
    assert first_shared


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", [None, "eagle3", "dflash"])
def test_completions_share_the_prompt_on_cuda(drafter):
    """On CUDA (graph replays, piecewise graphs of extend steps, the Triton backend), float32:
    greedy completions sharing the prompt's pages are plain greedy decoding's, and the prompt is
    prefilled once."""
    spec = DRAFTERS[drafter] if drafter else {"num_draft_tokens": 0}
    engine = Engine(TARGET, device="cuda", dtype="float32", max_num_seqs=16, **spec)
    plain_cuda = Engine(TARGET, device="cuda", dtype="float32", num_draft_tokens=0)
    greedy = SamplingParams(max_new_tokens=24, n=3, ignore_eos=True)
    outs = engine.generate(LONG, greedy)
    base = plain_cuda.generate(LONG, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == [b.token_ids for b in base for _ in range(3)]
    whole = sum((len(o.prompt_token_ids) - 1) // engine.kv.page_size * engine.kv.page_size
                for o in base)  # fmt: skip
    assert engine.stats()["shared_prompt_tokens"] == 2 * whole > 0


def test_n_refusals(plain):
    for value in (0, 1.5, True, "2", 10**4):
        with pytest.raises(SpeculantError, match=re.escape(f"n={value!r} must be an integer in")):
            plain.generate(["x"], SamplingParams(n=value))


def test_cli_n_lines_printing_and_dp(plain, tmp_path, capsys, caplog):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": PROMPTS[0], "n": 3, "temperature": 1.0, "seed": 4}) + "\n"
        + json.dumps({"prompt": PROMPTS[1]}) + "\n"
    )  # fmt: skip
    base = ["generate", "--device", "cpu", "--max-new-tokens", "12", "--ignore-eos",
            "--prompts", str(prompts), "--n", "2"]  # fmt: skip
    caplog.set_level("INFO", logger="speculant")
    assert cli.main([*base, "--num-draft-tokens", "0", "--output", str(tmp_path / "one")]) == 0
    # one process sizes its KV cache and rows for its 5 completions, not its 2 prompts (an
    # audit: the completions of a prompt ran one after another)
    assert "max_num_seqs=5 " in caplog.text, caplog.text
    lines = [json.loads(x) for x in open(tmp_path / "one")]
    keys = sorted((o["index"], o["sample_index"]) for o in lines)
    assert keys == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    expected = plain.generate(PROMPTS[:2], [
        SamplingParams(max_new_tokens=12, ignore_eos=True, n=3, temperature=1.0, seed=4),
        SamplingParams(max_new_tokens=12, ignore_eos=True, n=2),
    ])  # fmt: skip
    by_key = {(o["index"], o["sample_index"]): o["token_ids"] for o in lines}
    assert [by_key[o.key] for o in expected] == [o.token_ids for o in expected]
    capsys.readouterr()
    assert cli.main([*base, "--num-draft-tokens", "0"]) == 0
    printed = capsys.readouterr().out
    starts = [line.split("]")[0] + "]" for line in printed.splitlines() if line.startswith("[")]
    assert starts == ["[0:0]", "[0:1]", "[0:2]", "[1:0]", "[1:1]"]
    dp2_run(base, tmp_path / "dp")
    dp = {
        (o["index"], o["sample_index"]): o["token_ids"]
        for o in map(json.loads, open(tmp_path / "dp"))
    }
    assert dp[(1, 0)] == dp[(1, 1)] == by_key[(1, 0)]  # greedy: plain decoding's
    assert sorted(dp) == keys
    bad = tmp_path / "bad.jsonl"
    refused_in_one_line(capsys, tmp_path, [
        (["--n", "0"], None, "--n 0 is invalid; use an integer in 1..4096"),
        ([], {"prompt": "x", "n": 2.5}, f"{bad}:1: n=2.5 is invalid; use an integer in 1..4096"),
    ], "n")  # fmt: skip
