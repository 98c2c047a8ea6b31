"""The sampler's exponential race in one read of the probabilities: per row the index of the
largest p(t) / E(t), E(t) the exponential (executor/sampling.py `exponential_of_hash`) of the
32-bit hash of the row's key (seed, position, stream; `_key`) and token id t. torch's reference
(executor/sampling.py `race`) builds [rows, vocab] int64 hashes, their exponentials and the
ratios, a dozen passes over tensors twice the probabilities' size, before its argmax.

Here a row is split over `parts` programs (enough for the GPU at small batches), each hashing,
dividing and reducing its columns in registers to its best ratio and index; torch then takes the
first part holding the largest (so ties go to the lower index, as torch's argmax). The hash is
the reference's in uint32 arithmetic (wrapping multiplies, logical shifts), and w the same
float32 value; only the logarithm (and a fused multiply-add in the series) may differ from
torch's in its last bit."""

from __future__ import annotations

import functools

import torch

from speculant.kernels.runtime import tl, triton

BLOCK = 2048  # columns a program reads at a time
WARPS = 4


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (executor/sampling.py `_mix32`)."""
    x = x ^ (x >> 16)
    x = x * tl.full([1], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([1], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _part_kernel(
    p_ptr, stride_p, key_ptr, ids_ptr, stride_ids, vocab, part_chunks, v_ptr, i_ptr,
    BLOCK: tl.constexpr, HAS_IDS: tl.constexpr,
):  # fmt: skip
    """Program (row, part): the largest p / E of the part's columns and its index (the first
    of equal ones). A part is `part_chunks` chunks of BLOCK, a count read at run time."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    key = tl.load(key_ptr + row).to(tl.uint32)
    offs = tl.arange(0, BLOCK)
    best_v = tl.max(tl.full([BLOCK], -1.0, tl.float32), axis=0)
    best_i = tl.max(tl.zeros([BLOCK], tl.int32), axis=0)
    start = part * part_chunks * BLOCK
    end = start + part_chunks * BLOCK  # chunks past the vocabulary (the last part's) load nothing
    while start < end:  # (a `for` over a run-time count fails in the interpreter)
        cols = start + offs
        inside = cols < vocab
        p = tl.load(p_ptr + row * stride_p + cols, mask=inside, other=0.0)
        if HAS_IDS:
            ids = tl.load(ids_ptr + row * stride_ids + cols, mask=inside, other=0).to(tl.uint32)
        else:
            ids = cols.to(tl.uint32)
        h = _mix32(key ^ _mix32(ids ^ tl.full([1], 0x27D4EB2F, tl.uint32)))
        w = tl.minimum((h.to(tl.float32) + 0.5) * 2.0**-32, 1.0 - 2.0**-24)
        series = w * (1.0 + w * (0.5 + w * (1.0 / 3.0 + w * 0.25)))
        e = tl.where(w < 2.0**-6, series, -tl.log(1.0 - w))
        score = tl.where(inside, p / e, -1.0)
        v, at = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        if v > best_v:
            best_v = v
            best_i = start + at
        start += BLOCK
    out = row * parts + part
    tl.store(v_ptr + out, best_v)
    tl.store(i_ptr + out, best_i)


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """Two programs per SM (the interpreter: a few)."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def race(
    probs: torch.Tensor, key: torch.Tensor, ids: torch.Tensor | None, parts: int | None = None
) -> torch.Tensor:
    """argmax p / E per row: probs [R, V] float32 (last dim contiguous), key [R] int64 (the
    rows' 32-bit keys), ids None (the index is the token id), [V] or [R, V] (the token id of each
    index). Returns [R] int64. `parts`: the programs a row is split over (default: enough)."""
    rows, vocab = probs.shape
    blocks = -(-vocab // BLOCK)
    if parts is None:
        parts = -(-_programs_wanted(probs.device) // max(rows, 1))
    chunks = -(-blocks // max(1, min(parts, blocks)))
    parts = -(-blocks // chunks)
    values = torch.empty((rows, parts), dtype=torch.float32, device=probs.device)
    index = torch.empty((rows, parts), dtype=torch.int32, device=probs.device)
    if ids is not None:
        ids = ids.to(torch.int32)
        ids = ids.expand(rows, vocab) if ids.dim() == 1 else ids
        if ids.stride(-1) != 1:
            ids = ids.contiguous()
    _part_kernel[(rows, parts)](
        probs, probs.stride(0), key.contiguous(), probs if ids is None else ids,
        0 if ids is None else ids.stride(0), vocab, chunks, values, index,
        BLOCK=BLOCK, HAS_IDS=ids is not None, num_warps=WARPS,
    )  # fmt: skip
    best = values.argmax(-1, keepdim=True)
    return index.gather(-1, best).squeeze(-1).long()
