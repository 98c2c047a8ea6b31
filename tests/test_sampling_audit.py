"""Sampled output never leaves the filtered distribution: the random number of a rare
(seed, position) used to round to 1.0 (then the last vocabulary id was drawn whatever its
probability, and an accept test at p == q failed), and top_p 1 dropped a large vocabulary's
tail (the float32 cumsum reaches 1 before it)."""

from __future__ import annotations

import pytest
import torch
from helpers_eagle import write_random_eagle3

from speculant import Engine, SamplingParams
from speculant.executor.forward_batch import SamplingInfo
from speculant.executor.sampling import (
    FULL,
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    filtered_probs,
    sample,
    uniform,
)
from speculant.executor.verify import verify

# (seed, position) whose hash is the largest 24-bit value, found by search
SAMPLE_AT_TOP = (23160022, 26)  # STREAM_SAMPLE
ACCEPT_AT_TOP = (0, 6664954)  # STREAM_ACCEPT


def info_of(seed: int, rows: int = 1, top_k: int = 0) -> SamplingInfo:
    return SamplingInfo(
        torch.ones(rows),
        torch.full((rows,), top_k),
        torch.ones(rows),
        torch.full((rows,), seed, dtype=torch.int64),
    )


def test_uniform_stays_below_one_at_its_largest_hash():
    for (seed, position), stream in (
        (SAMPLE_AT_TOP, STREAM_SAMPLE),
        (ACCEPT_AT_TOP, STREAM_ACCEPT),
    ):
        u = uniform(torch.tensor(seed), torch.tensor(position), stream)
        assert 0.99999 < u.item() < 1.0


def test_sample_and_bonus_stay_inside_top_k_at_the_largest_random_number():
    seed, position = SAMPLE_AT_TOP
    logits = torch.tensor([[0.5, 3.0, 2.0, 1.0, 0.0, -1.0, 0.2, -2.0]])
    token = sample(logits, info_of(seed, top_k=2), torch.tensor([position]), FULL)
    assert token.item() in (1, 2)  # was 7: the last id, outside the top 2
    # the same number draws verify's bonus token (k = 1 draft, accepted)
    logits2 = logits.expand(2, 8).clone()[None]
    positions = torch.tensor([[position - 2, position - 1]])
    q = filtered_probs(logits2[:, :1], torch.ones(1, 1), torch.full((1, 1), 2), torch.ones(1, 1))
    out, accept_len = verify(
        logits2, torch.tensor([[1]]), q, info_of(seed, top_k=2), positions, FULL
    )
    assert accept_len.item() == 2 and out[0, 1].item() in (1, 2)


def test_accept_test_passes_where_p_equals_q_at_the_largest_random_number():
    # p(d) == q(d) must accept with certainty; a failed test resampled from the residual
    seed, position = ACCEPT_AT_TOP
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().expand(1, 2, 4)
    q = filtered_probs(logits[:, :1], torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long),
                       torch.ones(1, 1))  # fmt: skip
    q[..., 1] -= 0.2  # q(0) == p(0) exactly; mass moved from 1 to 2
    q[..., 2] += 0.2
    positions = torch.tensor([[position - 2, position - 1]])
    out, accept_len = verify(logits, torch.tensor([[0]]), q, info_of(seed), positions, FULL)
    assert accept_len.item() == 2 and out[0, 0].item() == 0


def test_top_p_one_keeps_every_token_of_a_large_vocabulary():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 32000, generator=gen) * 3
    off = torch.ones(4)
    probs = filtered_probs(logits, off, torch.zeros(4, dtype=torch.long), off)
    assert bool((probs > 0).all())  # was: hundreds of tail tokens at 0
    torch.testing.assert_close(probs, torch.softmax(logits, -1))
    top_k = filtered_probs(logits, off, torch.full((4,), 20000), off)
    assert ((top_k > 0).sum(-1) == 20000).all()


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, llama_dir):
    path = tmp_path_factory.mktemp("eagle3")
    write_random_eagle3(path, llama_dir, draft_vocab=200)
    return path


@pytest.mark.parametrize("speculative", [False, True])
def test_top_k_one_sampling_is_greedy_at_the_largest_random_number(
    llama_dir, eagle_dir, speculative
):
    """The first output token sits at position 26 (a 26-token prompt), where the seed's sample
    number is the largest: top_k 1 must still give the greedy token there."""
    seed, position = SAMPLE_AT_TOP
    draft = dict(algo="eagle3", draft=str(eagle_dir), num_draft_tokens=3) if speculative else {}
    engine = Engine(llama_dir, device="cpu", max_num_seqs=2, max_model_len=64, page_size=4, **draft)
    prompt = torch.randint(3, 500, (position,), generator=torch.Generator().manual_seed(3))
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    top1 = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1, seed=seed, ignore_eos=True)
    expected = engine.generate([prompt.tolist()], greedy)[0].token_ids
    assert engine.generate([prompt.tolist()], top1)[0].token_ids == expected


def test_top_k_and_top_p_together_filter_as_transformers_does():
    """top-k first, then top-p over the top-k set's renormalised mass (vLLM's and transformers'
    order): top_p was measured on the whole distribution, which kept more tokens than a user of
    either expects (the same request sampled from a wider set)."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(7)
    for _ in range(200):
        vocab = int(torch.randint(2, 300, (), generator=gen))
        logits = torch.randn(1, vocab, generator=gen) * 5 * float(torch.rand((), generator=gen))
        top_k = int(torch.randint(0, vocab + 1, (), generator=gen))
        top_p = 0.01 + 0.99 * float(torch.rand((), generator=gen))
        ours = filtered_probs(logits, torch.tensor([0.7]), torch.tensor([top_k]),
                              torch.tensor([top_p]))  # fmt: skip
        scores = logits / 0.7
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        expected = torch.softmax(TopPLogitsWarper(top_p)(None, scores), dim=-1)
        assert torch.equal(ours > 0, expected > 0), (vocab, top_k, top_p)
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_requests_do_not_share_their_random_streams():
    """20,000 requests' seeds (an engine seed's per-request ones), 256 positions each: no two
    requests draw many of the same numbers. With the position XORed into a 32-bit key, two
    requests whose keys differed by d < 256 drew the same numbers at p and p ^ d: 7 pairs here
    shared 8 or more of their 256 (one shared 240)."""
    n, length = 20_000, 256
    seeds = torch.arange(n, dtype=torch.int64) * 1_000_003 + 12345
    for stream in (STREAM_SAMPLE, STREAM_ACCEPT):
        u = uniform(seeds[:, None], torch.arange(length)[None, :], stream)
        value = (u * (1 << 24)).long().flatten()  # the 24 random bits of each draw
        owner = torch.arange(n).repeat_interleave(length)
        order = torch.argsort(value)
        value, owner = value[order], owner[order]
        same = (value[1:] == value[:-1]) & (owner[1:] != owner[:-1])
        a, b = owner[:-1][same], owner[1:][same]
        _, shared = torch.unique(torch.minimum(a, b) * n + torch.maximum(a, b), return_counts=True)
        # 5.1 M draws of 24 bits: chance alone makes ~0.8 M equal pairs, spread over pairs of
        # requests; a pair sharing 6 is already far past chance (a shared stream shares ~256)
        assert int(shared.max()) < 6, int(shared.max())


@pytest.mark.parametrize("temperature", [1.0, 100.0, 1e4])
def test_top_k_one_and_tiny_top_p_keep_the_argmax_where_probabilities_round_together(
    temperature,
):
    """At a high temperature the largest logit and one just below it (its float32 neighbour,
    at a lower id) round to one probability: the filters ranked tokens by that probability, a
    stable sort put the lower id first, and top_k 1 / top_p 1e-6 sampled a token greedy decoding
    never emits. They rank by logit."""
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 64, 300
    logits = (torch.randn(rows, vocab, generator=gen) * 3).clamp(max=9.0)
    low = torch.randint(0, vocab - 1, (rows,), generator=gen)
    high = low + 1 + (torch.rand(rows, generator=gen) * (vocab - 1 - low)).long()
    top = torch.full((rows,), 10.0)
    logits[torch.arange(rows), low] = top
    logits[torch.arange(rows), high] = torch.nextafter(top, torch.tensor(11.0))
    expected = logits.argmax(-1)
    assert torch.equal(expected, high)
    temp, seeds = torch.full((rows,), temperature), torch.arange(rows) * 7919
    positions = torch.arange(rows) + 5
    for top_k, top_p in ((1, 1.0), (0, 1e-6)):
        info = SamplingInfo(temp, torch.full((rows,), top_k), torch.full((rows,), top_p), seeds)
        probs = filtered_probs(logits, info.temperature, info.top_k, info.top_p)
        assert torch.equal(probs.argmax(-1), expected) and bool(((probs > 0).sum(-1) == 1).all())
        assert torch.equal(sample(logits, info, positions, FULL), expected)
