"""Graphs of extend steps by padded token count (executor/piecewise.py, [piecewise]) on the CPU:
the bucket policy, the static layout (padding tokens in the sentinel row, unused tiles empty),
the static tile table on the Triton kernel (interpreter), eager padding token-equal to unpadded
steps (plain, EAGLE-3, DFLASH; greedy and seeded sampling), the capture bookkeeping with a
stand-in graph (lazy = eager capture, order, uncaptured shapes), a capture-order mismatch over
two gloo ranks, clear and recapture, and `Engine.load_weights`; the drafters' N-token part of
extend steps through the same buckets (EAGLE-3's K/V, then its layer at the last positions only;
DFLASH's context K/V; the draft model's forward): padded == unpadded, lazy == eager capture,
clear / recapture, an uncaptured drafter shape. The `gpu` tests replay real graphs."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # triton reads it once, when first imported

import helpers_ckpt  # noqa: E402
from helpers_eagle import write_random_eagle3  # noqa: E402

from speculant import Engine, SamplingParams, SpeculantError  # noqa: E402
from speculant.comm.groups import ParallelContext  # noqa: E402
from speculant.config import GraphConfig  # noqa: E402
from speculant.executor.bucket_graphs import (  # noqa: E402
    BucketEntry,
    bucket_layout,
    num_bucket_tiles,
    tile_block_m,
)
from speculant.executor.piecewise import DEFAULT_SIZES, piecewise_sizes  # noqa: E402
from speculant.kernels import runtime  # noqa: E402
from speculant.kernels.paged_attention import (  # noqa: E402
    VarlenTiles,
    paged_attention,
    varlen_tiles,
)
from speculant.launch.cli import build_parser  # noqa: E402
from speculant.launch.spawn import RankFailure, run_ranks  # noqa: E402

ENGINE = dict(device="cpu", max_num_seqs=8, max_model_len=256, page_size=4)
BUDGET = 64  # max_num_batched_tokens: long prompts take several chunks, buckets 16, 32, 64


def prompts_of(lengths, seed=0, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def mixed_params(n, max_new_tokens=10):
    """Greedy and seeded sampled requests, alternating."""
    return [
        SamplingParams(
            max_new_tokens=max_new_tokens, ignore_eos=True, temperature=0.8 * (i % 2), seed=i
        )
        for i in range(n)
    ]


PROMPTS = prompts_of((5, 40, 90, 3, 17, 60, 9))  # chunks of 64 tokens and mixed steps
JOBS = [PROMPTS, PROMPTS[:1], PROMPTS[4:5]]  # and steps of buckets 16 and 32
# The Triton backend's engine tests (its interpreter on the CPU): mixed lengths, 97 tokens
TRITON_PROMPTS = prompts_of((5, 40, 3, 17, 9, 23), seed=1)


def run_jobs(eng) -> list[list[int]]:
    """Every job's tokens, one generate call each (greedy and seeded requests)."""
    return [o.token_ids for job in JOBS for o in eng.generate(job, mixed_params(len(job)))]


def engine(path, **kwargs):
    options = dict(ENGINE, max_num_batched_tokens=BUDGET, piecewise=True)
    options.update(kwargs)
    return Engine(path, **options)


# ------------------------------------------------------------------------------ sizes and layout


@pytest.mark.parametrize(
    "cfg, budget, expected",
    [
        (GraphConfig(piecewise=False), 8192, []),  # Engine(..., piecewise=False)
        (GraphConfig(piecewise=True), 8192, list(DEFAULT_SIZES)),
        (GraphConfig(piecewise=True), 2048, list(DEFAULT_SIZES)),
        (GraphConfig(piecewise=True), 3000, list(DEFAULT_SIZES)),  # the default stops at 2048
        (GraphConfig(piecewise=True), 1000, [s for s in DEFAULT_SIZES if s < 1000] + [1000]),
        (GraphConfig(piecewise=True), 10, [10]),
        (GraphConfig(piecewise_sizes=[64, 16, 16]), 2048, [16, 64]),
        (GraphConfig(piecewise_sizes=[16, 5000]), 2048, [16, 2048]),
        (GraphConfig(piecewise_sizes=[]), 2048, []),
    ],
)
def test_piecewise_size_policy(cfg, budget, expected):
    assert piecewise_sizes(cfg, budget) == expected


def test_cli_piecewise_flags():
    assert GraphConfig().piecewise  # on by default
    args = build_parser().parse_args(["generate", "--piecewise-sizes", "none"])
    assert args.piecewise_sizes == [] and args.piecewise_capture == "eager"
    args = build_parser().parse_args(
        ["generate", "--piecewise-sizes", "32,16", "--piecewise-capture", "lazy"]
    )
    assert args.piecewise_sizes == [32, 16] and args.piecewise_capture == "lazy"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--piecewise-sizes", "0,16"])


@pytest.mark.parametrize("mode", ["later", None, ["lazy"]])
def test_bad_capture_mode_is_a_clear_error(llama_dir, monkeypatch, mode):
    """Refused before the model loads (was after it, when the piecewise runner was built)."""
    import speculant.executor.engine as engine_module

    def refuse(*args, **kwargs):
        raise AssertionError("the model loaded before piecewise_capture was checked")

    monkeypatch.setattr(engine_module, "build_model", refuse)
    match = rf"piecewise capture {re.escape(repr(mode))} is not supported; use eager or lazy"
    with pytest.raises(SpeculantError, match=match):
        engine(llama_dir, piecewise_capture=mode)


def make_entry(num_tokens, max_seqs, group, device="cpu"):
    block_m = tile_block_m(group, num_tokens)
    num_tiles = num_bucket_tiles(group, num_tokens, max_seqs, block_m)
    return BucketEntry(
        num_tokens, max_seqs, block_m, num_tiles,
        tokens=torch.zeros(3, num_tokens, dtype=torch.int64, device=device),
        rows=torch.zeros(max_seqs + 2, dtype=torch.int64, device=device),
        meta=torch.zeros(2 * (max_seqs + 2) + 2 * num_tiles, dtype=torch.int32, device=device),
    )  # fmt: skip


@pytest.mark.parametrize(
    "lens, group",
    [([4] * 8, 4), ([1] * 16, 1), ([4, 4, 13, 1], 2), ([64], 8), ([7, 30], 4), ([3], 16)],
)
def test_bucket_layout_covers_each_query_row_once(lens, group):
    """Every (token, head) query row of the step and of the padding is in exactly one tile of
    its own sequence, the padding sequence sits in the sentinel row, and the tiles left over
    name the empty last sequence slot (length 0)."""
    N, max_seqs, sentinel = 64, 16, 99
    entry = make_entry(N, max_seqs, group)
    rows = list(range(len(lens)))
    seq_lens, all_rows, meta = bucket_layout(entry, lens, rows, group, sentinel)
    slots, t = entry.num_seq_slots, entry.num_tiles
    starts, lengths = meta[:slots], meta[slots : 2 * slots]
    tile_seq, tile_m0 = meta[2 * slots : 2 * slots + t], meta[2 * slots + t :]
    pad = N - sum(lens)
    assert seq_lens == tuple(lens) + ((pad,) if pad else ())
    assert all_rows[: len(lens)] == rows and set(all_rows[len(lens) :]) == {sentinel}
    assert lengths[slots - 1] == 0 and sum(lengths) == N
    covered = {}
    for seq, m0 in zip(tile_seq, tile_m0, strict=True):
        for m in range(m0, m0 + entry.block_m):
            if m < group * lengths[seq]:
                key = (starts[seq] + m // group, m % group)
                covered[key] = covered.get(key, 0) + 1
    assert covered == {(tok, h): 1 for tok in range(N) for h in range(group)}
    used = [seq for seq in tile_seq if seq != slots - 1]
    assert tile_seq[len(used) :] == [slots - 1] * (t - len(used))


def test_bucket_tiles_suffice_for_the_worst_layout():
    """The most tiles a bucket can need: every sequence one token past a tile boundary."""
    for group in (1, 2, 4, 8):
        for N in (16, 64, 256):
            max_seqs = min(N, 12)
            entry = make_entry(N, max_seqs, group)
            per = max(1, entry.block_m // group + 1)
            lens = [min(per, N // max_seqs)] * max_seqs
            lens[-1] += N - sum(lens) - 1  # one padding token
            bucket_layout(entry, lens, list(range(max_seqs)), group, 0)  # asserts it fits


@pytest.mark.needs("triton")
@pytest.mark.skipif(
    runtime.HAS_TRITON and not runtime.INTERPRET and not torch.cuda.is_available(),
    reason="needs Triton's interpreter (TRITON_INTERPRET=1 before triton's import) or CUDA",
)
def test_static_tile_table_matches_the_eager_one_on_the_kernel():
    """The Triton kernel over a bucket's static layout (padded tokens, worst-case tile table,
    the max kv_len) gives the step's rows the eager varlen output, and finite padding rows."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d, page, rows_n, pages_per_row = 4, 2, 16, 4, 6, 16
    group = heads // kv_heads
    num_slots = (rows_n * pages_per_row + 1) * page
    k_pool = torch.randn(num_slots, kv_heads, d, generator=gen).to(device)
    v_pool = torch.randn(num_slots, kv_heads, d, generator=gen).to(device)
    req_to_page = torch.zeros(rows_n + 1, pages_per_row, dtype=torch.int32)
    req_to_page[:rows_n] = 1 + torch.arange(rows_n * pages_per_row).view(rows_n, -1)
    req_to_page = req_to_page.to(device)
    lens, starts_at, rows = [4, 4, 13, 1], [9, 20, 0, 33], [3, 0, 5, 1]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts_at, lens, strict=True)])
    n, N = sum(lens), 32
    q = torch.randn(n, heads, d, generator=gen).to(device)
    kv_len = 48
    eager = paged_attention(
        q, k_pool, v_pool, req_to_page, torch.tensor(rows, device=device), positions.to(device),
        page, kv_len, 0, varlen=varlen_tiles(lens, group, torch.device(device)),
    )  # fmt: skip
    entry = make_entry(N, max_seqs=8, group=group, device=device)
    seq_lens, all_rows, meta = bucket_layout(entry, lens, rows, group, rows_n)
    entry.rows.copy_(torch.tensor(all_rows))
    entry.meta.copy_(torch.tensor(meta, dtype=torch.int32))
    tiles = VarlenTiles(seq_lens, group, entry.block_m, entry.num_tiles, entry.tile_tensors())
    q_pad = torch.cat([q, torch.zeros(N - n, heads, d, device=device)])
    pos_pad = torch.cat([positions, torch.zeros(N - n, dtype=torch.int64)]).to(device)
    static = paged_attention(
        q_pad, k_pool, v_pool, req_to_page, entry.rows, pos_pad, page,
        pages_per_row * page, 0, varlen=tiles,
    )  # fmt: skip
    torch.testing.assert_close(static[:n], eager, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(static).all()


# ------------------------------------------------------------------------------ eager padding


def drafter_options(kind, llama_dir, tmp_path):
    if kind == "eagle3":
        from helpers_eagle import write_random_eagle3

        write_random_eagle3(tmp_path, llama_dir, draft_vocab=200, seed=2)
        return dict(algo="eagle3", draft=str(tmp_path), num_draft_tokens=3)
    if kind == "dflash":
        from helpers_dflash import write_random_dflash

        write_random_dflash(tmp_path, llama_dir, block_size=4, target_layer_ids=[1, 0], seed=3)
        return dict(algo="dflash", draft=str(tmp_path))
    if kind == "draft-model":  # another shape (GQA group 4): its own tile layout
        draft = helpers_ckpt.save_hf_model(
            tmp_path / "draft", "qwen3", seed=4, num_hidden_layers=2, num_key_value_heads=1,
            tokenizer_dir=llama_dir,
        )  # fmt: skip
        return dict(algo="draft-model", draft=str(draft), num_draft_tokens=3)
    return {}


DRAFTERS = ["eagle3", "dflash", "draft-model"]


def drafter_pools(eng) -> list[torch.Tensor]:
    return eng.drafter.k_pools + eng.drafter.v_pools


@pytest.mark.parametrize("kind", ["plain", *DRAFTERS])
def test_eager_padding_is_token_equal_to_unpadded_steps(llama_dir, tmp_path, kind):
    """Prefill and mixed steps padded to their bucket (padding in the sentinel row) give the
    unpadded run's tokens, greedy and seeded-sampled; padded tokens wrote only the dummy
    page 0 and the sentinel row stays zero. The drafter's N-token part ran padded in every
    extend step, and its K/V equal the unpadded run's outside page 0."""
    spec = drafter_options(kind, llama_dir, tmp_path)
    plain = engine(llama_dir, piecewise_sizes=[], **spec)
    padded = engine(llama_dir, eager_padding=True, **spec)
    assert padded.piecewise.sizes == [16, 32, 64] and padded.piecewise.pad
    assert run_jobs(padded) == run_jobs(plain)
    stats = padded.piecewise.stats
    assert stats.padded_eager == padded.extend_steps and set(stats.by_size) == {16, 32, 64}
    assert plain.piecewise.stats.padded_eager == 0
    page, kv = plain.kv.page_size, padded.kv
    for k_ref, k_pad in zip(plain.kv.k + plain.kv.v, kv.k + kv.v, strict=True):
        torch.testing.assert_close(k_pad[page:], k_ref[page:], rtol=1e-5, atol=1e-5)
    assert int(kv.cache_lens[kv.sentinel_row]) == 0 and not kv.req_to_page[kv.sentinel_row].any()
    if kind == "plain":
        assert padded.piecewise.drafter is None
        return
    dstats = padded.piecewise.drafter.stats
    assert dstats.padded_eager == padded.extend_steps and set(dstats.by_size) == {16, 32, 64}
    assert plain.piecewise.drafter.stats.padded_eager == 0
    for ref, pad in zip(drafter_pools(plain), drafter_pools(padded), strict=True):
        torch.testing.assert_close(pad[page:], ref[page:], rtol=1e-5, atol=1e-5)


@pytest.mark.needs("triton")
def test_eager_padding_on_the_triton_backend(llama_dir):
    """The Triton backend's padded batches carry the static tile table (its CPU fallback reads
    the padded sequence lengths): still token-equal to unpadded steps (those of the torch
    backend here: the Triton backend's unpadded steps equal them,
    test_triton_decode_row_plan_equals_the_torch_backend)."""
    # Triton's interpreter runs a program per token in the norm and RoPE kernels: shorter
    # prompts than PROMPTS (still a chunk of 64 tokens, then a mixed step padded to 64)
    params = mixed_params(len(TRITON_PROMPTS), max_new_tokens=4)
    ref = engine(llama_dir, piecewise_sizes=[], attention_backend="torch")
    want = [o.token_ids for o in ref.generate(TRITON_PROMPTS, params)]
    padded = engine(llama_dir, eager_padding=True, attention_backend="triton")
    assert [o.token_ids for o in padded.generate(TRITON_PROMPTS, params)] == want
    assert padded.piecewise.stats.padded_eager > 0


@pytest.mark.needs("triton")
def test_triton_decode_row_plan_equals_the_torch_backend(llama_dir, monkeypatch, tmp_path):
    """Decode steps of mixed context lengths (3..40 + 4) through the Triton backend's decode
    attention's RowPlan (what the default takes for batches this small) token-equal to the
    torch backend (greedy and seeded sampled requests); EAGLE-3 verify and drafting steps
    through the plan: greedy spec == greedy plain."""
    from speculant.executor.triton_attention import TritonPagedAttention

    # (Triton's interpreter: a program per token in the norm and RoPE kernels, so short prompts)
    params = mixed_params(len(TRITON_PROMPTS), max_new_tokens=4)  # 3 decode steps of every row
    ref = engine(llama_dir, piecewise_sizes=[], attention_backend="torch")
    want = [o.token_ids for o in ref.generate(TRITON_PROMPTS, params)]
    monkeypatch.setattr(TritonPagedAttention, "row_layout", "plan")  # longest first: test_kernels
    out = engine(llama_dir, piecewise_sizes=[], attention_backend="triton")
    assert [o.token_ids for o in out.generate(TRITON_PROMPTS, params)] == want
    # verify steps (4 query tokens a row) and the drafter's decode steps through the plan:
    # greedy speculative output equals greedy plain output
    write_random_eagle3(tmp_path / "eagle3", llama_dir, draft_vocab=200, seed=7)
    prompts, greedy = TRITON_PROMPTS[1:3], SamplingParams(max_new_tokens=4, ignore_eos=True)
    plain = engine(llama_dir, piecewise_sizes=[], attention_backend="torch")
    want = [o.token_ids for o in plain.generate(prompts, greedy)]
    monkeypatch.setattr(TritonPagedAttention, "row_layout", "plan")
    spec = engine(llama_dir, piecewise_sizes=[], attention_backend="triton", algo="eagle3",
                  draft=str(tmp_path / "eagle3"), num_draft_tokens=3)  # fmt: skip
    outs = spec.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == want
    assert all(o.stats["num_verify_steps"] > 1 for o in outs)  # batched verify steps ran


def test_steps_past_the_largest_bucket_run_unpadded(llama_dir):
    padded = engine(llama_dir, eager_padding=True, piecewise_sizes=[16])
    assert padded.piecewise.sizes == [16]
    out = padded.generate(PROMPTS[:3], mixed_params(3))
    ref = engine(llama_dir, piecewise_sizes=[]).generate(PROMPTS[:3], mixed_params(3))
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert padded.piecewise.stats.unpadded > 0 and padded.piecewise.stats.padded_eager > 0


# ------------------------------------------------------------------ EAGLE-3's extend, restructured


@pytest.mark.parametrize("padding", [False, True])
def test_eagle3_extend_runs_its_layer_at_the_last_positions_only(padding):
    """On the bundled target and EAGLE-3 head (float32): every extend step (prefill, chunks,
    mixed steps) writes the K/V of all N positions without attention, then runs the layer at
    the bs last positions only; its drafts, q and the head's K/V equal the whole-head path's,
    and greedy speculative decoding equals plain decoding."""
    from speculant import bundled

    options = dict(
        device="cpu", dtype="float32", max_num_seqs=8, max_model_len=256, page_size=4,
        max_num_batched_tokens=BUDGET, piecewise_sizes=None if padding else [],
        eager_padding=padding,
    )  # fmt: skip
    target = str(bundled("target"))
    spec = Engine(target, algo="eagle3", draft=str(bundled("eagle3")), num_draft_tokens=3,
                  **options)  # fmt: skip
    drafter, head = spec.drafter, spec.drafter.head
    head_rows, checked = [], []
    forward, propose = head.forward, drafter.propose

    def counting_forward(embeds, *args):
        head_rows.append(embeds.shape[0])
        return forward(embeds, *args)

    def compared_propose(inputs, sampling, variant, num_drafts):
        if not inputs.batch.is_varlen:
            return propose(inputs, sampling, variant, num_drafts)
        pools = drafter_pools(spec)
        before = [p.clone() for p in pools]
        head_rows.clear()
        new = propose(inputs, sampling, variant, num_drafts)
        rows, graphs = inputs.batch.bs, spec.piecewise.per_sequence
        if graphs is not None and graphs.drafts_cheaply(rows, variant):  # padded to its size
            rows = graphs.bucket(rows)
        assert head_rows and max(head_rows) == rows  # one query per sequence (and padding)
        after = [p.clone() for p in pools]
        for pool, saved in zip(pools, before, strict=True):
            pool.copy_(saved)
        old = drafter.propose_whole_head(inputs, sampling, variant, num_drafts)
        assert torch.equal(new.tokens, old.tokens)
        assert (new.probs is None) == (old.probs is None)
        if new.probs is not None:
            torch.testing.assert_close(new.probs, old.probs, rtol=1e-5, atol=1e-6)
        page = spec.kv.page_size  # the padding's sentinel page 0 differs
        for pool, mine in zip(pools, after, strict=True):
            torch.testing.assert_close(mine[page:], pool[page:], rtol=1e-5, atol=1e-5)
            pool.copy_(mine)
        checked.append(inputs.batch.seq_lens)
        return new

    head.forward, drafter.propose = counting_forward, compared_propose
    prompts = prompts_of((5, 40, 90, 3, 17, 60, 9), vocab=4096)
    outs = spec.generate(prompts, mixed_params(len(prompts), max_new_tokens=12))
    assert len(checked) == spec.extend_steps and any(len(lens) > 1 for lens in checked)
    assert any(o.stats["accept_len"] > 1.5 for o in outs)  # a trained head: drafts accepted
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = Engine(target, **options).generate(prompts, greedy)
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == [o.token_ids for o in plain]


def test_dflash_extend_writes_the_context_then_drafts_from_the_last_positions():
    """On the bundled target and DFLASH drafter (float32): the context K/V of every position
    first (graphed by bucket), then the block from each sequence's last position only, gives
    the drafts, and the drafter's K/V, of one block forward over the whole chunk's context."""
    from dataclasses import replace

    from speculant import bundled

    target = str(bundled("target"))
    spec = Engine(
        target, algo="dflash", draft=str(bundled("dflash")), device="cpu", dtype="float32",
        max_num_seqs=8, max_model_len=256, page_size=4, max_num_batched_tokens=BUDGET,
        eager_padding=True,
    )  # fmt: skip
    drafter, checked = spec.drafter, []
    propose = drafter.propose

    def compared_propose(inputs, sampling, variant, num_drafts):
        if not inputs.batch.is_varlen:
            return propose(inputs, sampling, variant, num_drafts)
        pools = drafter_pools(spec)
        before = [p.clone() for p in pools]
        new = propose(inputs, sampling, variant, num_drafts)
        after = [p.clone() for p in pools]
        for pool, saved in zip(pools, before, strict=True):
            pool.copy_(saved)
        whole = replace(inputs, batch=replace(inputs.batch, seq_lens=None))  # the old path
        old = propose(whole, sampling, variant, num_drafts)
        assert torch.equal(new.tokens, old.tokens)
        page = spec.kv.page_size
        for pool, mine in zip(pools, after, strict=True):
            torch.testing.assert_close(mine[page:], pool[page:], rtol=1e-5, atol=1e-5)
            pool.copy_(mine)
        checked.append(inputs.batch.seq_lens)
        return new

    drafter.propose = compared_propose
    prompts = prompts_of((5, 40, 90, 3, 17, 60, 9), vocab=4096)
    outs = spec.generate(prompts, mixed_params(len(prompts), max_new_tokens=12))
    assert len(checked) == spec.extend_steps and any(len(lens) > 1 for lens in checked)
    assert any(o.stats["accept_len"] > 1.5 for o in outs)  # trained: drafts accepted
    assert spec.piecewise.drafter.stats.padded_eager == spec.extend_steps


# ------------------------------------------------------------------ capture (stand-in graph)


class StandInGraph:
    """A CPU stand-in for a captured graph: replay re-runs the forward reading only the entry's
    static buffers (the CPU attention's host sequence lengths are read back from them) and
    writes the captured output buffers, as a replay does."""

    def __init__(self, pw, entry, outputs):
        self.pw, self.entry, self.outputs = pw, entry, outputs

    def replay(self):
        slots = self.entry.num_seq_slots
        lens = self.entry.meta[slots : 2 * slots].tolist()
        batch = self.pw._batch(self.entry, tuple(n for n in lens if n))
        out = self.pw._run(batch)
        if self.outputs is None:  # a drafter's K/V writes: no outputs
            return
        self.outputs[0].copy_(out[0])
        for dst, src in zip(self.outputs[1], out[1], strict=True):
            dst.copy_(src)


def stand_in_capture(pw, log, stand_in=None):
    """Turn a bucket runner (the target's, the drafter's, or with `stand_in` StandInPropose its
    per-sequence graphs) to graph mode with stand-ins."""
    stand_in = stand_in or StandInGraph

    def capture_one(entry):
        batch = pw._fill_dummy(entry)
        while entry.num_warmups < 2:
            pw._run(batch)
            entry.num_warmups += 1
        out = pw._run(batch)
        entry.graph, entry.outputs, entry.captured = stand_in(pw, entry, out), out, True
        pw.capture_order.append(entry.num_tokens)
        log.append(entry.num_tokens)

    pw._capture_one = capture_one
    pw.graphs_possible = pw.pad = True


def stand_in_graphs(eng, log, drafter_log=None):
    """Turn the engine's piecewise runner (and its drafter's) to graph mode with stand-ins."""
    pw = eng.piecewise
    stand_in_capture(pw, log)
    if pw.drafter is not None:
        stand_in_capture(pw.drafter, [] if drafter_log is None else drafter_log)
    pw.capture = lambda: capture_with_stand_ins(pw)  # what Engine.capture_graphs calls
    return pw


def capture_with_stand_ins(pw):
    """`PiecewiseRunner.capture`'s graph branch without CUDA (its order and bookkeeping): the
    target's buckets, then the drafter's."""
    for runner in [pw] + ([pw.drafter] if pw.drafter is not None else []):
        runner.use_graphs = True
        for n in runner.capture_plan():
            runner._capture_one(runner.entries[n])


def record_extend_drafts(eng) -> list[list[list[int]]]:
    """Every later extend step's drafts per sequence, as the engine reads them back."""
    drafts, extend = [], eng.runner.extend

    def recording(*args, **kwargs):
        out = extend(*args, **kwargs)
        drafts.append(out.drafts.tolist())
        return out

    eng.runner.extend = recording
    return drafts


class StandInPropose:
    """A CPU stand-in for a per-sequence drafting graph: replay re-runs the drafting from the
    entry's static buffers and writes the captured output buffer."""

    def __init__(self, graphs, entry, outputs):
        self.graphs, self.entry, self.outputs = graphs, entry, outputs

    def replay(self):
        self.outputs.copy_(self.graphs._run(self.graphs._inputs(self.entry).batch))


def capture_propose_stand_ins(graphs, log):
    """`ProposeGraphs.capture`'s graph branch without CUDA: warm-ups, capture order."""
    stand_in_capture(graphs, log, StandInPropose)
    graphs.use_graphs = True
    for n in graphs.capture_plan():
        graphs._capture_one(graphs.entries[n])


@pytest.mark.parametrize("kind", DRAFTERS)
def test_per_sequence_drafting_runs_by_row_count(llama_dir, tmp_path, kind):
    """The drafter's per-sequence part of greedy extend steps (the drafts from each sequence's
    last position: executor/propose_graphs.py) by padded row count, the decode graphs' sizes:
    padded eagerly, and through stand-in graphs captured at start (largest first) and replayed,
    the unpadded engine's tokens and acceptance (its K/V too, outside page 0). A step with a
    sampled row drafts eagerly, unpadded."""
    spec = drafter_options(kind, llama_dir, tmp_path)
    greedy = [SamplingParams(max_new_tokens=10, ignore_eos=True)] * len(PROMPTS)
    plain = engine(llama_dir, piecewise_sizes=[], **spec)
    ref_drafts = record_extend_drafts(plain)
    ref = plain.generate(PROMPTS, greedy)
    assert plain.piecewise.per_sequence is None
    padded = engine(llama_dir, eager_padding=True, **spec)
    graphs = padded.piecewise.per_sequence
    assert graphs.sizes == [1, 2, 4, 7, 8] and graphs.pad and padded.drafter.per_sequence is graphs
    extends, drafts = padded.extend_steps, record_extend_drafts(padded)
    out = padded.generate(PROMPTS, greedy)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert drafts == ref_drafts  # every extend step's drafts (random drafters accept ~nothing)
    assert [o.stats["accept_len"] for o in out] == [o.stats["accept_len"] for o in ref]
    assert graphs.stats.padded_eager == padded.extend_steps - extends > 0
    page = plain.kv.page_size
    for k_ref, k_pad in zip(drafter_pools(plain), drafter_pools(padded), strict=True):
        torch.testing.assert_close(k_pad[page:], k_ref[page:], rtol=1e-5, atol=1e-5)
    eng, log = engine(llama_dir, **spec), []
    graphs = eng.piecewise.per_sequence
    capture_propose_stand_ins(graphs, log)
    assert log == [8, 7, 4, 2, 1] == graphs.capture_order
    extends, drafts = eng.extend_steps, record_extend_drafts(eng)
    out = eng.generate(PROMPTS, greedy)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref] and drafts == ref_drafts
    assert graphs.stats.replays == eng.extend_steps - extends > 0
    replays, params = graphs.stats.replays, mixed_params(2)  # a greedy and a sampled request
    sampled = eng.generate(PROMPTS[:2], params)
    assert graphs.stats.replays == replays  # drafted eagerly
    assert [o.token_ids for o in sampled] == [
        o.token_ids for o in plain.generate(PROMPTS[:2], params)
    ]
    eng.clear_graphs()
    assert graphs.capture_order == [] and not any(e.captured for e in graphs.entries.values())


@pytest.mark.parametrize("kind", ["plain", *DRAFTERS])
def test_lazy_and_eager_capture_give_equal_tokens(llama_dir, tmp_path, kind):
    """Capture at start (largest first) or on each bucket's first use: the same tokens as
    unpadded eager steps; every entry warmed up twice, captured once, replayed after. The
    drafter's entries likewise, captured after the target's, replayed in every extend step."""
    spec = drafter_options(kind, llama_dir, tmp_path)
    ref = run_jobs(engine(llama_dir, piecewise_sizes=[], **spec))
    results = {}
    for mode in ("eager", "lazy"):
        eng, log, dlog = engine(llama_dir, piecewise_capture=mode, **spec), [], []
        pw = stand_in_graphs(eng, log, dlog)
        capture_with_stand_ins(pw)
        assert log == ([64, 32, 16] if mode == "eager" else [])
        assert dlog == ([] if kind == "plain" or mode == "lazy" else [64, 32, 16])
        out = run_jobs(eng)
        assert out == ref, mode
        runners = [pw] + ([pw.drafter] if kind != "plain" else [])
        for runner, order in zip(runners, (log, dlog), strict=False):
            assert sorted(order) == [16, 32, 64] and runner.capture_order == order
            assert all(e.captured and e.num_warmups == 2 for e in runner.entries.values())
            assert runner.stats.replays == eng.extend_steps and runner.stats.padded_eager == 0
        results[mode] = out
    assert results["eager"] == results["lazy"]


def test_a_shape_must_be_captured_before_it_replays(llama_dir):
    eng = engine(llama_dir)
    pw = stand_in_graphs(eng, [])
    pw.use_graphs = True  # eager capture mode, nothing captured
    with pytest.raises(SpeculantError, match=r"no piecewise graph was captured for 16 tokens"):
        eng.generate(PROMPTS[:1], mixed_params(1))


def test_an_uncaptured_drafter_shape_is_refused(llama_dir, tmp_path):
    eng = engine(llama_dir, **drafter_options("eagle3", llama_dir, tmp_path))
    pw = stand_in_graphs(eng, [])
    pw.use_graphs = True
    for n in pw.capture_plan():  # the target's graphs only
        pw._capture_one(pw.entries[n])
    pw.drafter.use_graphs = True
    with pytest.raises(SpeculantError, match=r"no drafter piecewise graph was captured for 16"):
        eng.generate(PROMPTS[:1], mixed_params(1))


def test_per_sequence_drafting_honours_disabled_graph_padding(llama_dir, tmp_path):
    """With --disable-graph-padding the per-sequence graphs replay exact row counts only, as
    the decode graphs do: 3 rows with sizes [1, 4] draft eagerly, unpadded; the tokens stay the
    unpadded engine's."""
    from speculant.executor.sampling import GREEDY

    spec = drafter_options("eagle3", llama_dir, tmp_path)
    greedy = [SamplingParams(max_new_tokens=6, ignore_eos=True)] * 3
    ref = engine(llama_dir, piecewise_sizes=[], **spec).generate(PROMPTS[:3], greedy)
    eng = engine(llama_dir, eager_padding=True, disable_graph_padding=True, capture_sizes=[1, 4],
                 **spec)  # fmt: skip
    graphs = eng.piecewise.per_sequence
    assert graphs.sizes == [1, 4] and eng.graphs.padded_bs(3) == 3
    assert [graphs.bucket(n) for n in (1, 3, 4)] == [1, None, 4]
    assert not graphs.drafts_cheaply(3, GREEDY) and graphs.drafts_cheaply(4, GREEDY)
    padded = engine(llama_dir, eager_padding=True, capture_sizes=[1, 4], **spec)
    assert padded.piecewise.per_sequence.bucket(3) == 4  # padding on: the next size
    out = eng.generate(PROMPTS[:3], greedy)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_an_uncaptured_per_sequence_size_is_refused(llama_dir, tmp_path):
    eng = engine(llama_dir, **drafter_options("eagle3", llama_dir, tmp_path))
    graphs = eng.piecewise.per_sequence
    graphs.use_graphs = graphs.pad = True  # graph mode, nothing captured
    with pytest.raises(SpeculantError, match=r"no drafting piecewise graph .* for 1 rows"):
        eng.generate(PROMPTS[:1], [SamplingParams(max_new_tokens=4, ignore_eos=True)])


@pytest.mark.parametrize("kind", ["plain", *DRAFTERS])
def test_clear_graphs_releases_every_entry_and_capture_graphs_recaptures(llama_dir, tmp_path, kind):
    eng, log = engine(llama_dir, **drafter_options(kind, llama_dir, tmp_path)), []
    pw = stand_in_graphs(eng, log)
    capture_with_stand_ins(pw)
    runners = [pw] + ([pw.drafter] if kind != "plain" else [])
    first = eng.generate(PROMPTS, mixed_params(len(PROMPTS)))
    replays = [r.stats.replays for r in runners]
    assert all(replays)
    memory = eng.clear_graphs()
    assert memory == {"reserved_before": 0, "reserved_after": 0}  # the CPU
    assert pw.pool is None
    for runner in runners:
        assert not runner.use_graphs and runner.capture_order == []
        entries = runner.entries.values()
        assert all(e.graph is None and e.outputs is None and not e.captured for e in entries)
    assert eng.graphs.graphs == {} and not eng.graphs.use_graphs
    after_clear = eng.generate(PROMPTS, mixed_params(len(PROMPTS)))  # eagerly, padded
    assert [o.token_ids for o in after_clear] == [o.token_ids for o in first]
    assert [r.stats.replays for r in runners] == replays
    eng.capture_graphs()
    assert all(r.capture_order == [64, 32, 16] for r in runners)
    again = eng.generate(PROMPTS, mixed_params(len(PROMPTS)))
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert all(r.stats.replays > n for r, n in zip(runners, replays, strict=True))


# ------------------------------------------------------------------------------ load_weights


def test_load_weights_then_generate_equals_a_fresh_engine(llama_dir, tiny_tokenizer_dir, tmp_path):
    other = helpers_ckpt.save_hf_model(
        tmp_path / "other", "llama", seed=7, rope_scaling=helpers_ckpt.LLAMA3_ROPE,
        legacy_config=True, tokenizer_dir=tiny_tokenizer_dir,
    )  # fmt: skip
    params = mixed_params(len(PROMPTS))
    eng = engine(llama_dir, eager_padding=True)
    before = eng.generate(PROMPTS, params)
    eng.load_weights(str(other))
    after = eng.generate(PROMPTS, params)
    fresh = engine(other, eager_padding=True).generate(PROMPTS, params)
    assert [o.token_ids for o in after] == [o.token_ids for o in fresh]
    assert [o.token_ids for o in after] != [o.token_ids for o in before]


def test_load_weights_of_another_shape_is_a_clear_error(llama_dir, qwen2_dir):
    eng = engine(llama_dir)
    with pytest.raises(SpeculantError):
        eng.load_weights(str(qwen2_dir))


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(intermediate_size=96), "intermediate_size=96"),
        (dict(num_hidden_layers=3), "num_layers=3"),
        (dict(rope_theta=12345.0), "rope_theta=12345.0"),
    ],
)
def test_load_weights_of_another_architecture_changes_nothing(
    llama_dir, tiny_tokenizer_dir, tmp_path, change, needle
):
    """A checkpoint whose config.json differs from the target's in any architecture field
    (here a size, the layer count, RoPE) is refused before any weight changes (an audit: three
    layers loaded into a two-layer target with a warning; RoPE never compared)."""
    other = helpers_ckpt.save_hf_model(
        tmp_path / "other", "llama", seed=7, rope_scaling=helpers_ckpt.LLAMA3_ROPE,
        legacy_config=True, tokenizer_dir=tiny_tokenizer_dir, **change,
    )  # fmt: skip
    params = mixed_params(len(PROMPTS))
    eng = engine(llama_dir, eager_padding=True)
    before = eng.generate(PROMPTS, params)
    with pytest.raises(
        SpeculantError, match=f"not a checkpoint of the target's architecture.*{needle}"
    ):
        eng.load_weights(str(other))
    assert [o.token_ids for o in eng.generate(PROMPTS, params)] == [o.token_ids for o in before]


def test_load_weights_that_fails_part_way_keeps_the_old_weights(
    llama_dir, tiny_tokenizer_dir, tmp_path
):
    """A checkpoint of the target's config that lacks a tensor fails after other tensors were
    copied in: the weights are put back (an audit: the error came, the model was left half
    loaded and generated other tokens), and the engine still generates as before."""
    from safetensors.torch import load_file, save_file

    other = helpers_ckpt.save_hf_model(
        tmp_path / "other", "llama", seed=7, rope_scaling=helpers_ckpt.LLAMA3_ROPE,
        legacy_config=True, tokenizer_dir=tiny_tokenizer_dir,
    )  # fmt: skip
    weights = load_file(str(other / "model.safetensors"))
    weights.pop("model.norm.weight")  # the last tensor the model needs, after every layer's
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    params = mixed_params(len(PROMPTS))
    eng = engine(llama_dir, eager_padding=True)
    before = eng.generate(PROMPTS, params)
    with pytest.raises(SpeculantError, match="lacks the tensor for 'model.norm.weight'"):
        eng.load_weights(str(other))
    assert [o.token_ids for o in eng.generate(PROMPTS, params)] == [o.token_ids for o in before]


# ------------------------------------------------------------------------------ two gloo ranks

COLLECTIVE_TIMEOUT_S = 60
LAUNCH_TIMEOUT_S = 150


def build_engine_in_rank(sizes_by_rank, head=None) -> None:
    pctx = ParallelContext.from_env(2, 1, "cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
    target = os.environ["SPECULANT_TEST_TARGET"]
    spec = {} if head is None else dict(algo="eagle3", draft=head, num_draft_tokens=3)
    try:
        eng = engine(
            target, pctx=pctx, eager_padding=True, piecewise_sizes=sizes_by_rank[pctx.rank],
            **spec,
        )  # fmt: skip
        assert eng.piecewise.capture_order == [64, 32, 16]  # the lockstep ran every bucket
        if head is not None:  # and the drafter's, after the target's
            assert eng.piecewise.drafter.capture_order == [64, 32, 16]
            out = eng.generate(PROMPTS[:3], mixed_params(3))
            assert all(len(o.token_ids) == 10 for o in out)
    finally:
        pctx.close()


def test_ranks_with_different_piecewise_sizes_fail_with_a_clear_error(llama_dir, monkeypatch):
    monkeypatch.setenv("SPECULANT_TEST_TARGET", str(llama_dir))
    with pytest.raises(RankFailure, match=r"rank 1 would capture piecewise graphs .* but rank 0"):
        run_ranks(build_engine_in_rank, 2, ([None, [16, 32]],), timeout_s=LAUNCH_TIMEOUT_S)


def test_ranks_with_equal_piecewise_sizes_capture_in_lockstep(llama_dir, monkeypatch):
    monkeypatch.setenv("SPECULANT_TEST_TARGET", str(llama_dir))
    run_ranks(build_engine_in_rank, 2, ([None, None],), timeout_s=LAUNCH_TIMEOUT_S)


def test_ranks_capture_the_drafters_buckets_in_lockstep(llama_dir, tmp_path, monkeypatch):
    """Two TP ranks with an EAGLE-3 head: the drafter's buckets too, checked equal."""
    head = drafter_options("eagle3", llama_dir, tmp_path)["draft"]
    monkeypatch.setenv("SPECULANT_TEST_TARGET", str(llama_dir))
    run_ranks(build_engine_in_rank, 2, ([None, None], head), timeout_s=LAUNCH_TIMEOUT_S)


def test_capture_order_check_names_the_rank(monkeypatch):
    from speculant.executor import bucket_graphs

    class TwoRanks:
        def all_gather_object(self, obj):
            return [obj, [*obj, 8]]

    with pytest.raises(SpeculantError, match=r"rank 1 captured piecewise graphs .*\[64, 8\]"):
        bucket_graphs.check_same_order(TwoRanks(), [64], "captured")


# ------------------------------------------------------------------------------ GPU


def gpu_engine(path, **kwargs):
    return Engine(
        path, device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256, page_size=16,
        max_num_batched_tokens=BUDGET, attention_backend="triton", piecewise=True, **kwargs,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_gpu_piecewise_graphs_equal_eager_tokens(llama_dir, mode):
    params = mixed_params(len(PROMPTS))
    ref = gpu_engine(llama_dir, piecewise_sizes=[]).generate(PROMPTS, params)
    eng = gpu_engine(llama_dir, piecewise_capture=mode)
    pw = eng.piecewise
    if mode == "eager":
        assert pw.capture_order == [64, 32, 16] and pw.memory_bytes > 0
    replays = pw.stats.replays  # the engine's warm-up prefills replay too
    out = eng.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert pw.use_graphs and pw.stats.replays - replays == eng.extend_steps > 0
    assert sorted(pw.capture_order) == [16, 32, 64]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", DRAFTERS)
def test_gpu_drafter_piecewise_graphs_equal_eager(llama_dir, tmp_path, kind):
    """With a drafter: its N-token part replays its graphs (captured after the target's) in
    every extend step; tokens and acceptance equal the all-eager engine's."""
    spec = drafter_options(kind, llama_dir, tmp_path)
    params = mixed_params(len(PROMPTS))
    ref = gpu_engine(llama_dir, piecewise_sizes=[], **spec).generate(PROMPTS, params)
    eng = gpu_engine(llama_dir, **spec)
    dpw = eng.piecewise.drafter
    assert dpw.use_graphs and dpw.capture_order == [64, 32, 16]
    assert all(e.captured for e in dpw.entries.values())
    replays = dpw.stats.replays
    out = eng.generate(PROMPTS, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert [o.stats["accept_len"] for o in out] == [o.stats["accept_len"] for o in ref]
    assert dpw.stats.replays - replays == eng.extend_steps > 0
    assert dpw.stats.padded_eager == 0
    eng.clear_graphs()
    assert not dpw.use_graphs and not any(e.captured for e in dpw.entries.values())
    eng.capture_graphs()
    assert dpw.capture_order == [64, 32, 16]
    again = eng.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in ref]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", DRAFTERS)
def test_gpu_per_sequence_drafting_graphs_equal_eager(llama_dir, tmp_path, kind):
    """Greedy extend steps draft per sequence through graphs by row count, captured at start
    after the buckets (largest first): every extend step's drafts, the tokens and the
    acceptance equal the all-eager engine's; clear and recapture."""
    spec = drafter_options(kind, llama_dir, tmp_path)
    greedy = [SamplingParams(max_new_tokens=10, ignore_eos=True)] * len(PROMPTS)
    ref_engine = gpu_engine(llama_dir, piecewise_sizes=[], **spec)
    ref_drafts = record_extend_drafts(ref_engine)
    ref = ref_engine.generate(PROMPTS, greedy)
    eng = gpu_engine(llama_dir, **spec)
    graphs = eng.piecewise.per_sequence
    assert graphs.use_graphs and graphs.capture_order == sorted(graphs.sizes, reverse=True)
    assert graphs.memory_bytes >= 0 and all(e.captured for e in graphs.entries.values())
    replays, extends, drafts = graphs.stats.replays, eng.extend_steps, record_extend_drafts(eng)
    out = eng.generate(PROMPTS, greedy)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref] and drafts == ref_drafts
    assert [o.stats["accept_len"] for o in out] == [o.stats["accept_len"] for o in ref]
    assert graphs.stats.replays - replays == eng.extend_steps - extends > 0
    eng.clear_graphs()
    assert not graphs.use_graphs and not any(e.captured for e in graphs.entries.values())
    eng.capture_graphs()
    assert graphs.capture_order == sorted(graphs.sizes, reverse=True)
    assert [o.token_ids for o in eng.generate(PROMPTS, greedy)] == [o.token_ids for o in ref]


@pytest.mark.gpu
def test_gpu_clear_graphs_frees_memory_and_load_weights_recaptures(
    llama_dir, tiny_tokenizer_dir, tmp_path
):
    eng = gpu_engine(llama_dir)
    before = eng.generate(PROMPTS, mixed_params(len(PROMPTS)))
    memory = eng.clear_graphs()
    assert memory["reserved_after"] < memory["reserved_before"]
    eng.capture_graphs()
    assert eng.piecewise.capture_order == [64, 32, 16]
    again = eng.generate(PROMPTS, mixed_params(len(PROMPTS)))
    assert [o.token_ids for o in again] == [o.token_ids for o in before]
    other = helpers_ckpt.save_hf_model(
        tmp_path / "other", "llama", seed=7, rope_scaling=helpers_ckpt.LLAMA3_ROPE,
        legacy_config=True, tokenizer_dir=tiny_tokenizer_dir,
    )  # fmt: skip
    eng.load_weights(str(other))
    fresh = gpu_engine(other).generate(PROMPTS, mixed_params(len(PROMPTS)))
    after = eng.generate(PROMPTS, mixed_params(len(PROMPTS)))
    assert [o.token_ids for o in after] == [o.token_ids for o in fresh]
