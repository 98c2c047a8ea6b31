"""Continuous batching under a token budget, with KV pages on demand and preemption.

Each step `schedule` returns a StepPlan: first the decoding requests (k + 1 tokens each, oldest
first), each given the pages its step can write; then prefill chunks, in arrival order, fill the
budget that remains: the unfinished prompts of running requests, then waiting requests while
request rows (max_num_seqs), pages and budget allow. A prompt longer than what is left is split
over several steps (chunked prefill). A request holds the pages it has written plus one step's
lookahead and grows page by page; when the pool cannot serve a decoding request's next step, the
most recently admitted request is preempted: its pages are freed and it goes back to the front of
the queue, to be recomputed from its prompt and the tokens it has emitted (vLLM's recompute
preemption). A step that preempted admits no waiting request (the pages it freed go to the
running requests' next steps, as vLLM's scheduler does), and a waiting request is admitted only
while a free page per decoding request is left after its chunk (each may need one next step):
otherwise the one admitted is the next one preempted, and its chunks are computed again. While
requests decode, waiting ones are admitted in groups (`admit_group`, max_num_seqs // 16): a step
with prefill chunks runs eagerly, a pure decode step replays a graph, so admissions are gathered
into few mixed steps. Output is unchanged by preemption and grouping:
greedy steps are deterministic and sampling draws from a counter-based RNG keyed by position.

With prefix caching (executor/prefix_cache.py) an admitted request first takes the cached pages
of its context's start (`num_cached` tokens it does not prefill); its first chunk starts after
them (`Chunk.first`), and the engine registers the pages each extend step completes
(`cache_prefilled`)."""

from __future__ import annotations

from collections import deque

from speculant.errors import SpeculantError
from speculant.executor.kv_cache import PagedKVCache
from speculant.executor.request import Request
from speculant.executor.step_plan import Chunk, StepPlan


class Scheduler:
    def __init__(
        self,
        kv: PagedKVCache,
        max_num_seqs: int,
        tokens_per_req: int,
        max_num_batched_tokens: int,
    ):
        if max_num_batched_tokens < tokens_per_req:
            raise SpeculantError(
                f"max_num_batched_tokens={max_num_batched_tokens} is below one verify row's "
                f"{tokens_per_req} tokens (k + 1); raise --max-num-batched-tokens"
            )
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.tokens_per_req = tokens_per_req
        self.budget = max_num_batched_tokens
        # While requests decode, new ones are admitted in groups of at least this many (or all
        # that wait): each admission makes an eager mixed step, and a group shares one.
        self.admit_group = max(1, max_num_seqs // 16)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        # prompt positions later completions took from the prompt's first (_prompt_pages)
        self.shared_prompt_tokens = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def positions_needed(self, request: Request) -> int:
        """Positions a request may write over its life: its longest context, then one step's
        verify tokens and the drafter's lookahead past them (2 x (k + 1))."""
        return len(request.prompt_ids) + request.max_new_tokens + 2 * self.tokens_per_req

    def check_fits(self, request: Request) -> None:
        """Refuse, before generation starts, a request the pool could never hold alone."""
        needed = self.positions_needed(request)
        self.kv.check_fits(needed, needed - request.max_new_tokens + 1)  # (with one new token)

    def decode_reach(self, request: Request, steps: int = 1) -> int:
        """Positions a decoding request's next `steps` steps may write up to."""
        cached = len(request.prompt_ids) + len(request.output_ids) - 1
        return cached + 2 * steps * self.tokens_per_req

    def schedule(self) -> StepPlan:
        """The next step's plan (see the module docstring)."""
        T, kv = self.tokens_per_req, self.kv
        plan = StepPlan(tokens_per_req=T)
        budget = self.budget
        for request in [r for r in self.running if r.is_decoding]:
            if request.row < 0:  # preempted for an older request this step
                continue
            # its tokens this step: at most its input and the drafts it holds (adaptive plain
            # steps hold none: one token), never more than one verify row's k + 1
            width = min(T, len(request.next_input))
            if budget < width:
                break  # the rest wait a step
            while not kv.grow(request.row, self.decode_reach(request)):
                victim = self.running[-1]
                self.preempt(victim, plan)
                if victim is request:
                    break
            if request.row >= 0:
                plan.decode.append(request)
                budget -= width
        # tokens kept for later completions whose prompt pages completion 0 now holds: they
        # are admitted this step, before it can finish and free them (the prompt prefilled once);
        # only where nothing stops this step's admissions (a preemption, or the decode rows
        # waiting for a group's rows), else the running prefills would have lost the budget
        free_rows = self.max_num_seqs - len(self.running)
        gated = bool(plan.decode) and free_rows < min(len(self.waiting), self.admit_group)
        held = 0 if plan.preempted or gated else self._held_for_completions(budget)
        budget = self._extend_running(plan, budget - held) + held
        free_rows = self.max_num_seqs - len(self.running)
        group = min(len(self.waiting), self.admit_group)
        if plan.decode and not plan.chunks and free_rows < group:
            return self._done(plan)  # keep decoding in graphs until a group's rows are free
        if plan.preempted:
            return self._done(plan)
        i = 0  # the waiting request considered (later completions may wait their turn)
        kept = 0  # rows kept for later completions whose prompt is still being prefilled
        while i < len(self.waiting) and budget > 0 and len(self.running) + kept < self.max_num_seqs:
            request = self.waiting[i]
            shared = self._prompt_pages(request)
            if shared is None:  # the prompt's first completion prefills it: a later step, in a
                kept += 1  # row kept for it (given to the next prompt, it would wait until
                i += 1  # completion 0 ended and freed the pages, then prefill them again)
                continue
            request.row = kv.allocate_row()
            pages = kv.prefix.match(request.context) if kv.prefix is not None else []
            pages = shared if len(shared) > len(pages) else pages
            kv.attach(request.row, pages)
            request.num_computed = request.num_cached = len(pages) * kv.page_size
            chunk = self._chunk(request, budget)
            if chunk is not None and len(kv.free_pages) < len(plan.decode):
                chunk = None  # no page left for a decoding request's next step
            if chunk is None:
                kv.free(request.row)
                request.row = -1
                request.num_computed = request.num_cached = 0
                break
            del self.waiting[i]
            self.running.append(request)
            if pages is shared:  # counted once: here, not as prefix-cache hits
                self.shared_prompt_tokens += request.num_cached
            if kv.prefix is not None:
                kv.prefix.admitted_tokens += len(request.context)
                kv.prefix.hit_tokens += 0 if pages is shared else request.num_cached
            plan.chunks.append(chunk)
            budget -= len(chunk.tokens)
        if held and not plan.requests:
            # the completions held for found no free page: the prompts in progress take the
            # budget (preempting if need be), else they would wait for them forever
            self._extend_running(plan, budget)
        return self._done(plan)

    def _extend_running(self, plan: StepPlan, budget: int) -> int:
        """Add the next chunks of the running requests' unfinished prompts, in arrival order,
        within `budget` tokens; returns the budget left."""
        for request in [r for r in self.running if not r.is_decoding]:
            if budget <= 0:
                break
            if request.row < 0:  # preempted this step
                continue
            chunk = self._chunk(request, budget)
            while chunk is None:  # a prompt in progress must not wait for pages forever
                victim = self.running[-1]
                self.preempt(victim, plan)
                if victim is request:
                    break
                chunk = self._chunk(request, budget)
            if chunk is not None:
                plan.chunks.append(chunk)
                budget -= len(chunk.tokens)
        return budget

    def _held_for_completions(self, budget: int) -> int:
        """The tokens (at most `budget`) that the later completions ready to take their prompt
        pages (_prompt_pages) prefill after them, as many as rows are free."""
        rows = self.max_num_seqs - len(self.running)
        held = 0
        for request in self.waiting:  # they wait ahead of the prompts not admitted yet
            if rows <= 0 or held >= budget or request.first_completion is None:
                break
            if pages := self._prompt_pages(request):
                held += len(request.prompt_ids) - len(pages) * self.kv.page_size
                rows -= 1
        return min(held, budget)

    def _prompt_pages(self, request: Request) -> list[int] | None:
        """The prompt pages a later completion of a prompt (SamplingParams.n) takes from the
        prompt's first completion in the run, which holds and has computed them: the whole pages
        that end before the prompt's last token, as a prefix cache would give them
        (prefix_cache.py). None while that one is still prefilling them (this one is admitted
        once it has: the prompt is prefilled once, not n times); [] when there is nothing to
        take (it is not running, a chunk of it ran while the drafter rested, a prompt of one
        page)."""
        first = request.first_completion
        if first is None or first.row < 0 or first.drafter_gap:
            return []
        whole = (len(request.prompt_ids) - 1) // self.kv.page_size
        if whole == 0:
            return []
        if not first.is_decoding and first.num_computed < whole * self.kv.page_size:
            return None
        return self.kv.pages_of_row[first.row][:whole]

    def _done(self, plan: StepPlan) -> StepPlan:
        self.kv.commit()
        return plan

    def _chunk(self, request: Request, budget: int) -> Chunk | None:
        """The next chunk of a request's context within `budget` tokens, its pages taken (the
        chunk's positions and the drafter's lookahead past them); None when pages lack."""
        context = request.context
        start = request.num_computed
        end = min(len(context), start + budget)
        if not self.kv.grow(request.row, end + self.tokens_per_req):
            return None
        last = end == len(context)
        if not last:
            successor = context[end]
        else:  # a resumed request already emitted the token after its context
            successor = request.output_ids[-1] if request.output_ids else None
        first = start == request.num_cached
        return Chunk(request, start, context[start:end], last, successor, first)

    def preempt(self, request: Request, plan: StepPlan) -> None:
        """Free a running request's pages and row; it resumes first, recomputing its context."""
        self.running.remove(request)
        self.kv.free(request.row)
        request.row = -1
        request.num_computed = request.num_cached = 0
        request.drafter_gap = False
        request.next_input = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted.append(request)
        if request in plan.decode:  # planned before a prompt in progress needed its pages
            plan.decode.remove(request)
        plan.chunks = [c for c in plan.chunks if c.request is not request]

    def cache_prefilled(self, request: Request) -> None:
        """Register in the prefix cache the pages of `request`'s context its prefill has
        computed so far, unless a chunk of them ran while the drafter rested."""
        kv = self.kv
        if kv.prefix is not None and request.row >= 0 and not request.drafter_gap:
            kv.prefix.register(kv.pages_of_row[request.row], request.context, request.num_computed)

    def reserve_ahead(self, requests: list[Request], steps: int) -> bool:
        """Pages for `steps` more decode steps of each request, without preempting (overlap's
        step launched ahead); False when the pool cannot give them."""
        for request in requests:
            if not self.kv.grow(request.row, self.decode_reach(request, steps)):
                self.kv.commit()
                return False
        self.kv.commit()
        return True

    def withdraw(self, requests: list[Request]) -> None:
        """Take waiting requests that were never started out of the queue (moved to another DP
        rank: executor/dp.DPShares)."""
        gone = set(requests)
        if any(r.row >= 0 or r.output_ids for r in gone) or gone - set(self.waiting):
            raise RuntimeError("a DP move took a request this rank has started")
        self.waiting = deque(r for r in self.waiting if r not in gone)

    def abort_all(self) -> list[Request]:
        """Drop every waiting and running request, freeing the pages and rows they hold
        (a run that stopped part way: the engine starts the next one empty). Returns them."""
        dropped = [*self.running, *self.waiting]
        for request in dropped:  # a waiting one holds a row when stopped mid-admission
            if request.row >= 0:
                self.kv.free(request.row)
                request.row = -1
        self.running.clear()
        self.waiting.clear()
        return dropped

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.row)
        request.row = -1
