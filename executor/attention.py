"""Attention backends over the paged KV cache. `torch` works on CPU and GPU for prefill (with a
cached prefix), decode and multi-token verify, and is the reference for faster backends;
`triton` (executor/triton_attention.py) reads only live pages with fused kernels. A backend
declares the element-wise ops the layers run around it as `ops` (kernels/ops.py)."""

from __future__ import annotations

import importlib.util
import itertools
import logging

import torch
import torch.nn.functional as F

from speculant.errors import SpeculantError
from speculant.executor.forward_batch import ForwardBatch
from speculant.kernels.ops import TORCH_OPS

ATTENTION_BACKENDS = ("auto", "triton", "torch")
log = logging.getLogger("speculant")


def resolve_attention_backend(name: str, device: str) -> str:
    """`auto` is triton on CUDA when it imports (an installed one that fails to, e.g. built for
    another torch, falls back to torch with a warning), else torch; `triton` without triton
    installed is an error. On the CPU, triton runs its torch fallbacks (or the interpreter
    under TRITON_INTERPRET=1)."""
    if name not in ATTENTION_BACKENDS:
        raise SpeculantError(
            f"attention backend {name!r} is not supported; use one of "
            f"{', '.join(ATTENTION_BACKENDS)}"
        )
    installed = importlib.util.find_spec("triton") is not None  # without importing it
    if name == "auto":
        if not (installed and str(device).startswith("cuda")):
            return "torch"
        try:
            import triton  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any failure of the import: torch serves
            log.warning(
                "triton is installed but does not import (%s: %s); attention runs on the torch "
                "backend (fix the install, or pass --attention-backend torch)",
                type(exc).__name__, exc,
            )  # fmt: skip
            return "torch"
        return "triton"
    if name == "triton" and not installed:
        raise SpeculantError(
            "--attention-backend triton needs the triton package; pip install triton, or use "
            "--attention-backend torch"
        )
    return name


def paged_attention_backend(
    name: str,
    k_pools: list[torch.Tensor],
    v_pools: list[torch.Tensor],
    req_to_page: torch.Tensor,
    page_size: int,
    block: bool = False,
):
    """The paged attention backend `name` (resolved: triton or torch) over these pools; with
    `block`, DFLASH's block attention on that backend."""
    if name == "triton":
        from speculant.executor.triton_attention import (
            TritonBlockContextAttention,
            TritonPagedAttention,
        )

        kind = TritonBlockContextAttention if block else TritonPagedAttention
    else:
        kind = BlockContextAttention if block else TorchPagedAttention
    return kind(k_pools, v_pools, req_to_page, page_size)


class PoolAttention:
    """What every attention backend reads: the per-layer K/V pools [num_slots, kv_heads, d] and
    the block table `req_to_page` of `page_size`-token pages. `kv_slots` is the key-slot gather a
    backend shares with a drafter on the same block table (None when it makes none)."""

    kv_slots: torch.Tensor | None = None
    # whether its work grows with the batch's `kv_len` (every key position gathered, as the
    # torch backend does): an eager decode step then passes the positions its rows' pages hold
    # rather than a graph's whole reach (ModelRunner.verify_step)
    gathers_kv_len = False
    reads_zero_slot = False  # reads the pools' last slot for stale ones (`live_slots`)

    def __init__(
        self,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        req_to_page: torch.Tensor,
        page_size: int,
    ):
        slots = k_pools[0].shape[0] if k_pools else 1
        if self.reads_zero_slot and slots % page_size != 1 % page_size:
            raise ValueError(
                f"K/V pools of {slots} slots on {page_size}-slot pages: the torch attention "
                "backend needs the zero slot past every page (num_pages * page_size + 1 slots, "
                "as PagedKVCache makes them)"
            )
        self.k_pools, self.v_pools = k_pools, v_pools
        self.req_to_page, self.page_size = req_to_page, page_size

    def release_step(self) -> None:
        """Forget what the last `prepare` kept (tensors a graph capture left in its pool, which
        would keep the pool alive); the next step's `prepare` sets them again."""
        keep = {"k_pools", "v_pools", "req_to_page", "page_size"}
        for name in [n for n in vars(self) if n not in keep]:
            delattr(self, name)


class TorchPagedAttention(PoolAttention):
    """Writes the step's K/V into their slots, gathers each row's pages in position order, and
    runs masked SDPA: a query at position p sees keys at positions <= p. Slots past a row's
    newest position (stale: a freed row's, rejected drafts') are read as zeros (the gather takes
    the pools' zero slot in their place, `live_slots`), so that a non-finite value left there (a
    diverged checkpoint's, an fp16 overflow's) cannot reach the output through the mask (NaN +
    -inf is NaN; 0 x NaN too) as the Triton kernels never load them. Shapes depend only on (bs,
    T, kv_len), so the decode step is graph-capturable."""

    ops = TORCH_OPS
    gathers_kv_len = True
    reads_zero_slot = True

    def prepare(self, batch: ForwardBatch, shared_slots: torch.Tensor | None = None) -> None:
        """Per-step metadata: every row's key slots [bs, kv_len] and the position mask. A drafter
        on the same block table passes the target's slots (same rows, same shape) as
        `shared_slots` and skips its own gather."""
        self.kv_slots = key_slots(batch, self.req_to_page, self.page_size, shared_slots)
        key_pos = torch.arange(batch.kv_len, device=self.kv_slots.device)
        self.batch = batch
        if batch.is_varlen:  # one (bs 1) mask per packed sequence
            bounds = [0, *itertools.accumulate(batch.seq_lens)]
            self.spans = list(itertools.pairwise(bounds))
            self.visible_per_seq = [
                key_pos <= batch.positions[a:b].view(1, 1, b - a, 1) for a, b in self.spans
            ]
            self.live_per_seq = [  # a sequence's newest position is its last
                live_slots(self.kv_slots[i : i + 1], key_pos > batch.positions[b - 1], self.k_pools)
                for i, (_, b) in enumerate(self.spans)
            ]
            self.masks_per_seq = [{} for _ in self.spans]
            return
        query_pos = batch.positions.view(batch.bs, 1, batch.tokens_per_req, 1)
        self.visible = key_pos <= query_pos  # [bs, 1, T, kv_len]
        newest = batch.positions.view(batch.bs, batch.tokens_per_req).amax(1)
        self.live = live_slots(self.kv_slots, key_pos > newest[:, None], self.k_pools)
        self.masks = {}

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q [N, heads, d], k/v [N, kv_heads, d] -> [N, heads, d]."""
        batch = self.batch
        k_pool, v_pool = self.k_pools[layer_id], self.v_pools[layer_id]
        k_pool.index_copy_(0, batch.out_cache_loc, k.to(k_pool.dtype))
        v_pool.index_copy_(0, batch.out_cache_loc, v.to(v_pool.dtype))
        group = q.shape[1] // k.shape[1]
        if batch.is_varlen:
            out = torch.empty_like(q)
            for i, (a, b) in enumerate(self.spans):
                slots = self.live_per_seq[i]
                bias = additive_mask(self.visible_per_seq[i], group, q.dtype, self.masks_per_seq[i])
                out[a:b] = folded_sdpa(
                    q[a:b],
                    gather(k_pool, slots).transpose(1, 2),
                    gather(v_pool, slots).transpose(1, 2),
                    bias,
                    b - a,
                )
            return out
        keys = gather(k_pool, self.live).transpose(1, 2)  # [bs, kv_heads, kv_len, d]
        values = gather(v_pool, self.live).transpose(1, 2)
        return folded_sdpa(
            q,
            keys,
            values,
            additive_mask(self.visible, group, q.dtype, self.masks),
            batch.tokens_per_req,
        )


def live_slots(slots: torch.Tensor, stale: torch.Tensor, pools: list[torch.Tensor]) -> torch.Tensor:
    """`slots` [bs, L] with the `stale` ones (bool [bs, L]) replaced by the pools' zero slot:
    their last, one past every page (kv_cache.py), which nothing writes."""
    return torch.where(stale, pools[0].shape[0] - 1, slots)


def gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool[slots]: [bs, L, kv_heads, d] for slots [bs, L] (index_select: several times faster
    than advanced indexing on the CPU)."""
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, *pool.shape[1:])


def key_slots(
    batch: ForwardBatch,
    req_to_page: torch.Tensor,
    page_size: int,
    shared_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every row's cache slots in position order, [bs, kv_len] (`shared_slots` when given and of
    that shape: a drafter reuses the target's gather on the same block table)."""
    if shared_slots is not None and shared_slots.shape == (batch.bs, batch.kv_len):
        return shared_slots
    pages = req_to_page[batch.req_pool_indices, : batch.kv_len // page_size].long()
    offsets = torch.arange(page_size, device=pages.device)
    return (pages.unsqueeze(-1) * page_size + offsets).view(batch.bs, -1)


class BlockContextAttention(PoolAttention):
    """DFLASH's attention: each row's block of B query tokens attends to the row's cached
    context (keys at positions before the block) and to the whole block, non-causally (or
    causally when the drafter says so). Only context K/V are written to the pool; the block's
    K/V live for one forward. Shapes depend only on (bs, T, B, kv_len): graph-capturable."""

    reads_zero_slot = True

    def prepare(
        self,
        context: ForwardBatch,
        block_start: torch.Tensor,
        block_len: int,
        causal_block: bool = False,
        shared_slots: torch.Tensor | None = None,
    ) -> None:
        """`context` writes its tokens' K/V (at `out_cache_loc`); `block_start` [bs] is each
        row's first block position, so context keys at positions >= it (stale, rejected or not
        yet verified) are hidden."""
        bs, B = context.bs, block_len
        self.context, self.block_len = context, B
        self.kv_slots = key_slots(context, self.req_to_page, self.page_size, shared_slots)
        key_pos = torch.arange(context.kv_len, device=block_start.device)
        ctx_visible = (key_pos < block_start[:, None]).unsqueeze(1).expand(bs, B, -1)
        block_visible = torch.ones(B, B, dtype=torch.bool, device=block_start.device)
        if causal_block:
            block_visible = block_visible.tril()
        visible = torch.cat([ctx_visible, block_visible.expand(bs, B, B)], dim=-1)
        self.visible = visible.unsqueeze(1)  # [bs, 1, B, kv_len + B]
        # context slots at or after the block: stale, read as zeros (TorchPagedAttention)
        self.live = live_slots(self.kv_slots, key_pos >= block_start[:, None], self.k_pools)
        self.masks = {}

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_context: torch.Tensor,
        v_context: torch.Tensor,
    ) -> torch.Tensor:
        """Block q/k/v [bs * B, heads or kv_heads, d], context k/v [N_context, kv_heads, d]
        -> [bs * B, heads, d]."""
        k_pool, v_pool = self.k_pools[layer_id], self.v_pools[layer_id]
        k_pool.index_copy_(0, self.context.out_cache_loc, k_context.to(k_pool.dtype))
        v_pool.index_copy_(0, self.context.out_cache_loc, v_context.to(v_pool.dtype))
        bs, B = self.context.bs, self.block_len
        block_k = k.to(k_pool.dtype).view(bs, B, *k.shape[1:])
        block_v = v.to(v_pool.dtype).view(bs, B, *v.shape[1:])
        keys = torch.cat([gather(k_pool, self.live), block_k], dim=1)
        values = torch.cat([gather(v_pool, self.live), block_v], dim=1)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        group = q.shape[1] // k.shape[1]
        return folded_sdpa(
            q, keys, values, additive_mask(self.visible, group, q.dtype, self.masks), B
        )


def additive_mask(
    visible: torch.Tensor, group: int, dtype: torch.dtype, cache: dict
) -> torch.Tensor:
    """The additive form of `visible` [bs, 1, T, L] for queries laid out [bs, kv_heads,
    group * T] (made once per step and kept in `cache`)."""
    key = (group, dtype)
    if key not in cache:
        bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        bias.masked_fill_(~visible, float("-inf"))
        cache[key] = bias.repeat(1, 1, group, 1)
    return cache[key]


def folded_sdpa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, T: int
) -> torch.Tensor:
    """SDPA of q [bs * T, heads, d] over keys/values [bs, kv_heads, L, d] with an additive
    `bias` [bs, kv_heads or 1, group * T, L]; GQA folds the query heads of a KV head into the
    query axis, so K/V are never repeated."""
    bs, kv_heads, d = keys.shape[0], keys.shape[1], q.shape[-1]
    group = q.shape[1] // kv_heads
    queries = (
        q.view(bs, T, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(bs, kv_heads, group * T, d)
    )
    out = F.scaled_dot_product_attention(
        queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=bias
    )
    return out.view(bs, kv_heads, group, T, d).permute(0, 3, 1, 2, 4).reshape(q.shape)
