"""The model runner: one rank's target (and later drafter), KV cache and the two step functions.
`decode_step` reads only static buffers and device state, so the graph wrapper can capture it;
`prefill` runs eagerly on ragged prompts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculant.drafter.base import Drafter, DraftInputs, gather_rows
from speculant.executor.attention import paged_attention_backend
from speculant.executor.forward_batch import ForwardBatch, ForwardMode, SamplingInfo
from speculant.executor.input_buffers import InputBuffers
from speculant.executor.kv_cache import PagedKVCache
from speculant.executor.sampling import GREEDY, sample
from speculant.executor.verify import verify


@dataclass
class StepOutput:
    """What one decode step leaves in its (static) output tensors."""

    tokens: torch.Tensor  # [bs, T] emitted tokens, -1 after the last
    accept_len: torch.Tensor  # [bs] tokens emitted per row (accepted drafts + 1)
    drafts: torch.Tensor  # [bs, k] the next step's draft tokens
    packed: torch.Tensor | None = None  # [bs, T + k + 1]: tokens, drafts, accept_len

    @classmethod
    def of(cls, tokens, accept_len, drafts) -> StepOutput:
        """With the packed copy made on the device (inside the graph when captured), so the
        host reads a step's results with one transfer (input_buffers.Readback)."""
        return cls(tokens, accept_len, drafts, torch.cat([tokens, drafts, accept_len[:, None]], 1))

    def narrow(self, bs: int) -> StepOutput:
        packed = None if self.packed is None else self.packed[:bs]
        return StepOutput(self.tokens[:bs], self.accept_len[:bs], self.drafts[:bs], packed)

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tokens, self.accept_len, self.drafts


class ModelRunner:
    def __init__(
        self,
        model,
        kv: PagedKVCache,
        max_bs: int,
        num_draft_tokens: int = 0,
        drafter: Drafter | None = None,
        attention_backend: str = "torch",
    ):
        self.model = model
        self.kv = kv
        self.drafter = drafter
        self.device = kv.req_to_page.device
        self.k = num_draft_tokens
        self.writes_next_inputs = False  # set by the engine with overlap on, before capture
        self.tokens_per_req = num_draft_tokens + 1
        if drafter is not None:
            model.aux_layer_ids = drafter.aux_layer_ids
            # q of the drafts each request row holds, in target-vocabulary space (sampled drafts)
            vocab = model.config.vocab_size
            self.draft_probs = torch.zeros(
                kv.max_requests + 1, self.k, vocab, dtype=torch.float32, device=self.device
            )
        self.attn = paged_attention_backend(
            attention_backend, kv.k, kv.v, kv.req_to_page, kv.page_size
        )
        self.buffers = InputBuffers(max_bs, self.tokens_per_req, self.device)
        self.offsets = torch.arange(self.tokens_per_req, device=self.device)

    @torch.inference_mode()
    def decode_step(self, bs: int, variant: str) -> StepOutput:
        """Verify (or plainly decode) the bs rows of the input buffers, then draft the next k
        tokens; reads only static buffers and device state, so it is graph-capturable."""
        inputs, accept_len = self.verify_step(bs, variant)
        drafts = self._propose(inputs, variant)
        if self.writes_next_inputs:
            # the next step's input ids (last emitted token, then the drafts), for a step
            # launched before the host has read this one back (overlap)
            last = inputs.next_tokens.gather(1, (accept_len - 1).unsqueeze(1))
            self.buffers.input_ids[:bs].copy_(torch.cat([last, drafts.to(last.dtype)], dim=1))
        return StepOutput.of(inputs.next_tokens, accept_len, drafts)

    def verify_step(self, bs: int, variant: str) -> tuple[DraftInputs, torch.Tensor]:
        """The target half of the step: forward over T tokens per row, verify, grow the valid
        cache lengths. Returns what the drafter needs and accept_len [bs]."""
        buf, kv, T = self.buffers, self.kv, self.tokens_per_req
        rows = buf.req_pool_indices[:bs]
        positions = kv.cache_lens[rows].unsqueeze(1) + self.offsets  # [bs, T]
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            bs=bs,
            tokens_per_req=T,
            input_ids=buf.input_ids[:bs].reshape(-1),
            positions=positions.reshape(-1),
            req_pool_indices=rows,
            out_cache_loc=kv.slots(rows, positions).reshape(-1),
            kv_len=kv.max_tokens_per_req,
            sampling=buf.sampling(bs),
        )
        self.attn.prepare(batch)
        hidden, aux = self.model(batch.input_ids, batch.positions, self.attn)
        logits = self.model.compute_logits(hidden).view(bs, T, -1)
        sampled_drafts = self.drafter is not None and variant != GREEDY
        q = self.draft_probs[rows] if sampled_drafts else None
        tokens, accept_len = verify(
            logits, buf.input_ids[:bs, 1:], q, batch.sampling, positions, variant
        )
        live = rows != kv.sentinel_row  # padded rows must never grow the sentinel
        kv.cache_lens.index_add_(0, rows, accept_len * live)
        inputs = DraftInputs(batch, hidden, aux, tokens, accept_len - 1, self.attn.kv_slots)
        return inputs, accept_len

    def _propose(self, inputs: DraftInputs, variant: str) -> torch.Tensor:
        """The drafter's next k tokens per row ([bs, 0] without a drafter); records q."""
        if self.drafter is None:
            return inputs.next_tokens[:, :0]
        proposal = self.drafter.propose(inputs, inputs.batch.sampling, variant)
        if proposal.probs is not None:
            self.draft_probs.index_copy_(0, inputs.batch.req_pool_indices, proposal.probs)
        return proposal.tokens

    @torch.inference_mode()
    def forward_prefill(
        self, rows: list[int], new_tokens: list[list[int]], prefix_lens: list[int]
    ) -> tuple[torch.Tensor, list, ForwardBatch]:
        """Write the KV of each row's new tokens after its cached prefix. Returns the hidden
        states [bs * T, H] (rows padded to the longest), the auxiliary states and the batch."""
        bs, T = len(rows), max(len(t) for t in new_tokens)
        lengths = torch.tensor([len(t) for t in new_tokens])
        ids = torch.tensor([t + [0] * (T - len(t)) for t in new_tokens], dtype=torch.int64)
        starts = torch.tensor(prefix_lens)
        # room for the drafter's chain steps past the prompt, which share these key slots
        end = int((starts + lengths).max()) + self.tokens_per_req
        kv_len = min(self.kv.pages_for(end), self.kv.max_pages_per_req) * self.kv.page_size
        rows_t = torch.tensor(rows, device=self.device)
        positions = (starts[:, None] + torch.arange(T)).to(self.device)
        valid = (torch.arange(T) < lengths[:, None]).to(self.device)
        slots = torch.where(valid, self.kv.slots(rows_t, positions), 0)  # padding -> dummy page
        batch = ForwardBatch(
            mode=ForwardMode.PREFILL,
            bs=bs,
            tokens_per_req=T,
            input_ids=ids.to(self.device).reshape(-1),
            positions=positions.reshape(-1),
            req_pool_indices=rows_t,
            out_cache_loc=slots.reshape(-1),
            kv_len=kv_len,
            num_new_tokens=lengths.to(self.device),
        )
        self.attn.prepare(batch)
        hidden, aux = self.model(batch.input_ids, batch.positions, self.attn)
        self.kv.cache_lens[rows_t] = positions[:, 0] + batch.num_new_tokens
        return hidden, aux, batch

    @torch.inference_mode()
    def prefill(
        self,
        rows: list[int],
        new_tokens: list[list[int]],
        prefix_lens: list[int],
        sampling: SamplingInfo,
        variant: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill, sample the next token of every row and draft after it.
        Returns the tokens [bs] and the drafts [bs, k]."""
        hidden, aux, batch = self.forward_prefill(rows, new_tokens, prefix_lens)
        batch.sampling = sampling
        last_index = batch.num_new_tokens - 1
        logits = self.model.compute_logits(gather_rows(hidden, batch.bs, last_index))
        next_positions = batch.positions.view(batch.bs, -1)[:, 0] + batch.num_new_tokens
        tokens = sample(logits, sampling, next_positions, variant)
        # the token after each input position: the prompt shifted left, then the sampled token
        ids = batch.input_ids.view(batch.bs, -1)
        following = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
        following.scatter_(1, last_index[:, None], tokens[:, None])
        inputs = DraftInputs(batch, hidden, aux, following, last_index, self.attn.kv_slots)
        return tokens, self._propose(inputs, variant)
