"""Paged attention over the KV cache for decode (T = 1), multi-token verify (T = k + 1) and
prefill (T = the longest new-token count), reading pages through `req_to_page` like the torch
backend. A query at position p sees keys at positions <= p of its row, so each row's live length
comes from the device (its positions): only live pages are read and the launch shapes depend on
(bs, T, kv_len) alone, which keeps it graph-capturable.

Layout: one program per (row, tile of query rows, KV head, split). The query rows of a tile are
the (token, head) pairs of one KV head's GQA group, so K and V are read once per group. Long
contexts are split over `num_splits` programs (split-K); a second kernel merges their partial
outputs by log-sum-exp. Kernels compute in float32 with bf16/fp16 tensor-core dots."""

import functools
import math
from dataclasses import dataclass

import torch

from speculant.kernels import reference
from speculant.kernels.runtime import (
    next_power_of_2,
    pdl_enter,
    pdl_mode,
    pdl_options,
    runs_triton,
    tl,
    triton,
)

MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
# (num_warps, num_stages) of a decode / verify launch whose rows need no split (the batch fills
# the GPU): two pipeline stages read the KV at 83-97% of the copy bandwidth on an H200 where
# Triton's default three read it at 70-74% (bs 64 x 512: 38.0 vs 45.6 us a layer; 64 x 2048:
# 129.7 vs 170.1; benchmarks/attention_sweep.py, results/decode_wave12.md). Split launches (few
# rows, long contexts) and packed prefill keep the default: there it measured no better.
UNSPLIT_LAUNCH = (4, 2)
# packed prefill (varlen): query rows (tokens x the group's heads) a tile holds at most, and
# (BLOCK_N, num_warps, num_stages or None: Triton's default) of its launch
VARLEN_BLOCK_M = 64
VARLEN_LAUNCH: tuple[int, int, int | None] = (64, 4, None)


@triton.jit
def _load_kv(
    k_pool_ptr, v_pool_ptr, table, n, load, kv_head, d, d_ok, stride_slot, stride_head,
    PAGE_SIZE: tl.constexpr,
):  # fmt: skip
    """K and V [len(n), BLOCK_D] of key positions n through the row's page table (0 where not
    `load`)."""
    page = tl.load(table + n // PAGE_SIZE, mask=load, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + n % PAGE_SIZE
    kv_offsets = slot[:, None] * stride_slot + kv_head * stride_head + d[None, :]
    kv_mask = load[:, None] & d_ok[None, :]
    k = tl.load(k_pool_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_pool_ptr + kv_offsets, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _attend(
    q, k, v, n, n_ok, pos, m_i, l_i, acc, scale_log2, UPCAST: tl.constexpr, IEEE: tl.constexpr
):  # fmt: skip
    """Online softmax update of m_i, l_i, acc with the keys n (K, V given)."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    visible = (n[None, :] <= pos[:, None]) & n_ok[None, :]
    s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _attend_block(
    q, k_pool_ptr, v_pool_ptr, table, block, end, pos, kv_head, d, d_ok, m_i, l_i, acc,
    stride_slot, stride_head, scale_log2,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One block of BLOCK_N keys from `block` (online softmax update of m_i, l_i, acc)."""
    n = block + tl.arange(0, BLOCK_N)
    n_ok = n < end
    k, v = _load_kv(k_pool_ptr, v_pool_ptr, table, n, n_ok, kv_head, d, d_ok, stride_slot,
                    stride_head, PAGE_SIZE)  # fmt: skip
    return _attend(q, k, v, n, n_ok, pos, m_i, l_i, acc, scale_log2, UPCAST, IEEE)


@triton.jit(do_not_specialize=["tokens_per_req", "kv_len", "num_splits", "m_tiles"])
def _paged_attention_kernel(
    q_ptr,
    k_pool_ptr,
    v_pool_ptr,
    req_to_page_ptr,
    rows_ptr,
    positions_ptr,
    order_ptr,
    item_row_ptr,
    item_split_ptr,
    item_splits_ptr,
    tile_seq_ptr,
    tile_m0_ptr,
    seq_start_ptr,
    seq_len_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    stride_slot,
    stride_head,
    stride_table,
    scale_log2,
    tokens_per_req,
    kv_len,
    num_splits,
    m_tiles,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    ORDERED: tl.constexpr,
    PLANNED: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    VARLEN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if VARLEN:  # packed sequences of their own lengths: a tile table names each tile's sequence
        row = tl.load(tile_seq_ptr + pid).to(tl.int64)
        m = tl.load(tile_m0_ptr + pid) + tl.arange(0, BLOCK_M)
        m_ok = m < GROUP * tl.load(seq_len_ptr + row)
        token = tl.load(seq_start_ptr + row).to(tl.int64) + m // GROUP
    else:
        tile = pid % m_tiles
        row = (pid // m_tiles).to(tl.int64)
        if ORDERED:  # the hardware starts programs in linear order: the longest rows' first
            flat = pid + tl.num_programs(0) * (kv_head + tl.num_programs(1) * split)
            split = flat % num_splits
            flat = flat // num_splits
            kv_head = flat % (NUM_HEADS // GROUP)
            flat = flat // (NUM_HEADS // GROUP)
            tile = flat % m_tiles
            row = tl.load(order_ptr + flat // m_tiles).to(tl.int64)
        item = 0
        row_splits = num_splits
        if PLANNED:  # work item i of the step's RowPlan (live items first, longest rows first)
            flat = pid + tl.num_programs(0) * kv_head
            kv_head = flat % (NUM_HEADS // GROUP)
            flat = flat // (NUM_HEADS // GROUP)
            tile = flat % m_tiles
            item = flat // m_tiles
            row_splits = tl.load(item_splits_ptr + item)  # 0: an item past the plan's last
            row = tl.where(row_splits > 0, tl.load(item_row_ptr + item), 0).to(tl.int64)
            split = tl.where(row_splits > 0, tl.load(item_split_ptr + item), 0)
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query row = token * GROUP + head
        m_ok = (m < GROUP * tokens_per_req) & (row_splits > 0)
        token = row * tokens_per_req + m // GROUP
    head = kv_head * GROUP + m % GROUP
    pos = tl.load(positions_ptr + token, mask=m_ok, other=-1)

    # this program's keys: an equal share (in whole blocks) of the tile's live length
    seq_len = tl.minimum(tl.max(pos, axis=0) + 1, kv_len)
    if VARLEN:
        row_splits = num_splits
    per_split = tl.cdiv(tl.cdiv(seq_len, tl.maximum(row_splits, 1)), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    table = req_to_page_ptr + tl.load(rows_ptr + row).to(tl.int64) * stride_table

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
        mask=q_mask,
        other=0.0,
    )
    if UPCAST:  # the interpreter has no bf16 arithmetic
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows stay 0
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if UPCAST:  # the interpreter cannot take tensor loop bounds (numpy 2): a while loop
        block = start
        while block < end:
            m_i, l_i, acc = _attend_block(
                q, k_pool_ptr, v_pool_ptr, table, block, end, pos, kv_head, d, d_ok, m_i, l_i,
                acc, stride_slot, stride_head, scale_log2, PAGE_SIZE, BLOCK_N, UPCAST, IEEE,
            )  # fmt: skip
            block += BLOCK_N
    else:
        for block in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q, k_pool_ptr, v_pool_ptr, table, block, end, pos, kv_head, d, d_ok, m_i, l_i,
                acc, stride_slot, stride_head, scale_log2, PAGE_SIZE, BLOCK_N, UPCAST, IEEE,
            )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + token[:, None] * stride_on + head[:, None] * stride_oh + d[None, :]
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    if PLANNED:  # a row of one item writes its output; others their part, by item
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask & (row_splits == 1))
        part = (item * tokens_per_req + m // GROUP) * NUM_HEADS + head
        split_ok = m_ok & (row_splits > 1)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out,
                 mask=split_ok[:, None] & d_ok[None, :])  # fmt: skip
        tl.store(part_lse_ptr + part, lse, mask=split_ok)
    elif SPLIT:
        part = (token * NUM_HEADS + head) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
        tl.store(part_lse_ptr + part, lse, mask=m_ok)
    else:
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _lse_merge(part_out_ptr, part_lse_ptr, part, s_ok, d, d_ok, HEAD_DIM: tl.constexpr):
    """The log-sum-exp merge of the parts at indices `part` where `s_ok` (float32 [BLOCK_D])."""
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.where(s_ok & (lse > float("-inf")), tl.exp2(lse - top), 0.0)
    parts = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(weight, axis=0)
    return tl.sum(weight[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_on,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)  # token * NUM_HEADS + head
    token, head = pid // NUM_HEADS, pid % NUM_HEADS
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    part = pid * num_splits + s
    out = _lse_merge(part_out_ptr, part_lse_ptr, part, s < num_splits, d, d_ok, HEAD_DIM)
    dst = out_ptr + token * stride_on + head * stride_oh + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit(do_not_specialize=["tokens_per_req"])
def _merge_planned_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    order_ptr,
    rank_first_ptr,
    rank_splits_ptr,
    stride_on,
    stride_oh,
    tokens_per_req,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the parts of the plan's split rows: program (rank k, token t, head); ranks of one
    item (written directly by the attention kernel) and past the split rows do nothing."""
    pdl_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    head = pid % NUM_HEADS
    t = (pid // NUM_HEADS) % tokens_per_req
    rank = pid // NUM_HEADS // tokens_per_req
    splits = tl.load(rank_splits_ptr + rank)
    first = tl.load(rank_first_ptr + rank).to(tl.int64)
    row = tl.load(order_ptr + rank).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    part = ((first + s) * tokens_per_req + t) * NUM_HEADS + head
    s_ok = (s < splits) & (splits > 1)
    out = _lse_merge(part_out_ptr, part_lse_ptr, part, s_ok, d, d_ok, HEAD_DIM)
    dst = out_ptr + (row * tokens_per_req + t) * stride_on + head * stride_oh + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d_ok & (splits > 1))


@triton.jit(do_not_specialize=["bs", "tokens_per_req", "kv_len", "num_items"])
def _row_plan_kernel(
    positions_ptr,
    order_ptr,
    rank_first_ptr,
    rank_splits_ptr,
    item_row_ptr,
    item_split_ptr,
    item_splits_ptr,
    bs,
    tokens_per_req,
    kv_len,
    num_items,
    kv_heads,
    slots,
    MIN_KEYS: tl.constexpr,
    MAX_ROW_SPLITS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_I: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: RowPlan's tables from the step's positions (see row_plan)."""
    pdl_enter(PDL)
    r = tl.arange(0, BLOCK_B)
    ok = r < bs
    last = tl.load(positions_ptr + r * tokens_per_req + tokens_per_req - 1, mask=ok, other=-1)
    lens = tl.where(ok, tl.minimum(last + 1, kv_len), 0).to(tl.int64)
    # longest first, ties by row: one sort of length * BLOCK_B + (BLOCK_B - 1 - row)
    key = tl.where(ok, lens * BLOCK_B + (BLOCK_B - 1 - r), -1)
    key = tl.sort(key, 0, descending=True)
    rank_row = (BLOCK_B - 1 - key % BLOCK_B).to(tl.int32)
    rank_len = key // BLOCK_B
    target = tl.maximum(tl.cdiv(tl.sum(lens, axis=0) * kv_heads, slots), MIN_KEYS)
    splits = tl.minimum(tl.maximum(tl.cdiv(rank_len, target), 1), MAX_ROW_SPLITS)
    splits = tl.where(ok, splits, 0).to(tl.int32)
    first = tl.cumsum(splits, 0) - splits
    tl.store(order_ptr + r, rank_row, mask=ok)
    tl.store(rank_first_ptr + r, first, mask=ok)
    tl.store(rank_splits_ptr + r, splits, mask=ok)
    i = tl.arange(0, BLOCK_I)  # every item empty, then the plan's written over
    tl.store(item_splits_ptr + i, tl.zeros([BLOCK_I], dtype=tl.int32), mask=i < num_items)
    tl.debug_barrier()
    for split in range(MAX_ROW_SPLITS):
        live = split < splits
        tl.store(item_row_ptr + first + split, rank_row, mask=live)
        tl.store(item_split_ptr + first + split, tl.zeros_like(splits) + split, mask=live)
        tl.store(item_splits_ptr + first + split, splits, mask=live)


@dataclass
class VarlenTiles:
    """The tile table of packed sequences for one step (made once, read by every layer): tile i
    covers query rows [tile_m0[i], tile_m0[i] + block_m) of sequence tile_seq[i], a query row
    being token * group + head of one KV head's group."""

    seq_lens: tuple[int, ...]  # host copy of every sequence's query tokens
    group: int
    block_m: int
    num_tiles: int
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # seq, m0, start, len


def tile_layout(seq_lens, group: int, block_m: int) -> tuple[list[int], list[int], list[int]]:
    """Packed sequences of `seq_lens` query tokens, back to back: every sequence's start, and
    per tile (block_m query rows of `group` heads per KV head) its sequence and first row."""
    starts, tile_seq, tile_m0, start = [], [], [], 0
    for seq, length in enumerate(seq_lens):
        starts.append(start)
        start += length
        for m0 in range(0, group * length, block_m):
            tile_seq.append(seq)
            tile_m0.append(m0)
    return starts, tile_seq, tile_m0


def varlen_tiles(seq_lens: list[int], group: int, device: torch.device) -> VarlenTiles:
    """Tiles over packed sequences of `seq_lens` query tokens (laid out back to back), with
    `group` query heads per KV head; one host-to-device copy."""
    block_m = varlen_block_m(group, max(seq_lens, default=1))
    starts, tile_seq, tile_m0 = tile_layout(seq_lens, group, block_m)
    num_tiles = len(tile_seq)
    packed = torch.tensor(tile_seq + tile_m0 + starts + list(seq_lens), dtype=torch.int32).to(
        device, non_blocking=True
    )
    n, bs = num_tiles, len(seq_lens)
    tensors = (packed[:n], packed[n : 2 * n], packed[2 * n : 2 * n + bs], packed[2 * n + bs :])
    return VarlenTiles(tuple(seq_lens), group, block_m, num_tiles, tensors)


def varlen_block_m(group: int, longest: int) -> int:
    """Query rows a packed-prefill tile holds: the longest sequence's, 16..VARLEN_BLOCK_M."""
    return min(VARLEN_BLOCK_M, max(16, next_power_of_2(group * longest)))


def _launch_options(launch: tuple[int, int | None] | None) -> dict:
    warps, stages = launch or (4, None)
    return {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": stages}


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(programs: int, kv_len: int, device: torch.device) -> int:
    """Splits per (row, tile, KV head): about two waves of programs over the SMs, and at least
    MIN_KEYS_PER_SPLIT of the kv_len keys a row may hold per split."""
    by_occupancy = -(-2 * _num_sms(device) // max(programs, 1))
    by_length = -(-kv_len // MIN_KEYS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


MAX_ROW_SPLITS = 16  # a RowPlan's splits of one row at most


@dataclass
class RowPlan:
    """A decode / verify step's attention work, made once a step on the device (`row_plan`) and
    read by every layer: each row gets splits by its own length, so that no program holds much
    more than an even share of the step's keys, and the work items are laid out live first,
    longest rows first (the hardware starts a launch's programs in linear order).

    With L the sum of the rows' live lengths, a row of length l gets ceil(l / target) splits
    (1..MAX_ROW_SPLITS), target = max(MIN_KEYS_PER_SPLIT, ceil(L * kv_heads / slots)) and
    slots = two programs per SM; so the items number at most bs + slots / kv_heads (the static
    `num_items`, the launch's grid) and the rows of more than one item at most slots / kv_heads
    (`merge_ranks`, the merge's grid). Items past the plan's last and ranks of one item cost an
    empty program each."""

    bs: int
    order: torch.Tensor  # int32 [bs]: rank k's row (rows longest first)
    rank_first: torch.Tensor  # int32 [bs]: rank k's first item
    rank_splits: torch.Tensor  # int32 [bs]: rank k's items
    item_row: torch.Tensor  # int32 [num_items]
    item_split: torch.Tensor  # int32 [num_items]: the item's split of its row
    item_splits: torch.Tensor  # int32 [num_items]: its row's splits (0: an empty item)
    num_items: int
    merge_ranks: int


def query_tiles(group: int, tokens_per_req: int) -> tuple[int, int]:
    """(block_m, tiles a row) of a decode / verify launch: a row's group * T query rows."""
    block_m = min(64, max(16, next_power_of_2(group * tokens_per_req)))
    return block_m, -(-group * tokens_per_req // block_m)


def plans_rows(bs: int, tokens_per_req: int, heads: int, kv_heads: int, device) -> bool:
    """Whether a decode / verify batch takes a RowPlan rather than one split a row started
    longest first: when its one-split programs are fewer than four per slot. With more, the
    longest-first order alone evens the slots out and the plan's merge launch costs more than
    it saves (8B shape, H200: 192 rows of the job's contexts 141 us a layer ordered vs 147
    planned; 64 rows 95 vs 61; results/job_step_wave14.md)."""
    programs = bs * query_tiles(heads // kv_heads, tokens_per_req)[1] * kv_heads
    return programs < 4 * plan_slots(torch.device(device))


def plan_slots(device: torch.device) -> int:
    """Programs the GPU runs at once, as the plans count them (two per SM)."""
    return 2 * _num_sms(device)


def row_plan(positions: torch.Tensor, bs: int, tokens_per_req: int, kv_len: int,
             kv_heads: int) -> RowPlan:  # fmt: skip
    """The step's RowPlan (one launch, graph-capturable): rows of `tokens_per_req` positions
    each (the last the longest), keys at positions < kv_len reachable."""
    slots = plan_slots(positions.device)
    extra = -(-slots // kv_heads)
    num_items, merge_ranks = bs + extra, min(bs, extra)
    dev = positions.device
    ranks = torch.empty((3, bs), dtype=torch.int32, device=dev)
    items = torch.empty((3, num_items), dtype=torch.int32, device=dev)
    _row_plan_kernel[(1,)](
        positions, ranks[0], ranks[1], ranks[2], items[0], items[1], items[2], bs,
        tokens_per_req, kv_len, num_items, kv_heads, slots,
        MIN_KEYS=MIN_KEYS_PER_SPLIT, MAX_ROW_SPLITS=MAX_ROW_SPLITS,
        BLOCK_B=max(2, next_power_of_2(bs)), BLOCK_I=next_power_of_2(num_items), num_warps=4,
        **pdl_options(pdl_mode(positions, "plan")),
    )  # fmt: skip
    return RowPlan(bs, ranks[0], ranks[1], ranks[2], items[0], items[1], items[2], num_items,
                   merge_ranks)  # fmt: skip


def longest_first(positions: torch.Tensor, bs: int, tokens_per_req: int) -> torch.Tensor:
    """The step's rows ordered by context length, longest first (int32 [bs]): paged_attention's
    `row_order`, made once a step (every layer reads the same positions)."""
    last = positions.view(bs, tokens_per_req)[:, -1]
    return torch.argsort(last, descending=True).to(torch.int32)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_page: torch.Tensor,
    req_pool_indices: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    kv_len: int,
    tokens_per_req: int,
    num_splits: int | None = None,
    block_n: int | None = None,
    varlen: VarlenTiles | None = None,
    launch: tuple[int, int | None] | None = None,
    row_order: torch.Tensor | None = None,
    plan: RowPlan | None = None,
) -> torch.Tensor:
    """q [bs * T, heads, d] (row-major: T query tokens per row), pools [num_slots, kv_heads, d],
    req_to_page [rows, max_pages] int32, req_pool_indices [bs], positions [bs * T]; keys at
    positions < kv_len (a multiple of page_size) are reachable. Returns [bs * T, heads, d].
    With `varlen` (see `varlen_tiles`) the bs sequences are packed, each of its own length, and
    `tokens_per_req` is unused. `num_splits` / `block_n` override the split-K plan and key block,
    `launch` (num_warps, num_stages or None) the launch (tests, benchmarks/attention_sweep.py).
    `row_order` (a permutation of the bs rows, `longest_first`) sets the order programs start
    in: a batch whose programs run in several waves otherwise waits on long rows that started
    late (the job's context mix: 176 us a layer at bs 192 against 115 with every row at the
    mean; results/job_step_wave13.md); outputs do not depend on it. `plan` (a RowPlan of the
    step, not with `varlen`, `num_splits` or `row_order`) lays the launch out by its items."""
    if not runs_triton(q):
        if varlen is not None:
            return reference.paged_attention_varlen(
                q, k_pool, v_pool, req_to_page, req_pool_indices, positions, page_size, kv_len,
                varlen.seq_lens,
            )  # fmt: skip
        return reference.paged_attention(
            q, k_pool, v_pool, req_to_page, req_pool_indices, positions, page_size, kv_len,
            tokens_per_req,
        )  # fmt: skip
    n, heads, d = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    bs, T = req_pool_indices.shape[0], tokens_per_req
    assert heads == group * kv_heads, (q.shape, kv_heads)
    assert varlen is not None or n == bs * T, (q.shape, bs, T)
    assert k_pool.is_contiguous() and v_pool.stride() == k_pool.stride()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if varlen is not None:
        assert varlen.group == group, (varlen.group, group)
        block_m, m_tiles, programs = varlen.block_m, 1, varlen.num_tiles
    else:
        block_m, m_tiles = query_tiles(group, T)
        programs = bs * m_tiles
    block_d = max(16, next_power_of_2(d))
    if varlen is not None and launch is None and q.element_size() <= 2 and block_d <= 128:
        block_n, launch = block_n or VARLEN_LAUNCH[0], VARLEN_LAUNCH[1:]
    block_n = block_n or (64 if block_d <= 128 and q.element_size() <= 2 else 32)  # shared memory
    planned = plan is not None and varlen is None
    if planned:
        assert plan.bs == bs and num_splits is None and row_order is None, (plan.bs, bs)
        splits, programs = 1, plan.num_items * m_tiles
    else:
        splits = num_splits or choose_num_splits(programs * kv_heads, kv_len, q.device)
    out = torch.empty((n, heads, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    pdl = pdl_mode(q, "attention")
    if planned:  # parts by (item, token, head)
        part_out = torch.empty(
            (plan.num_items * T * heads, d), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((plan.num_items * T * heads,), dtype=torch.float32, device=q.device)
    elif splits > 1:
        part_out = torch.empty((n, heads, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n, heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out
    tables = varlen.tensors if varlen is not None else (req_pool_indices,) * 4  # unread
    items = (plan.item_row, plan.item_split, plan.item_splits) if planned else (positions,) * 3
    _paged_attention_kernel[(programs, kv_heads, splits)](
        q,
        k_pool,
        v_pool,
        req_to_page,
        req_pool_indices,
        positions,
        row_order if row_order is not None else positions,  # unread without row_order
        *items,  # unread without a plan
        *tables,
        out,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        req_to_page.stride(0),
        math.log2(math.e) / math.sqrt(d),
        T,
        kv_len,
        splits,
        m_tiles,
        NUM_HEADS=heads,
        GROUP=group,
        PAGE_SIZE=page_size,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SPLIT=splits > 1,
        ORDERED=row_order is not None and varlen is None,
        PLANNED=planned,
        UPCAST=not q.is_cuda,
        IEEE=q.dtype == torch.float32,
        VARLEN=varlen is not None,
        **_launch_options(launch or (UNSPLIT_LAUNCH if splits == 1 and varlen is None else None)),
        **pdl_options(pdl),
    )
    if planned:
        _merge_planned_kernel[(plan.merge_ranks * T * heads,)](
            part_out,
            part_lse,
            out,
            plan.order,
            plan.rank_first,
            plan.rank_splits,
            out.stride(0),
            out.stride(1),
            T,
            NUM_HEADS=heads,
            HEAD_DIM=d,
            BLOCK_S=MAX_ROW_SPLITS,
            BLOCK_D=block_d,
            num_warps=1 if block_d <= 64 else 2,
            **pdl_options(pdl_mode(q, "merge")),
        )
    elif splits > 1:
        _merge_splits_kernel[(n * heads,)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            splits,
            NUM_HEADS=heads,
            HEAD_DIM=d,
            BLOCK_S=max(2, next_power_of_2(splits)),
            BLOCK_D=block_d,
            num_warps=1 if block_d <= 64 else 2,
            **pdl_options(pdl_mode(q, "merge")),
        )
    return out
