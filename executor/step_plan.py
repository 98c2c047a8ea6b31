"""The step as one value: `StepPlan` is what the scheduler decides a step runs (decode rows,
prefill chunks, preempted requests) and what the DP exchange settles (graph or eager, padded
size, every rank's forward). The engine hands it whole to the runner; nothing about a step
travels any other way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from speculant.executor.request import Request
from speculant.executor.speculation import DraftShape


class DPStepSizes(NamedTuple):
    """Every rank's target forward in one step, by global rank: its tokens and its batch size
    (the same lists on every rank, from the DP exchange). The MoE dispatches are planned from the
    token counts, and a graph bakes in the sizes it was captured with."""

    tokens_per_rank: list[int]
    bs_per_rank: list[int]


class Move(NamedTuple):
    """Requests (indices) that DP rank `src` has not started and DP rank `dst` runs instead
    (executor/dp.DPShares)."""

    src: int
    dst: int
    indices: list[int]


@dataclass
class Chunk:
    """Prefill of tokens [start, start + len(tokens)) of a request's context (its prompt, and
    after a preemption its output so far). `last` ends the context: the step samples the token
    after it, or, for a resumed request, takes the one it had already emitted (`successor`)."""

    request: Request
    start: int
    tokens: list[int]
    last: bool
    successor: int | None  # the known token after the chunk (None: sample it)
    first: bool  # the first chunk of this residency (after any pages from the prefix cache)


@dataclass
class StepPlan:
    """One step. Decode rows verify k + 1 tokens each; chunks extend; both share one target
    forward (a pure decode step replays a graph of `padded_bs` rows when `use_graph`)."""

    decode: list[Request] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    tokens_per_req: int = 1  # a decode row's tokens: shape.verify + 1 once the shape is set
    shape: DraftShape | None = None  # drafts verified and proposed (the engine's choice)
    rests: bool = False  # the drafter rests: no drafter work at all (executor/speculation.py)
    padded_bs: int = 0  # rows the decode step runs (live, then sentinel rows); 0: no decode graph
    use_graph: bool = False
    dummy: bool = False  # this rank has no work but runs a padded dummy step for its DP peers
    all_idle: bool = False  # no DP rank has work left: the generation loop ends
    sizes: DPStepSizes | None = None  # every rank's forward this step (None: this rank only)
    # requests moved between DP ranks after this step (the next one schedules them)
    moves: list[Move] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Target tokens of the step (before graph padding)."""
        return len(self.decode) * self.tokens_per_req + sum(len(c.tokens) for c in self.chunks)

    @property
    def is_pure_decode(self) -> bool:
        return bool(self.decode) and not self.chunks

    @property
    def requests(self) -> list[Request]:
        return self.decode + [c.request for c in self.chunks]
