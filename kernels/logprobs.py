"""What a step's log-probabilities need of the full-vocabulary logits, in one read: per row the
log-sum-exp and the `num_top` largest values with their ids (executor/logprobs.py subtracts the
one from the others). torch's reference (kernels/reference.py `top_logprobs`) reads the
[rows, vocab] float32 logits in `logsumexp` and again, several passes, in `topk`'s radix select.

Here a row is split over `parts` programs (enough programs for the GPU at small batches); each
reads its columns once, keeping their running max and sum of exp (online softmax) and their
`num_top` largest (a chunk is searched only when its max beats the part's smallest kept value,
which after the first chunks is rare). One program a row then merges the parts: the norm, and
the `num_top` largest of the parts' candidates, most likely first, ties to the lower id (a row
with fewer than `num_top` finite logits gets id -1 for the rest).
Asked for more than TOP_LIMIT alternatives, the reference runs (a part's search would repeat
per alternative)."""

from __future__ import annotations

import functools

import torch

from speculant.kernels import reference
from speculant.kernels.runtime import (
    HAS_TRITON,
    next_power_of_2,
    pdl_enter,
    pdl_mode,
    pdl_options,
    runs_triton,
    tl,
    triton,
)

BLOCK = 4096  # columns a part reads at a time
WARPS = 8
TOP_LIMIT = 32  # the most alternatives the kernels search for
# an id no candidate has (vocabularies are far smaller); a kernel constant where triton is
ID_NONE = tl.constexpr(2**31 - 1) if HAS_TRITON else 2**31 - 1


@triton.jit
def _take_chunk(x_ptr, start, vocab, offs, slots, m_run, s_run, best_v, best_i):
    """One chunk of a part: its values folded into the running max and sum of exp, and those
    larger than the smallest kept value taken into the kept slots."""
    x = tl.load(x_ptr + start + offs, mask=start + offs < vocab, other=float("-inf"))
    top = tl.max(x, axis=0)
    new_m = tl.maximum(m_run, top)
    shift = tl.where(new_m == float("-inf"), 0.0, new_m)  # no -inf - -inf
    s_run = s_run * tl.exp(m_run - shift) + tl.sum(tl.exp(x - shift), axis=0)
    if top > tl.min(best_v, axis=0):
        v, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        while v > tl.min(best_v, axis=0):  # at most K times: each takes a kept slot
            # the slot of the smallest kept value, of the highest id among equal ones (ids come
            # in increasing order: the lower ids of a tie stay)
            low = tl.where(best_v == tl.min(best_v, axis=0), best_i, -1)
            slot = tl.argmax(low, axis=0, tie_break_left=True)
            best_v = tl.where(slots == slot, v, best_v)
            best_i = tl.where(slots == slot, start + at, best_i)
            x = tl.where(offs == at, float("-inf"), x)
            v, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    return new_m, s_run, best_v, best_i


@triton.jit
def _part_kernel(
    x_ptr, stride_x, vocab, part_chunks, m_ptr, s_ptr, v_ptr, i_ptr,
    K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (row, part): the part's max and sum of exp(x - max), and its K largest values
    and their ids (unordered; fewer than K finite values leave -inf at id ID_NONE). A part is
    `part_chunks` chunks of BLOCK, a count read at run time: one compiled kernel serves every
    split (a constant count, unrolled, measured no faster at top 5: results/wave23.md)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    x_ptr += row * stride_x
    slots = tl.arange(0, KP)
    offs = tl.arange(0, BLOCK)
    # slots past K hold +inf: never the smallest, so never replaced, and never stored
    best_v = tl.where(slots < K, float("-inf"), float("inf")).to(tl.float32)
    best_i = tl.full([KP], ID_NONE, tl.int32)
    m_run = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    s_run = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    start = part * part_chunks * BLOCK
    end = start + part_chunks * BLOCK  # chunks past the vocabulary (the last part's) load nothing
    while start < end:  # (a `for` over a run-time count fails in the interpreter)
        m_run, s_run, best_v, best_i = _take_chunk(
            x_ptr, start, vocab, offs, slots, m_run, s_run, best_v, best_i
        )
        start += BLOCK
    out = row * parts + part
    tl.store(m_ptr + out, m_run)
    tl.store(s_ptr + out, s_run)
    tl.store(v_ptr + out * K + slots, best_v, mask=slots < K)
    tl.store(i_ptr + out * K + slots, best_i, mask=slots < K)


@triton.jit
def _merge_kernel(
    m_ptr, s_ptr, v_ptr, i_ptr, norm_ptr, top_v_ptr, top_i_ptr, parts,
    K: tl.constexpr, PARTS: tl.constexpr, CANDIDATES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program row: the log-sum-exp over the parts, and the K largest of the parts' candidates
    less it, most likely first, ties to the lower id."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, PARTS)
    m = tl.load(m_ptr + row * parts + p, mask=p < parts, other=float("-inf"))
    s = tl.load(s_ptr + row * parts + p, mask=p < parts, other=0.0)
    peak = tl.max(m, axis=0)
    shift = tl.where(peak == float("-inf"), 0.0, peak)
    norm = shift + tl.log(tl.sum(s * tl.exp(m - shift), axis=0))
    tl.store(norm_ptr + row, norm)
    c = tl.arange(0, CANDIDATES)
    inside = c < parts * K
    vals = tl.load(v_ptr + row * parts * K + c, mask=inside, other=float("-inf"))
    ids = tl.load(i_ptr + row * parts * K + c, mask=inside, other=ID_NONE)
    for j in range(K):
        v = tl.max(vals, axis=0)
        pick = tl.min(tl.where(vals == v, ids, ID_NONE), axis=0)
        tl.store(top_v_ptr + row * K + j, v - norm)
        tl.store(top_i_ptr + row * K + j, tl.where(pick == ID_NONE, -1, pick).to(tl.int64))
        taken = (vals == v) & (ids == pick)
        vals = tl.where(taken, float("-inf"), vals)
        ids = tl.where(taken, ID_NONE, ids)


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """Two programs per SM (the interpreter: a few)."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def top_logprobs(
    logits: torch.Tensor, num_top: int, parts: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp [R] float32, the `num_top` largest logits less it [R, num_top] float32,
    their ids [R, num_top] int64) of float32 logits [R, V], most likely first. `parts`: the
    programs a row is split over (default: enough for the GPU)."""
    if (
        not runs_triton(logits) or logits.dim() != 2 or logits.dtype != torch.float32
        or logits.stride(-1) != 1 or num_top > TOP_LIMIT or not logits.numel()
    ):  # fmt: skip
        return reference.top_logprobs(logits, num_top)
    rows, vocab = logits.shape
    k = max(num_top, 1)  # the kernels keep one at least; none are returned for 0
    blocks = -(-vocab // BLOCK)
    if parts is None:
        parts = -(-_programs_wanted(logits.device) // rows)
    chunks = -(-blocks // max(1, min(parts, blocks)))
    parts = -(-blocks // chunks)
    device = logits.device
    m = torch.empty((rows, parts), dtype=torch.float32, device=device)
    s = torch.empty_like(m)
    v = torch.empty((rows, parts, k), dtype=torch.float32, device=device)
    i = torch.empty((rows, parts, k), dtype=torch.int32, device=device)
    pdl = pdl_options(pdl_mode(logits, "logprobs"))
    _part_kernel[(rows, parts)](
        logits, logits.stride(0), vocab, chunks, m, s, v, i,
        K=k, KP=next_power_of_2(k), BLOCK=BLOCK, num_warps=WARPS, **pdl,
    )  # fmt: skip
    norm = torch.empty(rows, dtype=torch.float32, device=device)
    top_v = torch.empty((rows, k), dtype=torch.float32, device=device)
    top_i = torch.empty((rows, k), dtype=torch.int64, device=device)
    # sized for the most parts a row can have: one compiled merge a vocabulary
    _merge_kernel[(rows,)](
        m, s, v, i, norm, top_v, top_i, parts,
        K=k, PARTS=next_power_of_2(blocks), CANDIDATES=next_power_of_2(blocks * k), num_warps=4,
        **pdl,
    )  # fmt: skip
    return norm, top_v[:, :num_top], top_i[:, :num_top]
