"""The drafter's per-sequence part of an extend step as graphs by padded row count
([piecewise]): after the target's forward over the packed chunks and the drafter's N-token part
(executor/piecewise_drafter.py), each sequence drafts from its last position: EAGLE-3's layer
there and its chain, DFLASH's block forward, the draft model's k single-token decodes. That is a
decode batch of one token per row (`last_position_inputs`), and eagerly it pays a launch per
kernel (7-11 ms on the bundled models on an H200, about 3, 5 and 36 ms for the three drafters
at the 8B shape: benchmarks/results/piecewise.md). `ProposeGraphs` captures it per padded row
count (the decode graphs' sizes) for greedy steps, so a prefill step under fixed speculation
drafts as cheaply as a decode step does.

Padding: the rows past the step's live ones are the sentinel row at position 0 with token 0 (as
the decode graphs pad; with `--disable-graph-padding` only exact sizes replay, as theirs do):
they write only the dummy page. Their hidden and auxiliary rows keep the older finite values of
the shared static buffers. Sampled steps (their drafts are drawn from q and recorded) and steps
of more rows than the largest size run eagerly; so does every step when the target's piecewise
graphs are off (no drafter graphs either: the two go together), and on the CPU, where
`eager_padding` runs the same padded forward eagerly (the tests). Capture is always at start
(all sizes): under DP the ranks' row counts differ."""

from __future__ import annotations

import torch

from speculant.drafter.base import DraftInputs
from speculant.executor.bucket_graphs import BucketEntry, BucketGraphs, InTargetPool, new_entry
from speculant.executor.forward_batch import ForwardBatch, ForwardMode, SamplingInfo
from speculant.executor.sampling import GREEDY


class ProposeGraphs(InTargetPool, BucketGraphs):
    """Greedy per-sequence drafting of extend steps, per padded row count, in the target's
    piecewise pool (captured after the target's and the drafter's buckets)."""

    label = " drafting"
    unit = "rows"
    oom_advice = (
        "lower --max-num-seqs or --kv-cache-memory-fraction, or pass --capture-sizes with "
        "smaller sizes (these graphs take the decode graphs' sizes)"
    )

    def __init__(self, target, row_sizes: list[int], num_drafts: int):  # the PiecewiseRunner
        runner = target.runner
        self.target, self.drafter, self.k = target, runner.drafter, num_drafts
        sizes = sorted(s for s in set(row_sizes) if s <= target.max_num_seqs)
        self._setup(target.cfg, target.pctx, target.device, sizes, target.graphs_possible)
        self.lazy = False  # every size at start: under DP the ranks' row counts differ
        self.sentinel_row, self.sentinel_slot = target.sentinel_row, target.sentinel_slot
        self.kv_len = target.kv_len
        self.entries: dict[int, BucketEntry] = {
            n: new_entry(n, n, 1, self.sentinel_row, self.device) for n in self.sizes
        }
        top = max(self.sizes, default=0)
        config = runner.model.config
        dtype = runner.model.model.embed_tokens.weight.dtype
        width = config.hidden_size
        self.hidden = torch.zeros(top, width, dtype=dtype, device=self.device)
        self.aux = [
            torch.zeros(top, width, dtype=dtype, device=self.device)
            for _ in runner.drafter.aux_layer_ids
        ]
        self.next_tokens = torch.zeros(top, dtype=torch.int64, device=self.device)
        self.sampling = SamplingInfo(
            torch.zeros(top, dtype=torch.float32, device=self.device),
            torch.zeros(top, dtype=torch.int64, device=self.device),
            torch.ones(top, dtype=torch.float32, device=self.device),
            torch.zeros(top, dtype=torch.int64, device=self.device),
        )
        self.rows_index = torch.arange(top, device=self.device)

    def _inputs(self, entry: BucketEntry) -> DraftInputs:
        n, tokens = entry.num_tokens, entry.tokens
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            bs=n,
            tokens_per_req=1,
            input_ids=tokens[0],
            positions=tokens[1],
            req_pool_indices=entry.rows[:n],
            out_cache_loc=tokens[2],
            kv_len=self.kv_len,
            sampling=self.sampling.take(slice(0, n)),
        )
        return DraftInputs(
            batch, self.hidden[:n], [a[:n] for a in self.aux], self.next_tokens[:n],
            self.rows_index[:n], None,
        )  # fmt: skip

    def _fill_dummy(self, entry: BucketEntry) -> ForwardBatch:
        """Capture's inputs: every row the sentinel at position 0."""
        entry.tokens[:2].zero_()
        entry.tokens[2].fill_(self.sentinel_slot)
        entry.rows.fill_(self.sentinel_row)
        self.next_tokens[: entry.num_tokens].zero_()
        return self._inputs(entry).batch

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        entry = self.entries[batch.bs]
        inputs = self._inputs(entry)
        return self.drafter.propose_last(inputs, inputs.batch.sampling, GREEDY, self.k).tokens

    def bucket(self, num_tokens: int, num_seqs: int = 1) -> int | None:
        """The size num_tokens rows run at: with `--disable-graph-padding` only an exact size
        (as the decode graphs), else the smallest size >= num_tokens (None: eagerly)."""
        size = super().bucket(num_tokens, num_seqs)
        if size != num_tokens and self.cfg.disable_padding:
            return None
        return size

    def drafts_cheaply(self, num_rows: int, variant: str) -> bool:
        """Whether a step of num_rows sequences in this sampler variant drafts through a size:
        a replay (or, where graphs are impossible, the CPU, the padded forward that stands in
        for one in tests), not eagerly unpadded, nor padded eagerly between `clear_graphs` and
        `capture_graphs`."""
        stands_in = self.use_graphs or not self.graphs_possible
        return stands_in and variant == GREEDY and self.bucket(num_rows) is not None

    def forward(self, one: DraftInputs, variant: str, num_drafts: int) -> torch.Tensor | None:
        """The drafts [n, k] of an extend step's last-position inputs `one` through its size (a
        replay, or the padded forward eagerly), or None: the caller drafts eagerly unpadded."""
        n = one.batch.bs
        if variant != GREEDY or num_drafts != self.k:
            return None
        size = self.bucket(n)
        if size is None:
            self.stats.unpadded += self.pad
            return None
        entry = self.entries[size]
        self._fill(entry, one)
        padded = None if self.use_graphs else self._inputs(entry).batch  # eager: its batch
        return self._forward_entry(entry, padded, lambda: self._fill(entry, one))[:n]

    def _fill(self, entry: BucketEntry, one: DraftInputs) -> None:
        batch, n, size = one.batch, one.batch.bs, entry.num_tokens
        tokens = entry.tokens
        tokens[0, :n].copy_(batch.input_ids)
        tokens[1, :n].copy_(batch.positions)
        tokens[2, :n].copy_(batch.out_cache_loc)
        entry.rows[:n].copy_(batch.req_pool_indices)
        self.hidden[:n].copy_(one.hidden)
        for buffer, part in zip(self.aux, one.aux, strict=True):
            buffer[:n].copy_(part)
        self.next_tokens[:n].copy_(one.next_tokens)
        if n < size:
            tokens[:2, n:size].zero_()
            tokens[2, n:size].fill_(self.sentinel_slot)
            entry.rows[n:size].fill_(self.sentinel_row)
            self.next_tokens[n:size].zero_()
