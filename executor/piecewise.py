"""Graphs for extend steps ([piecewise]): the target forward of a step of packed sequences (prefill
chunks, and the verify rows of a mixed step) captured per padded token count N, a "bucket", and
replayed for every step of up to N tokens. Pure decode steps keep their whole-step graphs
(executor/cuda_graph.py).

The whole forward is one graph: the Triton attention reads the step's layout from static device
buffers (every sequence's request row, start and length, and a tile table sized for the bucket's
worst case), so its grid is fixed per bucket. Logits at the wanted positions, verify, sampling
and the drafter run eagerly after it, on the step's own (unpadded) batch.

Padding: the tokens past the step's n (up to N) form one more sequence, in the sentinel row at
position 0 with token 0: they write only the sentinel slot (the dummy page 0, which no live row
maps) and attend only to it, so they stay finite. The tiles past the step's own name an empty
sequence and do nothing. `eager_padding` runs the same padded forward eagerly (the CPU tests).

FastDeploy's piecewise backend's behaviours: one `BucketEntry` per shape (graph, output buffers,
warm-up count, captured flag); every bucket captured at start, or each on first use
(`--piecewise-capture lazy`); the capture order recorded and checked equal on every rank; one
memory pool; a replay only of a captured shape; `clear` releases every graph and the pool.

Eager instead: steps above the largest bucket, the CPU, --enforce-eager, the torch attention
backend (its packed path loops over sequences on the host) and MoE targets (a replayed graph would
bake in every rank's dispatch sizes; their extend steps stay eager).

The drafter's part of an extend step that depends only on its N tokens has graphs of the same
buckets (executor/piecewise_drafter.py's `DrafterPiecewise`, in the target's pool, captured
after the target's; the machinery both share is executor/bucket_graphs.py): EAGLE-3's K/V
over every position (a one-layer head: fc, norms, K/V and RoPE, no attention), DFLASH's context
K/V, and the draft model's forward over the chunk (its own attention on the static layout). What
follows per sequence (bs rows: the layer at each sequence's last position, the chain drafting,
DFLASH's block forward) is a decode batch of one token per row (`last_position_inputs`), which
greedy steps replay from graphs by padded row count (executor/propose_graphs.py's
`ProposeGraphs`, the runner's `per_sequence`, in the same pool, captured last)."""

from __future__ import annotations

import torch

from speculant.comm.groups import ParallelContext
from speculant.config import GraphConfig
from speculant.errors import SpeculantError
from speculant.executor.bucket_graphs import (
    BucketEntry,
    BucketGraphs,
    bucket_layout,
    fill_tokens,
    new_entry,
    padded_batch,
)
from speculant.executor.forward_batch import ForwardBatch
from speculant.executor.piecewise_drafter import DrafterPiecewise
from speculant.executor.propose_graphs import ProposeGraphs

# Measured on an H200, 8B shape (benchmarks/results/piecewise.md): a graph saves the ~13 ms of
# launches of an eager forward, which a forward hides once its own compute is that long: 2048
# tokens replay in 51 ms vs 53.6 eager, while padding 576 tokens to a 1024 bucket cost more
# (24.9 ms) than it saved (18.2 eager). So buckets are fine-grained (padding <= 25%) and stop at
# 2048; larger steps run eagerly, unpadded.
DEFAULT_SIZES = (
    16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792,
    2048,
)  # fmt: skip
CAPTURE_MODES = ("eager", "lazy")


def piecewise_sizes(cfg: GraphConfig, max_num_batched_tokens: int) -> list[int]:
    """Token buckets: the configured or default list capped at the token budget (adding the
    budget itself when the list passes it, so every step of the budget replays); [] for none,
    and when piecewise graphs are off (`piecewise=False` and no sizes given)."""
    if cfg.piecewise_sizes is not None and not cfg.piecewise_sizes:
        return []
    if not cfg.piecewise and cfg.piecewise_sizes is None:
        return []
    sizes = sorted(set(cfg.piecewise_sizes or DEFAULT_SIZES))
    if min(sizes) < 1:
        raise SpeculantError(f"piecewise size {min(sizes)} is not positive; give sizes >= 1")
    kept = [s for s in sizes if s <= max_num_batched_tokens]
    if max(sizes) > max_num_batched_tokens and max_num_batched_tokens not in kept:
        kept.append(max_num_batched_tokens)
    return kept


def uses_piecewise_graphs(
    cfg: GraphConfig, device: str, attention_backend: str, is_moe: bool, budget: int
) -> bool:
    """Whether extend forwards replay graphs (else they run eagerly, padded or not)."""
    return (
        not cfg.enforce_eager
        and str(device).startswith("cuda")
        and attention_backend == "triton"
        and not is_moe
        and bool(piecewise_sizes(cfg, budget))
    )


class PiecewiseRunner(BucketGraphs):
    """Runs a packed target forward through its bucket: a replay, a padded eager forward, or
    None (the caller runs it eagerly unpadded). With a drafter, `drafter` runs the drafter's
    N-token part of the step through the same buckets (its graphs in this runner's pool)."""

    def __init__(
        self,
        runner,
        cfg: GraphConfig,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        pctx: ParallelContext,
        attention_backend: str,
        is_moe: bool = False,
        row_sizes: list[int] | None = None,
    ):
        if cfg.piecewise_capture not in CAPTURE_MODES:
            raise SpeculantError(
                f"piecewise capture {cfg.piecewise_capture!r} is not supported; use "
                f"{' or '.join(CAPTURE_MODES)}"
            )
        self.runner = runner
        self._setup(
            cfg, pctx, runner.device,
            [] if is_moe else piecewise_sizes(cfg, max_num_batched_tokens),
            uses_piecewise_graphs(
                cfg, runner.device, attention_backend, is_moe, max_num_batched_tokens
            ),
        )  # fmt: skip
        if self.lazy and self.use_graphs and pctx.dp_size > 1:
            raise SpeculantError(
                "--piecewise-capture lazy needs --dp 1 (DP ranks meet a size at different "
                "steps); use --piecewise-capture eager"
            )
        kv = runner.kv
        self.kv_len = kv.max_tokens_per_req
        self.sentinel_row = kv.sentinel_row
        self.sentinel_slot = int(kv.req_to_page[kv.sentinel_row, 0]) * kv.page_size
        self.max_num_seqs = max_num_seqs
        attn = runner.model.model.layers[0].self_attn
        self.group = attn.num_heads // attn.num_kv_heads
        self.entries: dict[int, BucketEntry] = {
            n: new_entry(n, min(max_num_seqs, n), self.group, self.sentinel_row, self.device)
            for n in self.sizes
        }
        self.drafter = self.per_sequence = None
        if runner.drafter is not None:
            self.drafter = DrafterPiecewise(self, runner.drafter.extend_piece())
            runner.drafter.piecewise = self.drafter
            if runner.drafter.drafts_per_sequence and runner.k and row_sizes and self.sizes:
                self.per_sequence = ProposeGraphs(self, row_sizes, runner.k)
                runner.drafter.per_sequence = self.per_sequence

    # ------------------------------------------------------------------ layout

    def _layout(self, entry: BucketEntry, seq_lens: list[int], rows: list[int]) -> tuple:
        return bucket_layout(entry, seq_lens, rows, self.group, self.sentinel_row)

    def _fill(self, entry: BucketEntry, batch: ForwardBatch, rows: list[int]) -> ForwardBatch:
        """Copy a step's packed batch (its request rows on the host) into the bucket's static
        inputs; the padded batch."""
        fill_tokens(entry, batch.input_ids, batch.positions, batch.out_cache_loc,
                    self.sentinel_slot)  # fmt: skip
        seq_lens, all_rows, meta = self._layout(entry, list(batch.seq_lens), rows)
        entry.rows.copy_(torch.tensor(all_rows, dtype=torch.int64))
        entry.meta.copy_(torch.tensor(meta, dtype=torch.int32))
        return self._batch(entry, seq_lens)

    def _fill_dummy(self, entry: BucketEntry) -> ForwardBatch:
        """Capture's inputs: one sequence of N tokens at position 0 in the sentinel row."""
        entry.tokens[:2].zero_()
        entry.tokens[2].fill_(self.sentinel_slot)
        seq_lens, all_rows, meta = self._layout(entry, [entry.num_tokens], [self.sentinel_row])
        entry.rows.copy_(torch.tensor(all_rows, dtype=torch.int64))
        entry.meta.copy_(torch.tensor(meta, dtype=torch.int32))
        return self._batch(entry, seq_lens)

    def _batch(self, entry: BucketEntry, seq_lens: tuple[int, ...]) -> ForwardBatch:
        """The padded batch over the static buffers (`seq_lens` is read only by the CPU's
        reference attention, never inside a graph)."""
        return padded_batch(entry, seq_lens, self.group, self.kv_len)

    def _run(self, batch: ForwardBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        runner = self.runner
        runner.attn.prepare(batch)
        return runner.model(batch.input_ids, batch.positions, runner.attn, None)

    # ------------------------------------------------------------------ the step

    def forward(
        self, batch: ForwardBatch, rows: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The packed forward of `batch` (request rows `rows`, on the host) through its bucket:
        hidden [n, H] and the auxiliary
        states (views of the bucket's outputs, valid until the next piecewise forward), or
        None when the step runs eagerly unpadded."""
        n = batch.input_ids.shape[0]
        size = self.bucket(n, len(batch.seq_lens))
        if size is None:
            self.stats.unpadded += self.pad
            return None
        entry = self.entries[size]
        padded = self._fill(entry, batch, rows)
        hidden, aux = self._forward_entry(entry, padded, lambda: self._fill(entry, batch, rows))
        return hidden[:n], [a[:n] for a in aux]

    # ------------------------------------------------------------------ capture

    def capture(self) -> None:
        """The target's buckets, then the drafter's (same pool)."""
        super().capture()
        for graphs in self._drafter_graphs():
            graphs.capture()

    def _drafter_graphs(self) -> list[BucketGraphs]:
        return [g for g in (self.drafter, self.per_sequence) if g is not None]

    @property
    def total_capture_seconds(self) -> float:
        """Capture time of the target's buckets and the drafter's (both parts)."""
        return self.capture_seconds + sum(g.capture_seconds for g in self._drafter_graphs())

    def clear(self) -> None:
        """Release every graph (the drafter's too), their output buffers and the pool; padded
        forwards then run eagerly until `capture` again."""
        for graphs in self._drafter_graphs():
            graphs.clear()
        self._release()
        self.pool = None
