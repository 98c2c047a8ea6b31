"""Top-k and top-p without sorting the vocabulary: executor/sampling.py `_rank_filter_`'s cut,
found per row by a radix select over the logits' bits.

The torch reference sorts each row by logit (descending; equal logits lower id first), takes the
first k, then the nucleus of that set (ranks whose mass before them is below top_p times the
set's mass), and zeroes the rest. Both cuts keep a prefix of that order, so a cut is a key L
(the logit's float32 bits mapped to a uint32 that orders as the float does) and a count c of the
entries equal to L kept (the first c by index): keep key > L, or key == L among the first c.

Here one program per row finds L a digit of BITS bits at a time, highest first (32 / BITS
passes over the row): each pass sums, over the entries whose higher digits equal L's found so
far, their count (top-k) or their mass (top-p) per digit value, and takes the digit where the
running sum crosses k (or top_p x mass). A digit no key of the row sets takes no pass (bf16
logits set none of the low 16 bits). A first pass counts the row's entries with mass, a last
one writes the zeros. The probabilities are read only where the digits found so far match; no
[rows, V] buffer is made (the sort's keys, indices and gathered copies were ~8 of them).

Counts are exact, so the top-k cut is the sort's. The top-p cut compares sums of float32 masses
taken in another order than the reference's running sum, so where the mass before a rank lies
within float rounding of top_p x mass the two can keep one rank more or fewer (the reference's
own cut moves so on CUDA with the batch's row count); each row is reduced in a fixed order,
whatever the batch."""

from __future__ import annotations

import torch

from speculant.kernels.runtime import tl, triton

BLOCK = 1024  # entries a program reads at a time
WARPS = 8
BITS = 4  # a digit's bits: 32 / BITS passes per cut, 2^BITS sums per entry per pass


@triton.jit
def _keys(logit_ptr, p_ptr, cols, inside):
    """The uint32 order key of each entry (0 for an entry of no mass: ranked last) and whether
    it has mass."""
    x = tl.load(logit_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ranks with 0.0 (equal floats), not below it
    p = tl.load(p_ptr + cols, mask=inside, other=0.0)
    valid = inside & (p > 0)
    bits = x.to(tl.uint32, bitcast=True)
    flip = tl.where((bits >> 31) == 1, tl.full([1], 0xFFFFFFFF, tl.uint32),
                    tl.full([1], 0x80000000, tl.uint32))  # fmt: skip
    key = tl.where(valid, bits ^ flip, tl.zeros_like(bits))
    return key, valid


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _select(
    logit_ptr, p_ptr, vocab, target_cnt, target_mass, BY_MASS: tl.constexpr,
    in_key, in_ties, any_bits, BLOCK: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """The key L where the rank order's running count reaches target_cnt (BY_MASS False) or its
    running mass reaches target_mass (BY_MASS True; masses are summed either way), over the
    entries of the set {key > in_key, or key == in_key among its first in_ties by index}
    (in_key 0: every entry with mass). any_bits: the OR of every key (a digit no key sets needs
    no pass: bf16 logits set none of the low 16 bits). Returns (L, count and mass of the set's
    entries above L, count and mass of its entries equal to L)."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 1 << BITS)
    prefix = tl.zeros([1], tl.uint32).sum(0)  # the digits of L found so far
    above_cnt = tl.zeros([1], tl.int32).sum(0)
    above_mass = tl.zeros([1], tl.float32).sum(0)
    hit_cnt = above_cnt
    hit_mass = above_mass
    for level in tl.static_range(32 // BITS):
        shift = 32 - BITS * (level + 1)
        if ((any_bits >> shift) & ((1 << BITS) - 1)) != 0:
            cnt = tl.zeros([1 << BITS], tl.int32)
            mass = tl.zeros([1 << BITS], tl.float32)
            ties_seen = tl.zeros([1], tl.int32).sum(0)
            start = 0
            while start < vocab:  # (a `for` over a run-time count fails in the interpreter)
                cols = start + offs
                inside = cols < vocab
                key, valid = _keys(logit_ptr, p_ptr, cols, inside)
                member = valid & (key > in_key)
                if in_key != 0:  # the first in_ties entries equal to in_key, by index
                    is_tie = valid & (key == in_key)
                    tie_rank = ties_seen + tl.cumsum(is_tie.to(tl.int32), 0) - 1
                    ties_seen += tl.sum(is_tie.to(tl.int32), 0)
                    member = member | (is_tie & (tie_rank < in_ties))
                if level == 0:
                    match = member
                else:
                    match = member & ((key >> (shift + BITS)) == prefix)
                digit = ((key >> shift) & ((1 << BITS) - 1)).to(tl.int32)
                onehot = (digit[:, None] == bins[None, :]) & match[:, None]
                cnt += tl.sum(onehot.to(tl.int32), 0)
                p = tl.load(p_ptr + cols, mask=match, other=0.0)
                mass += tl.sum(tl.where(onehot, p[:, None], 0.0), 0)
                start += BLOCK
            # digits at or above d: non-increasing in d (sums of more non-negative terms)
            at_or_above = bins[None, :] >= bins[:, None]
            cnt_from = tl.sum(tl.where(at_or_above, cnt[None, :], 0), 1)
            mass_from = tl.sum(tl.where(at_or_above, mass[None, :], 0.0), 1)
            if BY_MASS:  # a top_p of 0 (1e-46 in float32) reaches at the first entry
                reached = ((above_mass + mass_from) >= target_mass) & (cnt_from > 0)
            else:
                reached = (above_cnt + cnt_from) >= target_cnt
            # the last digit (from the top) where the running sum has not yet reached the
            # target before it; none reached (rounding between passes): the lowest digit
            d = tl.maximum(tl.sum(reached.to(tl.int32), 0) - 1, 0)
            higher = bins > d
            above_cnt += tl.sum(tl.where(higher, cnt, 0), 0)
            above_mass += tl.sum(tl.where(higher, mass, 0.0), 0)
            hit_cnt = tl.sum(tl.where(bins == d, cnt, 0), 0)
            hit_mass = tl.sum(tl.where(bins == d, mass, 0.0), 0)
            prefix = (prefix << BITS) | d.to(tl.uint32)
        else:  # every key's digit here is 0: the set at the prefix is unchanged
            prefix = prefix << BITS
    return prefix, above_cnt, above_mass, hit_cnt, hit_mass


@triton.jit
def _rank_filter_kernel(
    p_ptr, stride_p, logit_ptr, stride_logit, k_ptr, top_p_ptr, vocab, BLOCK: tl.constexpr,
    BITS: tl.constexpr,
):  # fmt: skip
    """Program `row`: zero row's entries outside its top-k, then top-p, set (see the module)."""
    row = tl.program_id(0).to(tl.int64)
    p_row = p_ptr + row * stride_p
    logit_row = logit_ptr + row * stride_logit
    k = tl.load(k_ptr + row).to(tl.int32)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    offs = tl.arange(0, BLOCK)
    zero_key = tl.zeros([1], tl.uint32).sum(0)
    # every entry with mass: its count, its mass and the bits its keys set
    valid_cnt = tl.zeros([1], tl.int32).sum(0)
    set_mass = tl.zeros([1], tl.float32).sum(0)
    any_bits = zero_key
    start = 0
    while start < vocab:
        cols = start + offs
        inside = cols < vocab
        key, valid = _keys(logit_row, p_row, cols, inside)
        p = tl.load(p_row + cols, mask=inside, other=0.0)
        valid_cnt += tl.sum(valid.to(tl.int32), 0)
        set_mass += tl.sum(tl.where(valid, p, 0.0), 0)
        any_bits = any_bits | tl.reduce(key, 0, _or)
        start += BLOCK
    cut_key = zero_key  # keep key > cut_key, or == it among the first cut_ties (0, 0: all)
    cut_ties = tl.zeros([1], tl.int32).sum(0)
    if (k > 0) & (k < valid_cnt):
        key_k, cnt_above, mass_above, cnt_hit, mass_hit = _select(
            logit_row, p_row, vocab, k, 0.0, False, zero_key, 0, any_bits, BLOCK, BITS
        )
        cut_key = key_k
        cut_ties = k - cnt_above
        set_mass = mass_above + mass_hit / cnt_hit.to(tl.float32) * cut_ties.to(tl.float32)
    if top_p < 1.0:
        target = top_p * set_mass
        key_p, cnt_above, mass_above, cnt_hit, mass_hit = _select(
            logit_row, p_row, vocab, 0, target, True, cut_key, cut_ties, any_bits, BLOCK, BITS
        )
        # entries equal to key_p share one probability q: the j-th (j from 0) is kept while
        # mass_above + j q < target. None equal (rounding between passes left the target
        # unreached): every entry above key_p is kept
        q = mass_hit / tl.maximum(cnt_hit, 1).to(tl.float32)
        room = tl.maximum(target - mass_above, 0.0)
        ties = tl.where(q > 0, tl.minimum(tl.ceil(room / tl.maximum(q, 1e-38)), 2.0**30), 1.0)
        cut_key = key_p
        cut_ties = tl.minimum(tl.maximum(ties.to(tl.int32), 1), cnt_hit)
    if cut_key != zero_key:
        ties_seen = tl.zeros([1], tl.int32).sum(0)
        start = 0
        while start < vocab:
            cols = start + offs
            inside = cols < vocab
            key, valid = _keys(logit_row, p_row, cols, inside)
            is_tie = valid & (key == cut_key)
            tie_rank = ties_seen + tl.cumsum(is_tie.to(tl.int32), 0) - 1
            ties_seen += tl.sum(is_tie.to(tl.int32), 0)
            drop = (valid & (key < cut_key)) | (is_tie & (tie_rank >= cut_ties))
            tl.store(p_row + cols, tl.zeros([BLOCK], tl.float32), mask=inside & drop)
            start += BLOCK


def rank_filter_(
    probs: torch.Tensor,
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    bits: int = BITS,
) -> None:
    """executor/sampling.py `_rank_filter_` on probs [R, V] float32 in place: logits [R, V]
    (any float dtype; last dim contiguous), top_k [R] or [R, 1] integers (0: off), top_p [R] or
    [R, 1] (1: off). `bits`: a digit's bits (1, 2, 4 or 8)."""
    rows, vocab = probs.shape
    if rows == 0:
        return
    assert probs.stride(-1) == 1 and logits.stride(-1) == 1
    k = top_k.reshape(rows).clamp(max=vocab).to(torch.int32)  # a top-k past int32: no wrap
    _rank_filter_kernel[(rows,)](
        probs, probs.stride(0), logits, logits.stride(0), k,
        top_p.reshape(rows).float().contiguous(), vocab, BLOCK=BLOCK, BITS=bits, num_warps=WARPS,
    )  # fmt: skip
