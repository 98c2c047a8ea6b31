"""`ForwardBatch`: one step described by one dataclass, handed whole to backends."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from speculant.kernels.paged_attention import VarlenTiles


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # packed sequences of their own lengths (prefill chunks, verify rows); eager
    DECODE = "decode"  # tokens_per_req tokens per request (1 plain, k+1 verify); graph-capturable


@dataclass
class SamplingInfo:
    """Per-row sampling parameters as device tensors [bs]."""

    temperature: torch.Tensor  # float32; 0 means greedy
    top_k: torch.Tensor  # int64; 0 means off
    top_p: torch.Tensor  # float32; 1 means off
    seed: torch.Tensor  # int64
    min_p: torch.Tensor | None = None  # float32; 0 (or None for every row) means off

    @property
    def is_greedy(self) -> torch.Tensor:
        return self.temperature <= 0

    def take(self, index) -> SamplingInfo:
        """The rows `index` (a slice or an index tensor) of every field."""
        return SamplingInfo(
            self.temperature[index], self.top_k[index], self.top_p[index], self.seed[index],
            None if self.min_p is None else self.min_p[index],
        )  # fmt: skip


@dataclass
class ForwardBatch:
    """bs sequences of query tokens, packed back to back: DECODE has tokens_per_req tokens per
    sequence (row-major [bs * T]); EXTEND has `seq_lens[i]` tokens for sequence i (tokens_per_req
    is 0). Each sequence is one request row attending to its cached prefix and itself."""

    mode: ForwardMode
    bs: int
    tokens_per_req: int
    input_ids: torch.Tensor  # [bs * T] int64
    positions: torch.Tensor  # [bs * T] int64
    req_pool_indices: torch.Tensor  # [bs] int64, rows of req_to_page (sentinel for padding)
    out_cache_loc: torch.Tensor  # [bs * T] int64 flat KV slots the new tokens write
    kv_len: int  # key positions each row attends over (a multiple of the page size)
    sampling: SamplingInfo | None = None
    seq_lens: tuple[int, ...] | None = None  # EXTEND: query tokens of each sequence (host)
    tokens_per_rank: list[int] | None = None  # every rank's tokens this forward (MoE dispatch plan)
    tiles: VarlenTiles | None = None  # EXTEND: a static tile table (piecewise graphs), else made

    @property
    def is_varlen(self) -> bool:
        return self.seq_lens is not None
