"""Top-k and top-p without sorting the vocabulary: executor/sampling.py `_rank_filter_`'s cut,
found per row by a radix select over the logits' bits.

The torch reference sorts each row by logit (descending; equal logits lower id first), takes the
first k, then the nucleus of that set (ranks whose mass before them is below top_p times the
set's mass), and zeroes the rest. Both cuts keep a prefix of that order, so a cut is a key L
(the logit's float32 bits mapped to a uint32 that orders as the float does) and a count c of the
entries equal to L kept (the first c by index): keep key > L, or key == L among the first c.

L is found a digit of BITS bits at a time, highest first: a pass sums, over the entries whose
higher digits equal L's found so far, their count (top-k) or mass (top-p) per digit value, and
the digit where the running sum crosses k (or top_p x the top-k set's mass) is L's next. A
digit no key of the row sets takes no pass (bf16 logits set none of the low 16 bits).

A row is split into parts of CHUNK entries (a number set by the vocabulary alone, so a row's
sums never depend on the batch), one program each; every pass is one launch of (rows, parts)
programs, each looping a constant CHUNK / BLOCK times (so Triton pipelines the loads: the next
blocks arrive by cp.async while one is binned), each thread binning its own entries into its
[2^BITS] sums (no entry passed between threads), a block with no entry in the set at the prefix
found so far skipped (SKIP_EMPTY: after the first digits most are), and writing its part's sums
once; a one-program-per-row launch then adds the parts' sums in a fixed order and takes the
digit into the row's state. Launches: a first pass (counts, mass, the bits the keys set), 32 /
BITS passes and decisions for top-k, as many for top-p, and a last pass writing the zeros (its
ties ranked by index across parts from the last pass's per-part counts). No [rows, V] buffer is
made (the sort's keys, indices and gathered copies were ~8 of them); rows without top-k (or
top-p) skip those passes' work.

Counts are exact, so the top-k cut is the sort's. The top-p cut compares sums of float32 masses
taken in another order than the reference's running sum, so where the mass before a rank lies
within float rounding of top_p x mass the two can keep one rank more or fewer (the reference's
own cut moves so on CUDA with the batch's row count); each row's sums here are taken in one
fixed order, whatever the batch."""

from __future__ import annotations

import torch

from speculant.kernels.runtime import HAS_TRITON, tl, triton


def _const(value: int):
    """A module constant the kernels read (triton reads only constexpr globals)."""
    return tl.constexpr(value) if HAS_TRITON else value


CHUNK = 8192  # entries per part: 19 parts of a 152k vocabulary
BLOCK = 256  # entries a program reads at a time (a pass's histograms: 2^BITS x BLOCK / 2)
WARPS = 4
SKIP_EMPTY = True  # a pass bins only blocks with an entry in the set (else: every block)
BITS = 4  # a digit's bits: 32 / BITS passes per cut, 2^BITS sums per entry per pass

# the row's state between launches: int32 fields (keys are uint32 bits) and float32 fields
I_PREFIX, I_ABOVE, I_HIT, I_BITS, I_FLAGS, I_KEY_K, I_TIES_K, I_ALL_K = map(_const, range(8))
I_SLOT, I_DIGIT, I_SLOT_K, I_DIGIT_K, I_CUT, I_CUT_TIES, I_CUT_SLOT, I_CUT_DIGIT = map(
    _const, range(8, 16)
)
F_ABOVE, F_TARGET, F_HIT, F_Q_K, F_SET = map(_const, range(5))
NI, NF = 16, 8  # fields of each kind (host side; the kernels take them as arguments)
K_ON, P_ON = _const(1), _const(2)  # I_FLAGS bits
PHASES = {"init": 0, "k": 1, "p": 2}  # the decision's phase (host side)
INIT, K_LEVEL, P_LEVEL = map(_const, PHASES.values())


@triton.jit
def _keys(logit_ptr, p_ptr, cols, inside):
    """The uint32 order key of each entry (0 for an entry of no mass: ranked last), whether it
    has mass, and its probability."""
    x = tl.load(logit_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ranks with 0.0 (equal floats), not below it
    p = tl.load(p_ptr + cols, mask=inside, other=0.0)
    valid = inside & (p > 0)
    bits = x.to(tl.uint32, bitcast=True)
    flip = tl.where((bits >> 31) == 1, tl.full([1], 0xFFFFFFFF, tl.uint32),
                    tl.full([1], 0x80000000, tl.uint32))  # fmt: skip
    key = tl.where(valid, bits ^ flip, tl.zeros_like(bits))
    return key, valid, p


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _get(values, fields, which):
    """values[which] of a row's state vector, as a scalar."""
    return tl.sum(tl.where(fields == which, values, 0), 0)


@triton.jit
def _u32(state_i, field):
    return tl.load(state_i + field).to(tl.uint32, bitcast=True)


@triton.jit
def _first_pass(
    p_ptr, stride_p, logit_ptr, stride_logit, vocab, cnt_ptr, mass_ptr, bits_ptr, parts, slots,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr = 3,
):  # fmt: skip
    """Program (row, part): its part's entries with mass, their mass and the OR of their keys
    (slot 0 of the part sums)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cnt = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    any_bits = tl.zeros([BLOCK], tl.uint32)
    # a constant trip count: Triton pipelines the loads (a run-time count fails in the
    # interpreter; the wrapper keeps CHUNK at most the vocabulary rounded up to BLOCK)
    for it in tl.range(0, CHUNK // BLOCK, num_stages=STAGES):
        cols = part * CHUNK + it * BLOCK + offs
        key, valid, p = _keys(logit_ptr + row * stride_logit, p_ptr + row * stride_p, cols,
                              cols < vocab)  # fmt: skip
        cnt += valid.to(tl.int32)
        mass += tl.where(valid, p, 0.0)
        any_bits = any_bits | key
    at = (row * slots * parts + part) * D  # slot 0, digit 0
    tl.store(cnt_ptr + at, tl.sum(cnt, 0))
    tl.store(mass_ptr + at, tl.sum(mass, 0))
    tl.store(bits_ptr + row * parts + part, tl.reduce(any_bits, 0, _or).to(tl.int32, bitcast=True))


@triton.jit
def _bin(cnt, mass, bins, digit, p):
    hit = bins[:, None] == digit[None, :]
    return cnt + hit.to(tl.int32), mass + tl.where(hit, p[None, :], 0.0)


@triton.jit(do_not_specialize=["slot", "level"])
def _pass(
    p_ptr, stride_p, logit_ptr, stride_logit, vocab, cnt_ptr, mass_ptr, state_i_ptr,
    state_f_ptr, parts, slots, slot, level, BY_MASS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK: tl.constexpr, BITS: tl.constexpr, NI: tl.constexpr, NF: tl.constexpr,
    STAGES: tl.constexpr = 3, SKIP_EMPTY: tl.constexpr = True,
):  # fmt: skip
    """Program (row, part): per digit value at `level`, the count and mass of its part's
    entries in the set (top-k: every entry with mass; top-p: key >= the top-k cut's, its
    excess ties taken out by the decision) whose higher digits equal the prefix found so far;
    into `slot` of the part sums. Nothing for a row without this cut or a digit no key sets."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    state_i = state_i_ptr + (row * (slots + 1) + slot) * NI
    shift = (32 - BITS * (level + 1)).to(tl.uint32)
    flags = tl.load(state_i + I_FLAGS)
    on = (flags & (P_ON if BY_MASS else K_ON)) != 0
    if on & (((_u32(state_i, I_BITS) >> shift) & ((1 << BITS) - 1)) != 0):
        prefix = _u32(state_i, I_PREFIX)
        in_key = _u32(state_i, I_KEY_K) if BY_MASS else tl.zeros([1], tl.uint32).sum(0)
        offs = tl.arange(0, BLOCK)
        bins = tl.arange(0, 1 << BITS)
        cnt = tl.zeros([1 << BITS, BLOCK // 2], tl.int32)
        mass = tl.zeros([1 << BITS, BLOCK // 2], tl.float32)
        for it in tl.range(0, CHUNK // BLOCK, num_stages=STAGES):
            cols = part * CHUNK + it * BLOCK + offs
            key, valid, p = _keys(logit_ptr + row * stride_logit, p_ptr + row * stride_p, cols,
                                  cols < vocab)  # fmt: skip
            # the higher digits: two shifts (one of 32 is undefined at level 0)
            match = valid & (key >= in_key) & (((key >> shift) >> BITS) == prefix)
            digit = tl.where(match, ((key >> shift) & ((1 << BITS) - 1)).to(tl.int32), -1)
            d0, d1 = tl.split(tl.reshape(digit, [BLOCK // 2, 2]))
            p0, p1 = tl.split(tl.reshape(p, [BLOCK // 2, 2]))
            # a block with no entry in the set at this prefix adds nothing (SKIP_EMPTY)
            if (tl.max(digit, 0) >= 0) if SKIP_EMPTY else True:
                cnt, mass = _bin(cnt, mass, bins, d0, p0)
                cnt, mass = _bin(cnt, mass, bins, d1, p1)
        at = ((row * slots + slot) * parts + part) * (1 << BITS) + bins
        tl.store(cnt_ptr + at, tl.sum(cnt, 1))
        tl.store(mass_ptr + at, tl.sum(mass, 1))


@triton.jit(do_not_specialize=["slot", "level"])
def _decide(
    cnt_ptr, mass_ptr, bits_ptr, state_i_ptr, state_f_ptr, k_ptr, top_p_ptr, parts, slots,
    slot, level, PHASE: tl.constexpr, LEVELS: tl.constexpr, BITS: tl.constexpr,
    PARTS: tl.constexpr, NI: tl.constexpr, NF: tl.constexpr,
):  # fmt: skip
    """Program `row`: the parts' sums of `slot` added in one order, the digit taken, the state
    for slot + 1 written (INIT: after the first pass; the last level of a phase also closes its
    cut)."""
    row = tl.program_id(0).to(tl.int64)
    D: tl.constexpr = 1 << BITS
    bins = tl.arange(0, D)
    part_ids = tl.arange(0, PARTS)
    in_parts = part_ids < parts
    tile = ((row * slots + slot) * parts + part_ids[:, None]) * D + bins[None, :]
    src_i = state_i_ptr + (row * (slots + 1) + slot) * NI
    src_f = state_f_ptr + (row * (slots + 1) + slot) * NF
    dst_i = src_i + NI
    dst_f = src_f + NF
    fields_i = tl.arange(0, NI)
    fields_f = tl.arange(0, NF)
    if PHASE == INIT:
        first = ((row * slots) * parts + part_ids) * D
        valid_cnt = tl.sum(tl.load(cnt_ptr + first, mask=in_parts, other=0), 0)
        total = tl.sum(tl.load(mass_ptr + first, mask=in_parts, other=0.0), 0)
        any_bits = tl.reduce(tl.load(bits_ptr + row * parts + part_ids, mask=in_parts, other=0),
                             0, _or)  # fmt: skip
        k = tl.load(k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        flags = tl.where((k > 0) & (k < valid_cnt), K_ON, 0) | tl.where(top_p < 1.0, P_ON, 0)
        ints = tl.where(fields_i == I_BITS, any_bits, 0)
        ints = tl.where(fields_i == I_FLAGS, flags, ints)
        floats = tl.where(fields_f == F_SET, total, 0.0)
        floats = tl.where(fields_f == F_TARGET, top_p, floats)  # x the set's mass later
        tl.store(dst_i + fields_i, ints)
        tl.store(dst_f + fields_f, floats)
    else:
        ints = tl.load(src_i + fields_i)
        floats = tl.load(src_f + fields_f)
        flags = _get(ints, fields_i, I_FLAGS)
        any_bits = _get(ints, fields_i, I_BITS).to(tl.uint32, bitcast=True)
        prefix = _get(ints, fields_i, I_PREFIX).to(tl.uint32, bitcast=True)
        above_cnt = _get(ints, fields_i, I_ABOVE)
        above_mass = _get(floats, fields_f, F_ABOVE)
        shift = (32 - BITS * (level + 1)).to(tl.uint32)
        on = (flags & (P_ON if PHASE == P_LEVEL else K_ON)) != 0
        if on & (((any_bits >> shift) & (D - 1)) != 0):
            cnt = tl.sum(tl.load(cnt_ptr + tile, mask=in_parts[:, None], other=0), 0)
            mass = tl.sum(tl.load(mass_ptr + tile, mask=in_parts[:, None], other=0.0), 0)
            if PHASE == P_LEVEL:  # the top-k cut's ties past its count are not in the set
                key_k = _get(ints, fields_i, I_KEY_K).to(tl.uint32, bitcast=True)
                excess = _get(ints, fields_i, I_ALL_K) - _get(ints, fields_i, I_TIES_K)
                q_k = _get(floats, fields_f, F_Q_K)
                inside = (((key_k >> shift) >> BITS) == prefix) & (excess > 0)
                at_k = bins == ((key_k >> shift) & (D - 1)).to(tl.int32)
                cnt = tl.where(inside & at_k, cnt - excess, cnt)
                mass = tl.where(inside & at_k, tl.maximum(mass - excess.to(tl.float32) * q_k,
                                                          0.0), mass)  # fmt: skip
                mass = tl.where(cnt > 0, mass, 0.0)
            at_or_above = bins[None, :] >= bins[:, None]
            cnt_from = tl.sum(tl.where(at_or_above, cnt[None, :], 0), 1)
            mass_from = tl.sum(tl.where(at_or_above, mass[None, :], 0.0), 1)
            if PHASE == P_LEVEL:  # a top_p of 0 (1e-46 in float32) reaches at the first entry
                target = _get(floats, fields_f, F_TARGET)
                # the set's lowest digit with entries counts as reached: where rounding between
                # passes leaves the set's whole mass short of the target (top_p within float
                # rounding of 1), the cut stays a key of the set; an empty digit's key zeroed
                # none of the set, the top-k cut's excess ties kept (all of them from the
                # first digit: a cut key of 0, the top-k cut lost)
                whole = cnt_from == tl.max(cnt_from, 0)
                reached = (((above_mass + mass_from) >= target) | whole) & (cnt_from > 0)
            else:
                k = tl.load(k_ptr + row)
                reached = (above_cnt + cnt_from) >= k
            # the last digit (from the top) where the running sum has not yet reached the
            # target before it
            d = tl.maximum(tl.sum(reached.to(tl.int32), 0) - 1, 0)
            higher = bins > d
            above_cnt += tl.sum(tl.where(higher, cnt, 0), 0)
            above_mass += tl.sum(tl.where(higher, mass, 0.0), 0)
            hit_cnt = tl.sum(tl.where(bins == d, cnt, 0), 0)
            hit_mass = tl.sum(tl.where(bins == d, mass, 0.0), 0)
            prefix = (prefix << BITS) | d.to(tl.uint32)
            ints = tl.where(fields_i == I_HIT, hit_cnt, ints)
            ints = tl.where(fields_i == I_SLOT, slot, ints)
            ints = tl.where(fields_i == I_DIGIT, d, ints)
            floats = tl.where(fields_f == F_HIT, hit_mass, floats)
        else:  # every key's digit here is 0 (or no such cut): the set at the prefix is unchanged
            prefix = prefix << BITS
        ints = tl.where(fields_i == I_PREFIX, prefix.to(tl.int32, bitcast=True), ints)
        ints = tl.where(fields_i == I_ABOVE, above_cnt, ints)
        floats = tl.where(fields_f == F_ABOVE, above_mass, floats)
        if level == LEVELS - 1:  # the phase's cut
            hit_cnt = _get(ints, fields_i, I_HIT)
            hit_mass = _get(floats, fields_f, F_HIT)
            last_slot = _get(ints, fields_i, I_SLOT)
            last_digit = _get(ints, fields_i, I_DIGIT)
            q = hit_mass / tl.maximum(hit_cnt, 1).to(tl.float32)
            if PHASE == K_LEVEL:
                if on:
                    ties = tl.load(k_ptr + row) - above_cnt
                    ints = tl.where(fields_i == I_KEY_K, prefix.to(tl.int32, bitcast=True), ints)
                    ints = tl.where(fields_i == I_TIES_K, ties, ints)
                    ints = tl.where(fields_i == I_ALL_K, hit_cnt, ints)
                    ints = tl.where(fields_i == I_SLOT_K, last_slot, ints)
                    ints = tl.where(fields_i == I_DIGIT_K, last_digit, ints)
                    ints = tl.where(fields_i == I_CUT, prefix.to(tl.int32, bitcast=True), ints)
                    ints = tl.where(fields_i == I_CUT_TIES, ties, ints)
                    ints = tl.where(fields_i == I_CUT_SLOT, last_slot, ints)
                    ints = tl.where(fields_i == I_CUT_DIGIT, last_digit, ints)
                    floats = tl.where(fields_f == F_Q_K, q, floats)
                    floats = tl.where(fields_f == F_SET, above_mass + q * ties.to(tl.float32),
                                      floats)  # fmt: skip
                # top-p starts from the top: its target top_p x the set's mass
                set_mass = _get(floats, fields_f, F_SET)
                top_p = _get(floats, fields_f, F_TARGET)
                floats = tl.where(fields_f == F_TARGET, top_p * set_mass, floats)
                floats = tl.where(fields_f == F_ABOVE, 0.0, floats)
                ints = tl.where((fields_i == I_PREFIX) | (fields_i == I_ABOVE), 0, ints)
            elif on:  # top-p: entries equal to the cut share one probability q; the j-th
                # (j from 0) is kept while above_mass + j q < target
                target = _get(floats, fields_f, F_TARGET)
                room = tl.maximum(target - above_mass, 0.0)
                ties = tl.where(q > 0, tl.minimum(tl.ceil(room / tl.maximum(q, 1e-30)), 2.0**30),
                                1.0)  # fmt: skip
                ties = tl.minimum(tl.maximum(ties.to(tl.int32), 1), hit_cnt)
                ints = tl.where(fields_i == I_CUT, prefix.to(tl.int32, bitcast=True), ints)
                ints = tl.where(fields_i == I_CUT_TIES, ties, ints)
                ints = tl.where(fields_i == I_CUT_SLOT, last_slot, ints)
                ints = tl.where(fields_i == I_CUT_DIGIT, last_digit, ints)
        tl.store(dst_i + fields_i, ints)
        tl.store(dst_f + fields_f, floats)


@triton.jit
def _last_pass(
    p_ptr, stride_p, logit_ptr, stride_logit, vocab, cnt_ptr, state_i_ptr, parts, slots,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr,
    NI: tl.constexpr, STAGES: tl.constexpr = 3,
):  # fmt: skip
    """Program (row, part): zero its part's entries below the row's cut (key < L, or == L past
    the first `ties` by index: those of earlier parts counted by the last pass of the cut)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    state_i = state_i_ptr + (row * (slots + 1) + slots) * NI
    cut = _u32(state_i, I_CUT)
    if cut != 0:
        ties = tl.load(state_i + I_CUT_TIES)
        slot = tl.load(state_i + I_CUT_SLOT)
        digit = tl.load(state_i + I_CUT_DIGIT)
        part_ids = tl.arange(0, PARTS)
        before = tl.load(cnt_ptr + ((row * slots + slot) * parts + part_ids) * D + digit,
                         mask=part_ids < part, other=0)  # fmt: skip
        seen = tl.sum(before, 0)
        offs = tl.arange(0, BLOCK)
        for it in tl.range(0, CHUNK // BLOCK, num_stages=STAGES):
            cols = part * CHUNK + it * BLOCK + offs
            inside = cols < vocab
            key, valid, p = _keys(logit_ptr + row * stride_logit, p_ptr + row * stride_p, cols,
                                  inside)  # fmt: skip
            tie = valid & (key == cut)
            rank = seen + tl.cumsum(tie.to(tl.int32), 0) - 1
            seen += tl.sum(tie.to(tl.int32), 0)
            drop = (valid & (key < cut)) | (tie & (rank >= ties))
            tl.store(p_ptr + row * stride_p + cols, tl.zeros([BLOCK], tl.float32),
                     mask=inside & drop)  # fmt: skip


def rank_filter_(
    probs: torch.Tensor,
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    bits: int = BITS,
    chunk: int = CHUNK,
) -> None:
    """executor/sampling.py `_rank_filter_` on probs [R, V] float32 in place: logits [R, V]
    (any float dtype; last dim contiguous), top_k [R] or [R, 1] integers (0: off), top_p [R] or
    [R, 1] (1: off). `bits`: a digit's bits (1, 2 or 4); `chunk`: entries per part (a multiple
    of BLOCK)."""
    rows, vocab = probs.shape
    if rows == 0 or vocab == 0:
        return
    assert probs.stride(-1) == 1 and logits.stride(-1) == 1 and chunk % BLOCK == 0
    levels, digits = 32 // bits, 1 << bits
    chunk = min(chunk, -(-vocab // BLOCK) * BLOCK)  # (the kernels loop CHUNK / BLOCK times)
    parts = -(-vocab // chunk)
    slots = 1 + 2 * levels  # the first pass, top-k's levels, top-p's
    dev = probs.device
    cnt = torch.empty((rows, slots, parts, digits), dtype=torch.int32, device=dev)
    mass = torch.empty((rows, slots, parts, digits), dtype=torch.float32, device=dev)
    key_bits = torch.empty((rows, parts), dtype=torch.int32, device=dev)
    state_i = torch.empty((rows, slots + 1, NI), dtype=torch.int32, device=dev)
    state_f = torch.empty((rows, slots + 1, NF), dtype=torch.float32, device=dev)
    # off below 1, as the sort takes it; a top-k past int32 either way: no wrap
    k = top_k.reshape(rows).clamp(0, vocab).to(torch.int32)
    p = top_p.reshape(rows).float().contiguous()
    part_pow2 = max(2, triton.next_power_of_2(parts))
    rows_parts = (rows, parts)
    data = (probs, probs.stride(0), logits, logits.stride(0), vocab)
    _first_pass[rows_parts](*data, cnt, mass, key_bits, parts, slots, CHUNK=chunk, BLOCK=BLOCK,
                            D=digits, num_warps=WARPS)  # fmt: skip
    decide = (cnt, mass, key_bits, state_i, state_f, k, p, parts, slots)
    consts = dict(LEVELS=levels, BITS=bits, PARTS=part_pow2, NI=NI, NF=NF, num_warps=1)
    _decide[(rows,)](*decide, 0, 0, PHASE=PHASES["init"], **consts)
    for phase, by_mass in ((PHASES["k"], False), (PHASES["p"], True)):
        for level in range(levels):
            slot = 1 + level + (levels if by_mass else 0)
            _pass[rows_parts](*data, cnt, mass, state_i, state_f, parts, slots, slot, level,
                              BY_MASS=by_mass, CHUNK=chunk, BLOCK=BLOCK, BITS=bits, NI=NI,
                              NF=NF, SKIP_EMPTY=SKIP_EMPTY, num_warps=WARPS)  # fmt: skip
            _decide[(rows,)](*decide, slot, level, PHASE=phase, **consts)
    _last_pass[rows_parts](*data, cnt, state_i, parts, slots, CHUNK=chunk, BLOCK=BLOCK,
                           D=digits, PARTS=part_pow2, NI=NI, num_warps=WARPS)  # fmt: skip
