"""The Triton attention backend: TorchPagedAttention's interface over kernels/paged_attention.py,
reading only each row's live pages (the torch backend gathers all kv_len keys of every row).
Its `ops` are the fused Triton ops, and `forward(..., rope)` rotates q and k while writing the
KV cache (kernels/rope.py). Where Triton cannot run (the CPU without TRITON_INTERPRET=1) every
kernel takes its torch reference."""

from __future__ import annotations

import torch

from speculant.executor.attention import PoolAttention
from speculant.executor.forward_batch import ForwardBatch
from speculant.kernels.decode_attention import fused_decode_attention, fuses
from speculant.kernels.ops import TritonOps
from speculant.kernels.paged_attention import (
    longest_first,
    paged_attention,
    plans_rows,
    row_plan,
    varlen_tiles,
)
from speculant.kernels.rope import rope_and_write_kv
from speculant.kernels.runtime import pdl_mode, runs_triton


class TritonPagedAttention(PoolAttention):
    """Per-step metadata is the batch itself: the kernels read positions, request rows and
    `req_to_page` on the device, so `prepare` launches nothing and the step stays
    graph-capturable. There is no key-slot gather to share with a drafter (`kv_slots` stays
    None; a drafter's torch backend then gathers its own)."""

    ops = TritonOps()
    # How a decode / verify batch's programs are laid out (made once a step, at the first layer):
    # "auto" (a RowPlan where kernels/paged_attention.plans_rows says so, else longest first),
    # "plan" (kernels/paged_attention.RowPlan: splits by each row's length, live items first,
    # longest rows first), "longest_first" (the static split plan, rows longest first), "batch"
    # (batch order). A batch of mixed context lengths in batch order waits on long rows started
    # late (benchmarks/job_step.py, attention_sweep.py compare them).
    row_layout = "auto"
    # One-token rows laid out in batch order (bs 1, or row_layout "batch") with RoPE fused: one
    # launch for RoPE, the KV write, attention and the split merge (kernels/decode_attention.py).
    # Off: measured slower than the three launches (one H100, 8B bs 1: FP8 3.635 vs 3.458 ms,
    # bf16 5.803 vs 5.683; benchmarks/results/wave25.md); a lever for work on its latency.
    fuse_decode = False

    def prepare(self, batch: ForwardBatch, shared_slots: torch.Tensor | None = None) -> None:
        """Remember the step; `shared_slots` (a torch backend's gather) is not needed. A packed
        batch's tile tables and a batch's row order are made at the first layer (the tables
        depend on the GQA group)."""
        self.batch = batch
        self.tiles = {}
        self.row_order = self.plan = None

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
        if (
            self.fuse_decode
            and rope is not None
            and batch.tokens_per_req == 1
            and not batch.is_varlen
            and (batch.bs == 1 or self.row_layout == "batch")
            and fuses(q, k, rope[0], k_pool)
        ):
            return fused_decode_attention(
                q, k, v, *rope, k_pool, v_pool, batch.out_cache_loc, self.req_to_page,
                batch.req_pool_indices, batch.positions, self.page_size, batch.kv_len,
                # keys of earlier forwards may be read before the PDL wait while the QKV
                # projection launches its successors after its own wait (a forward's first
                # kernels, embedding and the rotary lookup, are torch launches without PDL)
                early=pdl_mode(q, "gemv") < 2,
            )  # fmt: skip
        if rope is not None:
            q = rope_and_write_kv(q, k, v, *rope, k_pool, v_pool, batch.out_cache_loc)
        else:
            k_pool.index_copy_(0, batch.out_cache_loc, k.to(k_pool.dtype))
            v_pool.index_copy_(0, batch.out_cache_loc, v.to(v_pool.dtype))
        varlen = None
        if batch.is_varlen:
            group = q.shape[1] // k.shape[1]
            if batch.tiles is not None and batch.tiles.group == group:
                self.tiles[group] = batch.tiles  # static device buffers (a piecewise graph)
            elif group not in self.tiles:
                self.tiles[group] = varlen_tiles(list(batch.seq_lens), group, q.device)
            varlen = self.tiles[group]
        elif batch.bs > 1 and self.row_order is None and self.plan is None and runs_triton(q):
            bs, T, kv_heads = batch.bs, batch.tokens_per_req, k.shape[1]
            layout = self.row_layout
            if layout == "auto":
                plan = plans_rows(bs, T, q.shape[1], kv_heads, q.device)
                layout = "plan" if plan else "longest_first"
            if layout == "plan":
                self.plan = row_plan(batch.positions, bs, T, batch.kv_len, kv_heads)
            elif layout == "longest_first":
                self.row_order = longest_first(batch.positions, bs, T)
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
            varlen=varlen,
            row_order=self.row_order,
            plan=self.plan,
        )


class TritonBlockContextAttention(PoolAttention):
    """DFLASH's block attention (the interface of executor/attention.BlockContextAttention) on the
    paged kernel, reading only live pages: the block's K/V are written into the drafter's pool at
    the block's own positions, and every block query gets the visible position block_start + B - 1
    (its true position when the block is causal), so it sees the context before the block and the
    whole block. Those slots hold positions not yet verified: the next step's context write
    overwrites them before they are visible to anything. A row whose block runs past its reserved
    pages (a request that finished this step) writes into the zero page or its own last page:
    its drafts are never used."""

    def prepare(
        self,
        context: ForwardBatch,
        block_start: torch.Tensor,
        block_len: int,
        causal_block: bool = False,
        shared_slots: torch.Tensor | None = None,
    ) -> None:
        bs, B, page_size = context.bs, block_len, self.page_size
        self.context, self.block_len = context, B
        positions = block_start[:, None] + torch.arange(B, device=block_start.device)
        columns = (positions // page_size).clamp(max=self.req_to_page.shape[1] - 1)
        pages = self.req_to_page[context.req_pool_indices[:, None], columns].long()
        self.block_slots = (pages * page_size + positions % page_size).reshape(-1)
        visible = positions if causal_block else (block_start + B - 1)[:, None].expand(bs, B)
        self.query_positions = visible.reshape(-1).contiguous()
        max_tokens = self.req_to_page.shape[1] * page_size
        self.kv_len = min(max_tokens, -(-(context.kv_len + B) // page_size) * page_size)

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_context: torch.Tensor,
        v_context: torch.Tensor,
    ) -> torch.Tensor:
        """Block q/k/v [bs * B, heads or kv_heads, d] (rotated), context k/v [N_context,
        kv_heads, d] -> [bs * B, heads, d]."""
        k_pool, v_pool = self.k_pools[layer_id], self.v_pools[layer_id]
        for pool, slots, values in (
            (k_pool, self.context.out_cache_loc, k_context),
            (v_pool, self.context.out_cache_loc, v_context),
            (k_pool, self.block_slots, k),  # after the context: the block's K/V win
            (v_pool, self.block_slots, v),
        ):
            pool.index_copy_(0, slots, values.to(pool.dtype))
        return paged_attention(
            q,
            k_pool,
            v_pool,
            self.req_to_page,
            self.context.req_pool_indices,
            self.query_positions,
            self.page_size,
            self.kv_len,
            self.block_len,
        )
