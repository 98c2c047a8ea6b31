"""Deferred drafter catch-up for adaptive speculation's plain steps.

A plain step (shape (0, 0)) drafts nothing, but a later step may draft again, so the drafter
must hold its state for every position. Writing it in every plain step costs about as many
kernels as the step's own projections on a small model. Instead the plain step only records
what the drafter needs for its position (a token id and a feature row: EAGLE-3's auxiliary
target states, DFLASH's context features) in a small buffer per request row, `depth` entries
deep; `flush` later writes the drafter's K/V of all recorded positions at once (one batched
catch-up every `depth` plain steps, and before any step that drafts or extends). A request row
holds entries 0..count-1 for its newest `count` positions: entry j is at position
cache_len - count + j, since every plain step adds exactly one token.

The device side (`record`, `flush`) runs inside captured graphs; the host side (which rows hold
entries, when a flush is due) is `PendingRows`."""

from __future__ import annotations

import torch

DEFAULT_DEPTH = 8


class CatchUpBuffers:
    """Per request row: `depth` recorded (token id, features) entries and their count."""

    def __init__(self, drafter, kv, max_bs: int, depth: int = DEFAULT_DEPTH):
        rows, device = kv.max_requests + 1, kv.req_to_page.device
        self.drafter, self.kv, self.depth = drafter, kv, depth
        width, dtype = drafter.catch_up_width, drafter.pool_layout[3]
        self.ids = torch.zeros(rows, depth, dtype=torch.int64, device=device)
        self.features = torch.zeros(rows, depth, width, dtype=dtype, device=device)
        self.count = torch.zeros(rows, dtype=torch.int64, device=device)
        self.rows = torch.full((max_bs,), kv.sentinel_row, dtype=torch.int64, device=device)
        self.offsets = torch.arange(depth, device=device)
        self.sentinel = kv.sentinel_row
        if drafter.attention_backend == "triton":  # imports triton (kernels/runtime.py)
            from speculant.kernels.catch_up import record
        else:
            from speculant.kernels.reference import record_catch_up as record
        self._record = record

    def record(self, rows: torch.Tensor, ids: torch.Tensor | None, sources: list) -> None:
        """A plain step's entries for its rows [bs]: ids [bs] (or None) and the feature row,
        the concatenation of `sources` ([bs, w_i] each). Padded rows (the sentinel) keep count
        0 and overwrite their own entry 0. One kernel with the Triton backend."""
        self._record(rows, ids, sources, self.ids, self.features, self.count, self.sentinel)

    def flush(self, bs: int) -> None:
        """Write the drafter's state of every entry of the first bs rows of `self.rows` (padded
        with the sentinel), then empty them. Graph-capturable: it reads only device state."""
        kv, rows = self.kv, self.rows[:bs]
        count = self.count[rows]
        valid = self.offsets < count[:, None]  # [bs, depth]
        positions = kv.cache_lens[rows, None] - count[:, None] + self.offsets
        where_rows = torch.where(valid, rows[:, None], kv.sentinel_row)
        positions = torch.where(valid, positions, 0)
        slots = kv.slots(where_rows.reshape(-1), positions.reshape(-1, 1)).reshape(-1)
        self.drafter.catch_up(rows, self.ids[rows], self.features[rows], positions, slots)
        self.count.index_fill_(0, rows, 0)

    def reset(self, rows: list[int]) -> None:
        """Rows that start a context (their first prefill chunk): no entries."""
        if rows:
            index = torch.tensor(rows, dtype=torch.int64, device=self.count.device)
            self.count.index_fill_(0, index, 0)


class PendingRows:
    """Which requests hold recorded entries, and when the next flush is due: after `depth`
    plain steps, or before any step that is not a plain decode step."""

    def __init__(self, depth: int = DEFAULT_DEPTH):
        self.depth = depth
        self.batches: list[list] = []  # the requests of every plain step since the last flush
        self.flushes = 0

    @property
    def steps(self) -> int:
        """Plain steps since the last flush (each row holds at most this many entries)."""
        return len(self.batches)

    def due(self, plain: bool) -> bool:
        """Whether to flush before a step (`plain`: a plain decode step, which records)."""
        return bool(self.batches) and (not plain or len(self.batches) >= self.depth)

    def recorded(self, requests: list) -> None:
        """A plain decode step of these requests has been launched (the list is kept)."""
        self.batches.append(requests)

    def drop(self) -> None:
        """Forget every recorded step without a flush (the drafter rests: its rows go cold)."""
        self.batches.clear()

    def rows_to_flush(self, starting: set[int] = frozenset()) -> list[int]:
        """The rows the recorded requests hold now (a finished or preempted request holds -1;
        one preempted and resumed holds a row that starts its context again), except rows now
        starting a context; then forget every entry."""
        owners = {request.row: request for batch in self.batches for request in batch}
        self.batches.clear()
        self.flushes += 1
        return sorted(r for r in owners if r >= 0 and r not in starting)
