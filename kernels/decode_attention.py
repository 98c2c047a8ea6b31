"""One-token decode attention fused with RoPE, the KV write and the split merge: what
kernels/rope.py's `rope_and_write_kv` and kernels/paged_attention.py's split launch and merge do
in three launches, in one, for a batch of one token per row laid out by the static split plan
(the engine's bs-1 decode and draft steps).

Program (row, KV head, split): its GQA group's queries rotated from the QKV output, the new
key rotated and the new value (split 0 writes both to the row's cache slot), its share of the
row's keys attended with the new key taken from registers (no wait on the write), and with
several splits its part and log-sum-exp stored, the last split of the (row, KV head) to arrive
(a counter) merging them. Its step inputs (position, page table, slot, cos / sin) are read
before the PDL wait, and with `early` its first block's keys older than the new token too
(written by earlier steps; see `fused_decode_attention`). Rounds as the unfused path (RoPE as
kernels/rope.py, the same blocks and splits, the same log-sum-exp merge); the merge's sum runs
in another order, so outputs agree to float32 rounding, not bit for bit."""

import math

import torch

from speculant.kernels.paged_attention import (
    _attend,
    _load_kv,
    _lse_merge,
    choose_num_splits,
    query_tiles,
)
from speculant.kernels.rope import _rotate
from speculant.kernels.runtime import (
    MAX_COUNTERS,
    arrival_counters,
    next_power_of_2,
    pdl_enter,
    pdl_mode,
    pdl_options,
    runs_triton,
    tl,
    triton,
)


@triton.jit
def _rotated(ptr, base, d, partner, d_ok, cos, sin):
    """One head's d values at ptr + base rotated as kernels/rope.py's `_rotate` (several heads)
    rounds them."""
    x = tl.load(ptr + base + d, mask=d_ok, other=0.0)
    rolled = tl.load(ptr + base + partner, mask=d_ok, other=0.0)
    dtype = ptr.dtype.element_ty
    first = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    second = (rolled.to(tl.float32) * sin).to(dtype).to(tl.float32)
    return (first + second).to(dtype)


@triton.jit
def _with_new_key(
    q, k, v, n, n_ok, position, pos, k_new, v_new, m_i, l_i, acc, scale_log2,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """`_attend` with the new token's key and value (this launch writes them: not read back)
    in place of the cache's at its position."""
    new = (n == position)[:, None]
    k = tl.where(new, k_new[None, :], k)
    v = tl.where(new, v_new[None, :], v)
    return _attend(q, k, v, n, n_ok, pos, m_i, l_i, acc, scale_log2, UPCAST, IEEE)


@triton.jit
def _fused_block(
    q, k_pool_ptr, v_pool_ptr, table, block, end, position, pos, k_new, v_new, kv_head, d, d_ok,
    m_i, l_i, acc, stride_slot, stride_head, scale_log2, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One block of BLOCK_N keys from `block`, read after the wait."""
    n = block + tl.arange(0, BLOCK_N)
    n_ok = n < end
    k, v = _load_kv(k_pool_ptr, v_pool_ptr, table, n, n_ok, kv_head, d, d_ok, stride_slot,
                    stride_head, PAGE_SIZE)  # fmt: skip
    return _with_new_key(q, k, v, n, n_ok, position, pos, k_new, v_new, m_i, l_i, acc,
                         scale_log2, UPCAST, IEEE)  # fmt: skip


@triton.jit(do_not_specialize=["kv_len", "num_splits"])
def _fused_decode_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, k_pool_ptr, v_pool_ptr, req_to_page_ptr,
    rows_ptr, positions_ptr, out_ptr, part_out_ptr, part_lse_ptr, count_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_cos, stride_on,
    stride_oh, stride_slot, stride_head, stride_table, scale_log2, kv_len, num_splits,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, SPLIT: tl.constexpr, EARLY: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # the step's inputs: written before the forward, by launches without PDL
    position = tl.load(positions_ptr + row)
    seq_len = tl.minimum(position + 1, kv_len)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    table = req_to_page_ptr + tl.load(rows_ptr + row).to(tl.int64) * stride_table
    slot = tl.load(slots_ptr + row).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    partner = (d + HEAD_DIM // 2) % HEAD_DIM
    cos = tl.load(cos_ptr + row * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    n0 = start + tl.arange(0, BLOCK_N)
    if EARLY:  # keys older than the new token, written by earlier steps' launches
        k0, v0 = _load_kv(k_pool_ptr, v_pool_ptr, table, n0, (n0 < end) & (n0 < position),
                          kv_head, d, d_ok, stride_slot, stride_head, PAGE_SIZE)  # fmt: skip
    pdl_enter(PDL)

    m = tl.arange(0, BLOCK_M)  # query row = the group's head
    m_ok = m < GROUP
    head = kv_head * GROUP + m
    pos = tl.where(m_ok, position, -1)
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = _rotate(q_ptr, row * stride_qn, head * stride_qh, d, partner, q_mask, cos, sin)
    pool = k_pool_ptr.dtype.element_ty
    k_new = _rotated(k_ptr, row * stride_kn + kv_head * stride_kh, d, partner, d_ok, cos,
                     sin).to(pool)  # fmt: skip
    v_new = tl.load(v_ptr + row * stride_vn + kv_head * stride_vh + d, mask=d_ok,
                    other=0.0).to(pool)  # fmt: skip
    if split == 0:  # one writer per (row, KV head); the attention takes them from registers
        dst = slot * stride_slot + kv_head * stride_head + d
        tl.store(k_pool_ptr + dst, k_new, mask=d_ok)
        tl.store(v_pool_ptr + dst, v_new, mask=d_ok)
    if UPCAST:  # the interpreter has no bf16 arithmetic
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows stay 0
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    first = start
    if EARLY:  # the first block: the keys loaded before the wait, the new one and later after
        if start < end:
            late = (n0 < end) & (n0 >= position)
            k, v = _load_kv(k_pool_ptr, v_pool_ptr, table, n0, late, kv_head, d, d_ok,
                            stride_slot, stride_head, PAGE_SIZE)  # fmt: skip
            k = tl.where(late[:, None], k, k0)
            v = tl.where(late[:, None], v, v0)
            m_i, l_i, acc = _with_new_key(q, k, v, n0, n0 < end, position, pos, k_new, v_new,
                                          m_i, l_i, acc, scale_log2, UPCAST, IEEE)  # fmt: skip
        first = start + BLOCK_N
    if UPCAST:  # the interpreter takes no tensor range bounds: a while loop
        block = first
        while block < end:
            m_i, l_i, acc = _fused_block(
                q, k_pool_ptr, v_pool_ptr, table, block, end, position, pos, k_new, v_new,
                kv_head, d, d_ok, m_i, l_i, acc, stride_slot, stride_head, scale_log2,
                PAGE_SIZE, BLOCK_N, UPCAST, IEEE,
            )  # fmt: skip
            block += BLOCK_N
    else:  # compiled, a for loop pipelines
        for block in range(first, end, BLOCK_N):
            m_i, l_i, acc = _fused_block(
                q, k_pool_ptr, v_pool_ptr, table, block, end, position, pos, k_new, v_new,
                kv_head, d, d_ok, m_i, l_i, acc, stride_slot, stride_head, scale_log2,
                PAGE_SIZE, BLOCK_N, UPCAST, IEEE,
            )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + row * stride_on + head[:, None] * stride_oh + d[None, :]
    if not SPLIT:
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        part = (row * NUM_HEADS + head) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
        tl.store(part_lse_ptr + part, lse, mask=m_ok)
        tl.debug_barrier()  # every thread's part stored before the release below
        counter = count_ptr + row * (NUM_HEADS // GROUP) + kv_head
        done = tl.atomic_add(counter, 1, sem="acq_rel")
        if done == num_splits - 1:  # the last split of this (row, KV head) merges
            s = tl.arange(0, BLOCK_S)
            for g in tl.static_range(GROUP):
                parts = (row * NUM_HEADS + kv_head * GROUP + g) * num_splits + s
                merged = _lse_merge(part_out_ptr, part_lse_ptr, parts, s < num_splits, d, d_ok,
                                    HEAD_DIM)  # fmt: skip
                tl.store(out_ptr + row * stride_on + (kv_head * GROUP + g) * stride_oh + d,
                         merged.to(out_ptr.dtype.element_ty), mask=d_ok)  # fmt: skip
            tl.atomic_xchg(counter, 0)  # clean for the next launch or replay


def fuses(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether `fused_decode_attention` takes these (else rope_and_write_kv + paged_attention):
    Triton runs here, a GQA group that fits one query tile (a program holds the whole group),
    cos in q's dtype, unit strides along the head dim, a contiguous pool."""
    return (
        runs_triton(q)
        and query_tiles(q.shape[1] // k.shape[1], 1)[1] == 1
        and cos.dtype == q.dtype
        and k_pool.is_contiguous()
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and cos.stride(-1) == 1
    )


def fused_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    req_to_page: torch.Tensor,
    req_pool_indices: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    kv_len: int,
    num_splits: int | None = None,
    block_n: int | None = None,
    early: bool = True,
) -> torch.Tensor:
    """Unrotated q [bs, heads, d], k / v [bs, kv_heads, d] of one token per row (strided views
    of the QKV output are fine), cos / sin [bs, 1, d] or [bs, d] in q's dtype, pools [slots,
    kv_heads, d], `slots` [bs] the new tokens' cache slots: writes the rotated keys and the
    values there and returns the attention output [bs, heads, d] (see the module doc; take it
    where `fuses`). `early`: the caller's kernel before this one (the QKV projection) lets it
    launch only after its own PDL wait, so keys of earlier steps may be read before this
    launch's wait."""
    bs, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    assert heads == group * kv_heads and k_pool.stride() == v_pool.stride(), (q.shape, k.shape)
    block_m, tiles = query_tiles(group, 1)
    if tiles != 1:  # one program holds its KV head's whole group (see `fuses`)
        raise ValueError(f"fused decode attention: a GQA group of {group} is over {block_m}")
    out = torch.empty((bs, heads, d), dtype=q.dtype, device=q.device)
    if bs == 0:
        return out
    block_d = max(16, next_power_of_2(d))  # tl.dot takes K >= 16 (as paged_attention pads)
    block_n = block_n or (64 if block_d <= 128 and q.element_size() <= 2 else 32)
    splits = num_splits or choose_num_splits(bs * kv_heads, kv_len, q.device)
    if splits > 1:
        if bs * kv_heads > MAX_COUNTERS:
            raise ValueError(f"fused decode attention: {bs * kv_heads} counters, {MAX_COUNTERS}")
        part_out = torch.empty((bs, heads, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((bs, heads, splits), dtype=torch.float32, device=q.device)
        counters = arrival_counters(q.device)
    else:
        part_out = part_lse = counters = out  # unread
    _fused_decode_kernel[(bs, kv_heads, splits)](
        q, k, v, cos, sin, slots, k_pool, v_pool, req_to_page, req_pool_indices, positions, out,
        part_out, part_lse, counters, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), cos.stride(0), out.stride(0), out.stride(1), k_pool.stride(0),
        k_pool.stride(1), req_to_page.stride(0), math.log2(math.e) / math.sqrt(d), kv_len, splits,
        NUM_HEADS=heads, GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=d,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_S=max(2, next_power_of_2(splits)), SPLIT=splits > 1, EARLY=early,
        UPCAST=not q.is_cuda, IEEE=q.dtype == torch.float32, num_warps=4,
        **pdl_options(pdl_mode(q, "attention")),
    )  # fmt: skip
    return out
