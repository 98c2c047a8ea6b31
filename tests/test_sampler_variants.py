"""The SCALED sampler variant: a batch whose sampled requests ask for neither top-k nor top-p
skips the vocabulary ranking (a sort of [rows, V], most of a sampled step's sampler on a GPU)
and must give exactly what FULL gives those rows, so a seeded request draws the same tokens
whichever requests share its batch."""

from __future__ import annotations

import pytest
import torch
from helpers_eagle import write_random_eagle3

import speculant.executor.engine as engine_module
from speculant import Engine, SamplingParams
from speculant.executor import sampling
from speculant.executor.sampling import FULL, GREEDY, SCALED, batch_variant, filtered_probs


def test_scaled_filters_as_full_does_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    for shape in ((6, 300), (4, 3, 257)):  # sample's [bs, V] and verify's [bs, T, V]
        rows = shape[0]
        logits = torch.randn(*shape, generator=gen) * 4
        temperature = torch.tensor([0.0, 0.3, 1.0, 2.5, 0.7, 1.3][:rows])
        tail = (1,) * (len(shape) - 2)
        top_k = torch.zeros(rows, dtype=torch.int64).view(rows, *tail)
        top_p = torch.ones(rows).view(rows, *tail)
        temperature = temperature.view(rows, *tail)
        for min_p in (None, torch.tensor([0.0, 0.05, 0.2, 0.0, 0.5, 1.0][:rows]).view(rows, *tail)):
            full = filtered_probs(logits, temperature, top_k, top_p, min_p, FULL)
            scaled = filtered_probs(logits, temperature, top_k, top_p, min_p, SCALED)
            assert torch.equal(scaled, full)


def test_scaled_does_not_rank_the_vocabulary(monkeypatch):
    logits = torch.randn(3, 100)
    args = (torch.ones(3), torch.zeros(3, dtype=torch.int64), torch.ones(3))

    def no_sort(*_, **__):
        raise AssertionError("sorted the vocabulary")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    filtered_probs(logits, *args, None, SCALED)
    with pytest.raises(AssertionError, match="sorted"):
        filtered_probs(logits, *args, None, FULL)


def test_ranking_by_chunks_of_rows_gives_the_same_bits(monkeypatch):
    """top-k / top-p rank SORT_ELEMENTS entries at a time (the sort's memory in a large verify
    step): rows are independent, so on the CPU chunks of a few rows or all at once agree."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 3, 211, generator=gen) * 3
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.7, 0.9])[:, None]
    top_k = torch.tensor([0, 5, 0, 40, 1])[:, None]
    top_p = torch.tensor([0.3, 1.0, 0.8, 0.95, 1.0])[:, None]
    whole = sampling.filtered_probs(logits, temperature, top_k, top_p, None, FULL)
    assert ((whole > 0).sum(-1) < 211).all()  # every row filtered something
    for elements in (1, 211 * 2, 211 * 7):
        monkeypatch.setattr(sampling, "SORT_ELEMENTS", elements)
        chunked = sampling.filtered_probs(logits, temperature, top_k, top_p, None, FULL)
        assert torch.equal(chunked, whole)


@pytest.mark.parametrize(
    ("params", "variant"),
    [
        ([{}, {}], GREEDY),
        ([{"top_p": 0.5, "top_k": 3}], GREEDY),  # greedy rows are a one-hot whatever they ask
        ([{"temperature": 0.8}, {}], SCALED),
        ([{"temperature": 0.8, "min_p": 0.1}, {"top_k": 5}], SCALED),
        ([{"temperature": 0.8}, {"temperature": 1.0, "top_p": 0.9}], FULL),
        ([{"temperature": 0.8, "top_k": 20}], FULL),
        ([{"temperature": 0.8, "top_k": -1}], SCALED),  # vLLM's older "off"
    ],
)
def test_batch_variant_ranks_only_when_a_sampled_row_asks(params, variant):
    assert batch_variant([SamplingParams(**p).validate() for p in params]) == variant


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, llama_dir):
    path = tmp_path_factory.mktemp("eagle3_variants")
    write_random_eagle3(path, llama_dir, draft_vocab=200, num_kv_heads=1, seed=5)
    return path


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "eagle3"])
def test_a_seeded_request_draws_the_same_tokens_in_a_scaled_or_full_batch(
    llama_dir, eagle_dir, speculative, device, monkeypatch
):
    """Alone, a temperature-only request runs SCALED steps (verify's p and the drafter's q too);
    next to a top-p request the batch runs FULL: its tokens are the same (on CUDA, float32,
    each variant's captured graphs)."""
    chosen = []

    def recording(params):
        chosen.append(batch_variant(params))
        return chosen[-1]

    monkeypatch.setattr(engine_module, "batch_variant", recording)
    draft = dict(algo="eagle3", draft=str(eagle_dir), num_draft_tokens=3) if speculative else {}
    options = dict(dtype="float32") if device == "cuda" else {}
    engine = Engine(llama_dir, device=device, max_num_seqs=4, max_model_len=96, **options, **draft)
    prompts = [[5, 9, 11, 40, 3, 7], [8, 8, 2, 19, 33]]
    scaled = SamplingParams(max_new_tokens=24, temperature=1.3, min_p=0.02, seed=11,
                            ignore_eos=True)  # fmt: skip
    ranked = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.8, seed=4, ignore_eos=True)
    alone = engine.generate(prompts[:1], scaled)[0].token_ids
    assert set(chosen) == {SCALED}
    chosen.clear()
    mixed = engine.generate(prompts, [scaled, ranked])
    assert FULL in chosen
    assert mixed[0].token_ids == alone
    assert len(set(alone)) > 3  # sampled at a high temperature, not a greedy repeat
    if device == "cuda":
        assert engine.graphs.num_replays > 0


def test_ranking_never_scans_a_lone_row_of_a_larger_batch(monkeypatch):
    """On CUDA torch scans a cumsum of one row with cub, another summation order than the
    per-row kernel of several rows: a row ranked alone in the last chunk could then keep other
    top-p tokens than in the whole batch (as before the chunking). Only a one-row batch ranks
    one row at a time."""
    gen = torch.Generator().manual_seed(4)
    vocab = 97
    chunk_rows = []
    real_rank_filter = sampling._rank_filter_

    def recording(probs, *rest):
        chunk_rows.append(probs.shape[0])
        return real_rank_filter(probs, *rest)

    monkeypatch.setattr(sampling, "_rank_filter_", recording)
    for rows in (0, 1, 2, 3, 5, 7, 8):
        logits = torch.randn(rows, vocab, generator=gen) * 3
        args = (torch.full((rows,), 0.9), torch.zeros(rows, dtype=torch.int64),
                torch.full((rows,), 0.7))  # fmt: skip
        whole = filtered_probs(logits, *args, None, FULL)
        for per_chunk in (1, 2, 3):
            monkeypatch.setattr(sampling, "SORT_ELEMENTS", vocab * per_chunk)
            chunk_rows.clear()
            assert torch.equal(filtered_probs(logits, *args, None, FULL), whole)
            assert sum(chunk_rows) == rows
            assert rows == 1 or 1 not in chunk_rows, (rows, per_chunk, chunk_rows)
        monkeypatch.setattr(sampling, "SORT_ELEMENTS", 1 << 24)
