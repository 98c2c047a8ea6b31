"""The classic draft-model algorithm: a smaller LM of the same tokenizer drafts for the target,
with its own paged KV on the target's block tables. After prefill or verify it reads the same
inputs the target just read (its KV for them), then decodes k tokens from the newest one. With
the target as its own drafter, greedy drafts are always accepted: a test oracle.

Its vocab_size V_d may differ from the target's V_t when both share one tokenizer whose
embedding tables are padded to different sizes (Qwen2.5-0.5B: 151936 for Qwen2.5-7B: 152064;
executor/build.py checks the tokenizer files, drafter/tokenizer_vocab.py). Drafting stays
lossless:
- out: the draft logits become target-vocabulary logits before anything picks from them
  (`target_logits`): -inf on the ids V_d..V_t-1 when V_d < V_t, the ids >= V_t dropped when
  V_d > V_t. Greedy drafts are the argmax over the common range, sampled drafts are drawn from
  q over V_t, and that same q (zero where the draft has no token) is what verify's
  rejection test and residual read, so output follows the target's distribution.
- in: when V_d < V_t the target may emit (or a prompt hold) an id >= V_d that the draft LM has
  no embedding row for; every id entering the draft LM goes through `draft_ids`, which clamps
  it into range on the device (graph-capturable; any in-range id is lossless, drafts are only
  proposals)."""

from __future__ import annotations

import torch

from speculant.drafter.base import Drafter, DraftInputs, Proposal
from speculant.executor.forward_batch import ForwardBatch, ForwardMode, SamplingInfo
from speculant.executor.kv_cache import PagedKVCache
from speculant.executor.piecewise_drafter import (
    DraftModelPiece,
    propose_extend,
)
from speculant.executor.sampling import GREEDY
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
        self.vocab, self.target_vocab = cfg.vocab_size, target_vocab

    def draft_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary ids as ids the draft LM can embed: those >= V_d (only when
        V_d < V_t) clamped to V_d - 1, on the device (no host sync: capturable)."""
        return ids.clamp(max=self.vocab - 1) if self.vocab < self.target_vocab else ids

    def forward(self, ids: torch.Tensor, positions: torch.Tensor):
        """The draft LM over target-vocabulary `ids` on its attention (prepared by the caller)."""
        return self.lm(self.draft_ids(ids), positions, self.attn)

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V_d] as logits over the target's V_t ids: -inf padding past V_d,
        or the ids >= V_t dropped (identity when the sizes agree)."""
        if self.vocab > self.target_vocab:
            return logits[..., : self.target_vocab]
        if self.vocab < self.target_vocab:
            return torch.nn.functional.pad(
                logits, (0, self.target_vocab - self.vocab), value=float("-inf")
            )
        return logits

    def pick(self, logits, sampling, positions, variant):
        """`Drafter.pick` over the target's vocabulary (`target_logits`): the draft token is
        target-space and q [bs, V_t] is exactly the distribution it was drawn from. Greedy
        steps skip the -inf padding (the argmax over V_d is the one over the padded row)."""
        if variant == GREEDY and self.vocab < self.target_vocab:
            return super().pick(logits, sampling, positions, variant)
        return super().pick(self.target_logits(logits), sampling, positions, variant)

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
        self.forward(batch.input_ids, batch.positions)

    def propose(
        self, inputs: DraftInputs, sampling: SamplingInfo, variant: str, num_drafts: int
    ) -> Proposal:
        batch = inputs.batch
        if batch.is_varlen:  # EXTEND: the forward over the chunk, graphed by token bucket
            return propose_extend(self, inputs, sampling, variant, num_drafts)
        self.attn.prepare(batch, shared_slots=inputs.target_slots)
        self.forward(batch.input_ids, batch.positions)  # catch up: KV only
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
            hidden, _ = self.forward(token, position)
            token, q = self.pick(self.lm.compute_logits(hidden), sampling, position + 1, variant)
            drafts.append(token)
            probs.append(q)
            position = position + 1
        return self.proposal(drafts, probs)
