"""The torch references of the kernels: the exact code the models ran before the kernels (the
CPU path, and each kernel's fallback where Triton cannot run). Imports no triton."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * x / rms(x), computed in float32 and cast back like the HF models."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x)."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused gate-up output [N, 2I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def top_logprobs(
    logits: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp [...], the `num_top` largest logits less it [..., num_top], their ids) of
    logits [..., V], in float32, most likely first."""
    logits = logits.float()
    norm = torch.logsumexp(logits, dim=-1)
    if num_top:
        values, ids = logits.topk(num_top, dim=-1)
        return norm, values - norm.unsqueeze(-1), ids
    empty = (*logits.shape[:-1], 0)
    return norm, logits.new_empty(empty), logits.new_empty(empty, dtype=torch.int64)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of x [N, heads, d] by cos/sin [N, 1, d] (`sin` carries rotate_half's sign):
    two products in x's dtype, then their sum, like the HF models."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def rope_and_write_kv(q, k, v, cos, sin, k_pool, v_pool, slots) -> torch.Tensor:
    """Rotate q and k, write k and v at `slots` of the pools, return the rotated q."""
    k_pool.index_copy_(0, slots, rotate(k, cos, sin).to(k_pool.dtype))
    v_pool.index_copy_(0, slots, v.to(v_pool.dtype))
    return rotate(q, cos, sin)


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
) -> torch.Tensor:
    """Paged attention in float32: gathers each row's kv_len keys in position order and masks
    keys after each query's position (q [bs * T, heads, d] -> [bs * T, heads, d]); slots past
    a row's newest position read as zeros."""
    bs, T = req_pool_indices.shape[0], tokens_per_req
    heads, d = q.shape[1], q.shape[2]
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    pages = req_to_page[req_pool_indices, : kv_len // page_size].long()
    offsets = torch.arange(page_size, device=q.device)
    slots = (pages.unsqueeze(-1) * page_size + offsets).view(bs, -1)
    keys, values = k_pool[slots].float(), v_pool[slots].float()  # [bs, L, kv_heads, d]
    key_pos = torch.arange(slots.shape[1], device=q.device)
    # slots past each row's newest position are never read (as the kernel loads none): zeroed,
    # so a non-finite value left there cannot reach the output (0 x NaN is NaN)
    stale = (key_pos > positions.view(bs, T).amax(1, keepdim=True))[..., None, None]
    keys, values = keys.masked_fill_(stale, 0), values.masked_fill_(stale, 0)
    queries = q.float().view(bs, T, kv_heads, group, d)
    scores = torch.einsum("btkgd,blkd->bkgtl", queries, keys) / math.sqrt(d)
    visible = key_pos <= positions.view(bs, T, 1)  # [bs, T, L]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    out = torch.einsum("bkgtl,blkd->btkgd", scores.softmax(-1), values)
    return out.reshape(q.shape).to(q.dtype)


def paged_attention_varlen(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_page: torch.Tensor,
    req_pool_indices: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    kv_len: int,
    seq_lens: tuple[int, ...],
) -> torch.Tensor:
    """`paged_attention` over packed sequences of their own lengths (q [sum(seq_lens), heads,
    d]): each sequence as a batch of one."""
    out, start = torch.empty_like(q), 0
    for i, length in enumerate(seq_lens):
        end = start + length
        out[start:end] = paged_attention(
            q[start:end], k_pool, v_pool, req_to_page, req_pool_indices[i : i + 1],
            positions[start:end], page_size, kv_len, length,
        )  # fmt: skip
        start = end
    return out


def record_catch_up(rows, ids, sources, buf_ids, buf, count, sentinel: int) -> None:
    """A plain step's deferred catch-up record (kernels/catch_up.py's `record`, in torch)."""
    depth = buf.shape[1]
    live = (rows != sentinel).long()
    j = count[rows].clamp(max=depth - 1)
    if ids is not None:
        buf_ids[rows, j] = ids
    if buf.shape[-1]:
        features = sources[0] if len(sources) == 1 else torch.cat(sources, dim=-1)
        buf[rows, j] = features.to(buf.dtype)
    count.index_add_(0, rows, live)
