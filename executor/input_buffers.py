"""Static device buffers the decode step reads, sized for the largest batch. The host fills the
first bs rows (and padded rows with the sentinel) before each eager run or graph replay."""

from __future__ import annotations

import torch

from speculant.executor.forward_batch import SamplingInfo


class InputBuffers:
    def __init__(self, max_bs: int, tokens_per_req: int, device: str | torch.device):
        self.max_bs, self.tokens_per_req = max_bs, tokens_per_req
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_bs, tokens_per_req, dtype=torch.int64, device=device)
        self.temperature = torch.zeros(max_bs, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.top_p = torch.ones(max_bs, dtype=torch.float32, device=device)
        self.seed = torch.zeros(max_bs, dtype=torch.int64, device=device)

    def fill(
        self,
        rows: list[int],
        input_ids: list[list[int]],
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        seed: list[int],
        padded_bs: int,
        sentinel_row: int,
    ) -> None:
        """Write live rows, then padded rows pointing at the sentinel row (greedy, token 0)."""
        pad = padded_bs - len(rows)
        self.req_pool_indices[:padded_bs].copy_(torch.tensor(rows + [sentinel_row] * pad))
        self.input_ids[:padded_bs].copy_(
            torch.tensor(input_ids + [[0] * self.tokens_per_req] * pad, dtype=torch.int64)
        )
        self.temperature[:padded_bs].copy_(torch.tensor(temperature + [0.0] * pad))
        self.top_k[:padded_bs].copy_(torch.tensor(top_k + [0] * pad))
        self.top_p[:padded_bs].copy_(torch.tensor(top_p + [1.0] * pad))
        self.seed[:padded_bs].copy_(torch.tensor(seed + [0] * pad, dtype=torch.int64))

    def sampling(self, bs: int) -> SamplingInfo:
        return SamplingInfo(self.temperature[:bs], self.top_k[:bs], self.top_p[:bs], self.seed[:bs])
