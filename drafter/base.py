"""The drafter interface the runner and graph wrapper use, and what chain drafters share.

A drafter owns a paged KV pool indexed by the target's `req_to_page` (shared block tables: the
same rows, pages and slots as the target, so its attention reuses the target's per-step key-slot
gather). It proposes k tokens per request after prefill and after every verify step. Drafts are
argmax for greedy requests and sampled from the filtered draft distribution q otherwise; q is
returned in target-vocabulary space so verify can run rejection sampling."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from speculant.executor.attention import paged_attention_backend
from speculant.executor.forward_batch import ForwardBatch, ForwardMode, SamplingInfo
from speculant.executor.kv_cache import PagedKVCache
from speculant.executor.sampling import (
    GREEDY,
    STREAM_DRAFT,
    STREAM_SAMPLE,
    filtered_probs,
    race,
)


@dataclass
class Proposal:
    """k draft tokens per row, and their distribution q when they were sampled."""

    tokens: torch.Tensor  # [bs, k] target-vocabulary ids
    probs: torch.Tensor | None  # [bs, k, V_target] or None (argmax drafts, one-hot q)


@dataclass
class DraftInputs:
    """What the target step hands the drafter: the batch it ran (packed prefill chunks and verify
    rows, or a decode batch), its hidden and aux states, and the token after every input
    position (the prompt's next token, a sampled or verified one)."""

    batch: ForwardBatch
    hidden: torch.Tensor  # [N, H] target final-norm hidden states, N = the batch's tokens
    aux: list[torch.Tensor]  # target residual entering each of `aux_layer_ids`, [N, H] each
    next_tokens: torch.Tensor  # [N] (or [bs, T]): the token at (input position + 1), -1 after
    last_flat: torch.Tensor  # [bs]: per sequence, the input index whose successor is the newest
    target_slots: torch.Tensor  # the target attention's key slots for this batch (shared)


class Drafter(ABC):
    """Proposes `num_draft_tokens` tokens per request. Subclasses set `aux_layer_ids`."""

    aux_layer_ids: tuple[int, ...] = ()
    block_attention = False  # DFLASH's block attention instead of causal paged attention
    # features per position a deferred catch-up records (executor/catch_up.py); None: the
    # drafter catches up in every plain step instead
    catch_up_width: int | None = None
    # sampled verify by `match` (set by the engine before capture): sampled drafts are drawn
    # with the random number plain sampling draws the position's token with (so a draft equals
    # that token as often as the two distributions allow), and no q is kept (verify needs none)
    match_samples = False
    # whether its extend steps draft from each sequence's last position as a decode batch
    # (`propose_last`; graphed by executor/propose_graphs.py), after their N-token part
    drafts_per_sequence = True
    # the engine's piecewise graphs of its extend steps, set by executor/piecewise.py's
    # PiecewiseRunner (None: eagerly): the N-token part (`DrafterPiecewise`) and the
    # per-sequence part (`ProposeGraphs`)
    piecewise = None
    per_sequence = None

    @property
    def draft_stream(self) -> int:
        """The random stream sampled drafts are drawn with."""
        return STREAM_SAMPLE if self.match_samples else STREAM_DRAFT

    def __init__(
        self,
        kv: PagedKVCache,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        num_draft_tokens: int,
        attention_backend: str = "torch",
    ):
        self.k = num_draft_tokens
        self.pool_layout = (num_layers, num_kv_heads, head_dim, dtype)
        self.attention_backend = attention_backend
        self.bind_kv(kv)

    def bind_kv(self, kv: PagedKVCache) -> None:
        """Own K/V pools of `kv`'s size on its block table (the engine profiles a step on a small
        cache, then binds the drafter to the real one)."""
        num_layers, num_kv_heads, head_dim, dtype = self.pool_layout
        self.kv = kv
        self.k_pools = self.v_pools = []  # the old pools go before the new ones are made
        shape = (kv.num_pages * kv.page_size + 1, num_kv_heads, head_dim)  # as kv's: zero slot
        device = kv.req_to_page.device
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.attn = paged_attention_backend(
            self.attention_backend,
            self.k_pools,
            self.v_pools,
            kv.req_to_page,
            kv.page_size,
            self.block_attention,
        )

    @abstractmethod
    def propose(
        self, inputs: DraftInputs, sampling: SamplingInfo, variant: str, num_drafts: int
    ) -> Proposal:
        """Catch up on the newly verified tokens and propose the next `num_drafts` drafts, k or
        0 (capturable for decode batches). With 0 the drafter only brings its state up to date
        on the batch's positions (a plain step of adaptive speculation), so that a later step
        can draft from them."""

    def propose_last(
        self, one: DraftInputs, sampling: SamplingInfo, variant: str, num_drafts: int
    ) -> Proposal:
        """The per-sequence part of an extend step: `num_drafts` drafts from each sequence's last
        position, given that position's inputs as a decode batch of one token per row
        (executor/piecewise_drafter.py `last_position_inputs`; capturable: ProposeGraphs)."""
        return self.propose(one, sampling, variant, num_drafts)

    def extend_piece(self):
        """The part of its extend steps that depends only on their N tokens, which piecewise
        graphs run by token bucket (an executor/piecewise_drafter.py `DrafterPiece`)."""
        raise NotImplementedError

    def catch_up_entry(self, inputs: DraftInputs) -> tuple[torch.Tensor | None, list]:
        """What a plain decode step records for a deferred catch-up: a token id [bs] (None when
        the drafter needs none) and the parts [bs, w_i] of its feature row (their widths sum to
        catch_up_width)."""
        raise NotImplementedError

    def catch_up(self, rows, ids, features, positions, slots) -> None:
        """Write the drafter's state from recorded entries, as `propose` with no drafts would
        have: per request row of `rows` [bs], D entries (ids [bs, D], features [bs, D, width],
        positions [bs, D]) and their slots [bs * D]; padded entries point at the dummy page
        (position 0), after a row's valid ones."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared by chain drafters

    def single_token_batch(
        self, rows: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, kv_len: int
    ) -> ForwardBatch:
        """One token per row at `positions` [bs], writing the drafter's KV at those slots."""
        pos = positions.unsqueeze(1)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            bs=rows.shape[0],
            tokens_per_req=1,
            input_ids=tokens,
            positions=positions,
            req_pool_indices=rows,
            out_cache_loc=self.kv.slots(rows, pos).reshape(-1),
            kv_len=kv_len,
        )

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids to target ids (identity unless the drafter has its own vocab)."""
        return draft_ids

    def target_id_table(self) -> torch.Tensor | None:
        """The target id of each draft-vocabulary index [V_draft] (None: the index itself)."""
        return None

    def probs_to_target(self, probs: torch.Tensor) -> torch.Tensor:
        return probs

    def pick(
        self, logits: torch.Tensor, sampling: SamplingInfo, positions: torch.Tensor, variant: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft token per row (target ids) from draft logits [bs, V_draft]: argmax for greedy
        rows, else a sample from q (temperature, top-k, top-p applied) raced with
        `draft_stream` at the drafted token's `positions`, keyed by target ids; q is returned
        in target space (None under `match_samples`)."""
        greedy = self.to_target_ids(logits.argmax(-1))
        if variant == GREEDY:
            return greedy, None
        q = filtered_probs(
            logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, variant
        )
        ids = self.target_id_table()
        drawn = race(q, sampling.seed, positions, self.draft_stream, ids)
        drawn = drawn if ids is None else ids[drawn]
        kept = None if self.match_samples else self.probs_to_target(q)
        return torch.where(sampling.is_greedy, greedy, drawn), kept

    @staticmethod
    def no_drafts(batch: ForwardBatch) -> Proposal:
        """The proposal of a step that drafts nothing: [bs, 0] tokens."""
        return Proposal(batch.input_ids.new_empty((batch.bs, 0)), None)

    @staticmethod
    def proposal(drafts: list[torch.Tensor], probs: list[torch.Tensor | None]) -> Proposal:
        stacked = torch.stack(probs, dim=1) if probs[0] is not None else None
        return Proposal(torch.stack(drafts, dim=1), stacked)


def flat_index(bs: int, T: int, index: torch.Tensor) -> torch.Tensor:
    """Flat positions of `index[i]` of row i in a row-major [bs * T] layout."""
    return torch.arange(bs, device=index.device) * T + index
