"""Triton kernels against their torch references (kernels/reference.py), and the Triton
attention backend against the torch one. On a machine without CUDA the kernels run through
Triton's interpreter (TRITON_INTERPRET=1, set below before triton is imported) with tiny shapes;
the `cuda` variants (marked gpu) run compiled with bigger shapes. Every check draws fresh random
inputs, requires finite outputs, and a relative error below 1e-2 for bf16 operands (1e-4 for
fp32)."""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import zlib

import pytest
import torch
from helpers_triton import CPU, DEVICES  # noqa: E402, F401 - sets the interpreter first

from speculant.errors import SpeculantError  # noqa: E402
from speculant.executor.attention import (  # noqa: E402
    TorchPagedAttention,
    resolve_attention_backend,
)
from speculant.executor.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from speculant.executor.triton_attention import TritonPagedAttention  # noqa: E402
from speculant.kernels import activation, norm, reference, rope, runtime  # noqa: E402
from speculant.kernels.paged_attention import choose_num_splits, paged_attention  # noqa: E402
from speculant.models.layers import RotaryEmbedding  # noqa: E402

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def generator(*key) -> torch.Generator:
    """A generator seeded by the check's parameters: each check gets its own fresh inputs."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(gen, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = ""):
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    assert torch.isfinite(ref).all(), f"{what}: non-finite reference"
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()
    assert err < TOL[dtype], f"{what}: relative error {err:.2e}"


# ---------------------------------------------------------------------------- paged attention


class PagedScenario:
    """A random paged cache: `bs - 1` live rows with random page tables and context lengths
    (one ending just before a page boundary, one at the longest), plus a padded row on the zero
    sentinel row (context 0: its first query sees one key)."""

    def __init__(self, gen, bs, T, kv_heads, head_dim, page_size, max_pages, dtype, device):
        self.bs, self.T, self.page_size = bs, T, page_size
        self.kv_len = max_pages * page_size
        num_pages = (bs - 1) * max_pages + 2
        shape = (num_pages * page_size + 1, kv_heads, head_dim)  # and the zero slot
        self.k_pool = randn(gen, *shape, dtype=dtype, device=device)
        self.v_pool = randn(gen, *shape, dtype=dtype, device=device)
        self.k_pool[-1], self.v_pool[-1] = 0, 0
        pages = (torch.randperm(num_pages - 1, generator=gen) + 1).int()
        table = torch.zeros(bs, max_pages, dtype=torch.int32)
        table[: bs - 1] = pages[: (bs - 1) * max_pages].view(bs - 1, max_pages)
        self.req_to_page = table.to(device)  # last row: the sentinel (all page 0)
        self.rows = torch.arange(bs, device=device)
        lengths = torch.randint(0, self.kv_len - T + 1, (bs,), generator=gen)
        lengths[0] = page_size - 1  # the row's queries cross a page boundary
        if bs > 2:
            lengths[1] = self.kv_len - T  # the longest context a row can hold
        lengths[-1] = 0
        self.positions = (lengths[:, None] + torch.arange(T)).reshape(-1).to(device)

    def run(self, q, **kwargs):
        args = (self.req_to_page, self.rows, self.positions, self.page_size, self.kv_len, self.T)
        out = paged_attention(q, self.k_pool, self.v_pool, *args, **kwargs)
        ref = reference.paged_attention(q, self.k_pool, self.v_pool, *args)
        return out, ref


SHAPES = {  # device: (bs, kv_heads, page_size, max_pages, block_n, forced splits)
    "cpu": (3, 2, 16, 5, 16, 3),
    "cuda": (9, 8, 16, 160, None, 7),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "group, head_dim, T", list(itertools.product((1, 4, 8), (64, 128), (1, 4)))
)
def test_paged_attention_matches_reference(device, dtype, group, head_dim, T):
    bs, kv_heads, page_size, max_pages, block_n, splits = SHAPES[device]
    gen = generator("attention", device, dtype, group, head_dim, T)
    case = PagedScenario(gen, bs, T, kv_heads, head_dim, page_size, max_pages, dtype, device)
    for num_splits in (None, splits):  # the automatic plan, and splits crossing pages
        q = randn(gen, bs * T, group * kv_heads, head_dim, dtype=dtype, device=device)
        out, ref = case.run(q, num_splits=num_splits, block_n=block_n)
        assert_close(out, ref, dtype, f"splits={num_splits}")


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_prefill_tiles_and_strided_queries(device):
    """Many query tokens per row (several query tiles per KV head), page size 4, and q as a
    strided view of a fused QKV output."""
    dtype, group, head_dim, T, kv_heads = torch.bfloat16, 4, 64, 20, 2
    gen = generator("prefill", device)
    case = PagedScenario(gen, 3, T, kv_heads, head_dim, 4, 12, dtype, device)
    heads = group * kv_heads
    qkv = randn(gen, 3 * T, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    for num_splits in (None, 2):
        out, ref = case.run(q, num_splits=num_splits, block_n=16)
        assert_close(out, ref, dtype, f"splits={num_splits}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 4, 20])
def test_paged_attention_split_counts(device, dtype, T):
    """Each split count (1: no merge; many: empty splits) against the reference. T = 20: two
    query tiles per KV head."""
    bs, kv_heads, page_size, max_pages, block_n, _ = SHAPES[device]
    gen = generator("split counts", device, dtype, T)
    case = PagedScenario(gen, bs, T, kv_heads, 64, page_size, max_pages, dtype, device)
    for num_splits in (1, 2, 3, 8) if device == "cpu" else (1, 2, 3, 8, 64):
        q = randn(gen, bs * T, 4 * kv_heads, 64, dtype=dtype, device=device)
        out, ref = case.run(q, num_splits=num_splits, block_n=block_n)
        assert_close(out, ref, dtype, f"splits={num_splits}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T, num_splits", [(1, 1), (4, 3)])
def test_paged_attention_row_order(device, T, num_splits):
    """Programs started in a given row order (`row_order`: the step's rows longest first, or any
    permutation) give every row its own output: one split or several, the sentinel row
    included."""
    from speculant.kernels.paged_attention import longest_first

    dtype, kv_heads, page_size, max_pages = torch.bfloat16, 2, 16, 5
    bs = 6 if device == "cpu" else 40
    gen = generator("row order", device, T, num_splits)
    case = PagedScenario(gen, bs, T, kv_heads, 64, page_size, max_pages, dtype, device)
    order = longest_first(case.positions, bs, T)
    lengths = case.positions.view(bs, T)[:, -1]
    assert sorted(order.tolist()) == list(range(bs)) and order.dtype == torch.int32
    assert (lengths[order.long()].diff() <= 0).all(), "longest_first: not longest first"
    shuffled = torch.randperm(bs, generator=gen).int().to(device)
    for row_order in (order, shuffled):
        q = randn(gen, bs * T, 4 * kv_heads, 64, dtype=dtype, device=device)
        out, ref = case.run(q, block_n=16, num_splits=num_splits, row_order=row_order)
        assert_close(out, ref, dtype, f"row order {row_order.tolist()}, T={T}")


def expected_plan(positions, bs, T, kv_len, kv_heads, slots):
    """RowPlan's tables as its docstring defines them, in torch."""
    from speculant.kernels.paged_attention import MAX_ROW_SPLITS, MIN_KEYS_PER_SPLIT

    lens = (positions.view(bs, T)[:, -1] + 1).clamp(max=kv_len).cpu().tolist()
    order = sorted(range(bs), key=lambda r: (-lens[r], r))
    target = max(MIN_KEYS_PER_SPLIT, -(-sum(lens) * kv_heads // slots))
    splits = [min(MAX_ROW_SPLITS, max(1, -(-lens[r] // target))) for r in order]
    items = [(r, i, n) for r, n in zip(order, splits, strict=True) for i in range(n)]
    return order, splits, items


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T, lengths", [(1, "mixed"), (4, "mixed"), (20, "mixed"), (1, "uniform")])
def test_paged_attention_row_plan(device, T, lengths):
    """A step's RowPlan (each row split by its own length, items live first, rows longest
    first): its tables as defined, within the static bounds, and every row's attention output
    (one item or several, one query tile or two, the sentinel row) against the reference."""
    from speculant.kernels import paged_attention as attention

    dtype, kv_heads, page_size = torch.bfloat16, 2, 16
    bs, max_pages = (7, 24) if device == "cpu" else (96, 160)
    gen = generator("row plan", device, T, lengths)
    case = PagedScenario(gen, bs, T, kv_heads, 64, page_size, max_pages, dtype, device)
    if lengths == "uniform":
        case.positions = (torch.full((bs, 1), 300) + torch.arange(T)).reshape(-1).to(device)
    plan = attention.row_plan(case.positions, bs, T, case.kv_len, kv_heads)
    slots = attention.plan_slots(torch.device(device))
    order, splits, items = expected_plan(case.positions, bs, T, case.kv_len, kv_heads, slots)
    assert plan.order.tolist() == order
    assert plan.rank_splits.tolist() == splits
    assert plan.rank_first.tolist() == [sum(splits[:k]) for k in range(bs)]
    assert len(items) <= plan.num_items and sum(n > 1 for n in splits) <= plan.merge_ranks
    live = plan.item_splits.tolist()
    got = list(zip(plan.item_row.tolist(), plan.item_split.tolist(), live, strict=True))
    assert got[: len(items)] == items and live[len(items) :] == [0] * (plan.num_items - len(items))
    if lengths == "mixed":
        assert max(splits) > 1, splits  # the long rows split, or the check checks little
    for _ in range(2):  # fresh queries, the same plan
        q = randn(gen, bs * T, 4 * kv_heads, 64, dtype=dtype, device=device)
        out, ref = case.run(q, block_n=32, plan=plan)
        assert_close(out, ref, dtype, f"row plan, T={T}, {lengths}")


def test_row_plan_only_where_few_programs_share_a_slot():
    """`plans_rows`: a RowPlan for batches of fewer one-split programs than four a slot (the
    slots: two programs per SM; 8 "SMs" on the CPU), longest first above that; verify rows of
    two query tiles count twice."""
    from speculant.kernels.paged_attention import plan_slots, plans_rows

    slots = plan_slots(torch.device("cpu"))
    assert slots == 16
    assert plans_rows(31, 1, 8, 2, "cpu") and not plans_rows(32, 1, 8, 2, "cpu")  # 62, 64
    assert plans_rows(16, 4, 8, 2, "cpu") and not plans_rows(16, 20, 8, 2, "cpu")  # 32, 64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group, head_dim", [(4, 128), (1, 64), (8, 64)])
def test_fused_decode_attention_equals_rope_write_and_attention(device, dtype, group, head_dim):
    """kernels/decode_attention.py (one launch: RoPE, the KV write, attention, the split merge
    by the last split) against rope_and_write_kv then paged_attention: the same cache writes
    bit for bit and the same output (float32 rounding of the merge), for one row and several,
    one split and several (the merging counter left clean: launches back to back), keys read
    before the wait or not; a row at a block's edge and the sentinel row (context 0)."""
    from speculant.kernels.decode_attention import fused_decode_attention, fuses
    from speculant.models.layers import RotaryEmbedding

    bs_all, kv_heads, page_size, max_pages, block_n, forced = SHAPES[device]
    heads = group * kv_heads
    gen = generator("fused decode", device, dtype, group, head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, 500000.0, None).to(device)
    for bs in sorted({1, bs_all}):
        case = PagedScenario(gen, bs, 1, kv_heads, head_dim, page_size, max_pages, dtype, device)
        if bs > 1:
            case.positions[0] = block_n or 64  # the new key opens a block
        pages = case.req_to_page[torch.arange(bs, device=device), case.positions // page_size]
        slots = pages.long() * page_size + case.positions % page_size
        cos, sin = rotary.lookup(case.positions, dtype)
        for splits, early in ((None, True), (1, False), (forced, True), (forced, False)):
            qkv = randn(gen, bs, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
            q = qkv[:, : heads * head_dim].view(bs, heads, head_dim)
            k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(bs, kv_heads, -1)
            v = qkv[:, (heads + kv_heads) * head_dim :].view(bs, kv_heads, head_dim)
            assert fuses(q, k, cos, case.k_pool)
            pools = [pool.clone() for pool in (case.k_pool, case.v_pool)]
            rotated = rope.rope_and_write_kv(q, k, v, cos, sin, *pools, slots)
            args = (case.req_to_page, case.rows, case.positions, page_size, case.kv_len)
            want = paged_attention(rotated, *pools, *args, 1, num_splits=splits, block_n=block_n)
            fused_pools = [pool.clone() for pool in (case.k_pool, case.v_pool)]
            launch = {"num_splits": splits, "block_n": block_n, "early": early}
            got = fused_decode_attention(q, k, v, cos, sin, *fused_pools, slots, *args, **launch)
            what = f"bs={bs} splits={splits} early={early}"
            assert all(torch.equal(a, b) for a, b in zip(pools, fused_pools, strict=True)), what
            assert_close(got, want, dtype, what)
            ref = reference.paged_attention(rotated, *pools, *args, 1)
            assert_close(got, ref, dtype, what + " vs reference")


FUSED_EDGES = {  # (bs, kv_heads, group, head_dim, page_size, max_pages, positions, splits)
    "head_dim 96": (2, 2, 2, 96, 16, 4, [37, 16], 3),
    "head_dim 8": (2, 2, 2, 8, 16, 4, [37, 16], 3),
    "group 16": (1, 1, 16, 32, 16, 4, [40], 2),
    "group 32": (1, 1, 32, 32, 16, 4, [40], 2),
    "page 1": (2, 2, 2, 32, 1, 64, [33, 47], 3),
    "positions at block edges": (3, 1, 2, 32, 16, 4, [32, 48, 16], 3),
    "position 0": (2, 1, 2, 32, 16, 4, [0, 0], 4),
    "rows in batch order": (5, 2, 4, 32, 8, 8, [0, 7, 8, 31, 63], 5),
}


def _fused_edge_inputs(device, dtype, bs, kv_heads, group, d, page_size, max_pages, positions):
    gen = generator("fused edges", device, dtype, bs, group, d, page_size, *positions)
    heads, num_pages = group * kv_heads, bs * max_pages + 1
    pools = [randn(gen, num_pages * page_size, kv_heads, d, dtype=dtype, device=device)
             for _ in range(2)]  # fmt: skip
    table = (torch.randperm(num_pages - 1, generator=gen)[: bs * max_pages] + 1).int()
    table, rows = table.view(bs, max_pages).to(device), torch.arange(bs, device=device)
    pos = torch.tensor(positions, device=device)
    slots = table[rows, pos // page_size].long() * page_size + pos % page_size
    rotary = RotaryEmbedding(d, 4096, 10000.0, None).to(device)
    cos, sin = rotary.lookup(pos, dtype)
    qkv = randn(gen, bs, (heads + 2 * kv_heads) * d, dtype=dtype, device=device)
    q = qkv[:, : heads * d].view(bs, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(bs, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(bs, kv_heads, d)
    args = (table, rows, pos, page_size, max_pages * page_size)
    return q, k, v, cos, sin, pools, slots, args


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("name", list(FUSED_EDGES))
def test_fused_decode_attention_edges(device, name):
    """The fused decode launch at shapes the main test leaves out (head_dim not a power of two
    or under 16, groups of 16 / 32 query heads, one-token pages, new keys opening a block or a
    split, position 0, several rows in batch order) equals rope_and_write_kv + paged_attention,
    keys read before the wait or not."""
    from speculant.kernels.decode_attention import fused_decode_attention, fuses

    bs, kv_heads, group, d, page_size, max_pages, positions, splits = FUSED_EDGES[name]
    dtype = torch.float32
    q, k, v, cos, sin, pools, slots, args = _fused_edge_inputs(
        device, dtype, bs, kv_heads, group, d, page_size, max_pages, positions
    )
    assert fuses(q, k, cos, pools[0])
    want_pools = [p.clone() for p in pools]
    rotated = rope.rope_and_write_kv(q, k, v, cos, sin, *want_pools, slots)
    want = paged_attention(rotated, *want_pools, *args, 1, num_splits=splits, block_n=16)
    for early in (True, False):
        got_pools = [p.clone() for p in pools]
        got = fused_decode_attention(q, k, v, cos, sin, *got_pools, slots, *args,
                                     num_splits=splits, block_n=16, early=early)  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(want_pools, got_pools, strict=True)), early
        assert_close(got, want, dtype, f"{name} early={early}")


@pytest.mark.parametrize("device", [CPU])
def test_fused_decode_attention_refuses_groups_over_one_tile(device):
    """A GQA group of more than 64 query heads (two query tiles in paged_attention) is not
    fused: one program holds one tile, and the heads past it were left unwritten."""
    from speculant.kernels.decode_attention import fused_decode_attention, fuses

    q, k, v, cos, sin, pools, slots, args = _fused_edge_inputs(
        device, torch.float32, 1, 1, 128, 16, 16, 2, [20]
    )
    assert not fuses(q, k, cos, pools[0])
    with pytest.raises(ValueError, match="group of 128"):
        fused_decode_attention(q, k, v, cos, sin, *pools, slots, *args, num_splits=1)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_back_to_back_calls(device):
    """Consecutive launches (layers, steps) with fresh inputs, on the same and on other shapes,
    each match the reference (no state carried between calls)."""
    bs, kv_heads, page_size, max_pages, block_n, splits = SHAPES[device]
    dtype, gen = torch.bfloat16, generator("back to back", device)
    cases = {T: PagedScenario(gen, bs, T, kv_heads, 64, page_size, max_pages, dtype, device)
             for T in (1, 4)}  # fmt: skip
    for step, T in enumerate((1, 1, 4, 1, 4, 4)):
        q = randn(gen, bs * T, 4 * kv_heads, 64, dtype=dtype, device=device)
        out, ref = cases[T].run(q, num_splits=splits, block_n=block_n)
        assert_close(out, ref, dtype, f"call {step} (T={T})")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
def test_paged_attention_graph_replays(T):
    """Two launches captured in one CUDA graph (two layers), replayed with fresh queries: every
    replay matches the reference."""
    bs, kv_heads, page_size, max_pages, block_n, splits = SHAPES["cuda"]
    dtype, device, gen = torch.bfloat16, "cuda", generator("graph replays", T)
    case = PagedScenario(gen, bs, T, kv_heads, 128, page_size, max_pages, dtype, device)
    queries = [randn(gen, bs * T, 4 * kv_heads, 128, dtype=dtype, device=device) for _ in "ab"]
    args = (case.req_to_page, case.rows, case.positions, case.page_size, case.kv_len, T)

    def layers():
        return [
            paged_attention(q, case.k_pool, case.v_pool, *args, num_splits=splits) for q in queries
        ]

    layers()  # compiles outside capture, like the engine's warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layers()
    for replay in range(3):
        for q in queries:
            q.copy_(randn(gen, *q.shape, dtype=dtype, device=device))
        graph.replay()
        torch.cuda.synchronize()
        for layer, (q, out) in enumerate(zip(queries, outs, strict=True)):
            ref = reference.paged_attention(q, case.k_pool, case.v_pool, *args)
            assert_close(out, ref, dtype, f"replay {replay}, layer {layer}")


def test_resolve_attention_backend(monkeypatch):
    assert resolve_attention_backend("auto", "cpu") == "torch"
    assert resolve_attention_backend("torch", "cuda") == "torch"
    with pytest.raises(SpeculantError, match="not supported"):
        resolve_attention_backend("flash", "cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no triton
    assert resolve_attention_backend("auto", "cuda") == "torch"
    with pytest.raises(SpeculantError, match="pip install triton"):
        resolve_attention_backend("triton", "cpu")


def test_auto_takes_torch_when_an_installed_triton_does_not_import(monkeypatch, caplog):
    """A triton built for another torch imports with an error: `auto` ran the Triton backend
    anyway and failed at the first kernel; it now warns and attends with torch."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # "installed"
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    with caplog.at_level("WARNING", logger="speculant"):
        assert resolve_attention_backend("auto", "cuda:0") == "torch"
    assert "does not import" in caplog.text and "--attention-backend torch" in caplog.text


def test_cli_passes_the_attention_backend():
    from speculant.launch.cli import _engine_kwargs, build_parser

    args = build_parser().parse_args(
        ["generate", "--demo-model", "--prompt", "x", "--device", "cpu"]
    )
    assert _engine_kwargs(args)["attention_backend"] == "auto"
    args = build_parser().parse_args(
        ["generate", "--demo-model", "--prompt", "x", "--attention-backend", "triton"]
    )
    assert _engine_kwargs(args)["attention_backend"] == "triton"


def test_split_plan_covers_the_gpu_and_long_contexts():
    cpu = torch.device("cpu")
    assert choose_num_splits(programs=1000, kv_len=4096, device=cpu) == 1
    assert choose_num_splits(programs=1, kv_len=100, device=cpu) == 1  # short: no split
    assert 1 < choose_num_splits(programs=2, kv_len=8192, device=cpu) <= 64


# ---------------------------------------------------------------------------- element-wise


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_add(device, dtype):
    hidden, tokens = (256, 5) if device == "cpu" else (4096, 67)
    gen = generator("norm", device, dtype)
    weight = randn(gen, hidden, dtype=dtype, device=device, scale=0.5) + 1
    x = randn(gen, tokens, hidden, dtype=dtype, device=device)
    residual = randn(gen, tokens, hidden, dtype=dtype, device=device, scale=4.0)
    assert_close(norm.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), dtype)
    normed, summed = norm.add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_summed = reference.add_rms_norm(x, residual, weight, 1e-5)
    assert_close(summed, ref_summed, dtype, "residual")
    assert_close(normed, ref_normed, dtype, "normed")
    # q/k norms: per-head rows of a strided view (heads of dim 64 inside a wider row)
    head_weight = randn(gen, 64, dtype=dtype, device=device, scale=0.5) + 1
    wide = randn(gen, tokens, 6 * 64, dtype=dtype, device=device)
    heads = wide[:, : 4 * 64].view(tokens, 4, 64)
    out = norm.rms_norm(heads, head_weight, 1e-6)
    assert_close(out, reference.rms_norm(heads, head_weight, 1e-6), dtype, "per-head")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_and_kv_write(device, dtype, head_dim):
    from speculant.models.layers import RotaryEmbedding

    tokens, heads, kv_heads = (6, 4, 2) if device == "cpu" else (70, 32, 8)
    gen = generator("rope", device, dtype, head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, 500000.0, None).to(device)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(device)
    cos, sin = rotary.lookup(positions, dtype)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = randn(gen, tokens, width, dtype=dtype, device=device)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(4 * tokens, generator=gen)[:tokens].to(device)
    pools = [randn(gen, 4 * tokens, kv_heads, head_dim, dtype=dtype, device=device) for _ in "kv"]
    ref_pools = [p.clone() for p in pools]
    q_out = rope.rope_and_write_kv(q, k, v, cos, sin, *pools, slots)
    ref_q = reference.rope_and_write_kv(q, k, v, cos, sin, *ref_pools, slots)
    assert_close(q_out, ref_q, dtype, "q")
    assert_close(pools[0][slots], ref_pools[0][slots], dtype, "k written")
    assert torch.equal(pools[1][slots], ref_pools[1][slots]), "v written"
    untouched = torch.ones(4 * tokens, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert torch.equal(pools[0][untouched], ref_pools[0][untouched]), "other slots changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(device, dtype):
    tokens, width = (5, 1200) if device == "cpu" else (67, 14336)  # crosses the 1024-wide block
    gen = generator("silu", device, dtype)
    gate_up = randn(gen, tokens, 2 * width, dtype=dtype, device=device, scale=3.0)
    out = activation.silu_and_mul(gate_up)
    assert_close(out, reference.silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "rows, vocab, num_top, parts, block",
    [(3, 5000, 5, None, None), (2, 3000, 1, 3, 256), (1, 2500, 0, None, 256),
     (4, 1500, 7, 1, 256), (2, 4097, 20, 5, 512), (2, 9000, 3, 2, None)],
)  # fmt: skip
def test_top_logprobs_matches_reference(device, rows, vocab, num_top, parts, block, monkeypatch):
    """The one-read log-sum-exp and top-k (kernels/logprobs.py) against torch's: logits of
    bf16 values (ties among the largest, as a bf16 lm_head's give), rows split over one to
    several parts of one to several chunks (`block`: a chunk's columns, smaller than the
    default on the CPU) and the vocabulary past the last part's whole chunks; ties go to the
    lower id; values within float32 rounding of the reference."""
    from speculant.kernels import logprobs

    if block is not None and device == "cpu":
        monkeypatch.setattr(logprobs, "BLOCK", block)
    if device == "cuda":
        rows, vocab = rows * 64, 128256 + vocab  # Llama-3's vocabulary and more
    gen = generator("top_logprobs", device, rows, vocab, num_top, parts)
    logits = randn(gen, rows, vocab, dtype=torch.bfloat16, device=device, scale=3.0).float()
    logits[0, vocab // 3] = logits[0, vocab - 1] = logits[0].max() + 1  # a tie for the largest
    norm, values, ids = logprobs.top_logprobs(logits, num_top, parts)
    ref_norm, ref_values, _ = reference.top_logprobs(logits, num_top)
    assert values.shape == ids.shape == (rows, num_top) and ids.dtype == torch.int64
    assert torch.allclose(norm, ref_norm, rtol=1e-6, atol=1e-5)
    assert torch.allclose(values, ref_values, rtol=1e-6, atol=1e-5)  # the same largest values
    assert torch.equal(logits.gather(1, ids) - norm[:, None], values)  # at the ids given
    # most likely first, a tie to the lower id: a stable sort's first num_top
    ranked = torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :num_top]
    assert torch.equal(ids, ranked)
    assert ids[0, :2].tolist() == [vocab // 3, vocab - 1][:num_top]


@pytest.mark.parametrize("device", DEVICES)
def test_top_logprobs_keeps_the_lower_ids_of_a_tie_when_a_larger_value_comes(device, monkeypatch):
    """A tie kept from one chunk, then a larger value in a later chunk of the same part: the
    highest id of the tie makes room (the lowest one once did)."""
    from speculant.kernels import logprobs

    if device == "cpu":
        monkeypatch.setattr(logprobs, "BLOCK", 512)
    block = logprobs.BLOCK
    logits = torch.full((3, 4 * block), -5.0)
    logits[:, [1, 2, 3, 4]] = 5.0  # a four-way tie in the first chunk
    logits[:, 2 * block + 7] = 6.0  # a larger value two chunks later
    norm, values, ids = logprobs.top_logprobs(logits.to(device), 3, parts=1)
    assert ids.tolist() == [[2 * block + 7, 1, 2]] * 3


@pytest.mark.parametrize("device", DEVICES)
def test_top_logprobs_rows_with_few_finite_logits(device):
    """Fewer finite logits than alternatives asked (-inf elsewhere): the finite ones, then -inf
    at id -1 (no alternative has a probability); a row of ordinary values beside it."""
    from speculant.kernels import logprobs

    logits = torch.full((2, 2100), float("-inf"))
    logits[0, [7, 2050]] = torch.tensor([1.0, 2.0])
    logits[1] = torch.linspace(-3, 3, 2100)
    logits = logits.to(device)
    norm, values, ids = logprobs.top_logprobs(logits, 3, parts=2)
    assert ids[0].tolist() == [2050, 7, -1] and values[0, 2] == float("-inf")
    assert ids[1].tolist() == [2099, 2098, 2097]
    assert torch.allclose(norm, torch.logsumexp(logits, -1))


HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF)
def test_gemv_matches_linear(device, dtype):
    """The single-row Triton GEMV against a float64 x W^T, on shapes that take each block plan
    (on the GPU the Llama-3.1-8B projections it takes: qkv, o, down and the EAGLE-3 fc)."""
    from speculant.kernels import gemv

    shapes = (
        [(64, 512), (40, 192), (16, 64)]
        if device == "cpu"
        else [(6144, 4096), (4096, 4096), (4096, 14336), (4096, 12288), (8192, 4096)]
    )
    for n, k in shapes:
        gen = generator("gemv", device, dtype, n, k)
        x = randn(gen, 1, k, dtype=dtype, device=device)
        w = randn(gen, n, k, dtype=dtype, device=device, scale=k**-0.5)
        bias = randn(gen, n, dtype=dtype, device=device)
        assert gemv.uses_gemv(x, w), (n, k)
        ref = x.double() @ w.double().T
        assert_close(gemv.linear(x, w), ref, dtype, f"gemv {n}x{k}")
        assert_close(gemv.linear(x, w, bias), ref + bias.double(), dtype, f"gemv+bias {n}x{k}")
        assert_close(gemv.linear(x[0], w), ref[0], dtype, f"gemv 1-d {n}x{k}")


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_hands_other_shapes_to_linear(device):
    """Several rows, float32, or sizes the blocks cannot tile: exactly F.linear."""
    from speculant.kernels import gemv

    gen = generator("gemv-fallback", device)
    cases = [
        (torch.bfloat16, 2, 64, 512),  # two rows
        (torch.float32, 1, 64, 512),  # float32 stays on cuBLAS / the CPU BLAS
        (torch.bfloat16, 1, 60, 512),  # n not a multiple of BLOCK_N
        (torch.bfloat16, 1, 64, 100),  # k not a multiple of 64
        (torch.bfloat16, 1, gemv.MAX_ROWS + 8, 64),  # tall weights stay on cuBLAS
    ]
    for dtype, m, n, k in cases:
        x = randn(gen, m, k, dtype=dtype, device=device)
        w = randn(gen, n, k, dtype=dtype, device=device)
        assert not gemv.uses_gemv(x, w), (dtype, m, n, k)
        assert torch.equal(gemv.linear(x, w), torch.nn.functional.linear(x, w))


def test_pdl_is_off_where_it_cannot_run():
    """Programmatic dependent launch only on compiled sm_90+ CUDA: on the CPU (interpreted or
    not) every kernel launches plainly, with PDL=0."""
    assert runtime.pdl_mode(torch.zeros(2)) == 0
    assert runtime.pdl_options(0) == {"PDL": 0}
    assert runtime.pdl_options(2) == {"PDL": 2, "launch_pdl": True}


def test_pdl_setting_by_kind_and_a_models_launch_modes(monkeypatch):
    """SPECULANT_PDL: a mode, then kind=mode items; bad ones name the value and the kinds.
    launch_modes: a model's modes in force inside (the kinds SPECULANT_PDL names keep its
    modes), the previous ones back after, an exception included."""
    from speculant import SpeculantError

    assert runtime.parse_pdl("1") == (1, {})
    assert runtime.parse_pdl("1, norm=2,act = 2") == (1, {"norm": 2, "act": 2})
    for bad in ("3", "1,norm=3", "1,normal=2", "2,norm", ""):
        with pytest.raises(SpeculantError, match=r"kinds: gemv, norm, rope") as exc:
            runtime.parse_pdl(bad)
        assert f"SPECULANT_PDL={bad}:" in str(exc.value)
    monkeypatch.setattr(runtime, "ENV_KIND_MODES", {"norm": 1})
    monkeypatch.setattr(runtime, "PDL_KIND_MODES", {"norm": 1})
    with runtime.launch_modes({"norm": 2, "act": 2}):
        assert runtime.PDL_KIND_MODES == {"norm": 1, "act": 2}
        with runtime.launch_modes(None):
            assert runtime.PDL_KIND_MODES == {"norm": 1, "act": 2}
    assert runtime.PDL_KIND_MODES == {"norm": 1}
    with pytest.raises(RuntimeError), runtime.launch_modes({"merge": 2}):
        raise RuntimeError("a failed forward")
    assert runtime.PDL_KIND_MODES == {"norm": 1}


@pytest.mark.needs("triton")
def test_bad_pdl_setting_names_the_value():
    import subprocess

    env = {**os.environ, "SPECULANT_PDL": "7"}
    run = subprocess.run(
        [sys.executable, "-c", "import speculant.kernels.runtime"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert "SPECULANT_PDL=7: use 0 (off), 1 or 2" in run.stderr.strip().splitlines()[-1]


def _decoder_chain(gen, layers=6, hidden=1024, heads=16, kv_heads=4, head_dim=64, inter=2048):
    """A bs-1 decode chain of every PDL kernel (norms, GEMVs, RoPE + KV write, split paged
    attention with its merge, SiLU-and-mul), each consuming the kernel before it; returns
    (run, x): run() computes the chain from the static input x."""
    from speculant.kernels import gemv

    dtype, dev, page, pages = torch.bfloat16, "cuda", 16, 32
    qkv_rows = (heads + 2 * kv_heads) * head_dim

    def w(*shape):
        return randn(gen, *shape, dtype=dtype, device=dev, scale=shape[-1] ** -0.5)

    weights = [
        (w(qkv_rows, hidden), w(hidden, heads * head_dim), w(2 * inter, hidden), w(hidden, inter))
        for _ in range(layers)
    ]
    norm_w = [randn(gen, hidden, dtype=dtype, device=dev) for _ in range(2 * layers + 1)]
    pools = [randn(gen, 2, pages * page, kv_heads, head_dim, dtype=dtype, device=dev)
             for _ in range(layers)]  # fmt: skip
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(1, pages).to(dev)
    pos = torch.tensor([pages * page - 5], device=dev)
    slot = (table[0, pos // page].long() * page + pos % page).to(dev)
    angle = torch.rand(1, head_dim, generator=gen).to(device=dev)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    x = randn(gen, 1, hidden, dtype=dtype, device=dev)

    def run():
        h, residual = norm.rms_norm(x, norm_w[0], 1e-5), x
        for i, (wqkv, wo, wgu, wd) in enumerate(weights):
            qkv = gemv.linear(h, wqkv)
            q, k, v = qkv.view(1, -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
            q = rope.rope_and_write_kv(q, k, v, cos, sin, pools[i][0], pools[i][1], slot)
            attn = paged_attention(q, pools[i][0], pools[i][1], table,
                                   torch.zeros(1, dtype=torch.long, device=dev), pos, page,
                                   pages * page, 1, num_splits=4)  # fmt: skip
            h, residual = norm.add_rms_norm(
                gemv.linear(attn.view(1, -1), wo), residual, norm_w[2 * i + 1], 1e-5
            )
            up = activation.silu_and_mul(torch.nn.functional.linear(h, wgu))
            h, residual = norm.add_rms_norm(gemv.linear(up, wd), residual, norm_w[2 * i + 2], 1e-5)
        return h, residual

    return run, x


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("prefetch", [0, 16384, 65536])
def test_pdl_graph_chain_equals_plain_launches(mode, prefetch, monkeypatch):
    """The decode chain captured in one CUDA graph with programmatic dependent launch (and the
    GEMV's L2 prefetch) gives bit for bit the outputs of plain launches, replay after replay
    with fresh inputs: no kernel reads an input before the kernel writing it has finished."""
    from speculant.kernels import gemv

    gen = generator("pdl chain", mode, prefetch)
    run, x = _decoder_chain(gen)
    inputs = [randn(gen, *x.shape, dtype=x.dtype, device="cuda") for _ in range(4)]

    def graph_outputs(pdl):
        monkeypatch.setattr(runtime, "PDL_MODE", pdl)
        monkeypatch.setattr(gemv, "PREFETCH_BYTES", prefetch)
        run()  # compiles outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run()
        results = []
        for fresh in inputs:
            x.copy_(fresh)
            graph.replay()
            results.append([o.clone() for o in outs])
        torch.cuda.synchronize()
        return results

    plain, chained = graph_outputs(0), graph_outputs(mode)
    for i, (a, b) in enumerate(zip(plain, chained, strict=True)):
        assert torch.isfinite(a[0]).all(), i
        assert all(torch.equal(p, c) for p, c in zip(a, b, strict=True)), f"replay {i} differs"
    assert not torch.equal(plain[0][0], plain[1][0])  # the inputs reach the outputs


@pytest.mark.needs("triton")
def test_engine_decodes_one_row_through_the_fused_kernel(monkeypatch, llama_dir):
    """With `fuse_decode` (off as shipped: measured slower, benchmarks/results/wave25.md), the
    Triton backend's one-row decode steps run kernels/decode_attention.py; greedy tokens equal
    the torch backend's, for one request and for two (which take the unfused kernels). On the
    tiny Llama (2 layers, GQA group 2): Triton's interpreter runs every kernel program in Python."""
    from speculant import Engine, SamplingParams
    from speculant.executor import triton_attention

    if not runtime.INTERPRET:
        pytest.skip("the CPU engine runs Triton kernels only under TRITON_INTERPRET=1")
    calls = []
    fused = triton_attention.fused_decode_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return fused(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "fused_decode_attention", counted)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    prompts = ["def fibonacci(n):", "import os"]
    tokens = {}
    monkeypatch.setattr(triton_attention.TritonPagedAttention, "fuse_decode", True)
    for backend in ("torch", "triton"):  # torch: the reference (unfused kernels: tests above)
        engine = Engine(llama_dir, device="cpu", dtype="float32", max_num_seqs=2,
                        max_model_len=128, attention_backend=backend)  # fmt: skip
        calls.clear()
        tokens[backend] = [[o.token_ids for o in engine.generate(batch, params, use_tqdm=False)]
                           for batch in (prompts[:1], prompts)]  # fmt: skip
        assert bool(calls) == (backend == "triton"), (backend, calls)
        assert set(calls) <= {1}, calls
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.needs("triton")
def test_triton_backend_engines_route_linears_through_gemv(llama_dir, tmp_path):
    """The Triton backend sets the GEMV on every projection of the target and the EAGLE-3 head
    (not the LM head); the torch backend, the reference, leaves them on F.linear."""
    from helpers_eagle import write_random_eagle3

    from speculant import Engine
    from speculant.kernels import gemv

    write_random_eagle3(tmp_path, llama_dir, draft_vocab=300)
    for backend in ("triton", "torch"):
        engine = Engine(
            llama_dir, device="cpu", max_num_seqs=2, max_model_len=64, page_size=4,
            attention_backend=backend, algo="eagle3", draft=str(tmp_path), num_draft_tokens=2,
        )  # fmt: skip
        modules = list(engine.model.modules()) + list(engine.drafter.head.modules())
        linears = [m for m in modules if hasattr(m, "gemv")]
        assert len(linears) >= 4 * engine.model_config.num_layers
        expected = gemv.linear if backend == "triton" else None
        assert all(m.gemv is expected for m in linears), backend


@pytest.mark.needs("triton")
def test_fallbacks_where_triton_cannot_run(monkeypatch):
    """CPU tensors without the interpreter: every op is exactly its torch reference."""
    monkeypatch.setattr(runtime, "INTERPRET", False)
    gen = generator("fallback")
    x, w = torch.randn(3, 32, generator=gen), torch.randn(32, generator=gen)
    assert torch.equal(norm.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    gate_up = torch.randn(3, 64, generator=gen)
    assert torch.equal(activation.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    case = PagedScenario(gen, 3, 2, 2, 16, 4, 3, torch.float32, "cpu")
    q = torch.randn(6, 4, 16, generator=gen)
    out, ref = case.run(q)
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------- the backend


def decode_batch(case: PagedScenario, device) -> ForwardBatch:
    positions = case.positions.view(case.bs, case.T)
    pages = torch.gather(case.req_to_page[case.rows].long(), 1, positions // case.page_size)
    slots = pages * case.page_size + positions % case.page_size
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        bs=case.bs,
        tokens_per_req=case.T,
        input_ids=torch.zeros(case.bs * case.T, dtype=torch.int64, device=device),
        positions=case.positions,
        req_pool_indices=case.rows,
        out_cache_loc=slots.reshape(-1),
        kv_len=case.kv_len,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 4])
def test_backend_matches_torch_backend(device, dtype, T):
    """TritonPagedAttention (RoPE fused into the KV write) against TorchPagedAttention on the
    same verify batch: same outputs, same K/V written."""
    from speculant.models.layers import RotaryEmbedding

    bs, kv_heads, page_size, max_pages, _, _ = SHAPES[device]
    group, head_dim = 4, 64
    gen = generator("backend", device, dtype, T)
    case = PagedScenario(gen, bs, T, kv_heads, head_dim, page_size, max_pages, dtype, device)
    batch = decode_batch(case, device)
    n = bs * T
    q = randn(gen, n, group * kv_heads, head_dim, dtype=dtype, device=device)
    k = randn(gen, n, kv_heads, head_dim, dtype=dtype, device=device)
    v = randn(gen, n, kv_heads, head_dim, dtype=dtype, device=device)
    rotary = RotaryEmbedding(head_dim, case.kv_len, 10000.0, None).to(device)
    cos_sin = rotary.lookup(batch.positions, dtype)

    pools = ([case.k_pool.clone()], [case.v_pool.clone()])
    triton_attn = TritonPagedAttention(*pools, case.req_to_page, page_size)
    triton_attn.prepare(batch)
    out = triton_attn.forward(0, q, k, v, cos_sin)

    ref_pools = ([case.k_pool.clone()], [case.v_pool.clone()])
    torch_attn = TorchPagedAttention(*ref_pools, case.req_to_page, page_size)
    torch_attn.prepare(batch)
    ref = torch_attn.forward(
        0, RotaryEmbedding.apply(q, cos_sin), RotaryEmbedding.apply(k, cos_sin), v
    )
    assert_close(out, ref, dtype, "attention")  # the padded row included
    assert_close(pools[0][0], ref_pools[0][0], dtype, "k pool")
    assert torch.equal(pools[1][0], ref_pools[1][0]), "v pool"


# ---------------------------------------------------------------------------- the engine


def _generate(target, backend, device, **options):
    from speculant import Engine, SamplingParams

    engine = Engine(
        target,
        device=device,
        max_num_seqs=4,
        max_model_len=96,
        page_size=4,
        attention_backend=backend,
        **options,
    )
    expected = TritonPagedAttention if backend == "triton" else TorchPagedAttention
    assert isinstance(engine.runner.attn, expected)
    if options.get("algo") == "eagle3":
        assert isinstance(engine.drafter.attn, expected)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 11)]
    # Triton's interpreter (the CPU) runs every kernel program in Python: 3 decode steps there
    params = SamplingParams(max_new_tokens=4 if device == "cpu" else 6, ignore_eos=True)
    outs = engine.generate(prompts, params)
    if options.get("algo") == "eagle3":
        assert all(o.stats["num_verify_steps"] > 0 for o in outs)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("device", DEVICES)
def test_engine_greedy_triton_equals_torch(qwen3_dir, device):
    """Qwen3 (q/k norms before the fused RoPE), padded eager batches: the Triton backend's
    greedy tokens equal the torch backend's."""
    options = dict(eager_padding=True) if device == "cpu" else {}
    ours = _generate(qwen3_dir, "triton", device, **options)
    assert ours == _generate(qwen3_dir, "torch", device, **options)


@pytest.mark.parametrize("device", DEVICES)
def test_engine_eagle3_triton_equals_torch(llama_dir, tmp_path, device):
    """EAGLE-3 drafting on the Triton backend (target and head) is lossless: greedy tokens equal
    the torch backend's plain decoding."""
    from helpers_eagle import write_random_eagle3

    write_random_eagle3(tmp_path, llama_dir, draft_vocab=300)
    spec = dict(algo="eagle3", draft=str(tmp_path), num_draft_tokens=3)
    assert _generate(llama_dir, "triton", device, **spec) == _generate(llama_dir, "torch", device)


@pytest.mark.gpu
def test_graph_replay_equals_eager_with_triton(llama_dir):
    from test_gpu import graph_vs_eager

    from speculant import Engine

    engine = Engine(llama_dir, device="cuda", max_num_seqs=64, max_model_len=256)
    assert engine.attention_backend == "triton"
    gen = torch.Generator().manual_seed(3)
    for bs in (1, 3, 17, 64):
        graph_vs_eager(engine, bs, gen, max_new_tokens=16)
