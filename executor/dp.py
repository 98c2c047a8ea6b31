"""Data parallelism: each DP rank has its own scheduler, requests and KV cache.

Global rank 0 holds the user's prompts: it sends them to every rank, each DP rank takes its
share (balanced by tokens), runs it, and rank 0 gathers the outputs back in input order. Every
step the DP ranks exchange what they are about to run (the cross-DP collective): when every rank
decodes or is idle, all of them run the same batch size (the size a graph replays), and an idle
rank runs a dummy batch of sentinel rows, so collectives inside the step stay aligned. The
generation loop ends when the exchange shows no rank with work left."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from speculant.comm.groups import ParallelContext
from speculant.executor.cuda_graph import GraphRunner, dp_can_use_graph, dp_graph_batch_size
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

    def plan(self, num_prefill: int, num_decode: int, has_work: bool) -> StepPlan:
        """num_prefill requests to prefill or else num_decode to decode, on this rank."""
        if self.pctx.dp_size == 1:
            bs = self.graphs.padded_bs(num_decode) if num_decode else 0
            self.last = StepPlan(bs, True, not has_work)
            return self.last
        mode = PREFILL if num_prefill else DECODE if num_decode else IDLE
        tokens = num_decode * self.tokens_per_req if mode == DECODE else 0
        ranks = self.pctx.all_gather_dp([mode, tokens, int(has_work)])
        self.exchanges += 1
        self.last = self._agree(mode, num_decode, ranks)
        return self.last

    def _agree(self, mode: int, num_decode: int, ranks: list[list[int]]) -> StepPlan:
        if not any(work for _, _, work in ranks):
            return StepPlan(0, False, True)
        if mode == PREFILL:
            return StepPlan(0, False, False)
        global_bs = dp_graph_batch_size([tokens for _, tokens, _ in ranks], self.tokens_per_req)
        uniform = dp_can_use_graph(
            [m != PREFILL for m, _, _ in ranks],
            global_bs,
            self.graphs.sizes,
            self.graphs.cfg.disable_padding,
        )
        if uniform:
            size = self.graphs.padded_bs(global_bs)
            self.uniform_sizes.append(size)
            self.dummy_steps += mode == IDLE
            return StepPlan(size, True, False)
        # Another rank prefills, or the batch is above the captured sizes: run eagerly at this
        # rank's own size. A dense model has no cross-DP collective inside the step, so an
        # idle rank sits this one out; with a MoE target it runs one eager dummy row.
        if mode == IDLE and self.collectives_across_dp:
            self.dummy_steps += 1
            return StepPlan(1, False, False)
        return StepPlan(num_decode, False, False)


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
    `on_output` once all have finished; other ranks return their own DP rank's outputs."""
    pctx = engine.pctx
    prompts, sampling_params = pctx.broadcast_object((prompts, sampling_params))
    requests = engine.make_requests(prompts, sampling_params)  # every rank checks every prompt
    share = assign_requests([request_cost(r) for r in requests], pctx.dp_size)[pctx.dp_rank]
    local = engine.run([requests[i] for i in share], use_tqdm=use_tqdm and pctx.rank == 0)
    gathered = pctx.gather_object(local if pctx.tp_rank == 0 else None)
    if gathered is None:
        return local
    outputs = sorted((out for part in gathered if part for out in part), key=lambda o: o.index)
    indices = [out.index for out in outputs]
    if indices != list(range(len(requests))):
        raise RuntimeError(f"DP ranks returned outputs {indices} for {len(requests)} requests")
    if on_output is not None:
        for out in outputs:
            on_output(out)
    return outputs
