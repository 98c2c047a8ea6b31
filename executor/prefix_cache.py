"""Prefix caching (`--enable-prefix-caching`, vLLM's automatic prefix caching): whole KV pages of a
prefilled context are kept, after their request ends too, and given to a later request (or the
same one resumed after a preemption) whose context starts with the same tokens, so that it
prefills only the rest.

A page is known by its key: a digest (BLAKE2b, 128 bits) of the key of the page before it, its
`page_size` tokens, and the token after it. The token after is part of the key because an
EAGLE-3 head's K/V at a position is computed from the next token's embedding: with it the page's
drafter entries are exactly those the new request would compute. A context therefore shares
pages ending at most at its second-to-last token, and always computes at least its last one
(whose logits the step needs). Dict lookups compare whole keys, so a page's own tokens are
compared exactly, and the pages before it through a cryptographic digest (Python's tuple hash
can be made to collide on purpose); the same on every rank.

A page is registered after the extend step that completes it has run, the target's and the
drafter's K/V both written (a request one of whose chunks ran while the drafter rested registers
nothing: `Request.drafter_gap`), and only pages of the context a request prefills: pages that
decode steps fill are never shared. Pages no request holds stay cached, in least-recently-freed
order, and are taken back (and forgotten) only when the pool has no never-cached free page left
(`FreePages`). A shared page is only read: a request writes at positions past the ones it took
from the cache."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import chain


class FreePages:
    """The pool's free pages: never-cached ones (taken last-freed first, as a plain stack) and
    cached ones no request holds (taken least-recently-freed first, only when no plain one is
    left). len() and iteration cover both."""

    def __init__(self, pages):
        self.plain: list[int] = list(pages)
        self.cached: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.plain) + len(self.cached)

    def __iter__(self) -> Iterator[int]:
        return chain(self.plain, self.cached)

    def take(self) -> tuple[int, bool]:
        """A free page, and whether it was a cached one (its entry must be forgotten)."""
        if self.plain:
            return self.plain.pop(), False
        return self.cached.popitem(last=False)[0], True

    def uncache(self) -> None:
        """Every cached free page becomes a plain one (the cache forgot them)."""
        self.plain.extend(self.cached)
        self.cached.clear()

    def give(self, page: int, cached: bool = False) -> None:
        if cached:
            self.cached[page] = None
        else:
            self.plain.append(page)

    def claim(self, page: int) -> bool:
        """Take a cached free page out of the free set for a request that reuses it; False
        when it is not free (requests hold it)."""
        return self.cached.pop(page, False) is None


class PrefixCache:
    """Cached pages by key (see the module doc), and the hit figures."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.page_of: dict[tuple, int] = {}
        self.key_of: dict[int, tuple] = {}
        self.admitted_tokens = 0  # context tokens of the admissions (the scheduler counts)
        self.hit_tokens = 0  # of them, tokens taken from the cache

    def _keys(self, context: Sequence[int], end: int) -> Iterator[tuple]:
        """Keys of the context's pages that end at or before `end` and before its last token."""
        ps, parent = self.page_size, b""
        last = min(end, len(context) - 1)
        for stop in range(ps, last + 1, ps):
            tokens = context[stop - ps : stop + 1]  # the page and the token after it
            key = (parent, tuple(tokens[:-1]), tokens[-1])
            yield key
            digest = hashlib.blake2b(parent, digest_size=16)
            digest.update(array("q", tokens).tobytes())
            parent = digest.digest()

    def match(self, context: Sequence[int]) -> list[int]:
        """The cached pages that hold the longest cached start of `context`, in order."""
        pages = []
        for key in self._keys(context, len(context)):
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def register(self, pages: Sequence[int], context: Sequence[int], computed: int) -> None:
        """Cache the pages (a request's, in order) of `context` whose positions are all computed
        (below `computed`); a page already cached, or whose content another page caches, is
        left as it is."""
        for page, key in zip(pages, self._keys(context, computed), strict=False):
            if page not in self.key_of and key not in self.page_of:
                self.page_of[key] = page
                self.key_of[page] = key

    def forget(self, page: int) -> None:
        key = self.key_of.pop(page, None)
        if key is not None:
            del self.page_of[key]

    def clear(self) -> None:
        """Forget every page (the weights changed: no cached K/V is right any more)."""
        self.page_of.clear()
        self.key_of.clear()
