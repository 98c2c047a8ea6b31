"""The model runner: one rank's target (and later drafter), KV cache and the two step functions.
`decode_step` reads only static buffers and device state, so the graph wrapper can capture it;
`extend` runs eagerly on packed sequences (prefill chunks, and verify rows of a mixed step)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from speculant.drafter.base import Drafter, DraftInputs, flat_index
from speculant.executor.attention import paged_attention_backend
from speculant.executor.catch_up import CatchUpBuffers
from speculant.executor.forward_batch import ForwardBatch, ForwardMode, SamplingInfo
from speculant.executor.input_buffers import InputBuffers
from speculant.executor.kv_cache import PagedKVCache
from speculant.executor.logprobs import logprob_columns, pack_logprobs, widen
from speculant.executor.sampling import GREEDY, sample
from speculant.executor.speculation import DraftShape
from speculant.executor.verify import verify


@dataclass
class StepOutput:
    """What one decode step leaves in its (static) output tensors."""

    tokens: torch.Tensor  # [bs, T] emitted tokens, -1 after the last
    accept_len: torch.Tensor  # [bs] tokens emitted per row (accepted drafts + 1)
    drafts: torch.Tensor  # [bs, k] the next step's draft tokens
    # [bs, L]: `pack_logprobs` columns (when computed), then tokens, drafts, accept_len
    packed: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None  # [bs, T (1 + 2 n)] `pack_logprobs` of the tokens

    @classmethod
    def of(cls, tokens, accept_len, drafts, logprobs=None) -> StepOutput:
        """With the packed copy made on the device (inside the graph when captured), so the
        host reads a step's results with one transfer (input_buffers.Readback)."""
        parts = [tokens, drafts, accept_len[:, None]]
        if logprobs is not None:
            parts.insert(0, logprobs)
        return cls(tokens, accept_len, drafts, torch.cat(parts, 1), logprobs)

    def narrow(self, bs: int) -> StepOutput:
        packed = None if self.packed is None else self.packed[:bs]
        logprobs = None if self.logprobs is None else self.logprobs[:bs]
        tokens, accept_len, drafts = self.tokens[:bs], self.accept_len[:bs], self.drafts[:bs]
        return StepOutput(tokens, accept_len, drafts, packed, logprobs)

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.tokens, self.accept_len, self.drafts, self.logprobs


class ModelRunner:
    def __init__(
        self,
        model,
        kv: PagedKVCache,
        max_bs: int,
        num_draft_tokens: int = 0,
        drafter: Drafter | None = None,
        attention_backend: str = "torch",
        num_logprobs: int | None = None,
    ):
        self.model = model
        self.kv = kv
        self.drafter = drafter
        self.device = kv.req_to_page.device
        self.k = num_draft_tokens
        self.writes_next_inputs = False  # set by the engine with overlap on, before capture
        self.match_samples = False  # sampled verify by `match` (executor/verify.py), likewise
        # alternatives whose log-probabilities every step computes (None: none; graphs bake it)
        self.num_logprobs = num_logprobs
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
        self.piecewise = None  # the engine's PiecewiseRunner: extend forwards by token count
        # adaptive speculation's deferred drafter catch-up (executor/catch_up.py), set by the
        # engine before capture: plain decode steps then record instead of catching up
        self.catch_up: CatchUpBuffers | None = None

    def full_shape(self) -> DraftShape:
        return DraftShape(self.k, self.k)

    @torch.inference_mode()
    def decode_step(
        self,
        bs: int,
        variant: str,
        tokens_per_rank: list[int] | None = None,
        shape: DraftShape | None = None,
        drafter_rests: bool = False,
        kv_len: int | None = None,
    ) -> StepOutput:
        """Verify (or plainly decode) the bs rows of the input buffers, then draft the next
        tokens; reads only static buffers and device state, so it is graph-capturable.
        `tokens_per_rank`: every rank's target tokens this step (a MoE target's dispatch plan).
        `shape`: drafts verified and proposed (executor/speculation.py; default (k, k)).
        `drafter_rests`: a plain step in which the drafter does nothing, not even record for
        its catch-up (adaptive speculation's rest): the step a plain engine runs. `kv_len`: an
        eager step's bound on the positions its rows touch (the pages they hold; see
        verify_step); None: every position a row may reach (graphs)."""
        shape = shape or self.full_shape()
        inputs, accept_len, logprobs = self.verify_step(
            bs, variant, tokens_per_rank, shape.verify, kv_len
        )
        if drafter_rests:
            drafts = inputs.next_tokens.new_empty((bs, 0))
        else:
            drafts = self._propose(inputs, variant, shape.draft)
        if self.writes_next_inputs:
            # the next step's input ids (last emitted token, then the drafts), for a step
            # launched before the host has read this one back (overlap)
            last = inputs.next_tokens.gather(1, (accept_len - 1).unsqueeze(1))
            next_ids = torch.cat([last, drafts.to(last.dtype)], dim=1)
            self.buffers.input_ids[:bs, : 1 + shape.draft].copy_(next_ids)
        return StepOutput.of(inputs.next_tokens, accept_len, drafts, logprobs)

    def verify_step(
        self,
        bs: int,
        variant: str,
        tokens_per_rank: list[int] | None = None,
        num_verify: int | None = None,
        kv_len: int | None = None,
    ) -> tuple[DraftInputs, torch.Tensor, torch.Tensor | None]:
        """The target half of the step: forward over T = num_verify + 1 tokens per row (default
        k + 1), verify, grow the valid cache lengths. Returns what the drafter needs, accept_len
        [bs] and, when `num_logprobs` is set, the emitted tokens' `pack_logprobs`. The rows
        attend over `kv_len` key positions when given (an eager step on a backend whose work
        grows with it: `gathers_kv_len`), else over every position a row may reach."""
        buf, kv = self.buffers, self.kv
        num_verify = self.k if num_verify is None else num_verify
        T = num_verify + 1
        rows = buf.req_pool_indices[:bs]
        positions = kv.cache_lens[rows].unsqueeze(1) + self.offsets[:T]  # [bs, T]
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            bs=bs,
            tokens_per_req=T,
            input_ids=buf.input_ids[:bs, :T].reshape(-1),
            positions=positions.reshape(-1),
            req_pool_indices=rows,
            out_cache_loc=kv.slots(rows, positions).reshape(-1),
            kv_len=kv_len or kv.max_tokens_per_req,
            sampling=buf.sampling(bs),
            tokens_per_rank=tokens_per_rank,
        )
        self.attn.prepare(batch)
        hidden, aux = self.model(batch.input_ids, batch.positions, self.attn, tokens_per_rank)
        logits = self.model.compute_logits(hidden).view(bs, T, -1)
        sampled_drafts = self.drafter is not None and variant != GREEDY and num_verify > 0
        sampled_drafts = sampled_drafts and not self.match_samples  # match needs no q
        q = self.draft_probs[rows, :num_verify] if sampled_drafts else None
        tokens, accept_len = verify(
            logits, buf.input_ids[:bs, 1:T], q, batch.sampling, positions, variant,
            self.match_samples,
        )  # fmt: skip
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = pack_logprobs(logits, tokens, self.num_logprobs, self.attn.ops)
        live = rows != kv.sentinel_row  # padded rows must never grow the sentinel
        kv.cache_lens.index_add_(0, rows, accept_len * live)
        last_flat = flat_index(bs, T, accept_len - 1)
        inputs = DraftInputs(batch, hidden, aux, tokens, last_flat, self.attn.kv_slots)
        return inputs, accept_len, logprobs

    def _propose(self, inputs: DraftInputs, variant: str, num_drafts: int) -> torch.Tensor:
        """The drafter's next `num_drafts` tokens per row ([bs, 0] without a drafter); records
        q. With 0 the drafter still catches up on the batch's positions."""
        if self.drafter is None:
            return inputs.next_tokens.new_empty((inputs.batch.bs, 0))
        batch = inputs.batch
        if num_drafts == 0 and self.catch_up is not None and batch.mode == ForwardMode.DECODE:
            self.catch_up.record(batch.req_pool_indices, *self.drafter.catch_up_entry(inputs))
            return self.drafter.no_drafts(batch).tokens
        proposal = self.drafter.propose(inputs, inputs.batch.sampling, variant, num_drafts)
        if proposal.probs is not None:
            rows = inputs.batch.req_pool_indices
            self.draft_probs[:, :num_drafts].index_copy_(0, rows, proposal.probs)
        return proposal.tokens

    @torch.inference_mode()
    def flush_catch_up(self, bs: int) -> None:
        """The deferred catch-up of the rows in `catch_up.rows[:bs]` (graph-capturable)."""
        self.catch_up.flush(bs)

    @torch.inference_mode()
    def forward_packed(
        self,
        seqs: list[SeqInput],
        sampling: SamplingInfo | None = None,
        tokens_per_rank: list[int] | None = None,
    ) -> tuple[torch.Tensor, list, ForwardBatch]:
        """The target forward over packed sequences, writing their KV: the hidden states [N, H]
        (N = all their tokens, back to back), the auxiliary states and the batch."""
        kv, device, T = self.kv, self.device, self.tokens_per_req
        lens = [len(s.tokens) for s in seqs]
        ids, positions = [], []
        for seq in seqs:
            ids += seq.tokens
            positions += range(seq.start, seq.start + len(seq.tokens))
        rows = torch.tensor([s.row for s in seqs], dtype=torch.int64, device=device)
        pos_t = torch.tensor(positions, dtype=torch.int64).to(device)
        token_rows = torch.repeat_interleave(rows, torch.tensor(lens, device=device))
        reach = max(s.start + len(s.tokens) for s in seqs) + T  # drafts past the newest token
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            bs=len(seqs),
            tokens_per_req=0,
            input_ids=torch.tensor(ids, dtype=torch.int64).to(device),
            positions=pos_t,
            req_pool_indices=rows,
            out_cache_loc=kv.slots(token_rows, pos_t[:, None]).reshape(-1),
            kv_len=min(kv.pages_for(reach), kv.max_pages_per_req) * kv.page_size,
            sampling=sampling,
            seq_lens=tuple(lens),
            tokens_per_rank=tokens_per_rank,
        )
        if self.piecewise is not None:  # a graph of its padded token count (executor/piecewise.py)
            out = self.piecewise.forward(batch, [s.row for s in seqs])
            if out is not None:
                return *out, batch
        self.attn.prepare(batch)
        hidden, aux = self.model(batch.input_ids, batch.positions, self.attn, tokens_per_rank)
        return hidden, aux, batch

    def forward_prefill(
        self, rows: list[int], new_tokens: list[list[int]], prefix_lens: list[int]
    ) -> tuple[torch.Tensor, list, ForwardBatch]:
        """`forward_packed` of prompts (new tokens after cached prefixes), setting the rows'
        cache lengths (tests and benchmarks fill the cache with it)."""
        seqs = [SeqInput(r, p, t) for r, t, p in zip(rows, new_tokens, prefix_lens, strict=True)]
        out = self.forward_packed(seqs)
        ends = [p + len(t) for t, p in zip(new_tokens, prefix_lens, strict=True)]
        self.kv.cache_lens[torch.tensor(rows, device=self.device)] = torch.tensor(
            ends, device=self.device
        )
        return out

    @torch.inference_mode()
    def extend(
        self,
        seqs: list[SeqInput],
        sampling: SamplingInfo,
        variant: str,
        tokens_per_rank: list[int] | None = None,
        shape: DraftShape | None = None,
        drafter_rests: bool = False,
    ) -> ExtendOutput:
        """One eager target forward over packed sequences (see `SeqInput`: verify rows of k + 1
        tokens first, then prefill chunks), each attending to its cached prefix and itself;
        verify rows are verified, chunks that end a context sample (or take) their next token,
        the cache lengths grow, and the drafter catches up on every position and drafts after
        every sequence. `sampling` has one row per sequence. `shape`: drafts each verify row holds
        (its tokens: shape.verify + 1) and drafts proposed after every sequence (default k, k).
        `drafter_rests`: the drafter does nothing (adaptive speculation's rest; no drafts)."""
        kv, device = self.kv, self.device
        shape = shape or self.full_shape()
        T = shape.verify + 1  # verify row width
        num_verify = sum(s.verify for s in seqs)
        hidden, aux, batch = self.forward_packed(seqs, sampling, tokens_per_rank)
        pos_t, ids_t, rows = batch.positions, batch.input_ids, batch.req_pool_indices
        lens = list(batch.seq_lens)
        starts = list(itertools.accumulate([0, *lens[:-1]]))
        last_flat = [a + n - 1 for a, n in zip(starts, lens, strict=True)]
        following = []
        for seq in seqs:  # the token after each input position (-1 where the step decides it)
            after = seq.successor if seq.successor is not None else -1
            following += [-1] * len(seq.tokens) if seq.verify else [*seq.tokens[1:], after]
        # logits of every verify position, then of every chunk that samples its successor
        sampled = [i for i in range(num_verify, len(seqs)) if seqs[i].samples]
        verify_index = [a + t for a in starts[:num_verify] for t in range(T)]
        wanted = torch.tensor(
            verify_index + [last_flat[i] for i in sampled], dtype=torch.int64, device=device
        )
        logits = self.model.compute_logits(hidden[wanted]) if len(wanted) else None
        next_tokens = torch.tensor(following, dtype=torch.int64).to(device)
        last = torch.tensor(last_flat, dtype=torch.int64, device=device)
        accept_len = torch.zeros(len(seqs), dtype=torch.int64, device=device)
        emitted = torch.full((len(seqs), self.tokens_per_req), -1, dtype=torch.int64, device=device)
        logprobs = None  # per sequence the `pack_logprobs` of its k + 1 emitted slots
        if self.num_logprobs is not None:
            width = logprob_columns(self.tokens_per_req, self.num_logprobs)
            logprobs = torch.zeros((len(seqs), width), dtype=torch.int64, device=device)
        if num_verify:
            v_rows, v_info = rows[:num_verify], sampling.take(slice(0, num_verify))
            v_pos = pos_t[: num_verify * T].view(num_verify, T)
            drafts = ids_t[: num_verify * T].view(num_verify, T)[:, 1:]
            sampled_drafts = self.drafter is not None and variant != GREEDY and shape.verify
            sampled_drafts = sampled_drafts and not self.match_samples  # match needs no q
            q = self.draft_probs[v_rows, : shape.verify] if sampled_drafts else None
            tokens, v_accept = verify(
                logits[: num_verify * T].view(num_verify, T, -1), drafts, q, v_info, v_pos, variant,
                self.match_samples,
            )  # fmt: skip
            emitted[:num_verify, :T] = tokens
            if logprobs is not None:
                v_logits = logits[: num_verify * T].view(num_verify, T, -1)
                v_logprobs = pack_logprobs(v_logits, tokens, self.num_logprobs, self.attn.ops)
                logprobs[:num_verify] = widen(v_logprobs, T, self.tokens_per_req, self.num_logprobs)
            accept_len[:num_verify] = v_accept
            next_tokens[: num_verify * T] = tokens.reshape(-1)
            last[:num_verify] += v_accept - T  # the last accepted input, not the last input
            kv.cache_lens.index_add_(0, v_rows, v_accept)
        if sampled:
            index = torch.tensor(sampled, dtype=torch.int64, device=device)
            s_pos = pos_t[last[index]] + 1
            s_tokens = sample(logits[num_verify * T :], sampling.take(index), s_pos, variant)
            emitted[index, 0] = s_tokens
            if logprobs is not None:
                s_logits = logits[num_verify * T :].unsqueeze(1)
                s_logprobs = pack_logprobs(
                    s_logits, s_tokens.unsqueeze(1), self.num_logprobs, self.attn.ops
                )
                logprobs[index] = widen(s_logprobs, 1, self.tokens_per_req, self.num_logprobs)
            accept_len[index] = 1
            next_tokens[last[index]] = s_tokens
        if num_verify < len(seqs):  # chunks: their whole context is now cached
            c_rows = rows[num_verify:]
            ends = [s.start + len(s.tokens) for s in seqs[num_verify:]]
            kv.cache_lens[c_rows] = torch.tensor(ends, dtype=torch.int64, device=device)
        inputs = DraftInputs(batch, hidden, aux, next_tokens, last, self.attn.kv_slots)
        if drafter_rests and self.drafter is not None:
            drafts = self.drafter.no_drafts(batch).tokens
        else:
            drafts = self._propose(inputs, variant, shape.draft)
        return ExtendOutput(emitted, accept_len, drafts, logprobs)

    def prefill(
        self,
        rows: list[int],
        new_tokens: list[list[int]],
        prefix_lens: list[int],
        sampling: SamplingInfo,
        variant: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill whole prompts, sample each one's next token and draft after it (an `extend`
        of chunks that end their prompts). Returns the tokens [bs] and the drafts [bs, k]."""
        seqs = [
            SeqInput(r, p, t, samples=True)
            for r, t, p in zip(rows, new_tokens, prefix_lens, strict=True)
        ]
        out = self.extend(seqs, sampling, variant)
        return out.tokens[:, 0], out.drafts


@dataclass
class SeqInput:
    """One sequence of an extend step: a verify row (its last token and k drafts at its cache
    length) or a prefill chunk of a context, with the known token after it (`successor`: the
    next context token, or a resumed request's last emitted token) or None to sample it."""

    row: int
    start: int
    tokens: list[int]
    verify: bool = False
    successor: int | None = None
    samples: bool = False  # a chunk that ends a context and samples the token after it


@dataclass
class ExtendOutput:
    """Per sequence: tokens emitted (verified, or the sampled first token; -1 after), how many,
    and the next step's drafts."""

    tokens: torch.Tensor  # [bs, k + 1]
    accept_len: torch.Tensor  # [bs]
    drafts: torch.Tensor  # [bs, k]
    logprobs: torch.Tensor | None = None  # [bs, (k + 1) (1 + 2 n)]: `pack_logprobs` (or None)

    def to_host(self) -> list[list[int]]:
        """One read-back: per sequence its log-probability columns (when computed), tokens
        (T), drafts (k), accept_len."""
        parts = [self.tokens, self.drafts, self.accept_len[:, None]]
        if self.logprobs is not None:
            parts.insert(0, self.logprobs)
        return torch.cat(parts, 1).tolist()
