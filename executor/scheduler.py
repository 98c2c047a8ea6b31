"""Continuous batching: admit waiting requests while request rows and KV pages allow (up to
max_num_seqs running), prefill them, then decode every running request each step. A request
reserves the pages for its whole length at admission, so a running request never runs out."""

from __future__ import annotations

from collections import deque

from speculant.executor.kv_cache import PagedKVCache
from speculant.executor.request import Request


class Scheduler:
    def __init__(self, kv: PagedKVCache, max_num_seqs: int, tokens_per_req: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.tokens_per_req = tokens_per_req
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def positions_needed(self, request: Request) -> int:
        # The last step may write tokens_per_req positions past the final emitted token.
        return len(request.prompt_ids) + request.max_new_tokens + self.tokens_per_req

    def admit(self) -> list[Request]:
        """Move waiting requests (in arrival order) to running while rows and pages allow."""
        admitted = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            needed = self.positions_needed(request)
            if not self.kv.can_allocate(needed) and (self.running or admitted):
                break  # wait for running requests to return their pages
            request.row = self.kv.allocate(needed)  # on an empty pool: the error naming the limit
            self.waiting.popleft()
            self.running.append(request)
            admitted.append(request)
        return admitted

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.row)
        request.row = -1
