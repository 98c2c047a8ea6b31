"""Data parallelism: each DP rank has its own scheduler, requests and KV cache.

Global rank 0 holds the user's prompts: it sends them to every rank, each DP rank takes its
share (balanced by tokens), runs it, and rank 0 gathers the outputs back in input order.

The per-step protocol. Every step each DP rank sends (mode, tokens, requests, has_work): mode is
PREFILL (one eager forward over its newly admitted prompts, `tokens` of them padded), DECODE (its
running requests, `tokens` = requests * (k + 1)) or IDLE. From the same table every rank derives
what every rank runs:
1. no rank has work: the generation loop ends;
2. every rank decodes or is idle and the global batch ceil(max decode tokens / (k + 1)) fits the
   captured sizes: every rank runs that size padded to a captured one (a graph replays), an idle
   rank on sentinel rows only;
3. otherwise each rank runs its own step eagerly: its prefill, or its decode batch unpadded; an
   idle rank sits the step out, except with a MoE target, where it runs a one-row dummy decode
   step, because expert dispatches are collectives over every rank.
So with a MoE target every rank runs exactly one target forward per step whenever any rank does,
in the same order, and knows every rank's token count (`DPStepSizes`, handed to the model
through the graph runner): the expert dispatches are planned from it, with no collective of
their own, so an eager forward and a replayed graph make the same collectives. The drafter's
forwards are dense and need no partner."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from speculant.comm.groups import ParallelContext
from speculant.executor.cuda_graph import (
    DPStepSizes,
    GraphRunner,
    dp_can_use_graph,
    dp_graph_batch_size,
)
from speculant.executor.request import Request, RequestOutput

if TYPE_CHECKING:
    from speculant.executor.engine import Engine

IDLE, DECODE, PREFILL = 0, 1, 2  # what a DP rank runs in a step, as exchanged


def assign_requests(costs: Sequence[int], dp: int) -> list[list[int]]:
    """Request indices per DP rank, balanced by cost (tokens): the costliest request goes to the
    least loaded rank first (ties to the lower rank); each rank keeps arrival order. A rank may
    get none when there are fewer requests than ranks."""
    loads, shares = [0] * dp, [[] for _ in range(dp)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(dp), key=lambda r: (loads[r], r))
        loads[rank] += costs[index]
        shares[rank].append(index)
    return [sorted(share) for share in shares]


def request_cost(request: Request) -> int:
    """Tokens a request puts through the model: its prompt and its longest output."""
    return len(request.prompt_ids) + request.max_new_tokens


@dataclass
class StepPlan:
    """What this rank runs in one step, as agreed with the other DP ranks."""

    decode_bs: int  # rows the decode step runs (live rows, then sentinel rows); 0: no decode
    allow_graph: bool  # a graph may replay (every DP rank decodes or idles at this size)
    all_idle: bool  # no DP rank has work left: the generation loop ends
    sizes: DPStepSizes | None = None  # every rank's target forward this step (None: none runs)


class DPCoordinator:
    """Agrees each step's batch size across DP ranks. At dp=1 it exchanges nothing and plans
    exactly what one rank would run. It records the uniform sizes it ran (`uniform_sizes`) and
    how many dummy batches this rank ran (`dummy_steps`), so tests can compare ranks."""

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
        self.uniform_sizes: list[int] = []
        self.dummy_steps = 0
        self.exchanges = 0
        self.last = StepPlan(0, True, True)

    def plan(
        self, num_prefill: int, num_decode: int, has_work: bool, prefill_tokens: int = 0
    ) -> StepPlan:
        """num_prefill requests to prefill (`prefill_tokens` tokens in the one forward) or else
        num_decode to decode, on this rank; the plan's sizes are handed to the graph runner."""
        T = self.tokens_per_req
        if self.pctx.dp_size == 1:
            bs = self.graphs.padded_bs(num_decode) if num_decode else 0
            self.last = StepPlan(bs, True, not has_work)
            if num_prefill or bs:
                forward = (prefill_tokens, num_prefill) if num_prefill else (bs * T, bs)
                self._announce(self.last, [forward])
            return self.last
        mode = PREFILL if num_prefill else DECODE if num_decode else IDLE
        tokens = prefill_tokens if mode == PREFILL else num_decode * T
        ranks = self.pctx.all_gather_dp([mode, tokens, num_prefill or num_decode, int(has_work)])
        self.exchanges += 1
        self.last = self._agree(mode, ranks)
        return self.last

    def _agree(self, mode: int, ranks: list[list[int]]) -> StepPlan:
        """This rank's plan from every DP rank's (mode, tokens, requests, has_work)."""
        if not any(work for *_, work in ranks):
            return StepPlan(0, False, True)
        T = self.tokens_per_req
        decode_tokens = [tokens if m == DECODE else 0 for m, tokens, *_ in ranks]
        global_bs = dp_graph_batch_size(decode_tokens, T)
        uniform = dp_can_use_graph(
            [m != PREFILL for m, *_ in ranks],
            global_bs,
            self.graphs.sizes,
            self.graphs.cfg.disable_padding,
        )
        if uniform:
            size = self.graphs.padded_bs(global_bs)
            self.uniform_sizes.append(size)
            self.dummy_steps += mode == IDLE
            return self._announce(StepPlan(size, True, False), [(size * T, size)] * len(ranks))
        # Another rank prefills, or the batch is above the captured sizes: every rank runs its
        # own step eagerly (see the module docstring, case 3).
        forwards = [self._own_forward(m, tokens, reqs) for m, tokens, reqs, _ in ranks]
        bs = forwards[self.pctx.dp_rank][1]
        self.dummy_steps += mode == IDLE and bs > 0
        return self._announce(StepPlan(0 if mode == PREFILL else bs, False, False), forwards)

    def _own_forward(self, mode: int, tokens: int, num_requests: int) -> tuple[int, int]:
        """(tokens, bs) of a DP rank's forward in a step of case 3: its prefill or decode batch;
        idle, a one-row dummy decode step with a MoE target, else nothing."""
        if mode == IDLE:
            return (self.tokens_per_req, 1) if self.collectives_across_dp else (0, 0)
        return tokens, num_requests

    def _announce(self, plan: StepPlan, forwards: list[tuple[int, int]]) -> StepPlan:
        """Record every DP rank's (tokens, bs) by global rank (TP peers run the same) and hand
        them to the graph runner, which passes the token counts to the model."""
        tp = self.pctx.tp_size
        per_rank = [forwards[rank // tp] for rank in range(self.pctx.world_size)]
        plan.sizes = DPStepSizes([t for t, _ in per_rank], [b for _, b in per_rank])
        self.graphs.set_step_sizes(plan.sizes)
        return plan


def generate_distributed(
    engine: Engine,
    prompts: Sequence[str | Sequence[int]] | None,
    sampling_params,
    *,
    use_tqdm: bool = False,
    on_output: Callable[[RequestOutput], None] | None = None,
) -> list[RequestOutput]:
    """`Engine.generate` over every rank of the job: rank 0's prompts and params count (the
    others may pass None). Rank 0 returns every output in input order and passes each to
    `on_output` in the step it finishes, on whichever DP rank (one small gather per step, only
    when rank 0 has an `on_output`): nothing finished is lost to a later interrupt or rank
    failure. Other ranks return their own DP rank's outputs."""
    pctx = engine.pctx
    prompts, sampling_params, stream = pctx.broadcast_object(
        (prompts, sampling_params, on_output is not None)
    )
    requests = engine.make_requests(prompts, sampling_params)  # every rank checks every prompt
    share = assign_requests([request_cost(r) for r in requests], pctx.dp_size)[pctx.dp_rank]
    emitted: set[int] = set()

    def stream_to_rank0(finished: list[RequestOutput]) -> None:
        parts = pctx.gather_object(finished if pctx.tp_rank == 0 else None)
        for out in (out for part in parts or [] if part for out in part):
            if out.index not in emitted:
                emitted.add(out.index)
                on_output(out)

    local = engine.run(
        [requests[i] for i in share],
        use_tqdm=use_tqdm and pctx.rank == 0,
        on_step=stream_to_rank0 if stream else None,
    )
    gathered = pctx.gather_object(local if pctx.tp_rank == 0 else None)
    if gathered is None:
        return local
    outputs = sorted((out for part in gathered if part for out in part), key=lambda o: o.index)
    indices = [out.index for out in outputs]
    if indices != list(range(len(requests))):
        raise RuntimeError(f"DP ranks returned outputs {indices} for {len(requests)} requests")
    if on_output is not None:  # streamed already; this catches nothing unless a step was missed
        for out in outputs:
            if out.index not in emitted:
                on_output(out)
    return outputs
