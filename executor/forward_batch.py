"""`ForwardBatch`: one step described by one dataclass, handed whole to backends."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    PREFILL = "prefill"  # eager, ragged prompts padded to the longest new-token count
    DECODE = "decode"  # tokens_per_req tokens per request (1 plain, k+1 verify); graph-capturable


@dataclass
class SamplingInfo:
    """Per-row sampling parameters as device tensors [bs]."""

    temperature: torch.Tensor  # float32; 0 means greedy
    top_k: torch.Tensor  # int64; 0 means off
    top_p: torch.Tensor  # float32; 1 means off
    seed: torch.Tensor  # int64

    @property
    def is_greedy(self) -> torch.Tensor:
        return self.temperature <= 0


@dataclass
class ForwardBatch:
    """bs requests with tokens_per_req query tokens each, laid out row-major ([bs * T])."""

    mode: ForwardMode
    bs: int
    tokens_per_req: int
    input_ids: torch.Tensor  # [bs * T] int64
    positions: torch.Tensor  # [bs * T] int64
    req_pool_indices: torch.Tensor  # [bs] int64, rows of req_to_page (sentinel for padding)
    out_cache_loc: torch.Tensor  # [bs * T] int64 flat KV slots the new tokens write
    kv_len: int  # key positions each row attends over (a multiple of the page size)
    sampling: SamplingInfo | None = None
    num_new_tokens: torch.Tensor | None = None  # [bs] valid query tokens per row (prefill)
