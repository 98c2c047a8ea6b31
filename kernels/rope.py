"""Neox RoPE on q and k fused with the KV-cache write: one kernel rotates a token's query and key
heads, writes the rotated keys and the values to the token's cache slot, and returns the
rotated queries. Rounds like the torch reference (kernels/reference.py: two products in the
activation dtype, then their sum); `sin` carries rotate_half's sign, as models/layers.py's
RotaryEmbedding builds it."""

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


@triton.jit
def _rotate(ptr, base, heads, d, partner, mask, cos, sin):
    # x * cos + roll(x, d/2) * sin, each product rounded to the activation dtype as torch does
    x = tl.load(ptr + base + heads[:, None] + d[None, :], mask=mask, other=0.0)
    rolled = tl.load(ptr + base + heads[:, None] + partner[None, :], mask=mask, other=0.0)
    dtype = ptr.dtype.element_ty
    first = (x.to(tl.float32) * cos[None, :]).to(dtype).to(tl.float32)
    second = (rolled.to(tl.float32) * sin[None, :]).to(dtype).to(tl.float32)
    return (first + second).to(dtype)


@triton.jit
def _rope_kv_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    q_out_ptr,
    k_pool_ptr,
    v_pool_ptr,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_cos,
    stride_pool_slot,
    stride_pool_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    partner = (d + HEAD_DIM // 2) % HEAD_DIM
    cos = tl.load(cos_ptr + token * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)

    heads = tl.arange(0, BLOCK_H)
    mask = (heads < NUM_HEADS)[:, None] & d_ok[None, :]
    q = _rotate(q_ptr, token * stride_qn, heads * stride_qh, d, partner, mask, cos, sin)
    out = token * NUM_HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + d[None, :]
    tl.store(q_out_ptr + out, q, mask=mask)

    kv_heads = tl.arange(0, BLOCK_KV)
    kv_mask = (kv_heads < NUM_KV_HEADS)[:, None] & d_ok[None, :]
    k = _rotate(k_ptr, token * stride_kn, kv_heads * stride_kh, d, partner, kv_mask, cos, sin)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    dst = slot * stride_pool_slot + kv_heads[:, None] * stride_pool_head + d[None, :]
    tl.store(k_pool_ptr + dst, k.to(k_pool_ptr.dtype.element_ty), mask=kv_mask)
    v_src = token * stride_vn + kv_heads[:, None] * stride_vh + d[None, :]
    v = tl.load(v_ptr + v_src, mask=kv_mask, other=0.0)
    tl.store(v_pool_ptr + dst, v.to(v_pool_ptr.dtype.element_ty), mask=kv_mask)


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """q [N, heads, d], k/v [N, kv_heads, d] (strided views of the QKV output are fine),
    cos/sin [N, 1, d] or [N, d] in q's dtype, pools [num_slots, kv_heads, d], slots [N].
    Writes rotated k and v at `slots`; returns rotated q [N, heads, d] (contiguous)."""
    fallback = cos.dtype != q.dtype or cos.stride(0) != sin.stride(0) or not k_pool.is_contiguous()
    if fallback or not runs_triton(q) or any(t.stride(-1) != 1 for t in (q, k, v, cos, sin)):
        return reference.rope_and_write_kv(q, k, v, cos, sin, k_pool, v_pool, slots)
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty((n, heads, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return q_out
    assert k_pool.stride() == v_pool.stride(), "K and V pools must share a layout"
    _rope_kv_write_kernel[(n,)](
        q,
        k,
        v,
        cos,
        sin,
        slots,
        q_out,
        k_pool,
        v_pool,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_pool.stride(0),
        k_pool.stride(1),
        NUM_HEADS=heads,
        NUM_KV_HEADS=kv_heads,
        HEAD_DIM=d,
        BLOCK_H=next_power_of_2(heads),
        BLOCK_KV=next_power_of_2(kv_heads),
        BLOCK_D=next_power_of_2(d),
        num_warps=4,
        **pdl_options(pdl_mode(q, "rope")),
    )
    return q_out
