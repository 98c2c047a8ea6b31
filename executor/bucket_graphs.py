"""What the piecewise runners (executor/piecewise.py: the target's; executor/piecewise_drafter.py:
the drafter's) share: a `BucketEntry` per padded token count N (static inputs, layout buffers,
graph, outputs), the layout of a packed step in it (padding in the sentinel row and page),
`BucketGraphs` (replay or padded eager forward, capture at start or on first use, the order
checked on every rank, clear), and the capture-order check."""

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
from speculant.errors import SpeculantError
from speculant.executor.forward_batch import ForwardBatch, ForwardMode
from speculant.kernels.paged_attention import VarlenTiles, tile_layout, varlen_block_m

log = logging.getLogger("speculant")

WARMUP_RUNS = 2


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
    return varlen_block_m(group, num_tokens)


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
    starts, tile_seq, tile_m0 = tile_layout(lens, group, bm)
    unused = entry.num_tiles - len(tile_seq)
    assert unused >= 0 and len(lens) < slots, (N, entry.num_tiles, len(tile_seq), len(lens))
    pad_seqs = slots - len(lens)
    meta = (
        starts + [0] * pad_seqs + lens + [0] * pad_seqs
        + tile_seq + [empty] * unused + tile_m0 + [0] * unused
    )  # fmt: skip
    return tuple(lens), all_rows + [sentinel_row] * pad_seqs, meta


def release_cached(device) -> None:
    """Give the GPU back the cached blocks no tensor holds (warm-ups of a capture on its side
    stream, which steps on the main stream could not reuse); the graphs' pools stay."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


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
    unit = "tokens"  # what a size counts
    oom_advice = (
        "lower --max-num-batched-tokens or --kv-cache-memory-fraction, or pass "
        "--piecewise-sizes with smaller sizes"
    )
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
                        f"no{self.label} piecewise graph was captured for {size} {self.unit} "
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
        release_cached(device)
        reserved_before = torch.cuda.memory_reserved(device)
        bar = tqdm(
            plan, disable=self.pctx.rank != 0, desc=f"capturing{self.label} piecewise graphs"
        )
        gc.collect()
        gc.freeze()
        try:
            for n in bar:
                free = torch.cuda.mem_get_info(device)[0] / 2**30
                bar.set_description(f"capturing{self.label} {self.unit}={n} free={free:.1f} GiB")
                self._capture_one(self.entries[n])
        finally:
            gc.unfreeze()
        if self.pctx.world_size > 1:
            check_same_order(self.pctx, self.capture_order, f"captured{self.label}")
        release_cached(device)  # the warm-ups' blocks: the graphs' pool is what stays
        self.memory_bytes = torch.cuda.memory_reserved(device) - reserved_before
        self.capture_seconds = time.perf_counter() - start
        if self.pctx.rank == 0:
            log.info(
                "captured %d%s piecewise graphs (%s %s) in %.1f s using %.2f GiB",
                len(plan),
                self.label,
                self.unit,
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
        if device.type == "cuda":
            release_cached(device)
        taken = reserved() - before
        self.memory_bytes += taken
        self.capture_seconds += time.perf_counter() - start
        if self.pctx.rank == 0:
            log.info(
                "captured the%s piecewise graph for %d %s in %.2f s using %.2f GiB",
                self.label,
                entry.num_tokens,
                self.unit,
                time.perf_counter() - start,
                taken / 2**30,
            )

    def _capture_stream(self) -> torch.cuda.Stream:
        """The side stream every capture (and its warm-ups) runs on: one for all buckets. The
        caching allocator keeps a freed block for the stream it was allocated on, so warm-ups
        on a new stream per bucket left each bucket's activations cached apart (released by
        `release_cached`)."""
        if getattr(self, "_stream", None) is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _capture_one(self, entry: BucketEntry) -> None:
        """Warm up (the remaining of WARMUP_RUNS), then capture into the shared pool."""
        batch = self._fill_dummy(entry)
        stream = self._capture_stream()
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
                f"{entry.num_tokens} {self.unit}; {self.oom_advice}"
            ) from exc
        torch.cuda.synchronize()
        self.pctx.barrier()
        if self.pool is None:
            self.pool = graph.pool()
        entry.graph, entry.outputs, entry.captured = graph, out, True
        self.capture_order.append(entry.num_tokens)

    def clear(self) -> None:
        """Release every graph and its output buffers; padded forwards then run eagerly until
        `capture` again (the PiecewiseRunner also releases its pool)."""
        self._release()

    def _release(self) -> None:
        for entry in self.entries.values():
            entry.graph = entry.outputs = None
            entry.captured, entry.num_warmups = False, 0
        self.capture_order.clear()
        self.memory_bytes = 0
        self.use_graphs = False


class InTargetPool:
    """A drafter's graphs kept in the target runner's (`target`) memory pool."""

    target: BucketGraphs

    @property
    def pool(self):
        return self.target.pool

    @pool.setter
    def pool(self, value) -> None:
        self.target.pool = value


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
