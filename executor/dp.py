"""Data parallelism: each DP rank has its own scheduler, requests and KV cache, and plans its
own steps (executor/scheduler.py); this module settles what must agree across DP ranks.

Global rank 0 holds the user's prompts: it sends them to every rank, each DP rank takes its
share (balanced by tokens, `assign_requests`), runs it, taking requests another rank has not
started when its own queue runs dry (`DPShares`), and rank 0 gathers the outputs back in input
order (Engine.generate). Rank 0's progress bar counts every DP rank's finished requests
through a counter in the job's store (`JobProgress`), outside the step protocol.

The per-step protocol. Every step each DP rank sends (mode, tokens, rows, has_work; and its
queue for DPShares.plan_moves): mode is
DECODE (a pure decode step of `rows` requests, `tokens` = rows * (k + 1)), EXTEND (an eager
forward over prefill chunks and verify rows, `tokens` of them) or IDLE. From the same table
every rank derives what it runs:
1. no rank has work: the generation loop ends;
2. a dense target: each rank runs its own plan (a decode step replays the graph of its own
   padded size; an extend step runs eagerly; an idle rank sits the step out): nothing in a
   dense forward crosses DP ranks, so nothing needs to line up;
3. a MoE target (expert dispatches are collectives over every rank): when every rank decodes
   or is idle and the global batch ceil(max decode tokens / (k + 1)) fits the captured sizes,
   every rank runs that size padded to a captured one (a graph replays), an idle rank on
   sentinel rows only; otherwise every rank runs eagerly: its extend or its decode batch
   unpadded, and an idle rank a one-row dummy decode step.
So with a MoE target every rank runs exactly one target forward per step whenever any rank does,
in the same order, and knows every rank's token count (`DPStepSizes`, in the plan the runner
gets): the expert dispatches are planned from it, with no collective of their own, so an eager
forward and a replayed graph make the same collectives. The drafter's forwards are dense."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from speculant.comm.groups import ParallelContext
from speculant.comm.store_call import bounded_call
from speculant.executor.cuda_graph import GraphRunner, dp_can_use_graph, dp_graph_batch_size
from speculant.executor.request import Request
from speculant.executor.speculation import DraftShape
from speculant.executor.step_plan import DPStepSizes, Move, StepPlan

IDLE, DECODE, EXTEND = 0, 1, 2  # what a DP rank runs in a step, as exchanged
PROGRESS_INTERVAL_S = 0.2  # a DP rank touches the job's progress counter at most this often
# A store call that has not answered in this long is given up on (the store's server, rank 0's
# process or torchrun's agent, stopped or gone; a TCPStore client's add then waits forever)
STORE_CALL_S = 10.0

log = logging.getLogger("speculant")


def assign_requests(
    costs: Sequence[int], dp: int, groups: Sequence[int] | None = None
) -> list[list[int]]:
    """Request indices per DP rank, balanced by cost (tokens): the costliest unit goes to the
    least loaded rank first (ties to the lower rank); each rank keeps arrival order. A rank may
    get none when there are fewer requests than ranks. `groups` (one id per request: a prompt's
    completions share one) keeps a group on one rank, where its later completions take the
    prompt's pages from its first (scheduler.py), unless the group costs more than half a rank's
    fair share: then its requests are balanced one by one (on each rank the first of them
    prefills the prompt for the others there)."""
    if groups is None:
        groups = range(len(costs))
    members: dict[int, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    cap = sum(costs) / (2 * dp)
    units = []
    for indices in members.values():
        if len(indices) > 1 and sum(costs[i] for i in indices) > cap:
            units += [[i] for i in indices]
        else:
            units.append(indices)
    loads, shares = [0] * dp, [[] for _ in range(dp)]
    for unit in sorted(units, key=lambda u: (-sum(costs[i] for i in u), u[0])):
        rank = min(range(dp), key=lambda r: (loads[r], r))
        loads[rank] += sum(costs[i] for i in unit)
        shares[rank] += unit
    return [sorted(share) for share in shares]


class DPShares:
    """Which requests each DP rank runs in one generate call, the same value on every rank: the
    static shares of `assign_requests` (balanced by prompt + max_new_tokens), then the moves that
    the per-step exchange settles (`plan_moves`). Outputs end early (EOS, stop strings), so ranks
    drain their queues unevenly: once a rank has free rows and nothing waiting while another has
    more requests waiting than free rows, it takes half of that surplus from the tail of that
    rank's list, requests never started there (no output, no pages), so nothing is computed
    twice. Every rank applies the same moves from the same table: no other message.

    `lists[d]` is DP rank d's requests in the order it runs them; a rank reports how many of its
    list's last entries it has not started (`unstarted_tail`), and only those move, cut at a
    prompt's boundary so a prompt's completions stay together (they share its pages)."""

    def __init__(self, shares: Sequence[Sequence[int]], requests: Sequence[Request]):
        self.lists = [list(share) for share in shares]
        self.requests = {r.index: r for r in requests}

    def unstarted_tail(self, dp_rank: int, limit: int) -> int:
        """How many of DP rank `dp_rank`'s last requests it has not started and could give away,
        counted up to `limit` (this rank's own requests: it reads their state). The later
        completions of a prompt whose first ones started here stay with them (they take its
        pages): they are not counted, else a surplus that cannot move could be the largest and
        keep another rank's from moving."""
        own = self.lists[dp_rank]
        count = 0
        while count < limit and count < len(own) and not self._started(own[-1 - count]):
            count += 1
        # a prompt whose completions reach past the front of that tail (the first ones started,
        # or beyond `limit`) cannot move from its front: plan_moves never splits a prompt
        if 0 < count < len(own) and self._prompt(own[-count - 1]) == self._prompt(own[-count]):
            prompt = self._prompt(own[-count])
            while count and self._prompt(own[-count]) == prompt:
                count -= 1
        return count

    def _started(self, index: int) -> bool:
        request = self.requests[index]
        started = request.row >= 0 or request.output_ids or request.num_preemptions
        return bool(started) or request.finish_reason is not None

    def plan_moves(self, queues: Sequence[Sequence[int]]) -> list[Move]:
        """The moves for every rank's (unstarted tail, waiting, free rows), in DP-rank order: each
        rank with nothing waiting and a free row (in rank order) takes from the rank whose
        surplus (waiting past its free rows, at most its unstarted tail) is largest, half of it
        (at least one; a surplus whose half would split a prompt gives none, and the next largest
        is taken from). Applied to `lists` here; the caller moves the requests themselves."""
        surplus = [min(q[0], q[1] - q[2]) for q in queues]
        moves = []
        for dst, (_, waiting, free) in enumerate(queues):
            if waiting or free <= 0:
                continue
            while True:
                src = max(range(len(queues)), key=lambda d: (surplus[d], -d))
                if surplus[src] <= 0:
                    return moves
                own = self.lists[src]
                cut = len(own) - max(1, surplus[src] // 2)
                while 0 < cut < len(own) and self._prompt(own[cut]) == self._prompt(own[cut - 1]):
                    cut += 1  # a prompt's completions stay together
                if cut < len(own):
                    break
                surplus[src] = 0  # its half would split a prompt: the next largest surplus
            indices, own[cut:] = own[cut:], []
            self.lists[dst] += indices
            surplus[src] -= len(indices)
            moves.append(Move(src, dst, indices))
        return moves

    def _prompt(self, index: int) -> int:
        return self.requests[index].prompt_index


def request_cost(request: Request) -> int:
    """Tokens a request puts through the model: its prompt and its longest output."""
    return len(request.prompt_ids) + request.max_new_tokens


class JobProgress:
    """The requests finished on every DP rank of one `generate` call, for rank 0's progress bar
    (whose total is the whole job's). Each DP rank (its TP rank 0; one per DP rank) adds what it
    finished to one counter, `key`, in the job's store (`ParallelContext.store`): no collective,
    no rank waits for another, and a rank touches the store at most every `interval_s` seconds,
    plus once when it has no request left. Rank 0 (`reads`) reads the sum as it adds (every
    `interval_s` seconds even when it finished nothing). The key is new per call, so a second
    `generate` on the same engine counts from 0.

    The end is exact without waiting: a rank adds its last requests in the step that finishes
    them (it has none left), before the next step's DP exchange where it reports no work, and the
    generation loop ends only once every rank has reported none; so rank 0's last read
    (`final`) holds every request of the job.

    Each store call runs in a daemon thread waited on for at most `call_s` seconds: a store that
    stopped answering (its server's process stopped: a TCPStore client's `add` then never
    returns) costs one warning and the counter, not the job; the rank goes on to its next
    collective, which fails within the job's timeout if the rank behind the store is gone."""

    def __init__(
        self,
        store: Any,
        key: str,
        total: int,
        reads: bool,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        call_s: float = STORE_CALL_S,
    ):
        self.store, self.key, self.total, self.reads = store, key, total, reads
        self.call_s = call_s
        self.lost = False  # a store call did not answer in call_s: the store is not touched again
        self.interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
        self.clock = clock
        self.pending = 0  # finished here, not yet added
        self.count = 0  # the job's count at rank 0's last read
        self.last = -float("inf")  # when this rank last touched the store

    def update(self, finished: int, done: bool) -> int | None:
        """This rank finished `finished` more requests (`done`: it has none left). Returns the
        job's count when rank 0 read it now, else None."""
        self.pending += finished
        now = self.clock()
        if self.pending and done:  # its last requests: before it reports no work
            return self._add(now)
        if now - self.last >= self.interval_s and (self.pending or self.reads):
            return self._add(now)
        return None

    def final(self) -> int | None:
        """After the generation loop (every rank has added all it finished): add what is left
        and, on rank 0, return the job's count and drop the key."""
        count = self._add(self.clock()) if self.pending or self.reads else None
        if self.reads and not self.lost:
            try:
                self._call(self.store.delete_key, self.key)
            except Exception:  # a store that cannot delete keeps a few bytes
                pass
        return count

    def _add(self, now: float) -> int | None:
        added, self.pending, self.last = self.pending, 0, now
        if self.lost:
            return None
        total = self._call(self.store.add, self.key, added)
        if total is None or not self.reads:
            return None
        self.count = int(total)
        return self.count

    def _call(self, method: Callable, *args: Any) -> Any:
        """method(*args), waited on for call_s (comm.store_call): its result, or None (and the
        store given up on) when it did not answer."""
        answered, value = bounded_call(lambda: method(*args), self.call_s, "speculant-progress")
        if not answered:
            self.lost = True
            log.warning(
                "the job's store did not answer a progress update in %.0f s (the rank holding "
                "it stopped?); the progress bar stops counting the other DP ranks",
                self.call_s,
            )
        return value


class DPCoordinator:
    """Settles each step's plan across DP ranks (graph or eager, padded size, every rank's
    forward) and the requests that move between DP ranks (`shares`). At dp=1 it exchanges nothing.
    It records the padded sizes this rank's decode steps ran (`decode_sizes`, of the last
    `Engine.run` only: a list over an engine's life would grow without bound), how many dummy
    steps it ran (`dummy_steps`) and how many requests moved (`moved`)."""

    def __init__(
        self,
        pctx: ParallelContext,
        graphs: GraphRunner,
        tokens_per_req: int,
        collectives_across_dp: bool = False,
    ):
        self.pctx, self.graphs, self.tokens_per_req = pctx, graphs, tokens_per_req
        # A MoE target's forward has collectives over all ranks: no rank may skip a step.
        self.collectives_across_dp = collectives_across_dp
        self.decode_sizes: list[int] = []
        self.dummy_steps = 0
        self.exchanges = 0
        self.last = StepPlan(all_idle=True)
        self.shares: DPShares | None = None  # the generate call's requests per DP rank
        self.moved = 0  # requests moved between DP ranks (every rank counts every move)

    def agree(
        self, plan: StepPlan, has_work: bool, queue: tuple[int, int, int] = (0, 0, 0)
    ) -> StepPlan:
        """Complete this rank's scheduled `plan` (in place, and returned). `queue` is this rank's
        (unstarted tail, waiting, free rows) after scheduling it: with `shares` set, the moves
        they settle go in `plan.moves` (DPShares.plan_moves)."""
        if plan.shape is None:  # no draft shape chosen: every step at (k, k)
            k = self.tokens_per_req - 1
            plan.shape, plan.tokens_per_req = DraftShape(k, k), k + 1
        mode = DECODE if plan.is_pure_decode else EXTEND if plan.requests else IDLE
        rows = len(plan.decode) if mode == DECODE else len(plan.requests)
        if self.pctx.dp_size == 1:
            plan.all_idle = not has_work
            if mode == DECODE:
                self._pad_own(plan)
            if mode != IDLE:
                self._record(plan, [self._own_forward(plan, mode, plan.num_tokens, rows)])
            self.last = plan
            return plan
        chunk_tokens = plan.num_tokens - len(plan.decode) * plan.tokens_per_req
        exchanged = [mode, chunk_tokens, len(plan.decode), rows, int(has_work), *plan.shape]
        table = self.pctx.all_gather_dp([*exchanged, *queue])
        gathered = [g[: len(exchanged)] for g in table]
        self.exchanges += 1
        self.last = plan
        if not any(work for _, _, _, _, work, _, _ in gathered):
            plan.all_idle = True
            return plan
        if self.shares is not None:
            plan.moves = self.shares.plan_moves([g[len(exchanged) :] for g in table])
            self.moved += sum(len(move.indices) for move in plan.moves)
        if not self.collectives_across_dp:  # dense: each rank its own step (case 2)
            if mode == DECODE:
                self._pad_own(plan)
                self.decode_sizes.append(plan.padded_bs)
            return plan  # no forward needs the others' sizes
        # one draft shape for every rank (their forwards' sizes depend on it): the fewest drafts
        # proposed, and verified (a rank's rows may hold none)
        busy = [g for g in gathered if g[0] != IDLE] or gathered
        plan.shape = DraftShape(min(g[5] for g in busy), min(g[6] for g in busy))
        if plan.shape.draft == 0:
            plan.shape = DraftShape(0, 0)
        T = plan.tokens_per_req = plan.shape.tokens_per_req
        ranks = [(m, chunks + decode * T, r, work) for m, chunks, decode, r, work, _, _ in gathered]
        decode_tokens = [tokens if m == DECODE else 0 for m, tokens, *_ in ranks]
        global_bs = dp_graph_batch_size(decode_tokens, T)
        uniform = dp_can_use_graph(
            [m != EXTEND for m, *_ in ranks],
            global_bs,
            self.graphs.sizes,
            self.graphs.cfg.disable_padding,
        )
        if uniform:
            size = self.graphs.padded_bs(global_bs)
            plan.padded_bs, plan.use_graph, plan.dummy = size, True, mode == IDLE
            self.dummy_steps += plan.dummy
            return self._record(plan, [(size * T, size)] * len(ranks))
        # Another rank extends, or the batch is above the captured sizes: every rank runs its
        # own step eagerly, an idle one a one-row dummy decode step (case 3).
        forwards = [self._forward(m, tokens, r, T) for m, tokens, r, _ in ranks]
        if mode == DECODE:
            plan.padded_bs = len(plan.decode)
        elif mode == IDLE:
            plan.padded_bs, plan.dummy = 1, True
            self.dummy_steps += 1
        return self._record(plan, forwards)

    def _pad_own(self, plan: StepPlan) -> None:
        plan.padded_bs = self.graphs.padded_bs(len(plan.decode))
        plan.use_graph = True

    def _own_forward(self, plan: StepPlan, mode: int, tokens: int, rows: int) -> tuple[int, int]:
        if mode == DECODE:
            return plan.padded_bs * plan.tokens_per_req, plan.padded_bs
        return tokens, rows

    def _forward(self, mode: int, tokens: int, rows: int, T: int) -> tuple[int, int]:
        """(tokens, rows) of a DP rank's eager forward in case 3 (a dummy one: T tokens)."""
        if mode == IDLE:
            return T, 1
        return tokens, rows

    def _record(self, plan: StepPlan, forwards: list[tuple[int, int]]) -> StepPlan:
        """Every DP rank's (tokens, rows) by global rank (TP peers run the same), in the plan."""
        tp = self.pctx.tp_size
        per_rank = [forwards[rank // tp] for rank in range(self.pctx.world_size)]
        plan.sizes = DPStepSizes([t for t, _ in per_rank], [b for _, b in per_rank])
        if plan.padded_bs and (plan.decode or plan.dummy):
            self.decode_sizes.append(plan.padded_bs)
        return plan
