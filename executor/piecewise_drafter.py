"""The drafter's part of an extend step that depends only on its N tokens, by the target's
buckets (`DrafterPiecewise`, in the target's pool, captured after the target's): EAGLE-3's K/V
over every position (a one-layer head: fc, norms, K/V and RoPE, no attention), DFLASH's context
K/V, and the draft model's forward over the chunk (its own attention on the static layout). What
follows per sequence (bs rows: the layer at each sequence's last position, the chain drafting,
DFLASH's block forward) is a decode batch of one token per row (`last_position_inputs`), drafted
by `propose_per_sequence` (both parts in turn: `propose_extend`): through
executor/propose_graphs.py's graphs by row count for greedy steps, else eagerly. Each drafter
names its piece (`Drafter.extend_piece`)."""

from __future__ import annotations

import torch

from speculant.drafter.base import DraftInputs, Proposal
from speculant.executor.bucket_graphs import (
    BucketEntry,
    BucketGraphs,
    InTargetPool,
    bucket_layout,
    fill_tokens,
    new_entry,
    padded_batch,
)
from speculant.executor.forward_batch import ForwardBatch, ForwardMode


class DrafterPiece:
    """A drafter's part of an extend step that is a function of its N tokens only: `run` over a
    batch (the step's own, or a bucket's padded one) with `ids` [N] and the extra input rows
    [N, width] (target states; None for width 0)."""

    group: int | None = None  # GQA group of its attention (None: it attends to nothing)
    width = 0  # columns of its extra input rows

    def __init__(self, drafter):
        self.drafter = drafter

    def ids(self, inputs: DraftInputs) -> torch.Tensor:
        return inputs.batch.input_ids

    def parts(self, inputs: DraftInputs) -> list[torch.Tensor]:
        """The extra input rows [n, w_i] of a step, concatenated in order."""
        return []

    def run(self, batch: ForwardBatch, ids, extra, shared_slots=None):
        raise NotImplementedError

    def run_step(self, inputs: DraftInputs) -> None:
        """Eagerly over the step's own (unpadded) batch."""
        parts = self.parts(inputs)
        extra = torch.cat(parts, dim=-1) if parts else None
        self.run(inputs.batch, self.ids(inputs), extra, inputs.target_slots)


class EagleKVPiece(DrafterPiece):
    """EAGLE-3, one layer: the K/V of every position from (next token, aux states)."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.width = 3 * drafter.head.config.target_hidden_size

    def ids(self, inputs: DraftInputs) -> torch.Tensor:
        return inputs.next_tokens.reshape(-1).clamp(min=0)

    def parts(self, inputs: DraftInputs) -> list[torch.Tensor]:
        return list(inputs.aux)

    def run(self, batch, ids, extra, shared_slots=None) -> None:
        d = self.drafter
        embeds = d.head.embed(ids, d.target)
        pools = (d.k_pools, d.v_pools)
        d.head.write_kv(embeds, extra, batch.positions, pools, batch.out_cache_loc, d.attn.ops)


class DFlashContextPiece(DrafterPiece):
    """DFLASH: every layer's context K/V of every position from the target layer outputs."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.width = len(drafter.feature_sources) * drafter.target.config.hidden_size

    def parts(self, inputs: DraftInputs) -> list[torch.Tensor]:
        sources = self.drafter.feature_sources
        return [inputs.hidden if i is None else inputs.aux[i] for i in sources]

    def run(self, batch, ids, extra, shared_slots=None) -> None:
        d = self.drafter
        d.model.write_context(extra, batch.positions, d.k_pools, d.v_pools, batch.out_cache_loc)


class DraftModelPiece(DrafterPiece):
    """The draft model's forward over the chunk (its KV), on its own attention; the ids enter
    through `DraftModelDrafter.forward` (mapped into a smaller draft vocabulary inside the
    bucket's graph)."""

    def __init__(self, drafter):
        super().__init__(drafter)
        attn = drafter.lm.model.layers[0].self_attn
        self.group = attn.num_heads // attn.num_kv_heads

    def run(self, batch, ids, extra, shared_slots=None):
        d = self.drafter
        d.attn.prepare(batch, shared_slots=shared_slots)
        return d.forward(ids, batch.positions)


def propose_extend(drafter, inputs: DraftInputs, sampling, variant: str, num_drafts: int):
    """An extend step's drafter work: its N-token part (`drafter_extend`), then, unless it
    drafts nothing, the per-sequence part (`propose_per_sequence`)."""
    drafter_extend(drafter, inputs)
    if num_drafts == 0:
        return drafter.no_drafts(inputs.batch)
    return propose_per_sequence(drafter, inputs, sampling, variant, num_drafts)


def drafter_extend(drafter, inputs: DraftInputs) -> None:
    """The drafter's N-token part of an extend step: through its bucket (a replay or a padded
    eager forward) when the engine gave it a `DrafterPiecewise`, else eagerly unpadded."""
    runner = drafter.piecewise  # set by PiecewiseRunner
    if runner is None or not runner.forward(inputs):
        (runner.piece if runner is not None else drafter.extend_piece()).run_step(inputs)


def last_position_inputs(inputs: DraftInputs) -> DraftInputs:
    """An extend step's inputs at each sequence's last position only: a decode batch of one
    token per row (its queries attend to the K/V just written over every position; it writes
    its own position's K/V again, with the same values)."""
    batch, last = inputs.batch, inputs.last_flat
    one = ForwardBatch(
        mode=ForwardMode.DECODE,
        bs=batch.bs,
        tokens_per_req=1,
        input_ids=batch.input_ids[last],
        positions=batch.positions[last],
        req_pool_indices=batch.req_pool_indices,
        out_cache_loc=batch.out_cache_loc[last],
        kv_len=batch.kv_len,
        sampling=batch.sampling,
    )
    return DraftInputs(
        one,
        inputs.hidden[last],
        [a[last] for a in inputs.aux],
        inputs.next_tokens.reshape(-1)[last],
        torch.arange(batch.bs, device=last.device),
        inputs.target_slots,
    )


def propose_per_sequence(drafter, inputs: DraftInputs, sampling, variant: str, num_drafts: int):
    """The per-sequence part of an extend step (after its N-token part): the drafts from each
    sequence's last position, through the drafter's `ProposeGraphs` (executor/propose_graphs.py:
    a replay, or its padded forward eagerly) when the engine gave it one and the step fits, else
    eagerly unpadded (`Drafter.propose_last`)."""
    one = last_position_inputs(inputs)
    graphs = drafter.per_sequence  # set by PiecewiseRunner
    if graphs is not None:
        tokens = graphs.forward(one, variant, num_drafts)
        if tokens is not None:
            return Proposal(tokens, None)
    return drafter.propose_last(one, sampling, variant, num_drafts)


class DrafterPiecewise(InTargetPool, BucketGraphs):
    """The drafter's N-token part of extend steps (`DrafterPiece`) by the target's buckets: its
    entries (tokens, positions, slots, layout) and one extra-input buffer of the largest bucket
    shared by all of them (one forward at a time), its graphs in the target's pool."""

    label = " drafter"

    def __init__(self, target: BucketGraphs, piece: DrafterPiece):  # the PiecewiseRunner
        self.target, self.piece = target, piece
        self._setup(target.cfg, target.pctx, target.device, target.sizes, target.graphs_possible)
        self.sentinel_row, self.sentinel_slot = target.sentinel_row, target.sentinel_slot
        self.kv_len = target.kv_len
        group = piece.group or 1
        self.entries: dict[int, BucketEntry] = {
            n: new_entry(n, min(target.max_num_seqs, n), group, self.sentinel_row, self.device)
            for n in self.sizes
        }
        self.extra = None
        if piece.width and self.sizes:
            dtype = piece.drafter.pool_layout[3]
            shape = (max(self.sizes), piece.width)
            self.extra = torch.zeros(shape, dtype=dtype, device=self.device)

    def _extra(self, n: int) -> torch.Tensor | None:
        return None if self.extra is None else self.extra[:n]

    def _layout(self, entry: BucketEntry, seq_lens: list[int], num_rows: int) -> tuple:
        """The static layout (when the piece attends); the step's rows are copied on the device
        (`_fill`), so the host layout names the sentinel for them."""
        rows = [self.sentinel_row] * num_rows
        seq_lens, all_rows, meta = bucket_layout(
            entry, seq_lens, rows, self.piece.group, self.sentinel_row
        )
        entry.rows.copy_(torch.tensor(all_rows, dtype=torch.int64))
        entry.meta.copy_(torch.tensor(meta, dtype=torch.int32))
        return seq_lens

    def _fill(self, entry: BucketEntry, inputs: DraftInputs) -> ForwardBatch:
        batch, piece = inputs.batch, self.piece
        n = batch.input_ids.shape[0]
        fill_tokens(entry, piece.ids(inputs), batch.positions, batch.out_cache_loc,
                    self.sentinel_slot)  # fmt: skip
        column = 0
        for part in piece.parts(inputs):  # the padding's rows keep finite older values
            width = part.shape[-1]
            self.extra[:n, column : column + width].copy_(part)
            column += width
        if piece.group is None:
            lens = list(batch.seq_lens)
            seq_lens = (*lens, entry.num_tokens - n) if n < entry.num_tokens else tuple(lens)
        else:
            seq_lens = self._layout(entry, list(batch.seq_lens), batch.bs)
            entry.rows[: batch.bs].copy_(batch.req_pool_indices)
        return self._batch(entry, seq_lens)

    def _fill_dummy(self, entry: BucketEntry) -> ForwardBatch:
        """Capture's inputs: one sequence of N tokens at position 0 in the sentinel row."""
        entry.tokens[:2].zero_()
        entry.tokens[2].fill_(self.sentinel_slot)
        seq_lens = (entry.num_tokens,)
        if self.piece.group is not None:
            seq_lens = self._layout(entry, [entry.num_tokens], 1)
        return self._batch(entry, seq_lens)

    def _batch(self, entry: BucketEntry, seq_lens: tuple[int, ...]) -> ForwardBatch:
        return padded_batch(entry, seq_lens, self.piece.group, self.kv_len)

    def _run(self, batch: ForwardBatch):
        n = batch.input_ids.shape[0]
        return self.piece.run(batch, batch.input_ids, self._extra(n))

    def forward(self, inputs: DraftInputs) -> bool:
        """The piece over the step's bucket (False: the step runs it eagerly unpadded)."""
        batch = inputs.batch
        size = self.bucket(batch.input_ids.shape[0], len(batch.seq_lens))
        if size is None:
            self.stats.unpadded += self.pad
            return False
        entry = self.entries[size]
        padded = self._fill(entry, inputs)
        self._forward_entry(entry, padded, lambda: self._fill(entry, inputs))
        return True
