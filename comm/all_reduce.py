"""The TP all-reduce of small activations in one kernel through symmetric memory (GPUs).

At decode sizes (a few KiB to 2 MiB: bs x (k + 1) rows of the hidden size) an NCCL all-reduce
costs tens of microseconds of fixed latency, twice per layer. torch's symmetric-memory one-shot
all-reduce copies the local rows into a buffer every TP rank can read over NVLink and has each
rank sum all ranks' copies itself: one kernel, a barrier before the reads and after them, no
multicast (which these hosts keep off). With two ranks each sum is a + b in either order, so the
results equal NCCL's bit for bit. Larger tensors (long prefills), other dtypes, or a torch
without the op stay on NCCL; the choice depends only on the tensor's shape and dtype, which
every TP rank shares, so the ranks never disagree about which collective runs.
`SPECULANT_TP_ALL_REDUCE=nccl` keeps every all-reduce on NCCL."""

from __future__ import annotations

import logging
import os
import socket

import torch

from speculant.errors import SpeculantError

log = logging.getLogger("speculant")
MAX_BYTES = 2 << 20  # bs 64 x 4 rows x hidden 4096 in bf16
CHOICES = ("auto", "nccl")


def requested() -> str:
    """SPECULANT_TP_ALL_REDUCE: auto (one-shot where it can run) or nccl."""
    choice = os.environ.get("SPECULANT_TP_ALL_REDUCE", "auto")
    if choice not in CHOICES:
        raise SpeculantError(f"SPECULANT_TP_ALL_REDUCE={choice}: use {' or '.join(CHOICES)}")
    return choice


class OneShotAllReduce:
    """Sums tensors of one dtype, up to `MAX_BYTES`, over `group` in one kernel. Build it on
    every rank of the group at once (the buffer's rendezvous is collective)."""

    def __init__(self, group, dtype: torch.dtype, device: torch.device | str):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.dtype = dtype
        numel = MAX_BYTES // torch.empty((), dtype=dtype).element_size()
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self._op = torch.ops.symm_mem.one_shot_all_reduce_copy_out

    def fits(self, x: torch.Tensor) -> bool:
        """Whether x goes through the one-shot kernel (else NCCL)."""
        return (
            x.dtype == self.dtype
            and x.is_contiguous()
            and 0 < x.numel() <= self.buffer.numel()
            and x.numel() % 8 == 0  # 16-byte vectors for every dtype the op takes
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group, as a new tensor (x is left as it was)."""
        out = torch.empty_like(x)
        slot = self.buffer[: x.numel()].view_as(x)
        return self._op(slot, x, "sum", self.group_name, out)


def build_one_shot(pctx, dtype: torch.dtype, device: str) -> OneShotAllReduce | None:
    """A one-shot all-reduce for pctx's TP group, or None (NCCL) where it cannot run: not CUDA,
    tp = 1, SPECULANT_TP_ALL_REDUCE=nccl, a TP group spread over hosts, or the op or its buffer
    failed on any rank. Every rank takes the same decision (one on NCCL and another on one-shot
    would hang); collective over all ranks."""
    if pctx.tp_size == 1 or pctx.backend != "nccl" or requested() == "nccl":
        return None
    hosts = pctx.all_gather_object(socket.gethostname())
    tp = pctx.tp_size
    if any(len(set(hosts[d * tp : (d + 1) * tp])) > 1 for d in range(pctx.dp_size)):
        return None  # the buffer is shared through CUDA IPC: one host per TP group, all or none
    fast, error = None, None
    try:
        fast = OneShotAllReduce(pctx.tp_group, dtype, device)
        probe = torch.full((64,), float(pctx.tp_rank + 1), dtype=dtype, device=device)
        total = fast(probe)
        expected = pctx.tp_size * (pctx.tp_size + 1) / 2
        if not bool((total == expected).all()):
            error = f"probe sum {total[0].item()} != {expected}"
    except Exception as exc:  # an older torch, no P2P between the GPUs, no symmetric memory
        error = f"{type(exc).__name__}: {exc}"
    # every rank of the TP group (and, harmlessly, of the job) must make the same choice
    errors = [e for e in pctx.all_gather_object(error) if e is not None]
    if errors:
        if pctx.rank == 0:
            log.warning("TP all-reduce stays on NCCL: one-shot unavailable (%s)", errors[0])
        return None
    return fast
