"""Moving MoE tokens to the rank that holds their experts, and their outputs back.

A `MoeDispatcher` turns this rank's tokens and their top-k routing into per-local-expert token
buffers (`ExpertTokens`: [num_local_experts, capacity, H] plus the number of valid rows of each
expert; rows past the count are padding and are never read back), and `combine` turns the experts'
outputs in that layout into each token's weighted sum. Shapes depend only on the token count and
the configured per-rank limit, never on the routing, so dispatch and combine can be captured in a
CUDA graph. Expert e lives on EP rank e // (num_experts / ep_size); the EP group is every rank.

Every forward is planned from every EP rank's token count, handed to `begin_forward` with the
forward (the step plan's `DPStepSizes`, from the DP exchange in executor/dp.py; uniform dummies
while capturing, since a graph bakes the plan in). Without them (a model used on its own)
`begin_forward` asks the other ranks with a host all-reduce, which cannot run in a graph.

Implementations: `LocalDispatcher` (one EP rank), `AllToAllDispatcher` (all_to_all_single over
fixed per-rank blocks; gloo on CPU, NCCL on GPU) and comm/deepep.py's `DeepEPDispatcher`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from speculant.errors import SpeculantError

LIMIT_OPTION = "--moe-max-tokens-per-rank"


@dataclass
class ExpertTokens:
    """Tokens grouped by local expert: rows 0..counts[e]-1 of hidden[e] are real, the rest
    padding (arbitrary values; their outputs are ignored)."""

    hidden: torch.Tensor  # [num_local_experts, capacity, H]
    counts: torch.Tensor  # [num_local_experts] int32
    max_rows: int | None = None  # a host-known bound on sum(counts) (None: every row may be real)


@dataclass
class ExpertSlots:
    """Where each token's top-k choices sit in the flattened expert buffers, for the combine."""

    rows: torch.Tensor  # [N * k] int64 rows of [num_local_experts * capacity] (0 where invalid)
    valid: torch.Tensor  # [N * k] bool: the choice names an expert of this rank
    weights: torch.Tensor  # [N, k] float32 router weights


def is_capturing() -> bool:
    """True inside CUDA-graph capture, where no host sync or host-side collective may run."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def pack_by_expert(
    hidden: torch.Tensor, local_ids: torch.Tensor, num_local: int, capacity: int
) -> tuple[ExpertTokens, torch.Tensor, torch.Tensor]:
    """Copy each token [N, H] into the rows of its local experts (`local_ids` [N, k], -1: not on
    this rank), in token order within an expert. `capacity` must be >= N (a token picks an expert
    at most once). Returns the buffers, each choice's flat row [N * k] and its validity [N * k].
    Sort-based and of fixed shape: capturable."""
    n, k = local_ids.shape
    flat = local_ids.reshape(-1).long()
    valid = flat >= 0
    expert = torch.where(valid, flat, num_local)  # invalid choices sort after every expert
    order = torch.argsort(expert, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(expert)
    slot[order] = torch.arange(n * k, device=flat.device) - starts[expert[order]]
    spare = num_local * capacity  # one extra row takes every invalid choice
    rows = torch.where(valid, expert * capacity + slot, spare)
    width = hidden.shape[-1]
    buffer = hidden.new_empty(spare + 1, width)
    buffer.index_copy_(0, rows, hidden.unsqueeze(1).expand(n, k, width).reshape(n * k, width))
    tokens = ExpertTokens(
        buffer[:spare].view(num_local, capacity, width),
        counts[:num_local].to(torch.int32),
        max_rows=n * k,
    )
    return tokens, torch.where(valid, rows, 0), valid


def combine_weighted(expert_out: torch.Tensor, slots: ExpertSlots) -> torch.Tensor:
    """Each token's sum over its valid choices of weight * expert output, in float32, returned in
    the experts' dtype: [N, H]."""
    n, k = slots.weights.shape
    hidden = expert_out.shape[-1]
    picked = expert_out.reshape(-1, hidden).index_select(0, slots.rows).float()
    weighted = picked * slots.weights.reshape(-1, 1)
    weighted = torch.where(slots.valid.unsqueeze(1), weighted, 0.0)  # never 0 * NaN padding
    return weighted.view(n, k, hidden).sum(1).to(expert_out.dtype)


class MoeDispatcher(ABC):
    """Token movement for the MoE layers of one model (one instance shared by all its layers).

    `begin_forward(num_tokens)` runs once per model forward and fixes how many dispatches of at
    most `chunk_tokens` tokens each layer makes; every EP rank makes the same number, because each
    dispatch is a collective."""

    def __init__(
        self,
        num_experts: int,
        ep_size: int,
        ep_rank: int,
        max_tokens_per_rank: int | None,
        cpu_group: Any = None,
    ):
        if num_experts % ep_size:
            raise SpeculantError(
                f"num_experts={num_experts} is not divisible by the {ep_size} expert-parallel "
                "ranks (every rank holds experts); run a world size that divides it"
            )
        if max_tokens_per_rank is not None and max_tokens_per_rank < 1:
            raise SpeculantError(
                f"max_tokens_per_rank={max_tokens_per_rank} must be positive; fix {LIMIT_OPTION}"
            )
        self.num_experts, self.ep_size, self.ep_rank = num_experts, ep_size, ep_rank
        self.num_local_experts = num_experts // ep_size
        self.first_expert = ep_rank * self.num_local_experts
        self.max_tokens_per_rank = max_tokens_per_rank
        self.cpu_group = cpu_group  # gloo group over the EP ranks (None: the default group)
        self.num_chunks, self.chunk_tokens = 1, max_tokens_per_rank or 1
        self.most_tokens = 0  # the largest token count of any EP rank in the planned forward
        self.num_forwards = 0  # forwards planned (eagerly run or captured) on this rank

    def begin_forward(self, num_tokens: int, tokens_per_rank: list[int] | None = None) -> None:
        """Plan this forward's dispatches: ceil(max tokens over EP ranks / limit) chunks.
        `tokens_per_rank`: every EP rank's token count in this forward, the same list on every
        rank (None: ask the other ranks)."""
        self.most_tokens = most = self.max_tokens_over_ranks(num_tokens, tokens_per_rank)
        limit = self.max_tokens_per_rank or max(most, 1)
        self.num_chunks, self.chunk_tokens = max(1, -(-most // limit)), limit

    def max_tokens_over_ranks(self, num_tokens: int, planned: list[int] | None = None) -> int:
        """The largest token count of any EP rank this forward, from `tokens_per_rank` (checked
        against this rank's own count), else by a host-side all-reduce (never inside a graph)."""
        self.num_forwards += 1
        if self.ep_size == 1:
            return num_tokens
        if planned is not None:
            if len(planned) != self.ep_size:
                raise ValueError(f"{len(planned)} token counts for {self.ep_size} EP ranks")
            if planned[self.ep_rank] != num_tokens:
                raise SpeculantError(
                    f"this forward has {num_tokens} tokens but the step's per-rank token counts "
                    f"{planned} give EP rank {self.ep_rank} {planned[self.ep_rank]}; every rank "
                    "must plan a forward from the same counts (a stale or non-uniform plan)"
                )
            return max(planned)
        if is_capturing():
            raise SpeculantError(
                "capturing an expert-parallel forward needs every rank's token count; call "
                "pass tokens_per_rank (the graph runner captures with uniform dummies)"
            )
        most = torch.tensor([num_tokens], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return int(most.item())

    def check_tokens(self, num_tokens: int) -> None:
        limit = self.max_tokens_per_rank
        if limit is not None and num_tokens > limit:
            raise SpeculantError(
                f"{num_tokens} tokens in one MoE dispatch exceed max_tokens_per_rank={limit}; "
                f"raise {LIMIT_OPTION} to at least {num_tokens}"
            )

    def replay_hooks(self) -> list:
        """ReplayHooks (executor/cuda_graph.py) this dispatcher needs around graph replays."""
        return []

    @abstractmethod
    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[ExpertTokens, Any]:
        """hidden [T, H], topk_ids [T, k] int64 global expert ids, topk_weights [T, k] float32
        -> this rank's experts' tokens and a handle for `combine`."""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        """expert_out in the layout `dispatch` returned -> [T, H] weighted sums, in the order of
        the dispatched tokens."""


class LocalDispatcher(MoeDispatcher):
    """One EP rank: every expert is local; `max_tokens_per_rank` (optional) only bounds the
    buffer size of one dispatch ([num_experts, tokens, H])."""

    def __init__(self, num_experts: int, max_tokens_per_rank: int | None = None):
        super().__init__(num_experts, 1, 0, max_tokens_per_rank)

    def dispatch(self, hidden, topk_ids, topk_weights):
        self.check_tokens(hidden.shape[0])
        tokens, rows, valid = pack_by_expert(hidden, topk_ids, self.num_experts, hidden.shape[0])
        return tokens, ExpertSlots(rows, valid, topk_weights.float())

    def combine(self, expert_out, handle: ExpertSlots):
        return combine_weighted(expert_out, handle)


@dataclass
class AllToAllHandle:
    """What `AllToAllDispatcher.combine` needs from its dispatch."""

    slots: ExpertSlots  # where the received tokens' choices sit in this rank's expert buffers
    num_tokens: int  # this rank's dispatched tokens T
    block: int  # rows per rank in the exchanged buffers (M)


class AllToAllDispatcher(MoeDispatcher):
    """Expert parallelism over torch.distributed `all_to_all_single` with fixed-size blocks.

    Dispatch sends every EP rank one [M, H] block holding this rank's tokens at their own row
    index, and an [M, 2k] float32 block of their top-k ids and weights in which the choices not
    owned by that rank, and all padding rows, carry id -1. M is the most tokens any rank has in
    this dispatch (from `begin_forward`: the same on every rank, bs * (k + 1) in a graph captured
    at bs), or `max_tokens_per_rank` for a dispatch made outside a planned forward. The receiver
    packs the [ep_size * M] rows it got by local expert (capacity ep_size * M, the DeepEP
    low-latency layout). Combine sends back each source's rows summed over this rank's experts;
    the source adds the ep_size partial sums. No shape depends on the routing, so the step stays
    capturable."""

    def __init__(
        self,
        num_experts: int,
        ep_size: int,
        ep_rank: int,
        max_tokens_per_rank: int,
        group: Any = None,
        cpu_group: Any = None,
    ):
        super().__init__(num_experts, ep_size, ep_rank, max_tokens_per_rank, cpu_group)
        self.group = group  # device-backend group over the EP ranks (None: the default group)
        self.block_tokens = max_tokens_per_rank  # M

    def begin_forward(self, num_tokens: int, tokens_per_rank: list[int] | None = None) -> None:
        super().begin_forward(num_tokens, tokens_per_rank)
        self.block_tokens = max(1, min(self.most_tokens, self.chunk_tokens))

    def dispatch(self, hidden, topk_ids, topk_weights):
        num_tokens, k = topk_ids.shape
        self.check_tokens(num_tokens)
        ranks, block = self.ep_size, self.block_tokens
        if num_tokens > block:
            raise SpeculantError(
                f"{num_tokens} tokens in one dispatch exceed this forward's block of {block} rows "
                "per rank; plan the forward with begin_forward from every rank's count"
            )
        owner = topk_ids // self.num_local_experts
        dest = torch.arange(ranks, device=topk_ids.device).view(ranks, 1, 1)
        ids_for = torch.where(owner.unsqueeze(0) == dest, topk_ids.unsqueeze(0), -1)  # [R, T, k]
        send_meta = torch.full(
            (ranks, block, 2 * k), -1.0, dtype=torch.float32, device=hidden.device
        )
        send_meta[:, :num_tokens, :k] = ids_for.float()  # exact: ids < 2**24
        send_meta[:, :num_tokens, k:] = topk_weights.float()
        send_x = hidden.new_zeros(ranks, block, hidden.shape[-1])
        send_x[:, :num_tokens] = hidden
        recv_x, recv_meta = torch.empty_like(send_x), torch.empty_like(send_meta)
        dist.all_to_all_single(recv_x, send_x, group=self.group)
        dist.all_to_all_single(recv_meta, send_meta, group=self.group)
        recv_ids = recv_meta[..., :k].reshape(ranks * block, k).long()
        local_ids = torch.where(recv_ids >= 0, recv_ids - self.first_expert, -1)
        tokens, rows, valid = pack_by_expert(
            recv_x.view(ranks * block, -1), local_ids, self.num_local_experts, ranks * block
        )
        weights = recv_meta[..., k:].reshape(ranks * block, k)
        return tokens, AllToAllHandle(ExpertSlots(rows, valid, weights), num_tokens, block)

    def combine(self, expert_out, handle: AllToAllHandle):
        partial = combine_weighted(expert_out, handle.slots)  # [R * M, H] per source rank
        back = torch.empty_like(partial)
        dist.all_to_all_single(back, partial, group=self.group)
        back = back.view(self.ep_size, handle.block, -1)[:, : handle.num_tokens]
        return back.float().sum(0).to(expert_out.dtype)
