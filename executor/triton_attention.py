"""The Triton attention backend: TorchPagedAttention's interface over kernels/paged_attention.py,
reading only each row's live pages (the torch backend gathers all kv_len keys of every row).
Its `ops` are the fused Triton ops, and `forward(..., rope)` rotates q and k while writing the
KV cache (kernels/rope.py). Where Triton cannot run (the CPU without TRITON_INTERPRET=1) every
kernel takes its torch reference."""

from __future__ import annotations

import torch

from speculant.executor.forward_batch import ForwardBatch
from speculant.kernels.ops import TritonOps
from speculant.kernels.paged_attention import paged_attention
from speculant.kernels.rope import rope_and_write_kv


class TritonPagedAttention:
    """Per-step metadata is the batch itself: the kernels read positions, request rows and
    `req_to_page` on the device, so `prepare` launches nothing and the step stays
    graph-capturable. There is no key-slot gather to share with a drafter (`kv_slots` is
    None; a drafter's torch backend then gathers its own)."""

    ops = TritonOps()

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

    def prepare(self, batch: ForwardBatch, shared_slots: torch.Tensor | None = None) -> None:
        """Remember the step; `shared_slots` (a torch backend's gather) is not needed."""
        self.batch = batch

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q [N, heads, d], k/v [N, kv_heads, d] -> [N, heads, d]. With `rope` (cos, sin from
        RotaryEmbedding.lookup) q and k arrive unrotated and are rotated here, fused with the
        KV write; without it they are already rotated."""
        batch = self.batch
        k_pool, v_pool = self.k_pools[layer_id], self.v_pools[layer_id]
        if rope is not None:
            q = rope_and_write_kv(q, k, v, *rope, k_pool, v_pool, batch.out_cache_loc)
        else:
            k_pool.index_copy_(0, batch.out_cache_loc, k.to(k_pool.dtype))
            v_pool.index_copy_(0, batch.out_cache_loc, v.to(v_pool.dtype))
        return paged_attention(
            q,
            k_pool,
            v_pool,
            self.req_to_page,
            batch.req_pool_indices,
            batch.positions,
            self.page_size,
            batch.kv_len,
            batch.tokens_per_req,
        )
