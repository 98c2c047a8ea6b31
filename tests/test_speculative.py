"""Speculative decoding is lossless: greedy speculative output equals greedy plain output (EAGLE-3
and the draft-model algorithm, eager and eager-padded), and rejection sampling emits tokens with
the target's distribution."""

from __future__ import annotations

import pytest
import torch
from helpers_eagle import write_random_eagle3
from scipy.stats import chisquare

import speculant
from speculant import Engine, SamplingParams
from speculant.executor.forward_batch import SamplingInfo
from speculant.executor.sampling import FULL, filtered_probs, race
from speculant.executor.verify import verify


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, llama_dir):
    path = tmp_path_factory.mktemp("eagle3")
    write_random_eagle3(path, llama_dir, draft_vocab=200)
    return path


def prompts_of(lengths, seed, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def engine(target, **kwargs):
    return Engine(target, device="cpu", max_num_seqs=8, max_model_len=160, page_size=4, **kwargs)


@pytest.fixture(scope="module")
def plain(llama_dir):
    return engine(llama_dir)


GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


# Triton's interpreter runs each kernel program in Python: its engine tests decode fewer tokens
TRITON_GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def assert_lossless(spec, plain, prompts, k, params=GREEDY):
    """Greedy speculative output equals plain greedy; stats are sane; every page returns."""
    ours = spec.generate(prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain.generate(prompts, params)]
    for out in ours:
        assert out.stats["num_verify_steps"] > 0
        assert 1.0 <= out.stats["accept_len"] <= k + 1
        assert len(out.stats["per_position_acceptance"]) == k
    assert len(spec.kv.free_pages) == spec.kv.num_pages - 1


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("padding", [False, True])
def test_eagle3_greedy_equals_plain(plain, llama_dir, eagle_dir, k, padding):
    prompts = prompts_of((3, 17, 1, 30, 9), seed=k)
    spec = engine(
        llama_dir, algo="eagle3", draft=str(eagle_dir), num_draft_tokens=k, eager_padding=padding
    )
    assert_lossless(spec, plain, prompts, k)


@pytest.mark.parametrize("k", [2, 4])
def test_draft_model_with_target_as_drafter_accepts_everything(plain, llama_dir, k):
    prompts = prompts_of((4, 21, 11), seed=10 + k)
    spec = engine(
        llama_dir, algo="draft-model", draft=str(llama_dir), num_draft_tokens=k, eager_padding=True
    )
    params = SamplingParams(max_new_tokens=1 + 5 * (k + 1), ignore_eos=True)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]
    for out in outs:
        assert out.stats["accept_len"] == k + 1
        assert out.stats["per_position_acceptance"] == [1.0] * k


def test_draft_model_other_architecture_greedy_equals_plain(llama_tied_dir, qwen2_dir, qwen3_dir):
    # other LMs of the same vocabulary draft: acceptance is partial, output unchanged
    prompts = prompts_of((6, 13, 2), seed=21)
    expected = [o.token_ids for o in engine(llama_tied_dir).generate(prompts, GREEDY)]
    for draft in (qwen2_dir, qwen3_dir):
        spec = engine(
            llama_tied_dir,
            algo="draft-model",
            draft=str(draft),
            num_draft_tokens=3,
            eager_padding=True,
        )
        assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == expected


def test_seeded_speculative_sampling_is_batch_invariant(llama_dir, eagle_dir):
    spec = engine(
        llama_dir, algo="eagle3", draft=str(eagle_dir), num_draft_tokens=3, eager_padding=True
    )
    prompts = prompts_of((5, 12, 27), seed=31)
    params = [
        SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.95, seed=7 + i, ignore_eos=True)
        for i in range(3)
    ]
    batched = [o.token_ids for o in spec.generate(prompts, params)]
    alone = [spec.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    assert batched == alone


TRIALS = 20000


@pytest.mark.parametrize("drafts_sampled", [False, True])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (6, 0.8)])
def test_rejection_sampling_follows_target_distribution(drafts_sampled, top_k, top_p):
    """Over 20k seeded trials, the first emitted token (k=2 drafts) is distributed as the
    target's filtered p, and so is the second given the first was an accepted draft."""
    vocab, k = 8, 2
    gen = torch.Generator().manual_seed(int(drafts_sampled) * 100 + top_k)
    target_logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    draft_logits = torch.randn(k, vocab, generator=gen) * 1.5
    temp = torch.full((TRIALS,), 0.9)
    info = SamplingInfo(
        temp,
        torch.full((TRIALS,), top_k),
        torch.full((TRIALS,), top_p),
        torch.arange(TRIALS, dtype=torch.int64) * 7919 + 13,
    )
    p = filtered_probs(target_logits, temp[:1], torch.tensor([top_k]), torch.tensor([top_p]))
    positions = torch.arange(k + 1).expand(TRIALS, k + 1) + 40
    if drafts_sampled:
        q = filtered_probs(draft_logits, temp[:1], torch.tensor([top_k]), torch.tensor([top_p]))
        q = q.expand(TRIALS, k, vocab)
        drafts = race(q, info.seed[:, None], positions[:, 1:] + 1000, 3)
    else:
        q = None
        drafts = draft_logits.argmax(-1).expand(TRIALS, k)
    logits = target_logits.expand(TRIALS, k + 1, vocab)
    out, accept_len = verify(logits, drafts, q, info, positions, FULL)
    assert accept_len.min() >= 1 and accept_len.max() <= k + 1
    p = p.double() / p.double().sum(-1, keepdim=True)
    first = torch.bincount(out[:, 0], minlength=vocab).double()
    expected = p[0] * TRIALS
    support = expected > 0
    assert first[~support].sum() == 0, "a token outside top-k/top-p was emitted"
    assert chisquare(first[support], expected[support]).pvalue > 0.001
    # the second token, among trials whose first token is the first draft that was accepted
    kept = accept_len >= 2
    if kept.sum() < 1000:  # the first draft is (almost) never accepted under this filter
        return
    second = torch.bincount(out[kept, 1], minlength=vocab).double()
    expected2 = p[1] * kept.sum()
    assert second[expected2 == 0].sum() == 0
    assert chisquare(second[expected2 > 0], expected2[expected2 > 0]).pvalue > 0.001


def test_greedy_verify_takes_longest_matching_prefix():
    logits = torch.full((2, 4, 10), -5.0)
    for row, targets in enumerate([[3, 4, 5, 6], [7, 1, 2, 9]]):
        for j, t in enumerate(targets):
            logits[row, j, t] = 5.0
    drafts = torch.tensor([[3, 4, 0], [8, 1, 2]])
    info = SamplingInfo(
        torch.zeros(2),
        torch.zeros(2, dtype=torch.long),
        torch.ones(2),
        torch.zeros(2, dtype=torch.long),
    )
    out, accept_len = verify(
        logits, drafts, None, info, torch.zeros(2, 4, dtype=torch.long), "greedy"
    )
    assert accept_len.tolist() == [3, 1]
    assert out.tolist() == [[3, 4, 5, -1], [7, -1, -1, -1]]


def test_eagle3_head_with_other_hidden_greedy_equals_plain(plain, llama_dir, tmp_path):
    """A head with hidden 32 for the 64-wide target (own embed_tokens, fc 192 -> 32)."""
    write_random_eagle3(tmp_path, llama_dir, draft_vocab=200, hidden=32, seed=4)
    k = 3
    prompts = prompts_of((3, 17, 1, 30, 9), seed=21)
    spec = engine(
        llama_dir, algo="eagle3", draft=str(tmp_path), num_draft_tokens=k, eager_padding=True
    )
    assert spec.drafter.head.embed_tokens.weight.shape[-1] == 32
    assert_lossless(spec, plain, prompts, k)


@pytest.mark.parametrize("vocab", [8192, 8191, 128256])
@pytest.mark.parametrize("chunks", [64, 7])
def test_chunked_argmax_equals_argmax_with_ties(vocab, chunks):
    """The two-stage argmax the sampler and verify use for few rows on the GPU gives torch's
    index (the first maximum), also with ties across and inside chunks and a ragged last
    chunk; on the GPU `argmax` takes it, elsewhere torch's."""
    from speculant.executor.sampling import argmax, chunked_argmax

    gen = torch.Generator().manual_seed(vocab + chunks)
    logits = torch.randn(5, vocab, generator=gen)
    logits[1, [7, vocab // 2, vocab - 1]] = 50.0  # ties: the first one wins
    logits[2, -3:] = 60.0  # the maximum in the (ragged) last chunk
    logits[3] = 0.0  # every entry tied
    logits[4, 0] = float("nan")  # torch treats NaN as the maximum
    expected = logits.argmax(-1)
    assert torch.equal(chunked_argmax(logits, chunks), expected)
    assert torch.equal(chunked_argmax(logits.view(5, 1, vocab), chunks), expected.view(5, 1))
    assert torch.equal(argmax(logits.bfloat16()), logits.bfloat16().argmax(-1))
    if torch.cuda.is_available():
        assert torch.equal(argmax(logits[:2].cuda()).cpu(), expected[:2])


def test_bundled_eagle3_rejection_sampling_emits_the_targets_joint_distribution():
    """End to end on the bundled models (float32): the first three tokens of 1,500 seeded
    requests of one prompt under EAGLE-3 rejection sampling, k = 2 (token 1 from the prefill,
    tokens 2-3 from one verify step: a draft accepted or resampled from the residual, then the
    second draft or the bonus), follow the target's joint p(t1) p(t2 | t1) p(t3 | t1, t2) from
    transformers' logits of the checkpoint (chi-square over the (t1, t2, t3) bins, those
    expected fewer than 5 times merged), and never leave its top-k support."""
    from transformers import AutoModelForCausalLM

    target = speculant.bundled("target")
    prompt, n, top_k = [759, 1425, 200, 759, 222], 1500, 20  # "import os\nimport "
    spec = Engine(target, device="cpu", dtype="float32", max_num_seqs=256, max_model_len=32,
                  algo="eagle3", draft=speculant.bundled("eagle3"), num_draft_tokens=2)  # fmt: skip
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, top_k=top_k, seed=s,
                             ignore_eos=True) for s in range(n)]  # fmt: skip
    outs = spec.generate([prompt] * n, params)
    emitted = sum(len(o.token_ids) - 1 for o in outs)  # the first token is the prefill's
    verified = sum(o.stats["num_verify_steps"] for o in outs)
    assert emitted > 1.3 * verified, (emitted, verified)  # drafts accepted: both paths ran

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()

    def next_probs(prefixes: list[tuple[int, ...]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        rows = len(prefixes)
        return filtered_probs(logits, torch.ones(rows), torch.full((rows,), top_k),
                              torch.ones(rows)).double()  # fmt: skip

    joint = {(): 1.0}
    for _ in range(3):  # expand every prefix inside the support (20, then 400)
        prefixes = list(joint)
        probs = next_probs(prefixes)
        joint = {
            prefix + (t,): joint[prefix] * probs[i, t].item()
            for i, prefix in enumerate(prefixes)
            for t in probs[i].nonzero().flatten().tolist()
        }
    seen: dict[tuple[int, ...], int] = {}
    for out in outs:
        seen[tuple(out.token_ids[:3])] = seen.get(tuple(out.token_ids[:3]), 0) + 1
    assert not set(seen) - set(joint), "a token outside the target's top-k was emitted"
    cells = sorted(joint, key=joint.get, reverse=True)
    expected = torch.tensor([joint[c] * n for c in cells], dtype=torch.float64)
    counts = torch.tensor([seen.get(c, 0) for c in cells], dtype=torch.float64)
    keep = expected >= 5
    assert keep.sum() >= 20
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    assert chisquare(obs, exp * n / exp.sum()).pvalue > 1e-3
