"""Paged KV cache: a page pool per layer, the `req_to_page` block table, and the page allocator.

Page 0 is never handed out: it is the dummy page that padded rows read and write. The request
pool has `max_requests + 1` rows; the last one, `sentinel_row`, stays zero (length 0, page 0) and
is where padded graph rows point, so they never touch a live request's state."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from speculant.errors import SpeculantError
from speculant.executor.prefix_cache import FreePages, PrefixCache

log = logging.getLogger("speculant")


class PagedKVCache:
    """K and V pools of shape [num_pages * page_size + 1, kv_heads, head_dim] per layer, plus
    the per-request block table and valid cache lengths (both on the device). The last slot of
    every pool, past all pages, is the zero slot: no page holds it, so nothing writes it, and the
    torch attention backend reads it in place of stale slots (executor/attention.py)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
        max_requests: int,
        max_pages_per_req: int,
        prefix_caching: bool = False,
    ):
        if num_pages < 2:
            raise SpeculantError(
                f"KV cache of {num_pages} page(s) is too small; raise "
                "--num-pages or --kv-cache-memory-fraction"
            )
        self.num_pages, self.page_size = num_pages, page_size
        self.max_requests, self.max_pages_per_req = max_requests, max_pages_per_req
        self.sentinel_row = max_requests
        shape = (num_pages * page_size + 1, num_kv_heads, head_dim)  # + the zero slot
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.req_to_page = torch.zeros(
            max_requests + 1, max_pages_per_req, dtype=torch.int32, device=device
        )
        self.cache_lens = torch.zeros(max_requests + 1, dtype=torch.int64, device=device)
        self.free_pages = FreePages(range(num_pages - 1, 0, -1))
        self.free_rows = list(range(max_requests - 1, -1, -1))
        self.pages_of_row: dict[int, list[int]] = {}
        # prefix caching (executor/prefix_cache.py): pages held by more than one row, by count
        # (a held page absent here has one holder)
        self.prefix = PrefixCache(page_size) if prefix_caching else None
        self.holders: dict[int, int] = {}
        self.pending: list[tuple[int, int, int]] = []  # (row, column, page) not yet on the device

    @property
    def max_tokens_per_req(self) -> int:
        return self.max_pages_per_req * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def usable_pages(self) -> int:
        """Pages requests can hold (page 0 is the dummy page)."""
        return self.num_pages - 1

    def can_allocate(self, num_tokens: int) -> bool:
        return bool(self.free_rows) and self.pages_for(num_tokens) <= len(self.free_pages)

    def check_fits(self, num_tokens: int, least: int | None = None) -> None:
        """Refuse a request that could never run: `num_tokens` positions above what a row holds
        or what the whole pool holds (`least`: what it would need with one output token, so
        the message says whether fewer output tokens could fit it)."""
        num = self.pages_for(num_tokens)
        if num > self.max_pages_per_req:
            raise SpeculantError(
                f"needs {num_tokens} positions, more than the {self.max_tokens_per_req} a "
                "request can hold; raise --max-model-len (max_model_len)"
            )
        if num > self.usable_pages:
            raise SpeculantError(
                f"needs {num} KV pages of {self.page_size} tokens ({num_tokens} positions) but "
                f"the pool holds {self.usable_pages} usable page(s) (page 0 is reserved); use "
                f"--num-pages {num + 1} or more (num_pages; or raise --kv-cache-memory-fraction)"
                + (
                    ", or lower --max-new-tokens (max_new_tokens)"
                    if least is None or self.pages_for(least) <= self.usable_pages
                    else f"; the prompt alone with one output token needs {least} positions"
                )
            )

    def allocate_row(self) -> int:
        """Take a request row with no pages yet (it grows with `grow`)."""
        row = self.free_rows.pop()
        self.pages_of_row[row] = []
        self.cache_lens[row] = 0
        return row

    def allocate(self, num_tokens: int) -> int:
        """Take a request row and enough pages for `num_tokens` positions; returns the row."""
        self.check_fits(num_tokens)
        row = self.allocate_row()
        if not self.grow(row, num_tokens):
            self.free(row)
            raise SpeculantError(
                f"{self.pages_for(num_tokens)} KV pages wanted but {len(self.free_pages)} are "
                "free; free rows first, or raise --num-pages"
            )
        self.commit()
        return row

    def pages_needed(self, row: int, num_tokens: int) -> int:
        """Pages `row` still lacks to hold `num_tokens` positions."""
        want = min(self.pages_for(num_tokens), self.max_pages_per_req)
        return max(0, want - len(self.pages_of_row[row]))

    def grow(self, row: int, num_tokens: int) -> bool:
        """Give `row` pages until it holds `num_tokens` positions (capped at a row's table);
        False, with nothing taken, when the pool has too few free pages."""
        extra = self.pages_needed(row, num_tokens)
        if extra == 0:
            return True
        if extra > len(self.free_pages):
            return False
        held = self.pages_of_row[row]
        for _ in range(extra):
            page, was_cached = self.free_pages.take()
            if was_cached:
                self.prefix.forget(page)
            self.pending.append((row, len(held), page))
            held.append(page)
        return True

    def attach(self, row: int, pages: list[int]) -> None:
        """Give a row with no pages yet the cached `pages` (its context's start), shared with
        any row that holds them (PrefixCache.match)."""
        held = self.pages_of_row[row]
        assert not held, "cached pages start a row"
        for page in pages:
            if not self.free_pages.claim(page):  # held elsewhere: one holder more
                self.holders[page] = self.holders.get(page, 1) + 1
            self.pending.append((row, len(held), page))
            held.append(page)

    def forget_cached(self) -> None:
        """Forget every cached page (the weights changed: no cached K/V is right any more);
        the free ones become plain free pages."""
        if self.prefix is not None:
            self.prefix.clear()
            self.free_pages.uncache()

    def commit(self) -> None:
        """Write the block-table entries `grow` added since the last commit (one copy)."""
        if not self.pending:
            return
        rows, cols, pages = torch.tensor(self.pending, dtype=torch.int64).T
        self.pending.clear()
        device = self.req_to_page.device
        self.req_to_page.index_put_(
            (rows.to(device), cols.to(device)), pages.to(device, torch.int32)
        )

    def free(self, row: int) -> None:
        """Return a request's pages and row; the row is zeroed like the sentinel."""
        pages = self.pages_of_row.pop(row)
        self.pending = [entry for entry in self.pending if entry[0] != row]
        # cached pages go out least recently freed first: free a row's last pages first, so that
        # a chain is cut from its end (its start still matches), as vLLM frees blocks
        for page in reversed(pages) if self.prefix is not None else pages:
            left = self.holders.pop(page, 1) - 1
            if left > 1:
                self.holders[page] = left
            elif left == 0:  # no row holds it: free, and still cached if it was
                self.free_pages.give(
                    page, cached=self.prefix is not None and page in self.prefix.key_of
                )
        self.free_rows.append(row)
        self.req_to_page[row, : len(pages)] = 0
        self.cache_lens[row] = 0

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat cache slots of `positions` [bs, T] for request rows [bs] (device ops only)."""
        pages = torch.gather(self.req_to_page[rows].long(), 1, positions // self.page_size)
        return pages * self.page_size + positions % self.page_size


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def choose_num_pages(
    page_size: int,
    max_num_seqs: int,
    max_model_len: int,
    bytes_per_token: int,
    device: str,
    memory_fraction: float,
    requested: int | None,
    reserved_bytes: int = 0,
    ranks_on_host: int = 1,
) -> int:
    """Pages for the pool: as requested, else enough for max_num_seqs requests of
    `max_model_len` positions each (the caller passes the positions a row may reach), both
    capped at `memory_fraction` of the free GPU memory less `reserved_bytes` (the profiled peak
    activations of a step), or of this rank's share of the available host memory on the CPU
    (`ranks_on_host` ranks share it); a requested pool beyond that is refused, naming the
    flags."""
    full = max_num_seqs * -(-max_model_len // page_size) + 1
    page_bytes = bytes_per_token * page_size
    budget, limit = page_budget(page_bytes, device, memory_fraction, reserved_bytes, ranks_on_host)
    if requested is not None:
        if requested > budget:
            raise SpeculantError(
                f"--num-pages {requested} needs {requested * page_bytes / 2**30:,.1f} GiB of KV "
                f"cache, more than {limit} ({budget} pages); lower --num-pages or raise "
                "--kv-cache-memory-fraction"
            )
        num, how = requested, "--num-pages"
    elif full <= budget:
        num, how = full, f"max_num_seqs={max_num_seqs} x {max_model_len} positions"
    else:
        num, how = budget, f"{limit} (max_num_seqs x positions would need {full} pages)"
    log.info(
        "KV cache: %d pages of %d tokens (%.1f MiB) from %s",
        num,
        page_size,
        num * page_bytes / 2**20,
        how,
    )
    return num


def page_budget(
    page_bytes: int,
    device: str,
    memory_fraction: float,
    reserved_bytes: int = 0,
    ranks_on_host: int = 1,
) -> tuple[int, str]:
    """The KV pages `memory_fraction` of the free GPU memory less `reserved_bytes` holds (of
    this rank's share of the available host memory on the CPU), and the limit in words."""
    if str(device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        free = max(0, free - reserved_bytes)
        where = f"free after {reserved_bytes / 2**30:.2f} GiB of profiled step activations"
    else:
        free = max(0, _available_host_memory() // max(1, ranks_on_host) - reserved_bytes)
        where = "available" if ranks_on_host <= 1 else f"available to each of {ranks_on_host} ranks"
        if reserved_bytes:
            where += f" after {reserved_bytes / 2**30:.2f} GiB of request-row buffers"
    budget = int(free * memory_fraction) // page_bytes
    return budget, f"{memory_fraction:.0%} of {free / 2**30:.1f} GiB {where}"


def rows_that_fit(
    max_num_seqs: int, page_size: int, bytes_per_token: int, row_bytes: int, device: str,
    memory_fraction: float, ranks_on_host: int = 1,
) -> int:  # fmt: skip
    """One rank's request rows, lowered (with a warning) to what memory could hold at all:
    every running sequence holds at least one KV page besides its row's own buffers
    (`row_bytes`, allocated for every row up front), so rows past that never run and their
    buffers would exhaust memory first."""
    page_bytes = bytes_per_token * page_size
    pages, limit = page_budget(page_bytes, device, memory_fraction, ranks_on_host=ranks_on_host)
    rows = max(1, min(max_num_seqs, pages * page_bytes // (page_bytes + row_bytes) - 1))
    if rows < max_num_seqs:
        log.warning(
            "max_num_seqs lowered to %d rows a rank (asked %d): every running sequence holds a "
            "KV page of %d tokens and %d bytes of row buffers, and %s holds %d of them",
            rows, max_num_seqs, page_size, row_bytes, limit, rows + 1,
        )  # fmt: skip
    return rows


def _available_host_memory() -> int:
    """Bytes this process may still allocate: MemAvailable (free plus reclaimable cache), else
    the free pages, lowered to the cgroup's limit when one is set (containers); no cap (a very
    large number) where neither can be read."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return 1 << 62
    cgroup = Path("/sys/fs/cgroup")
    try:  # cgroup v2: memory.max is "max" or a byte count
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return available
