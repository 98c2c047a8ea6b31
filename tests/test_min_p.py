"""min-p sampling (`SamplingParams.min_p`, `--min-p`, a --prompts line's "min_p"; vLLM's
semantics and order: after temperature, tokens less likely than min_p times the most likely are
dropped, then top-k, then top-p over what is left).

Checked: the filter against transformers' warpers applied in vLLM's order; rejection sampling
with min-p (argmax and sampled drafts) emits the target's filtered distribution (chi-square);
the engine's sampled tokens, plain and speculative, never fall outside the filter at their
position (transformers' logits); `match` verification keeps plain sampling's tokens with min-p
for every drafter; the packed input buffers (tests/test_input_buffers.py); refusals."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers_io import refused_in_one_line
from scipy.stats import chisquare

import speculant
from speculant import Engine, SamplingParams, SpeculantError
from speculant.executor.forward_batch import SamplingInfo
from speculant.executor.sampling import FULL, filtered_probs, race
from speculant.executor.verify import verify
from speculant.launch import cli

TARGET = speculant.bundled("target")
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:", "x = ["]
DRAFTERS = {
    "eagle3": {"algo": "eagle3", "draft": speculant.bundled("eagle3")},
    "dflash": {"algo": "dflash", "draft": speculant.bundled("dflash")},
    "draft-model": {"algo": "draft-model", "draft": speculant.bundled("draft_lm")},
}


def test_min_p_filters_as_vllm_orders_it():
    """min-p on softmax(logits / T) first, then top-k, then top-p over the renormalised rest
    (transformers' warpers applied in that order)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        vocab = int(torch.randint(2, 300, (), generator=gen))
        logits = torch.randn(1, vocab, generator=gen) * 5 * float(torch.rand((), generator=gen))
        top_k = int(torch.randint(0, vocab + 1, (), generator=gen))
        top_p = 0.05 + 0.95 * float(torch.rand((), generator=gen))
        min_p = float(torch.rand((), generator=gen)) ** 2
        ours = filtered_probs(logits, torch.tensor([0.7]), torch.tensor([top_k]),
                              torch.tensor([top_p]), torch.tensor([min_p]))  # fmt: skip
        scores = MinPLogitsWarper(min_p)(None, logits / 0.7)
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        expected = torch.softmax(TopPLogitsWarper(top_p)(None, scores), dim=-1)
        assert torch.equal(ours > 0, expected > 0), (vocab, top_k, top_p, min_p)
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    # 0 keeps every token; 1 only the most likely (and its ties)
    logits = torch.randn(4, 50, generator=gen)
    ones, zeros = torch.ones(4), torch.zeros(4, dtype=torch.int64)
    none = filtered_probs(logits, ones, zeros, ones)
    assert torch.equal(filtered_probs(logits, ones, zeros, ones, torch.zeros(4)), none)
    top = filtered_probs(logits, ones, zeros, ones, ones)
    assert torch.equal(top.argmax(-1), logits.argmax(-1)) and bool((top.max(-1).values == 1).all())


TRIALS = 20000


@pytest.mark.parametrize("drafts_sampled", [False, True])
@pytest.mark.parametrize("min_p, top_k", [(0.1, 0), (0.3, 5), (0.05, 0)])
def test_rejection_sampling_with_min_p_follows_target_distribution(drafts_sampled, min_p, top_k):
    """Over 20k seeded trials (k = 2), the first emitted token is distributed as the target's
    min-p filtered p, and so is the second given the first draft was accepted."""
    vocab, k = 8, 2
    gen = torch.Generator().manual_seed(int(drafts_sampled) * 10 + int(min_p * 100))
    temp = torch.full((TRIALS,), 0.9)
    one = (temp[:1], torch.tensor([top_k]), torch.ones(1), torch.tensor([min_p]))
    while True:  # logits where the filter keeps several tokens but not all, at the first position
        target_logits = torch.randn(k + 1, vocab, generator=gen) * 1.2
        if 2 < int((filtered_probs(target_logits, *one)[0] > 0).sum()) < vocab:
            break
    draft_logits = torch.randn(k, vocab, generator=gen) * 1.2
    info = SamplingInfo(
        temp, torch.full((TRIALS,), top_k), torch.ones(TRIALS),
        torch.arange(TRIALS, dtype=torch.int64) * 7919 + 13, torch.full((TRIALS,), min_p),
    )  # fmt: skip
    p = filtered_probs(target_logits, *one)
    positions = torch.arange(k + 1).expand(TRIALS, k + 1) + 40
    if drafts_sampled:
        q = filtered_probs(draft_logits, *one).expand(TRIALS, k, vocab)
        drafts = race(q, info.seed[:, None], positions[:, 1:] + 1000, 3)
    else:
        q = None
        drafts = draft_logits.argmax(-1).expand(TRIALS, k)
    out, accept_len = verify(target_logits.expand(TRIALS, k + 1, vocab), drafts, q, info,
                             positions, FULL)  # fmt: skip
    p = p.double() / p.double().sum(-1, keepdim=True)
    follows(torch.bincount(out[:, 0], minlength=vocab).double(), p[0] * TRIALS)
    kept = accept_len >= 2  # the second token, where the first draft was accepted
    if kept.sum() >= 1000:
        follows(torch.bincount(out[kept, 1], minlength=vocab).double(), p[1] * kept.sum())


def follows(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """No token outside the filter; the counts of those inside as expected (chi-square, where
    more than one is inside)."""
    support = expected > 0
    assert counts[~support].sum() == 0, "a token outside the min-p set was emitted"
    if int(support.sum()) > 1:
        assert chisquare(counts[support], expected[support]).pvalue > 0.001


@pytest.fixture(scope="module")
def target_logits():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()

    def logits_of(prompt_ids, output_ids):
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
        return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(output_ids)]

    return logits_of


@pytest.mark.parametrize("drafter", [None, "eagle3", "dflash", "draft-model"])
def test_engine_samples_only_inside_min_p(drafter, target_logits):
    """Every sampled token, plain or speculative (drafts accepted or resampled), is one min-p
    keeps at its position under the target's logits; without min-p such tokens do occur."""
    spec = {} if drafter is None else DRAFTERS[drafter]
    engine = Engine(TARGET, device="cpu", **spec)
    temperature, min_p = 1.5, 0.2
    params = [SamplingParams(max_new_tokens=32, temperature=temperature, min_p=min_p, seed=s,
                             ignore_eos=True) for s in range(len(PROMPTS) * 2)]  # fmt: skip
    outputs = engine.generate(PROMPTS * 2, params)
    loose = engine.generate(PROMPTS * 2, [SamplingParams(**{**vars(p), "min_p": 0.0})
                                          for p in params])  # fmt: skip
    outside = 0
    for out, free in zip(outputs, loose, strict=True):
        for run, bound in ((out, min_p), (free, None)):
            probs = torch.softmax(target_logits(run.prompt_token_ids, run.token_ids) / temperature,
                                  dim=-1)  # fmt: skip
            chosen = probs.gather(1, torch.tensor(run.token_ids)[:, None]).squeeze(1)
            ratio = chosen / probs.max(-1).values
            if bound is None:
                outside += int((ratio < min_p * 0.9).sum())
            else:
                assert bool((ratio >= min_p * (1 - 1e-4)).all()), (drafter, ratio.min().item())
    assert outside > 0, "min-p would drop nothing here: the test would show nothing"


@pytest.mark.parametrize("drafter", ["eagle3", "dflash", "draft-model"])
def test_match_verification_with_min_p_keeps_plain_tokens(drafter):
    """With `match`, a seeded request's tokens are plain sampling's whatever was drafted, with
    min-p and top-p too (float32)."""
    params = [SamplingParams(max_new_tokens=24, temperature=0.9, min_p=0.1, top_p=0.95,
                             seed=s, ignore_eos=True) for s in range(len(PROMPTS))]  # fmt: skip
    plain = Engine(TARGET, device="cpu", num_draft_tokens=0).generate(PROMPTS, params)
    engine = Engine(TARGET, device="cpu", sampled_verify="match", **DRAFTERS[drafter])
    outputs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]


def test_min_p_refusals_and_the_cli(tmp_path, capsys):
    engine = Engine(TARGET, device="cpu", num_draft_tokens=0)
    for value in (-0.1, 1.5, float("nan"), True, "0.1"):
        with pytest.raises(SpeculantError, match=re.escape(f"min_p={value!r} must be in [0, 1]")):
            engine.generate(["x"], SamplingParams(min_p=value))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": PROMPTS[0], "min_p": 0.2, "temperature": 1.5, "seed": 3}) + "\n"
        + json.dumps({"prompt": PROMPTS[1]}) + "\n"
    )  # fmt: skip
    args = ["generate", "--device", "cpu", "--num-draft-tokens", "0", "--max-new-tokens", "16",
            "--ignore-eos", "--prompts", str(prompts), "--output", str(tmp_path / "out"),
            "--min-p", "0.5", "--temperature", "1.2"]  # fmt: skip
    assert cli.main(args) == 0
    lines = sorted((json.loads(x) for x in open(tmp_path / "out")), key=lambda o: o["index"])
    expected = engine.generate(PROMPTS[:2], [
        SamplingParams(max_new_tokens=16, ignore_eos=True, min_p=0.2, temperature=1.5, seed=3),
        SamplingParams(max_new_tokens=16, ignore_eos=True, min_p=0.5, temperature=1.2),
    ])  # fmt: skip
    assert [o["token_ids"] for o in lines] == [o.token_ids for o in expected]
    bad = tmp_path / "bad.jsonl"
    refused_in_one_line(capsys, tmp_path, [
        (["--min-p", "2"], None, "--min-p 2.0 is invalid; use a number in [0, 1] (0 = off)"),
        (["--min-p", "nan"], None, "--min-p nan is invalid"),
        ([], {"prompt": "x", "min_p": -1}, f"{bad}:1: min_p=-1 is invalid; use a number in [0, 1]"),
    ], "min_p")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", [None, "eagle3"])
def test_min_p_on_cuda_graphs_equals_eager(drafter, target_logits):
    """On CUDA in float32, seeded sampled requests with min-p: graph replays (min-p read from
    the step's static inputs) give the eager steps' tokens, each inside the filter at its
    position (transformers' logits on the CPU)."""
    spec = {} if drafter is None else DRAFTERS[drafter]
    params = [SamplingParams(max_new_tokens=32, temperature=1.2, min_p=0.1 * (s % 3), seed=s,
                             ignore_eos=True) for s in range(8)]  # fmt: skip
    options = dict(device="cuda", dtype="float32", max_num_seqs=8, **spec)
    graphs = Engine(TARGET, **options).generate(PROMPTS * 2, params)
    eager = Engine(TARGET, **options, enforce_eager=True).generate(PROMPTS * 2, params)
    assert [o.token_ids for o in graphs] == [o.token_ids for o in eager]
    for out, sp in zip(graphs, params, strict=True):
        probs = torch.softmax(target_logits(out.prompt_token_ids, out.token_ids) / 1.2, dim=-1)
        chosen = probs.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert bool((chosen / probs.max(-1).values >= sp.min_p * (1 - 1e-3)).all())
