"""Static device buffers the decode step reads, sized for the largest batch (the host fills the
first bs rows, and padded rows with the sentinel, before each eager run or graph replay), and
the host buffers its packed results are copied back into."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculant.executor.forward_batch import SamplingInfo


class InputBuffers:
    """The step's per-row inputs in two packed device tensors (integers, floats), so the host
    writes them with two copies per step instead of one per field; every field is a contiguous
    slice of its pack (the kernels index them as flat arrays)."""

    def __init__(self, max_bs: int, tokens_per_req: int, device: str | torch.device):
        self.max_bs, self.tokens_per_req = max_bs, tokens_per_req
        n = max_bs
        self._ints = torch.zeros((3 + tokens_per_req) * n, dtype=torch.int64, device=device)
        self._floats = torch.zeros(3 * n, dtype=torch.float32, device=device)
        self.req_pool_indices = self._ints[:n]
        self.top_k = self._ints[n : 2 * n]
        self.seed = self._ints[2 * n : 3 * n]
        self.input_ids = self._ints[3 * n :].view(n, tokens_per_req)
        self.temperature = self._floats[:n]
        self.top_p = self._floats[n : 2 * n]
        self.top_p.fill_(1.0)
        self.min_p = self._floats[2 * n :]
        # host copies of the two packs, kept between steps: a step rewrites only the rows it
        # and the step before it used. Converting a list of every row each step cost a bs-1
        # step 35 / 121 us at 64 / 256 rows of one token, 51 / 217 us at 8 tokens a row (a
        # 2-core CPU); this fill 4-8 us there
        self._host_ints = torch.zeros_like(self._ints, device="cpu")
        self._host_floats = torch.zeros_like(self._floats, device="cpu")
        self._ints_np, self._floats_np = self._host_ints.numpy(), self._host_floats.numpy()
        self._floats_np[n : 2 * n] = 1.0
        self._used = 0  # rows the last fill wrote (its padded size)

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
        min_p: list[float] | None = None,
    ) -> None:
        """Write live rows, then padded rows pointing at the sentinel row (greedy, token 0); rows
        past padded_bs are zeroed (no step of this size reads them), as if the whole packs were
        written afresh (tests/test_input_buffers.py)."""
        n, T, live = self.max_bs, self.tokens_per_req, len(rows)
        ints, floats = self._ints_np, self._floats_np
        end = max(padded_bs, self._used)  # rows this fill must write: its own and stale ones
        ints[:live] = rows
        ints[live:padded_bs] = sentinel_row
        ints[padded_bs:end] = 0
        ints[n : n + live] = top_k
        ints[n + live : n + end] = 0
        ints[2 * n : 2 * n + live] = seed
        ints[2 * n + live : 2 * n + end] = 0
        base = 3 * n
        if T == 1:
            ints[base : base + live] = [ids[0] if ids else 0 for ids in input_ids]
        else:
            flat: list[int] = []
            for ids in input_ids:  # a row holding fewer drafts than T - 1 (adaptive): zeros after
                flat += ids[:T]
                flat += [0] * (T - len(ids))
            ints[base : base + live * T] = flat
        ints[base + live * T : base + end * T] = 0
        floats[:live] = temperature
        floats[live:end] = 0.0
        floats[n : n + live] = top_p
        floats[n + live : n + end] = 1.0
        floats[2 * n : 2 * n + live] = 0.0 if min_p is None else min_p  # none given: off
        floats[2 * n + live : 2 * n + end] = 0.0
        self._used = padded_bs
        # from pageable memory: non-blocking copies from pinned staging measured no faster here
        self._ints.copy_(self._host_ints)
        self._floats.copy_(self._host_floats)

    def sampling(self, bs: int) -> SamplingInfo:
        return SamplingInfo(
            self.temperature[:bs], self.top_k[:bs], self.top_p[:bs], self.seed[:bs],
            self.min_p[:bs],
        )  # fmt: skip


@dataclass
class ReadResults:
    """A step's results already on the host (a synchronous read-back)."""

    rows: list[list[int]]

    def wait(self) -> list[list[int]]:
        return self.rows


@dataclass
class PendingResults:
    """A step's packed results on their way to the host."""

    host: torch.Tensor  # [bs, L + T + k + 1]: log-probability columns (L, often 0), then the rest
    copied: torch.cuda.Event | None  # recorded after the copy (None: the copy was synchronous)

    def wait(self) -> list[list[int]]:
        """Per row: the log-probability columns when computed (executor/logprobs.py),
        tokens (T), drafts (k), accept_len; waits for this copy only, not for steps launched
        after it."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


class Readback:
    """Two host buffers (pinned on CUDA) that steps' packed results are copied into without
    blocking, in turn: one step's results can be read while the next step's are on their way
    (a buffer is reused two launches later, after its results were read)."""

    def __init__(self, max_bs: int, device: str | torch.device):
        self.max_bs, self.cuda = max_bs, torch.device(device).type == "cuda"
        self.buffers: list[torch.Tensor] = []
        self.turn = 0

    def start(self, packed: torch.Tensor) -> PendingResults:
        """Start copying `packed` [bs, width] (bs <= max_bs) to the host."""
        bs, width = packed.shape
        first = self.buffers[0] if self.buffers else None
        if first is None or first.numel() < self.max_bs * width or first.dtype != packed.dtype:
            self.buffers = [
                torch.empty(self.max_bs * width, dtype=packed.dtype, pin_memory=self.cuda)
                for _ in range(2)
            ]
        host = self.buffers[self.turn][: bs * width].view(bs, width)
        self.turn ^= 1
        host.copy_(packed, non_blocking=self.cuda)
        copied = None
        if self.cuda:
            copied = torch.cuda.Event()
            copied.record()
        return PendingResults(host, copied)
