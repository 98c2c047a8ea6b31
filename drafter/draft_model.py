"""The classic draft-model algorithm: a smaller LM of the same tokenizer drafts for the target,
with its own paged KV on the target's block tables. After prefill or verify it reads the same
inputs the target just read (its KV for them), then decodes k tokens from the newest one. With
the target as its own drafter, greedy drafts are always accepted: a test oracle."""

from __future__ import annotations

import torch

from speculant.drafter.base import Drafter, DraftInputs, Proposal
from speculant.errors import SpeculantError
from speculant.executor.forward_batch import ForwardBatch, ForwardMode, SamplingInfo
from speculant.executor.kv_cache import PagedKVCache
from speculant.executor.piecewise_drafter import (
    DraftModelPiece,
    propose_extend,
)
from speculant.models.llama import CausalLM


class DraftModelDrafter(Drafter):
    def __init__(
        self,
        draft_lm: CausalLM,
        target_vocab: int,
        kv: PagedKVCache,
        dtype: torch.dtype,
        num_draft_tokens: int,
        attention_backend: str = "torch",
    ):
        cfg = draft_lm.config
        if cfg.vocab_size != target_vocab:
            raise SpeculantError(
                f"draft LM vocabulary {cfg.vocab_size} != target vocabulary {target_vocab} "
                "(config.json vocab_size): the draft model must share the target's tokenizer "
                "and vocabulary size (one family's checkpoints padded to different sizes, e.g. "
                "Qwen2.5-0.5B and -7B, are not supported yet); pick a draft model of the same "
                "vocab_size"
            )
        attn = draft_lm.model.layers[0].self_attn
        super().__init__(
            kv,
            cfg.num_layers,
            attn.num_kv_heads,
            cfg.head_dim,
            dtype,
            num_draft_tokens,
            attention_backend,
        )
        self.lm = draft_lm
        self.catch_up_width = 0  # its catch-up is its LM over the recorded input tokens

    def extend_piece(self) -> DraftModelPiece:
        return DraftModelPiece(self)

    def catch_up_entry(self, inputs: DraftInputs) -> tuple[torch.Tensor, list]:
        return inputs.batch.input_ids, []

    def catch_up(self, rows, ids, features, positions, slots) -> None:
        """The LM over D recorded tokens per row (a D-token decode batch: a query sees keys at
        positions <= its own), writing its K/V."""
        bs, depth = ids.shape
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            bs=bs,
            tokens_per_req=depth,
            input_ids=ids.reshape(-1),
            positions=positions.reshape(-1),
            req_pool_indices=rows,
            out_cache_loc=slots,
            kv_len=self.kv.max_tokens_per_req,
        )
        self.attn.prepare(batch)
        self.lm(batch.input_ids, batch.positions, self.attn)

    def propose(
        self, inputs: DraftInputs, sampling: SamplingInfo, variant: str, num_drafts: int
    ) -> Proposal:
        batch = inputs.batch
        if batch.is_varlen:  # EXTEND: the forward over the chunk, graphed by token bucket
            return propose_extend(self, inputs, sampling, variant, num_drafts)
        self.attn.prepare(batch, shared_slots=inputs.target_slots)
        self.lm(batch.input_ids, batch.positions, self.attn)  # catch up: KV only
        if num_drafts == 0:
            return self.no_drafts(batch)
        token = inputs.next_tokens.reshape(-1)[inputs.last_flat]
        position = batch.positions[inputs.last_flat] + 1
        return self._chain(token, position, inputs, sampling, variant, num_drafts)

    def propose_last(
        self, one: DraftInputs, sampling: SamplingInfo, variant: str, num_drafts: int
    ) -> Proposal:
        """After an extend step's forward over its chunks: the chain from each sequence's last
        position (its K/V is written already)."""
        token, position = one.next_tokens.reshape(-1), one.batch.positions + 1
        return self._chain(token, position, one, sampling, variant, num_drafts)

    def _chain(self, token, position, inputs: DraftInputs, sampling, variant, num_drafts):
        """num_drafts single-token decodes from `token` at `position` in each row."""
        batch = inputs.batch
        drafts, probs = [], []
        for _ in range(num_drafts):
            one = self.single_token_batch(batch.req_pool_indices, position, token, batch.kv_len)
            self.attn.prepare(one, shared_slots=inputs.target_slots)
            hidden, _ = self.lm(token, position, self.attn)
            token, q = self.pick(self.lm.compute_logits(hidden), sampling, position + 1, variant)
            drafts.append(token)
            probs.append(q)
            position = position + 1
        return self.proposal(drafts, probs)
