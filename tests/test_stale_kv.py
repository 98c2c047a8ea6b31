"""Stale KV slots (a freed row's pages, rejected drafts' positions) never reach the output: the
torch attention backend and the kernels' torch references read whole pages and hid the stale
keys with a mask, through which a non-finite value (a diverged checkpoint's K/V, an fp16
overflow) still poisoned the next request on the page (NaN + -inf = NaN, 0 x NaN = NaN; a helper
audit: after a NaN checkpoint, loading good weights back never recovered). Also what an engine
refuses while `generate` runs, and `load_weights`' argument."""

from __future__ import annotations

import shutil

import pytest
import torch

import speculant
from speculant import Engine, SamplingParams, SpeculantError
from speculant.executor.attention import TorchPagedAttention
from speculant.executor.forward_batch import ForwardBatch, ForwardMode
from speculant.kernels.reference import paged_attention

TARGET = speculant.bundled("target")
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\nimport json\nimport time\n", "x = ["]
DRAFTERS = {
    None: {"num_draft_tokens": 0},
    "eagle3": {"algo": "eagle3", "draft": speculant.bundled("eagle3")},
    "dflash": {"algo": "dflash", "draft": speculant.bundled("dflash")},
}


def nan_checkpoint(tmp_path):
    """The bundled target with one layer's weights NaN (a diverged checkpoint)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "nan"
    shutil.copytree(TARGET, path)
    for file in path.glob("*.safetensors"):
        weights = load_file(str(file))
        for name in weights:
            if ".layers.1." in name:
                weights[name] = torch.full_like(weights[name], float("nan"))
        save_file(weights, str(file), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_output_recovers_after_a_nan_checkpoint(tmp_path, drafter):
    """Generate on a NaN checkpoint (every K/V it writes non-finite), load the good weights
    back: the engine's output equals a fresh engine's, though the NaN K/V stay in the pages it
    hands out next."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    options = dict(device="cpu", max_num_seqs=2, page_size=4, **DRAFTERS[drafter])
    fresh = Engine(TARGET, **options).generate(PROMPTS, params)
    engine = Engine(TARGET, **options)
    engine.load_weights(str(nan_checkpoint(tmp_path)))
    engine.generate(PROMPTS, params)
    assert not all(bool(torch.isfinite(pool).all()) for pool in engine.kv.k)  # NaN left behind
    engine.load_weights(str(TARGET))
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [o.token_ids for o in fresh]


def test_stale_slots_read_as_zeros():
    """TorchPagedAttention and the reference: pools whose every slot past the rows' positions
    holds NaN / inf give the output of pools holding zeros there (decode rows of T tokens and
    packed sequences)."""
    torch.manual_seed(0)
    page, pages, heads, kv_heads, d = 4, 12, 4, 2, 8
    slots = page * pages + 1  # and the zero slot past every page, as PagedKVCache lays pools out
    req_to_page = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0]], dtype=torch.int32)
    lengths = [7, 13]  # each row's positions after this step's tokens
    T = 3
    live = torch.zeros(slots, dtype=torch.bool)
    for row, length in enumerate(lengths):
        for p in range(length):
            live[int(req_to_page[row, p // page]) * page + p % page] = True
    k_clean, v_clean = torch.randn(slots, kv_heads, d), torch.randn(slots, kv_heads, d)
    k_clean[~live], v_clean[~live] = 0.0, 0.0
    k_bad, v_bad = k_clean.clone(), v_clean.clone()
    live[-1] = True  # the zero slot: no page holds it, nothing writes it
    k_bad[~live], v_bad[~live] = float("nan"), float("inf")
    positions = torch.tensor([[n - T + t for t in range(T)] for n in lengths]).view(-1)
    rows = torch.tensor([0, 1])
    q = torch.randn(len(positions), heads, d)
    for decode in (True, False):
        outs = []
        for k_pool, v_pool in ((k_clean, v_clean), (k_bad.clone(), v_bad.clone())):
            batch = ForwardBatch(
                mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
                bs=2, tokens_per_req=T if decode else 0, input_ids=torch.zeros(len(positions)),
                positions=positions, req_pool_indices=rows,
                out_cache_loc=torch.tensor(
                    [int(req_to_page[r, p // page]) * page + p % page
                     for r, n in enumerate(lengths) for p in range(n - T, n)]
                ),
                kv_len=4 * page, seq_lens=None if decode else (T, T),
            )  # fmt: skip
            attn = TorchPagedAttention([k_pool], [v_pool], req_to_page, page)
            attn.prepare(batch)
            k_new = k_pool[batch.out_cache_loc].clone()
            v_new = v_pool[batch.out_cache_loc].clone()
            outs.append(attn.forward(0, q, k_new, v_new))
        assert torch.isfinite(outs[1]).all() and torch.allclose(outs[0], outs[1])
    ref = [paged_attention(q, k, v, req_to_page, rows, positions, page, 4 * page, T)
           for k, v in ((k_clean, v_clean), (k_bad, v_bad))]  # fmt: skip
    assert torch.isfinite(ref[1]).all() and torch.allclose(ref[0], ref[1])


def test_model_changes_are_refused_while_generate_runs(tmp_path):
    """load_weights, clear_graphs and capture_graphs from inside on_output (generate running)
    are refused like a nested generate: the requests in flight would mix two models."""
    engine = Engine(TARGET, device="cpu", num_draft_tokens=0)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for call in (lambda: engine.load_weights(str(TARGET)), engine.clear_graphs,
                 engine.capture_graphs):  # fmt: skip
        errors = []

        def on_output(out, call=call, errors=errors):
            try:
                call()
            except SpeculantError as exc:
                errors.append(str(exc))

        engine.generate(PROMPTS, params, on_output=on_output)
        assert errors and "while generate runs on this engine" in errors[0], errors
    expected = Engine(TARGET, device="cpu", num_draft_tokens=0).generate(PROMPTS, params)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [
        o.token_ids for o in expected
    ]
    for bad in (None, 5, "", str(tmp_path / "missing"), str(TARGET / "config.json")):
        with pytest.raises(SpeculantError, match=r"load_weights\("):
            engine.load_weights(bad)
