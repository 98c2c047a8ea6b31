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
buckets (`DrafterPiecewise`, in the target's pool, captured after the target's): EAGLE-3's K/V
over every position (a one-layer head: fc, norms, K/V and RoPE, no attention), DFLASH's context
K/V, and the draft model's forward over the chunk (its own attention on the static layout). What
follows per sequence (bs rows: the layer at each sequence's last position, the chain drafting,
DFLASH's block forward) runs eagerly, as a decode batch of one token per row
(`last_position_inputs`)."""

from __future__ import annotations

import bisect
import gc
import logging
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from speculant.comm.groups import ParallelContext
from speculant.config import GraphConfig
from speculant.drafter.base import DraftInputs
from speculant.errors import SpeculantError
from speculant.executor.forward_batch import ForwardBatch, ForwardMode
from speculant.kernels.paged_attention import VarlenTiles
from speculant.kernels.runtime import next_power_of_2

log = logging.getLogger("speculant")

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
WARMUP_RUNS = 2


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


def check_same_order(pctx: ParallelContext, order: list[int], what: str) -> None:
    """Every rank must capture the same buckets in the same order (TP graphs hold all-reduces
    that must line up); a mismatch is an error on every rank instead of a hang."""
    orders = pctx.all_gather_object(list(order))
    for rank, other in enumerate(orders):
        if other != orders[0]:
            raise SpeculantError(
                f"rank {rank} {what} piecewise graphs for token counts {other} but rank 0 "
                f"{orders[0]}; give every rank the same --piecewise-sizes, "
                "--max-num-batched-tokens and --piecewise-capture"
            )


def tile_block_m(group: int, num_tokens: int) -> int:
    """Query rows per tile of a bucket (the eager plan's rule at its longest sequence)."""
    return min(64, max(16, next_power_of_2(group * num_tokens)))


@dataclass
class BucketEntry:
    """One shape: N padded tokens of at most `max_seqs` sequences (plus the padding sequence and
    the empty one), its static inputs, and once captured its graph and output buffers."""

    num_tokens: int
    max_seqs: int
    block_m: int
    num_tiles: int
    tokens: torch.Tensor  # int64 [3, N]: input ids, positions, cache slots
    rows: torch.Tensor  # int64 [max_seqs + 2]: request rows of the sequences
    meta: torch.Tensor  # int32: starts, lens [max_seqs + 2]; tile seq, tile m0 [num_tiles]
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple[torch.Tensor, list[torch.Tensor]] | None = None
    num_warmups: int = 0
    captured: bool = False
    replays: int = 0

    @property
    def num_seq_slots(self) -> int:
        return self.max_seqs + 2

    def tile_tensors(self) -> tuple[torch.Tensor, ...]:
        s, t = self.num_seq_slots, self.num_tiles
        meta = self.meta
        return meta[2 * s : 2 * s + t], meta[2 * s + t :], meta[:s], meta[s : 2 * s]


def num_bucket_tiles(group: int, num_tokens: int, max_seqs: int, block_m: int) -> int:
    """Tiles enough for any layout of num_tokens tokens in at most max_seqs sequences and the
    padding sequence: each sequence's last tile may be partial, so at most one more per
    sequence than the tokens fill."""
    return -(-group * num_tokens // block_m) + max_seqs + 2


def bucket_layout(
    entry: BucketEntry, seq_lens: list[int], rows: list[int], group: int, sentinel_row: int
) -> tuple[tuple[int, ...], list[int], list[int]]:
    """Host values of a bucket's static metadata for sequences of `seq_lens` tokens in request
    rows `rows`: the sequences, the padding sequence (sentinel row, N - n tokens), then empty
    sequence slots; every unused tile names the last one (length 0: it reads and writes
    nothing). Returns the sequence lengths (padding included), the rows and the int32 block
    (starts, lens, tile seq, tile m0)."""
    n, N, bm = sum(seq_lens), entry.num_tokens, entry.block_m
    lens = list(seq_lens) + ([N - n] if N > n else [])
    all_rows = list(rows) + ([sentinel_row] if N > n else [])
    slots = entry.num_seq_slots
    empty = slots - 1
    starts, start, tile_seq, tile_m0 = [], 0, [], []
    for seq, length in enumerate(lens):
        starts.append(start)
        start += length
        for m0 in range(0, group * length, bm):
            tile_seq.append(seq)
            tile_m0.append(m0)
    unused = entry.num_tiles - len(tile_seq)
    assert unused >= 0 and len(lens) < slots, (N, entry.num_tiles, len(tile_seq), len(lens))
    pad_seqs = slots - len(lens)
    meta = (
        starts + [0] * pad_seqs + lens + [0] * pad_seqs
        + tile_seq + [empty] * unused + tile_m0 + [0] * unused
    )  # fmt: skip
    return tuple(lens), all_rows + [sentinel_row] * pad_seqs, meta


@dataclass
class PiecewiseStats:
    replays: int = 0
    padded_eager: int = 0  # padded forwards run eagerly (no graphs, or eager padding)
    unpadded: int = 0  # steps above the largest bucket (or with too many sequences)
    by_size: dict[int, int] = field(default_factory=dict)


class BucketGraphs:
    """What the target's and the drafter's runners share: a `BucketEntry` per bucket, replay or
    padded eager forward of a filled entry, capture (every bucket at start, or each on first
    use), the order checked on every rank, and `clear`. Subclasses make the entries and the
    forward (`_entry`, `_fill_dummy`, `_run`) and hold the pool (`pool`)."""

    label = ""  # in messages: " drafter" for the drafter's graphs
    pool = None

    def _setup(self, cfg: GraphConfig, pctx: ParallelContext, device, sizes, graphs_possible):
        self.cfg, self.pctx, self.device = cfg, pctx, device
        self.sizes = sizes
        self.graphs_possible = self.use_graphs = graphs_possible
        self.pad = bool(sizes) and (graphs_possible or cfg.eager_padding)
        self.lazy = cfg.piecewise_capture == "lazy"
        self.capture_order: list[int] = []
        self.memory_bytes = 0
        self.capture_seconds = 0.0
        self.stats = PiecewiseStats()

    def bucket(self, num_tokens: int, num_seqs: int = 1) -> int | None:
        """The bucket a step of num_tokens tokens in num_seqs sequences runs at (None: eager)."""
        if not self.pad:
            return None
        index = bisect.bisect_left(self.sizes, num_tokens)
        if index == len(self.sizes) or num_seqs > self.entries[self.sizes[index]].max_seqs:
            return None
        return self.sizes[index]

    def _forward_entry(self, entry: BucketEntry, padded: ForwardBatch, refill):
        """Replay the filled entry's graph (capturing it first when lazy; `refill` fills it again
        after capture, which ran on dummy inputs), or run its padded forward eagerly."""
        size = entry.num_tokens
        if self.use_graphs:
            if not entry.captured:
                if not self.lazy:
                    raise SpeculantError(
                        f"no{self.label} piecewise graph was captured for {size} tokens "
                        f"(captured: {self.capture_order}); call Engine.capture_graphs()"
                    )
                self._capture_lazily(entry)
                refill()
            entry.graph.replay()
            entry.replays += 1
            self.stats.replays += 1
            out = entry.outputs
        else:
            out = self._run(padded)
            self.stats.padded_eager += 1
        self.stats.by_size[size] = self.stats.by_size.get(size, 0) + 1
        return out

    # ------------------------------------------------------------------ capture

    def capture_plan(self) -> list[int]:
        """Buckets to capture at start, largest first (none when lazy)."""
        return [] if self.lazy else sorted(self.sizes, reverse=True)

    def capture(self) -> None:
        """Capture every bucket (largest first, one memory pool), or with lazy capture none yet.
        With several ranks and no graphs (the CPU, --enforce-eager) the same lockstep runs each
        padded forward once eagerly, so the protocol is exercised there too."""
        self.use_graphs = self.graphs_possible
        plan = self.capture_plan()
        if self.pctx.world_size > 1:
            check_same_order(self.pctx, plan, f"would capture{self.label}")
        if not self.use_graphs:
            if self.pctx.world_size > 1 and self.pad:
                for n in plan:
                    self._lockstep_eager(self.entries[n])
                check_same_order(self.pctx, self.capture_order, f"captured{self.label}")
            return
        if not plan:
            return
        device = self.device
        start = time.perf_counter()
        reserved_before = torch.cuda.memory_reserved(device)
        bar = tqdm(
            plan, disable=self.pctx.rank != 0, desc=f"capturing{self.label} piecewise graphs"
        )
        gc.collect()
        gc.freeze()
        try:
            for n in bar:
                free = torch.cuda.mem_get_info(device)[0] / 2**30
                bar.set_description(f"capturing{self.label} tokens={n} free={free:.1f} GiB")
                self._capture_one(self.entries[n])
        finally:
            gc.unfreeze()
        if self.pctx.world_size > 1:
            check_same_order(self.pctx, self.capture_order, f"captured{self.label}")
        self.memory_bytes = torch.cuda.memory_reserved(device) - reserved_before
        self.capture_seconds = time.perf_counter() - start
        if self.pctx.rank == 0:
            log.info(
                "captured %d%s piecewise graphs (tokens %s) in %.1f s using %.2f GiB",
                len(plan),
                self.label,
                sorted(plan),
                self.capture_seconds,
                self.memory_bytes / 2**30,
            )

    def _lockstep_eager(self, entry: BucketEntry) -> None:
        batch = self._fill_dummy(entry)
        self.pctx.barrier()
        self._run(batch)
        self.pctx.barrier()
        self.capture_order.append(entry.num_tokens)

    def _capture_lazily(self, entry: BucketEntry) -> None:
        """A bucket's first use (lazy capture): every TP rank runs the same step, so they all
        capture it now; the orders so far are checked equal before it replays."""
        device = self.device

        def reserved() -> int:
            return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0

        start, before = time.perf_counter(), reserved()
        self._capture_one(entry)
        if self.pctx.world_size > 1:
            check_same_order(self.pctx, self.capture_order, f"captured{self.label}")
        taken = reserved() - before
        self.memory_bytes += taken
        self.capture_seconds += time.perf_counter() - start
        if self.pctx.rank == 0:
            log.info(
                "captured the%s piecewise graph for %d tokens in %.2f s using %.2f GiB",
                self.label,
                entry.num_tokens,
                time.perf_counter() - start,
                taken / 2**30,
            )

    def _capture_one(self, entry: BucketEntry) -> None:
        """Warm up (the remaining of WARMUP_RUNS), then capture into the shared pool."""
        batch = self._fill_dummy(entry)
        stream = torch.cuda.Stream(self.device)
        torch.cuda.synchronize()
        self.pctx.barrier()
        with torch.cuda.stream(stream):
            while entry.num_warmups < WARMUP_RUNS:
                self._run(batch)
                entry.num_warmups += 1
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(
                graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"
            ):
                out = self._run(batch)
        except torch.OutOfMemoryError as exc:
            raise SpeculantError(
                f"out of GPU memory capturing the{self.label} piecewise graph for "
                f"{entry.num_tokens} tokens; lower --max-num-batched-tokens or "
                "--kv-cache-memory-fraction, or pass --piecewise-sizes with smaller sizes"
            ) from exc
        torch.cuda.synchronize()
        self.pctx.barrier()
        if self.pool is None:
            self.pool = graph.pool()
        entry.graph, entry.outputs, entry.captured = graph, out, True
        self.capture_order.append(entry.num_tokens)

    def _release(self) -> None:
        for entry in self.entries.values():
            entry.graph = entry.outputs = None
            entry.captured, entry.num_warmups = False, 0
        self.capture_order.clear()
        self.memory_bytes = 0
        self.use_graphs = False


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
        self.drafter = None
        if runner.drafter is not None:
            self.drafter = DrafterPiecewise(self, drafter_piece(runner.drafter))
            runner.drafter.piecewise = self.drafter

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
        if self.drafter is not None:
            self.drafter.capture()

    @property
    def total_capture_seconds(self) -> float:
        """Capture time of the target's and the drafter's buckets."""
        drafter = self.drafter.capture_seconds if self.drafter is not None else 0.0
        return self.capture_seconds + drafter

    def clear(self) -> None:
        """Release every graph (the drafter's too), their output buffers and the pool; padded
        forwards then run eagerly until `capture` again."""
        if self.drafter is not None:
            self.drafter.clear()
        self._release()
        self.pool = None


# ------------------------------------------------------------------------------ entries


def new_entry(n: int, max_seqs: int, group: int, sentinel_row: int, device) -> BucketEntry:
    """The static buffers of a bucket of n tokens, at most max_seqs sequences."""
    block_m = tile_block_m(group, n)
    num_tiles = num_bucket_tiles(group, n, max_seqs, block_m)
    slots = max_seqs + 2
    return BucketEntry(
        n, max_seqs, block_m, num_tiles,
        tokens=torch.zeros(3, n, dtype=torch.int64, device=device),
        rows=torch.full((slots,), sentinel_row, dtype=torch.int64, device=device),
        meta=torch.zeros(2 * slots + 2 * num_tiles, dtype=torch.int32, device=device),
    )  # fmt: skip


def fill_tokens(entry: BucketEntry, ids, positions, slots, sentinel_slot: int) -> None:
    """A step's n ids, positions and cache slots into the entry's [3, N]; the padding tokens
    get token 0 at position 0, writing the sentinel slot."""
    n, tokens = ids.shape[0], entry.tokens
    tokens[0, :n].copy_(ids)
    tokens[1, :n].copy_(positions)
    tokens[2, :n].copy_(slots)
    if n < entry.num_tokens:
        tokens[:2, n:].zero_()
        tokens[2, n:].fill_(sentinel_slot)


def padded_batch(
    entry: BucketEntry, seq_lens: tuple[int, ...], group: int | None, kv_len: int
) -> ForwardBatch:
    """The EXTEND batch over an entry's static buffers (tiles for a GQA `group`'s attention;
    None: a forward that attends to nothing)."""
    tiles = None
    if group is not None:
        tiles = VarlenTiles(seq_lens, group, entry.block_m, entry.num_tiles, entry.tile_tensors())
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        bs=entry.num_seq_slots,
        tokens_per_req=0,
        input_ids=entry.tokens[0],
        positions=entry.tokens[1],
        req_pool_indices=entry.rows,
        out_cache_loc=entry.tokens[2],
        kv_len=kv_len,
        seq_lens=seq_lens,
        tiles=tiles,
    )


# ------------------------------------------------------------------------------ the drafter


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
    """The draft model's forward over the chunk (its KV), on its own attention."""

    def __init__(self, drafter):
        super().__init__(drafter)
        attn = drafter.lm.model.layers[0].self_attn
        self.group = attn.num_heads // attn.num_kv_heads

    def run(self, batch, ids, extra, shared_slots=None):
        d = self.drafter
        d.attn.prepare(batch, shared_slots=shared_slots)
        return d.lm(ids, batch.positions, d.attn)


def drafter_piece(drafter) -> DrafterPiece:
    """The N-token part of `drafter`'s extend steps."""
    from speculant.drafter.dflash import DFlashDrafter
    from speculant.drafter.draft_model import DraftModelDrafter
    from speculant.drafter.eagle_drafter import Eagle3Drafter

    if isinstance(drafter, Eagle3Drafter):
        return EagleKVPiece(drafter)
    if isinstance(drafter, DFlashDrafter):
        return DFlashContextPiece(drafter)
    if isinstance(drafter, DraftModelDrafter):
        return DraftModelPiece(drafter)
    raise TypeError(f"no extend piece for {type(drafter).__name__}")


def drafter_extend(drafter, inputs: DraftInputs) -> None:
    """The drafter's N-token part of an extend step: through its bucket (a replay or a padded
    eager forward) when the engine gave it a `DrafterPiecewise`, else eagerly unpadded."""
    runner = getattr(drafter, "piecewise", None)  # set by PiecewiseRunner
    if runner is None or not runner.forward(inputs):
        (runner.piece if runner is not None else drafter_piece(drafter)).run_step(inputs)


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


class DrafterPiecewise(BucketGraphs):
    """The drafter's N-token part of extend steps (`DrafterPiece`) by the target's buckets: its
    entries (tokens, positions, slots, layout) and one extra-input buffer of the largest bucket
    shared by all of them (one forward at a time), its graphs in the target's pool."""

    label = " drafter"

    def __init__(self, target: PiecewiseRunner, piece: DrafterPiece):
        self.target, self.piece = target, piece
        self._setup(target.cfg, target.pctx, target.device, target.sizes, target.graphs_possible)
        self.sentinel_row, self.sentinel_slot = target.sentinel_row, target.sentinel_slot
        self.kv_len = target.kv_len
        group = piece.group or 1
        self.entries: dict[int, BucketEntry] = {
            n: new_entry(
                n, min(target.max_num_seqs, n), group, self.sentinel_row, self.device
            )
            for n in self.sizes
        }
        self.extra = None
        if piece.width and self.sizes:
            dtype = piece.drafter.pool_layout[3]
            shape = (max(self.sizes), piece.width)
            self.extra = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def pool(self):
        return self.target.pool

    @pool.setter
    def pool(self, value) -> None:
        self.target.pool = value

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

    def clear(self) -> None:
        self._release()
