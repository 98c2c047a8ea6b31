"""Sampling that does not depend on batching: temperature, top-k and top-p applied to the
distribution, and random numbers from a counter-based hash of (request seed, position, stream),
so a seeded request draws the same numbers in any batch, padding, graph or eager path.

A token is drawn by an exponential race (`race`): the largest p(t) / E(t), with E(t) ~ Exp(1)
a hash of (seed, position, stream, target token id t), which picks t with probability
p(t) / sum p. Only the two best ratios decide the draw, so a logit's last-bit change with the
batch shape moves a draw only when those two are within that change of each other (an
inverse-CDF draw moved whenever u fell within it of any of the cumulative sums' boundaries:
~1,000x more often at a 152k vocabulary). Keyed by token id, a drafter's draw over its own
vocabulary and the target's over the whole one share their numbers token by token (the coupling
`--sampled-verify match` accepts by)."""

from __future__ import annotations

import functools
import importlib
import itertools
import logging

import torch

from speculant.executor.forward_batch import SamplingInfo
from speculant.executor.request import GREEDY_TEMPERATURE, SamplingParams

log = logging.getLogger("speculant")

MASK32 = 0xFFFFFFFF
# Independent random streams per position.
STREAM_SAMPLE = 1  # the token emitted at a position (plain sampling, bonus and resample)
STREAM_ACCEPT = 2  # the accept test of a draft token
STREAM_DRAFT = 3  # a drafter's own sampled proposal

# Sampler variants, each captured as its own graph: argmax only; temperature and min-p (no row
# asks for top-k or top-p: no vocabulary sort); everything (top-k / top-p rank the vocabulary)
GREEDY, SCALED, FULL = "greedy", "scaled", "full"
VARIANTS = (GREEDY, SCALED, FULL)
U_MAX = 1.0 - 2.0**-24  # the largest float32 below 1
# top-k / top-p by torch's sort (the CPU, or CUDA where kernels/rank_filter.py's check failed)
# rank this many entries (rows x vocabulary) at a time: the sort's keys, indices
# and buffers for every row of a 512-row verify step at a 128k vocabulary were ~10 GiB (the
# step's peak, and its CUDA graph's pool), 3.8 GiB by chunks of 2^24 (64 MiB of float32; one
# H100, results/wave31.md), at 0-5% more time than one sort of every row (wave32.md)
SORT_ELEMENTS = 1 << 24
# from this many rows on CUDA cuts top-k / top-p with kernels/rank_filter.py, no sort: as CUDA
# graph replays at a 152k vocabulary (bf16 logits, one H100, results/wave33.md) top-p 0.95 took
# 0.25 / 0.45 / 0.77 / 2.43 / 9.04 vs the sort's 0.42 / 1.12 / 1.90 / 6.96 / 26.9 ms at 2 / 32 /
# 64 / 256 / 1,024 rows (top-k 50 with it: 0.31 / 0.55 / 0.98 / 3.05 / 11.4), but 0.24 vs 0.20
# at one row (its 35 launches), where the sort stays
RANK_KERNEL_ROWS = 2


ARGMAX_CHUNKS = 64
ARGMAX_MAX_ROWS = 8  # more rows than this fill the GPU with torch's own argmax


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), the same index (the first maximum). For a few rows of a large
    vocabulary on the GPU torch reduces each row in one block (28 us for one 128k row on an
    H200); there the rows are split into ARGMAX_CHUNKS chunks reduced in parallel first."""
    vocab = logits.shape[-1]
    rows = logits.numel() // max(vocab, 1)
    if not logits.is_cuda or rows > ARGMAX_MAX_ROWS or vocab < 128 * ARGMAX_CHUNKS:
        return logits.argmax(-1)
    return chunked_argmax(logits, ARGMAX_CHUNKS)


def chunked_argmax(logits: torch.Tensor, chunks: int) -> torch.Tensor:
    """argmax over the last dim in two stages: each chunk's first maximum, then the first chunk
    holding the largest (padding is -inf, so it never wins over a real entry)."""
    vocab = logits.shape[-1]
    size = -(-vocab // chunks)
    padded = torch.nn.functional.pad(logits, (0, chunks * size - vocab), value=float("-inf"))
    values, index = padded.view(*logits.shape[:-1], chunks, size).max(-1)
    best = values.argmax(-1, keepdim=True)
    return (best * size + index.gather(-1, best)).squeeze(-1)


def batch_variant(params: list[SamplingParams]) -> str:
    """The graph variant a batch needs: argmax only when every request is greedy; no ranking
    of the vocabulary when no sampled request asks for top-k or top-p (a greedy row is a
    one-hot either way)."""
    sampled = [p for p in params if p.temperature >= GREEDY_TEMPERATURE]
    if not sampled:
        return GREEDY
    ranked = any(p.top_k > 0 or p.top_p < 1 for p in sampled)
    return FULL if ranked else SCALED


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # lowbias32 integer hash on uint32 values held in int64; masking keeps the low 32 bits exact.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def _key(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """The 32-bit hash of (seed, position, stream); seed broadcasts against position."""
    key = _mix32((seed & MASK32) ^ _mix32((seed >> 32) & MASK32) ^ (stream * 0x9E3779B9 & MASK32))
    # the position hashed before it meets the key: with key ^ position, two requests whose keys
    # differ by d < the context length drew the same numbers at positions p and p ^ d (a whole
    # stream shared, about one pair in a job of 1,000 requests); now only isolated coincidences
    return _mix32(key ^ _mix32((position & MASK32) ^ 0x5BD1E995))


def _unit(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash to U(0,1) float32 on a 2^-24 grid, strictly inside (0, 1)."""
    # (2^24 - 1) + 0.5 rounds up to 2^24 in float32: keep u below 1 (an exponential of 0 would
    # make its token win the race whatever its probability)
    return (((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp_(max=U_MAX)


def uniform(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """U(0,1) float32 per element, a pure function of (seed, position, stream).
    seed broadcasts against position (for example [bs, 1] against [bs, T])."""
    return _unit(_key(seed, position, stream))


def exponentials(
    seed: torch.Tensor, position: torch.Tensor, stream: int, ids: torch.Tensor
) -> torch.Tensor:
    """Exp(1) float32 per (row, token) (`exponential_of_hash`): [..., V], a pure function of
    (seed, position, stream, token id). seed broadcasts against position ([...]); ids [V] or
    [..., V] are target ids."""
    token = _mix32((ids.long() & MASK32) ^ 0x27D4EB2F)
    return exponential_of_hash(_mix32(_key(seed, position, stream).unsqueeze(-1) ^ token))


SERIES_BELOW = 2.0**-6  # w below this: -log(1 - w) by its series (1 - w would round)
W_MAX = 1.0 - 2.0**-24  # E <= 16.6: a token with p > 0 always beats those with p = 0


def exponential_of_hash(h: torch.Tensor) -> torch.Tensor:
    """Exp(1) float32 from a 32-bit hash: E = -log(1 - w), w = (h + 0.5) 2^-32, which resolves
    small E (where a token of small probability wins the race) to ~2^-32 rather than the 2^-24 of
    a float32 uniform near 1: a token with p 1e-9 of the best is drawn at its rate. Below
    SERIES_BELOW by w (1 + w (1/2 + w (1/3 + w / 4))) (relative error < 2^-24); kernels/race.py
    computes the same."""
    w = ((h.to(torch.float32) + 0.5) * 2.0**-32).clamp_(max=W_MAX)
    series = w * (1.0 + w * (0.5 + w * (1.0 / 3.0 + w * 0.25)))
    return torch.where(w < SERIES_BELOW, series, -torch.log(1.0 - w))


def race(
    probs: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    stream: int,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The index of the token drawn from probs [..., V] (not necessarily normalised, >= 0, some
    mass in every row): argmax p / E with E the `exponentials` of (seed, position, stream) at
    each index's target id (`ids` [V] or [..., V]; default the index itself). On CUDA one
    Triton kernel (kernels/race.py) hashes, divides and reduces in one read of probs."""
    kernel = _race_kernel(probs.device) if probs.is_cuda else None
    if kernel is not None:
        vocab = probs.shape[-1]
        key = torch.broadcast_to(_key(seed, position, stream), probs.shape[:-1]).reshape(-1)
        flat_ids = ids if ids is None or ids.dim() == 1 else ids.reshape(-1, vocab)
        flat = probs.float().reshape(-1, vocab)
        index = kernel(flat if flat.stride(-1) == 1 else flat.contiguous(), key, flat_ids)
        return index.view(probs.shape[:-1])
    if ids is None:
        ids = torch.arange(probs.shape[-1], device=probs.device)
    return argmax(probs / exponentials(seed, position, stream, ids))


def _checked_kernel(device, module: str, name: str, check, what: str, fallback: str):
    """`name` of speculant.kernels.<module> for this device once `check(kernel, device)` holds
    (the kernel gives the torch reference's result on a check input); else None, with one
    warning ("<what> failed (...)" or "<what> <mismatch>", then "; <fallback>"), and the caller
    runs its torch reference (also without triton). Imported on first CUDA use only: the kernel
    modules import triton, which the CPU tests set up first. The first call comes from a
    sampled step's eager run (graph capture warms up each graph eagerly first), where the check
    may sync; during a capture the kernel is taken unchecked."""
    try:
        from speculant.kernels import runtime

        kernels = importlib.import_module(f"speculant.kernels.{module}")
    except ImportError:
        return None
    if not runtime.HAS_TRITON:
        return None
    kernel = getattr(kernels, name)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # no check here
        return kernel
    try:
        mismatch = check(kernel, device)
    except Exception as error:  # a Triton build or launch failure: the reference still runs
        log.warning("%s failed (%s); %s", what, error, fallback)
        return None
    if mismatch:
        log.warning("%s %s; %s", what, mismatch, fallback)
        return None
    return kernel


def _race_check(kernel, device) -> str:
    """'' when the race kernel draws the torch reference's tokens on a check input."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(8, 5000, generator=gen) * 4, -1)
    seed, position = torch.arange(8) * 977 + 5, torch.arange(8) + 30
    ids = torch.randperm(5000, generator=gen)
    want = argmax(probs / exponentials(seed, position, STREAM_SAMPLE, ids))
    key = _key(seed, position, STREAM_SAMPLE).to(device)
    got = kernel(probs.to(device), key, ids.to(device)).cpu()
    return "" if torch.equal(got, want) else "drew other tokens than torch"


@functools.cache
def _race_kernel(device: torch.device):
    """kernels/race.py's `race` for this CUDA device, once checked (`_checked_kernel`)."""
    return _checked_kernel(device, "race", "race", _race_check, "the sampler's Triton kernel",
                           "sampling with torch")  # fmt: skip


def rank_check_input():
    """(logits, probs, top_k, top_p) the kernel's cut is checked on: 8 rows of 5,000 tokens, no
    row's cut within float rounding of another (tests/test_rank_filter.py)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 5000, generator=gen) * 3
    top_k = torch.tensor([0, 1, 7, 40, 0, 0, 300, 5000]).view(8, 1)
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.5, 0.3, 0.7, 0.8, 0.6]).view(8, 1)
    return logits, torch.softmax(logits, -1), top_k, top_p


def _rank_check(kernel, device) -> str:
    """'' when the rank kernel keeps the sort's tokens on `rank_check_input`."""
    logits, probs, top_k, top_p = rank_check_input()
    want = probs.clone()
    _rank_filter_(want, logits, top_k, top_p)
    got = probs.to(device, copy=True)
    kernel(got, logits.to(device), top_k.to(device), top_p.to(device))
    return "" if torch.equal(got.cpu() > 0, want > 0) else "cut other tokens than torch"


@functools.cache
def _rank_kernel(device: torch.device):
    """kernels/rank_filter.py's `rank_filter_` (top-k / top-p without a sort) for this CUDA
    device, once checked (`_checked_kernel`); else the sort cuts."""
    return _checked_kernel(device, "rank_filter", "rank_filter_", _rank_check,
                           "the top-k / top-p Triton kernel", "sorting with torch")  # fmt: skip


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
    variant: str = FULL,
) -> torch.Tensor:
    """softmax(logits / T) restricted to the tokens at least min_p times as likely as the most
    likely one (vLLM's min-p, applied first as vLLM does), then to the top-k tokens, then to the
    top-p nucleus of that set (its mass renormalised first, as vLLM and transformers apply
    them), and renormalised. logits [..., V]; parameters broadcast over the leading dims ([bs]
    or [bs, 1]); min_p None: off for every row.
    Rows with T below GREEDY_TEMPERATURE get a one-hot at the argmax (logits / T would overflow
    float32); the most likely token always survives top-p, however small top_p is.
    Top-k / top-p: on CUDA, from RANK_KERNEL_ROWS rows, kernels/rank_filter.py finds each row's
    cut without a sort (top-p's cut can differ from the sort's where the mass before a rank is
    within float rounding of top_p x mass); elsewhere torch's sort by chunks of rows.
    `variant` SCALED: no row asks for top-k or top-p (batch_variant), so the vocabulary is not
    ranked (a sort of [rows, V]: most of a sampled step's sampler); the same result bit for bit
    as FULL gives such rows."""
    # In place wherever a [rows, V] result is not read again: a verify step of 512 rows of 4
    # tokens at a 128k vocabulary holds 1 GiB per such tensor (the step's peak, and its graph's)
    greedy = temperature < GREEDY_TEMPERATURE
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits.float() / temp.unsqueeze(-1), dim=-1)
    greedy = greedy.unsqueeze(-1)
    at_max = argmax(logits).unsqueeze(-1)
    top = torch.where(greedy, 1.0, probs.gather(-1, at_max))
    probs.masked_fill_(greedy, 0.0).scatter_(-1, at_max, top)  # greedy rows: a one-hot
    if min_p is not None:  # 0 keeps every token (p >= 0); the most likely always survives
        probs.mul_(probs >= min_p.unsqueeze(-1) * probs.amax(-1, keepdim=True))
    if variant == SCALED:
        return probs.div_(probs.sum(-1, keepdim=True))
    vocab = probs.shape[-1]
    rows = probs.numel() // max(vocab, 1)
    flat_probs, flat_logits = probs.view(rows, vocab), logits.reshape(rows, vocab)
    flat_k = top_k.expand(probs.shape[:-1]).reshape(rows, 1)
    flat_p = top_p.expand(probs.shape[:-1]).reshape(rows, 1)
    kernel = _rank_kernel(probs.device) if probs.is_cuda and rows >= RANK_KERNEL_ROWS else None
    if kernel is not None:  # no sort: a radix select of each row's cut, in place
        rows_of_logits = flat_logits if flat_logits.stride(-1) == 1 else flat_logits.contiguous()
        kernel(flat_probs, rows_of_logits, flat_k, flat_p)  # rows may be strided: no copy
        return probs.div_(probs.sum(-1, keepdim=True))
    # rows are independent: on the CPU the same bits by chunks. On CUDA torch's cumsum picks
    # its summation order by the row count (a lone row with cub), so the top-p cut can move
    # where a row's mass lands within float rounding of top_p, as it did with the batch's size
    # before chunking; chunks never hold one row of several
    step = max(2, SORT_ELEMENTS // max(vocab, 1))
    starts = list(range(0, rows, step))
    if len(starts) > 1 and rows - starts[-1] == 1:
        starts.pop()  # the last row joins the chunk before it
    for start, end in itertools.pairwise([*starts, rows]):
        _rank_filter_(flat_probs[start:end], flat_logits[start:end], flat_k[start:end],
                      flat_p[start:end])  # fmt: skip
    return probs.div_(probs.sum(-1, keepdim=True))


def _rank_filter_(probs: torch.Tensor, logits: torch.Tensor, top_k, top_p) -> None:
    """Top-k, then top-p over the top-k set's mass, on probs [rows, V] in place (top_k, top_p
    [rows, 1]). Ranked by logit, not probability: at a high temperature two close logits round
    to one probability, and a stable sort of probabilities put the lower id first (top_k 1 and
    a tiny top_p then kept another token than the argmax); dropped tokens rank last."""
    rank_key = logits.float().masked_fill(probs <= 0, float("-inf"))
    order = rank_key.sort(dim=-1, descending=True, stable=True).indices
    del rank_key
    sorted_probs = probs.gather(-1, order)
    vocab = probs.shape[-1]
    rank = torch.arange(vocab, device=probs.device)
    sorted_probs.mul_(rank < torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)))
    mass_before = sorted_probs.cumsum(-1)
    top_k_mass = mass_before[:, -1:].clone()
    mass_before.sub_(sorted_probs)
    # top_p 1 keeps every token: the float32 cumsum reaches 1 before a large vocabulary's tail
    keep = (mass_before < top_p * top_k_mass) | (top_p >= 1) | (rank == 0)
    del mass_before
    sorted_probs.mul_(keep)
    probs.scatter_(-1, order, sorted_probs)  # order is a permutation: every entry written


def sample(
    logits: torch.Tensor, info: SamplingInfo, positions: torch.Tensor, variant: str
) -> torch.Tensor:
    """One token per row of logits [bs, V] emitted at `positions` [bs]."""
    greedy = argmax(logits)
    if variant == GREEDY:
        return greedy
    probs = filtered_probs(logits, info.temperature, info.top_k, info.top_p, info.min_p, variant)
    drawn = race(probs, info.seed, positions, STREAM_SAMPLE)
    return torch.where(info.is_greedy, greedy, drawn)
