"""Attention backends over the paged KV cache. `torch` works on CPU and GPU for prefill (with a
cached prefix), decode and multi-token verify, and is the reference for faster backends."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speculant.executor.forward_batch import ForwardBatch


class TorchPagedAttention:
    """Writes the step's K/V into their slots, gathers each row's pages in position order, and
    runs masked SDPA: a query at position p sees keys at positions <= p. Shapes depend only on
    (bs, T, kv_len), so the decode step is graph-capturable."""

    def __init__(
        self,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        req_to_page: torch.Tensor,
        page_size: int,
    ):
        self.k_pools, self.v_pools = k_pools, v_pools
        self.req_to_page = req_to_page
        self.page_size = page_size
        self.batch: ForwardBatch | None = None
        self.kv_slots: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    def prepare(self, batch: ForwardBatch, shared_slots: torch.Tensor | None = None) -> None:
        """Per-step metadata: every row's key slots [bs, kv_len] and the position mask. A drafter
        on the same block table passes the target's slots (same rows, same shape) as
        `shared_slots` and skips its own gather."""
        if shared_slots is not None and shared_slots.shape == (batch.bs, batch.kv_len):
            self.kv_slots = shared_slots
        else:
            num_pages = batch.kv_len // self.page_size
            pages = self.req_to_page[batch.req_pool_indices, :num_pages].long()
            offsets = torch.arange(self.page_size, device=pages.device)
            self.kv_slots = (pages.unsqueeze(-1) * self.page_size + offsets).view(batch.bs, -1)
        key_pos = torch.arange(batch.kv_len, device=self.kv_slots.device)
        query_pos = batch.positions.view(batch.bs, 1, batch.tokens_per_req, 1)
        self.visible = key_pos <= query_pos  # [bs, 1, T, kv_len]
        self.masks = {}
        self.batch = batch

    def _mask(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask for queries laid out [bs, kv_heads, group * T] (made once per step)."""
        key = (group, dtype)
        if key not in self.masks:
            bias = torch.zeros(self.visible.shape, dtype=dtype, device=self.visible.device)
            bias.masked_fill_(~self.visible, float("-inf"))
            self.masks[key] = bias.repeat(1, 1, group, 1)
        return self.masks[key]

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q [N, heads, d], k/v [N, kv_heads, d] -> [N, heads, d]."""
        batch = self.batch
        k_pool, v_pool = self.k_pools[layer_id], self.v_pools[layer_id]
        k_pool.index_copy_(0, batch.out_cache_loc, k.to(k_pool.dtype))
        v_pool.index_copy_(0, batch.out_cache_loc, v.to(v_pool.dtype))
        keys = k_pool[self.kv_slots].transpose(1, 2)  # [bs, kv_heads, kv_len, d]
        values = v_pool[self.kv_slots].transpose(1, 2)
        bs, T, kv_heads, d = batch.bs, batch.tokens_per_req, k.shape[1], q.shape[-1]
        group = q.shape[1] // kv_heads
        # Fold the query heads of a KV head into the query axis: no K/V repeat for GQA.
        queries = (
            q.view(bs, T, kv_heads, group, d)
            .permute(0, 2, 3, 1, 4)
            .reshape(bs, kv_heads, group * T, d)
        )
        out = F.scaled_dot_product_attention(
            queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=self._mask(group, q.dtype)
        )
        return out.view(bs, kv_heads, group, T, d).permute(0, 3, 1, 2, 4).reshape(q.shape)
