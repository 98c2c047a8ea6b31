"""Paged KV cache: a page pool per layer, the `req_to_page` block table, and the page allocator.

Page 0 is never handed out: it is the dummy page that padded rows read and write. The request
pool has `max_requests + 1` rows; the last one, `sentinel_row`, stays zero (length 0, page 0) and
is where padded graph rows point, so they never touch a live request's state."""

from __future__ import annotations

import logging

import torch

from speculant.errors import SpeculantError

log = logging.getLogger("speculant")


class PagedKVCache:
    """K and V pools of shape [num_pages * page_size, kv_heads, head_dim] per layer, plus the
    per-request block table and valid cache lengths (both on the device)."""

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
    ):
        if num_pages < 2:
            raise SpeculantError(
                f"KV cache of {num_pages} page(s) is too small; raise "
                "--num-pages or --kv-cache-memory-fraction"
            )
        self.num_pages, self.page_size = num_pages, page_size
        self.max_requests, self.max_pages_per_req = max_requests, max_pages_per_req
        self.sentinel_row = max_requests
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.req_to_page = torch.zeros(
            max_requests + 1, max_pages_per_req, dtype=torch.int32, device=device
        )
        self.cache_lens = torch.zeros(max_requests + 1, dtype=torch.int64, device=device)
        self.free_pages = list(range(num_pages - 1, 0, -1))
        self.free_rows = list(range(max_requests - 1, -1, -1))
        self.pages_of_row: dict[int, list[int]] = {}

    @property
    def max_tokens_per_req(self) -> int:
        return self.max_pages_per_req * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return bool(self.free_rows) and self.pages_for(num_tokens) <= len(self.free_pages)

    def allocate(self, num_tokens: int) -> int:
        """Take a request row and enough pages for `num_tokens` positions; returns the row."""
        num = self.pages_for(num_tokens)
        if num > self.max_pages_per_req:
            raise SpeculantError(
                f"{num_tokens} tokens exceed the {self.max_tokens_per_req} "
                "positions a request can hold; raise --max-model-len"
            )
        if num > self.num_pages - 1:
            raise SpeculantError(
                f"a request needs {num} KV pages but the pool has "
                f"{self.num_pages - 1}; raise --num-pages or "
                "--kv-cache-memory-fraction, or lower --max-new-tokens"
            )
        row = self.free_rows.pop()
        pages = [self.free_pages.pop() for _ in range(num)]
        self.pages_of_row[row] = pages
        table = torch.zeros(self.max_pages_per_req, dtype=torch.int32)
        table[:num] = torch.tensor(pages, dtype=torch.int32)
        self.req_to_page[row].copy_(table)
        self.cache_lens[row] = 0
        return row

    def free(self, row: int) -> None:
        """Return a request's pages and row; the row is zeroed like the sentinel."""
        self.free_pages.extend(self.pages_of_row.pop(row))
        self.free_rows.append(row)
        self.req_to_page[row].zero_()
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
) -> int:
    """Pages for the pool: as requested, else enough for max_num_seqs full-length requests on the
    CPU, else a fraction of free GPU memory (capped at what max_num_seqs can use)."""
    full = max_num_seqs * -(-max_model_len // page_size) + 1
    if requested is not None:
        num = requested
        how = "--num-pages"
    elif str(device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        num = min(full, int(free * memory_fraction) // (bytes_per_token * page_size))
        how = f"{memory_fraction:.0%} of {free / 2**30:.1f} GiB free"
    else:
        num = full
        how = f"max_num_seqs={max_num_seqs} x max_model_len={max_model_len}"
    log.info(
        "KV cache: %d pages of %d tokens (%.1f MiB) from %s",
        num,
        page_size,
        num * page_size * bytes_per_token / 2**20,
        how,
    )
    return num
