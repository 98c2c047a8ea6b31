"""The `ParallelContext`: which DP group and TP rank this process is, passed explicitly to every
layer (there are no module-level process groups)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from speculant.errors import SpeculantError


@dataclass
class ParallelContext:
    """Ranks and groups of one process. TP is innermost: global rank = dp_rank * tp + tp_rank."""

    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    tp_group: Any = None
    dp_group: Any = None
    cpu_group: Any = None  # gloo group over all ranks for host-side objects

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank

    @classmethod
    def single(cls) -> ParallelContext:
        return cls()

    def all_reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the TP group in place (identity at tp=1)."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_tp(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate the TP shards of `x` along `dim` (identity at tp=1)."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)


def check_world(world_size: int, tp: int, dp: int) -> None:
    if tp < 1 or dp < 1 or world_size != tp * dp:
        raise SpeculantError(
            f"world size {world_size} != dp {dp} x tp {tp}; launch dp*tp ranks or change --tp/--dp"
        )
