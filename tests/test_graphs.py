"""The graph wrapper's contract on the CPU: capture-size policy, padding to captured sizes with
sentinel rows (eager padding), DP sizing helpers, variant errors and replay hooks."""

from __future__ import annotations

import pytest
import torch

from speculant import Engine, SamplingParams, SpeculantError
from speculant.config import GraphConfig
from speculant.executor.cuda_graph import (
    DEFAULT_SIZES,
    capture_sizes,
    dp_can_use_graph,
    dp_capture_dummies,
    dp_graph_batch_size,
)
from speculant.executor.model_runner import StepOutput


@pytest.mark.parametrize(
    "cfg, max_num_seqs, dp, expected",
    [
        (GraphConfig(), 512, 1, DEFAULT_SIZES),
        (GraphConfig(), 64, 1, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 63, 64]),
        (GraphConfig(), 64, 2, [1, 2, 4, 8, 16, 24, 31, 32]),
        (GraphConfig(), 10, 1, [1, 2, 4, 8, 9, 10]),
        (GraphConfig(max_capture_size=16), 256, 1, [1, 2, 4, 8, 16]),
        (GraphConfig(max_capture_size=20), 64, 1, [1, 2, 4, 8, 16]),
        (GraphConfig(capture_sizes=[8, 1, 4, 4]), 64, 1, [1, 4, 8]),
        (GraphConfig(disable_padding=True), 256, 1, list(range(1, 33)) + [64, 96, 128, 160]),
        (GraphConfig(disable_padding=True), 40, 1, list(range(1, 33)) + [39, 40]),
        (GraphConfig(), 1, 1, [1]),
    ],
)
def test_capture_size_policy(cfg, max_num_seqs, dp, expected):
    assert capture_sizes(cfg, max_num_seqs, dp) == expected


def test_dp_sizing_helpers():
    assert dp_graph_batch_size([0, 7, 12], tokens_per_req=4) == 3
    assert dp_graph_batch_size([5, 1], tokens_per_req=1) == 5
    sizes = [1, 2, 4, 8]
    assert dp_can_use_graph([True, True], 3, sizes, disable_padding=False)
    assert not dp_can_use_graph([True, False], 3, sizes, disable_padding=False)
    assert not dp_can_use_graph([True, True], 9, sizes, disable_padding=False)
    assert not dp_can_use_graph([True, True], 3, sizes, disable_padding=True)
    assert not dp_can_use_graph([True, True], 0, sizes, disable_padding=False)
    tokens, batch = dp_capture_dummies(8, 4, world_size=3)
    assert tokens == [32, 32, 32] and batch == [8, 8, 8]


def make_engine(path, **kwargs):
    return Engine(path, device="cpu", max_num_seqs=24, max_model_len=128, page_size=4, **kwargs)


def test_padding_picks_smallest_captured_size(llama_dir):
    graphs = make_engine(llama_dir, eager_padding=True).graphs
    assert graphs.sizes == [1, 2, 4, 8, 16, 23, 24]
    assert [graphs.padded_bs(b) for b in (1, 3, 5, 9, 17, 23, 24)] == [1, 4, 8, 16, 23, 23, 24]
    exact = make_engine(llama_dir, eager_padding=True, disable_graph_padding=True).graphs
    assert exact.padded_bs(3) == 3


@pytest.mark.parametrize("bs", [3, 5, 17])
def test_eager_padding_leaves_live_requests_untouched(llama_dir, bs):
    gen = torch.Generator().manual_seed(bs)
    prompts = [
        torch.randint(3, 256, (int(n),), generator=gen).tolist()
        for n in torch.randint(1, 30, (bs,), generator=gen)
    ]
    params = [
        SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=t, seed=i)
        for i, t in enumerate([0.0, 0.8] * bs)
    ][:bs]
    plain, padded = make_engine(llama_dir), make_engine(llama_dir, eager_padding=True)
    calls = []
    original = padded.runner.decode_step
    padded.runner.decode_step = lambda b, *rest: calls.append(b) or original(b, *rest)
    ref = plain.generate(prompts, params)
    out = padded.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert calls and all(b in padded.graphs.sizes for b in calls) and max(calls) > bs - 1
    page = plain.kv.page_size
    for k_ref, k_pad in zip(plain.kv.k + plain.kv.v, padded.kv.k + padded.kv.v, strict=True):
        # Every page but the dummy page 0 holds the same KV; GEMMs over 3 or 4 rows may round
        # the last bit differently, a padded row writing there would differ by O(1).
        torch.testing.assert_close(k_pad[page:], k_ref[page:], rtol=1e-5, atol=1e-5)
    sentinel = padded.kv.sentinel_row
    assert padded.kv.cache_lens[sentinel] == 0 and not padded.kv.req_to_page[sentinel].any()


def check_sentinel_after_every_step(engine) -> list[tuple[int, int, set[int]]]:
    """Wrap the engine's decode step: after each one the sentinel row is still zero (length 0,
    every page entry page 0) and no live row holds page 0. Returns per step (rows run, live
    rows, the live rows' request-pool indices)."""
    kv, runner, steps = engine.kv, engine.runner, []
    inner = runner.decode_step

    def decode_step(bs, variant, *args, **kwargs):
        rows = runner.buffers.req_pool_indices[:bs].tolist()
        out = inner(bs, variant, *args, **kwargs)
        live = {row for row in rows if row != kv.sentinel_row}
        steps.append((bs, len(live), live))
        assert int(kv.cache_lens[kv.sentinel_row]) == 0, "a padded row grew the sentinel row"
        assert not kv.req_to_page[kv.sentinel_row].any(), "the sentinel row gained a page"
        for row in live:
            pages = kv.req_to_page[row, : kv.pages_for(int(kv.cache_lens[row]))]
            assert pages.all(), f"live row {row} maps a position to the dummy page 0"
        return out

    runner.decode_step = decode_step
    return steps


@pytest.mark.parametrize("algo", [None, "eagle3"])
def test_padded_rows_write_only_the_dummy_page_and_leave_the_sentinel_zero(
    llama_dir, tmp_path, algo
):
    """Every request row in use (9 requests through 6 rows, rows freed and reused) and batches
    that shrink to sizes padded with sentinel rows (6 sizes [1, 2, 4, 5, 6]: 3 live rows run as
    4; then a job of 3 requests): after every padded step the sentinel row is still zero and no
    live row maps page 0; the padded rows wrote through the dummy page 0 only (every other page
    equals the unpadded run's) and the tokens equal it."""
    from helpers_eagle import write_random_eagle3

    spec = {}
    if algo == "eagle3":
        write_random_eagle3(tmp_path, llama_dir, draft_vocab=200, seed=2)
        spec = dict(algo="eagle3", draft=str(tmp_path), num_draft_tokens=3)
    options = dict(device="cpu", max_num_seqs=6, max_model_len=128, page_size=4, **spec)
    plain, padded = Engine(llama_dir, **options), Engine(llama_dir, eager_padding=True, **options)
    assert padded.graphs.sizes == [1, 2, 4, 5, 6]
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in (5, 17, 2) * 3]
    lengths = (6, 19, 11, 3, 14, 8, 20, 9, 5)
    params = [
        SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
        for i, n in enumerate(lengths)
    ]
    steps = check_sentinel_after_every_step(padded)
    ref = plain.generate(prompts, params)
    out = padded.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    # three requests alone run as 4 rows, whatever sizes the first job's finishing order gave
    ref, out = plain.generate(prompts[:3], params[:3]), padded.generate(prompts[:3], params[:3])
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert any(bs > live for bs, live, _ in steps), "no step ran padded rows"
    assert set().union(*(rows for *_, rows in steps)) == set(range(6)), "a row was never used"
    page = plain.kv.page_size
    for k_ref, k_pad in zip(plain.kv.k + plain.kv.v, padded.kv.k + padded.kv.v, strict=True):
        torch.testing.assert_close(k_pad[page:], k_ref[page:], rtol=1e-5, atol=1e-5)
        assert not k_ref[:page].any()  # nothing unpadded writes the dummy page ...
    assert any(k[:page].any() for k in padded.kv.k)  # ... padded rows wrote it


class RecordingGraph:
    def __init__(self, log):
        self.log = log

    def replay(self):
        self.log.append("replay")


class RecordingHook:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def capture(self):
        self.log.append(f"{self.name}.capture")

    def replay(self):
        self.log.append(f"{self.name}.replay")


def fake_captured(engine, log, variants):
    graphs = engine.graphs
    graphs.use_graphs = graphs.pad = True
    out = StepOutput(
        torch.zeros(8, 1, dtype=torch.long),
        torch.ones(8, dtype=torch.long),
        torch.zeros(8, 0, dtype=torch.long),
    )
    for variant in variants:
        for bs in graphs.sizes:
            graphs.graphs[graphs.key(variant, bs)] = RecordingGraph(log)
            graphs.outputs[graphs.key(variant, bs)] = out
    return graphs


def test_replay_hooks_run_before_every_replay_in_order(llama_dir):
    log = []
    graphs = fake_captured(make_engine(llama_dir), log, ["greedy"])
    graphs.hooks += [RecordingHook("a", log), RecordingHook("b", log)]
    for bs in (1, 3, 5):
        result = graphs.run(bs, graphs.padded_bs(bs), "greedy")
        assert result.tokens.shape[0] == bs
    assert log == ["a.replay", "b.replay", "replay"] * 3


def test_uncaptured_variant_names_the_captured_ones(llama_dir):
    graphs = fake_captured(make_engine(llama_dir), [], ["greedy"])
    with pytest.raises(SpeculantError, match=r"'full'.*\['greedy'\]"):
        graphs.run(2, 2, "full")
