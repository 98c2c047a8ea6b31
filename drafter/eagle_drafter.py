"""EAGLE-3 chain drafting. The head's KV at position p holds (token p+1, target features at p):
after prefill or a verify step it first catches up over every input position of the batch with
the target's auxiliary states (rejected positions are rewritten later), then drafts k tokens, the
first from the newest verified position and the rest from its own fed-back hidden state."""

from __future__ import annotations

import torch

from speculant.drafter.base import Drafter, DraftInputs, Proposal
from speculant.drafter.eagle import Eagle3Head
from speculant.executor.forward_batch import SamplingInfo
from speculant.executor.kv_cache import PagedKVCache
from speculant.executor.piecewise_drafter import (
    EagleKVPiece,
    propose_extend,
)


class Eagle3Drafter(Drafter):
    def __init__(
        self,
        head: Eagle3Head,
        target,
        kv: PagedKVCache,
        dtype: torch.dtype,
        num_draft_tokens: int,
        attention_backend: str = "torch",
    ):
        super().__init__(
            kv,
            head.num_layers,
            head.num_kv_heads,
            head.head_dim,
            dtype,
            num_draft_tokens,
            attention_backend,
        )
        self.head, self.target = head, target
        self.aux_layer_ids = tuple(head.config.aux_layer_ids)
        if head.num_layers == 1:  # its K/V need only (token, aux): a catch-up can wait
            self.catch_up_width = len(self.aux_layer_ids) * target.config.hidden_size
        # a deeper head runs over every position of an extend step (propose_whole_head)
        self.drafts_per_sequence = head.num_layers == 1

    def extend_piece(self) -> EagleKVPiece:
        return EagleKVPiece(self)

    def catch_up_entry(self, inputs: DraftInputs) -> tuple[torch.Tensor, list]:
        return inputs.next_tokens.clamp(min=0).reshape(-1), list(inputs.aux)

    def catch_up(self, rows, ids, features, positions, slots) -> None:
        embeds = self.head.embed(ids.reshape(-1), self.target)
        aux = features.reshape(embeds.shape[0], -1)
        pools = (self.k_pools, self.v_pools)
        self.head.write_kv(embeds, aux, positions.reshape(-1), pools, slots, self.attn.ops)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(draft_ids)

    def target_id_table(self) -> torch.Tensor | None:
        return None if self.head.identity_vocab else self.head.draft_to_target

    def probs_to_target(self, probs: torch.Tensor) -> torch.Tensor:
        return self.head.draft_probs_to_target(probs)

    def propose(
        self, inputs: DraftInputs, sampling: SamplingInfo, variant: str, num_drafts: int
    ) -> Proposal:
        batch = inputs.batch
        if batch.is_varlen and self.head.num_layers == 1:
            # EXTEND: the K/V of all N positions (no attention: a function of N only, graphed
            # by token bucket), then the layer at each sequence's last position only
            return propose_extend(self, inputs, sampling, variant, num_drafts)
        return self.propose_whole_head(inputs, sampling, variant, num_drafts)

    def propose_whole_head(
        self, inputs: DraftInputs, sampling: SamplingInfo, variant: str, num_drafts: int
    ) -> Proposal:
        """The head over every input position of the batch (decode batches, multi-layer heads;
        for a one-layer head's extend step, the reference its restructure is checked against),
        then the chain from each sequence's newest position."""
        batch = inputs.batch
        tokens = inputs.next_tokens.clamp(min=0).reshape(-1)
        embeds = self.head.embed(tokens, self.target)
        aux = torch.cat(inputs.aux, dim=-1)
        if num_drafts == 0 and self.head.num_layers == 1:  # K/V only: no attention, MLP, logits
            pools = (self.k_pools, self.v_pools)
            self.head.write_kv(embeds, aux, batch.positions, pools, batch.out_cache_loc,
                               self.attn.ops)  # fmt: skip
            return self.no_drafts(batch)
        self.attn.prepare(batch, shared_slots=inputs.target_slots)
        hidden = self.head(embeds, aux, batch.positions, self.attn)
        if num_drafts == 0:
            return self.no_drafts(batch)
        hidden = hidden[inputs.last_flat]
        position = batch.positions[inputs.last_flat]
        drafts, probs = [], []
        for step in range(num_drafts):
            token, q = self.pick(self.head.logits(hidden), sampling, position + 2, variant)
            drafts.append(token)
            probs.append(q)
            if step == num_drafts - 1:
                break
            position = position + 1
            one = self.single_token_batch(batch.req_pool_indices, position, token, batch.kv_len)
            self.attn.prepare(one, shared_slots=inputs.target_slots)
            hidden = self.head(self.head.embed(token, self.target), hidden, position, self.attn)
        return self.proposal(drafts, probs)
