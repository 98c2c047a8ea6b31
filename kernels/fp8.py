"""y = x W^T for an e4m3 weight W [N, K] with its float32 scales, bf16/fp16 activations x [M, K]
(issue 24): the Triton kernels behind models/fp8.py's forward on the Triton backend.

Scales come in two forms. `block`: one scale per 128 x 128 block of W, a [ceil(N/128),
ceil(K/128)] tensor (the published `weight_scale_inv` layout of one matrix). `row`: one scale
per output row, a float32 [N] vector (per-channel scales, and per-tensor scales expanded over
their rows).

Paths, picked by `route`: the tuned table's row for this GPU, shape (N, K) and M
(kernels/fp8_tuned.json, written by benchmarks/fp8_sweep.py; fp8_table.py), borrowed from the
nearest measured shape or a GPU of the same compute capability where the table has no exact
row, else by M alone (`choice`: PATH_TABLE or the thresholds below):
- `_splitk_kernel` (`splitk`, a few rows): a grid of N tiles x K splits, each program loading
  one whole [BLOCK_N, BLOCK_K] W tile before its first use (before waiting on the previous
  kernel under PDL); the splits' float32 partials summed in split order, by the tile's last
  program (per-tile counter) or by `_sum_splits_kernel`: deterministic either way.
- `_stream_kernel` (`stream`, M = 1): each program owns BLOCK_N whole rows of W, the first
  PRE_K columns loaded before the PDL wait as split-K's tile is, the rest streamed after it;
  no partials and no reduction tail.
- `scaled_mm` (CUDA only): cuBLASLt's block-wise FP8 GEMM through torch._scaled_mm.
- `_fma_kernel` (M <= FMA_MAX_M, decode at small batch): each program owns BLOCK_N output rows
  for every row of x and streams its slice of W once, converting e4m3 to float32 in registers
  and multiplying x (not W) by the block scale of each column; float32 multiply-adds, one
  reduction at the end. Written for memory bandwidth, as kernels/gemv.py.
- `_dot_kernel` (FMA_MAX_M < M <= SKINNY_MAX_M, verify and large decode batches; also a W8A16
  GEMM for any M): W tiles converted to bf16 in registers, tl.dot against x^T ("swap AB": the
  weight rows fill the MMA's tall side), each 128-column chunk's product scaled by its block
  scale; optional split-K into a float32 partial buffer summed by torch.
- `_sk_kernel` (`sk_w8a16`, `sk_w8a8`, `sk_w8a8_pre`; M = 2 ... 256, verify and batch
  decode): split-K on tensor cores, swap AB as `_dot_kernel`, 128-column chunks pipelined, a
  grid of N tiles x M tiles x K splits sized to fill the GPU, the splits' float32 partials
  summed in split order by the tile's last program (per-tile counter, as `_splitk_kernel`):
  one launch, deterministic. sk_w8a16: W to bf16 in registers; sk_w8a8: x quantised to e4m3
  per row and chunk inside the kernel (no `_act_quant_kernel` launch), FP8 MMA; sk_w8a8_pre:
  the same MMA on x quantised by `_act_quant_kernel` (split-K W8A8 with the separate
  quantisation). Under PDL each program prefetches its W slice into L2 before the wait.
- above SKINNY_MAX_M (prefill): PREFILL_GEMM picks `dequant` (W to bf16 once by
  `_dequant_kernel`, then cuBLAS), `w8a8` (x quantised per token per 128 columns by
  `_act_quant_kernel`, then `_w8a8_kernel`: FP8 tensor cores, tl.dot on float8e4nv, both
  scales applied per 128-column chunk) or `w8a16` (`_dot_kernel` with GEMM tiles).

Every launch is CUDA-graph capturable: buffers are sized by the shapes only, nothing reads a
device value on the host. Under Triton's interpreter (CPU tests) tl.dot runs in float32 on the
same values (the interpreter's bf16 and fp8 dots are not exact), and float32 is rounded to the
e4m3 grid before its cast (`_round_e4m3`: the interpreter's cast misrounds). The torch references
(`reference_linear`, `reference_w8a8`) are what the kernels are checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speculant.kernels import fp8_table
from speculant.kernels.runtime import (
    INTERPRET,
    MAX_COUNTERS,
    arrival_counters,
    pdl_enter,
    pdl_mode,
    pdl_options,
    prefetch_l2,
    runs_triton,
    tl,
    triton,
)

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128  # rows and columns of one scale block
MODES = ("block", "row")

# The defaults below are the `applied` settings measured by benchmarks/fp8_gpu.py on one H200
# (2026-12-01, Llama-3.1-8B shapes; see benchmarks/results/fp8_2026-12-01.md, which also says
# why the per-M table is noisy and one path per M is a stopgap).
# M thresholds: used only when PATH_TABLE is None
FMA_MAX_M = 2
SKINNY_MAX_M = 64
PREFILL_GEMM = "dequant"  # dequant | w8a8 | w8a16
# a measured table instead of the thresholds: ((max M, path), ...) by increasing M; an M above
# the last bound takes the last path
PATH_TABLE: tuple[tuple[int, str], ...] | None = (
    (1, "fma"), (2, "fma"), (4, "dot"), (8, "dot"), (16, "w8a8"), (32, "dot"), (64, "dot"),
    (256, "dequant"), (2048, "dequant"),
)  # fmt: skip
# (BLOCK_N, BLOCK_K, num_warps) of the FMA kernel; BLOCK_N divides 128 (one scale row block)
FMA_CONFIG = (16, 512, 4)
# (BLOCK_N, BLOCK_M cap, num_warps, num_stages) of the skinny dot kernel; BLOCK_K is 128
DOT_CONFIG = (64, 64, 4, 2)
GEMM_CONFIG = (128, 128, 8, 3)  # the same for the w8a16 / w8a8 GEMMs (BLOCK_N, BLOCK_M, ...)
# the tuned per-shape table (kernels/fp8_tuned.json, see fp8_table.py), consulted before
# PATH_TABLE; benchmarks replace it
TUNED: fp8_table.Table = fp8_table.load()
# the probe's layout for torch._scaled_mm block-wise scales (see scaled_mm): the one that
# worked on the H200 (torch 2.11 + cu130, benchmarks/results/fp8_wave3.md)
SCALED_MM_CONFIG = {"api": "v1", "scale_a": "col", "scale_b": "t"}
SCALED_MM_ROWS = 16  # scaled_mm pads x to a multiple of this many rows (M = 4, 8, 16k measured)
# Split-K for the dot kernel: split while the grid has fewer programs than this (the H200 has
# 132 SMs), up to MAX_SPLIT_K ways.
MIN_PROGRAMS = 264
MAX_SPLIT_K = 8
# (BLOCK_N, BLOCK_K, num_warps, reduce) of the split-K GEMV (M <= 8); not yet measured
SPLITK_CONFIG = (16, 1024, 4, "atomic")
# (BLOCK_N, PRE_K, BLOCK_K, num_warps) of the one-row streaming GEMV (`_stream_kernel`)
STREAM_CONFIG = (16, 1024, 512, 8)
# The split-K tensor-core paths (`_sk_kernel`) by name: the ACT value each launches
SK_PATHS = {"sk_w8a16": 0, "sk_w8a8": 1, "sk_w8a8_pre": 2}
# (BLOCK_N, BLOCK_M cap, num_warps, num_stages, splits: 0 = enough for MIN_PROGRAMS) of
# `_sk_kernel`; not yet measured
SK_CONFIG = (64, 64, 4, 4, 0)


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# ---------------------------------------------------------------------------- kernels


@triton.jit
def _fma_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K: tl.constexpr, stride_x, stride_w, stride_y, stride_s,
    BLOCK_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.arange(0, BLOCK_M)
    row_ok = rows < N
    m_ok = ms < M
    scale_row = s_ptr + (pid * BLOCK_N // 128) * stride_s  # BLOCK_N divides 128
    pdl_enter(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None] * stride_w + cols[None, :]
        x_ptrs = x_ptr + ms[:, None] * stride_x + cols[None, :]
        if EVEN:
            w = tl.load(w_ptrs).to(tl.float32)
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0).to(tl.float32)
        else:
            col_ok = cols < K
            w = tl.load(w_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            w = w.to(tl.float32)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        if BLOCK_SCALE:
            if EVEN:
                s = tl.load(scale_row + cols // 128)
            else:
                s = tl.load(scale_row + cols // 128, mask=cols < K, other=0.0)
            x = x * s[None, :]
        acc += w[None, :, :] * x[:, None, :]
    out = tl.sum(acc, axis=2)
    if not BLOCK_SCALE:
        out = out * tl.load(s_ptr + rows, mask=row_ok, other=0.0)[None, :]
    y_ptrs = y_ptr + ms[:, None] * stride_y + rows[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])


@triton.jit
def _dot_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K: tl.constexpr, stride_x, stride_w, stride_y, stride_s,
    stride_split, K_CHUNKS_PER_SPLIT: tl.constexpr, BLOCK_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """acc[BLOCK_N, BLOCK_M] = W_tile x^T over this program's K chunks (BLOCK_K divides 128)."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    m_ok = ms < M
    pdl_enter(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for i in range(0, K_CHUNKS_PER_SPLIT):  # chunks past K (the last split's) load nothing
        kc = pid_k * K_CHUNKS_PER_SPLIT + i
        cols = kc * BLOCK_K + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        w = tl.load(
            w_ptr + rows[:, None] * stride_w + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :], other=0.0,
        )  # fmt: skip
        xt = tl.load(
            x_ptr + ms[None, :] * stride_x + cols[:, None],
            mask=m_ok[None, :] & col_ok[:, None], other=0.0,
        )  # fmt: skip
        if DOT_F32:
            part = tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            part = tl.dot(w.to(xt.dtype), xt)
        if BLOCK_SCALE:
            s_ptrs = s_ptr + (rows // 128) * stride_s + (kc * BLOCK_K) // 128
            s = tl.load(s_ptrs, mask=row_ok & (kc * BLOCK_K < K), other=0.0)
            acc += part * s[:, None]
        else:
            acc += part
    if not BLOCK_SCALE:
        acc = acc * tl.load(s_ptr + rows, mask=row_ok, other=0.0)[:, None]
    y_ptrs = y_ptr + pid_k * stride_split + ms[None, :] * stride_y + rows[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[None, :] & row_ok[:, None])


@triton.jit
def _dequant_kernel(
    w_ptr, s_ptr, out_ptr, N, K, stride_w, stride_s, stride_out, BLOCK_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=ok, other=0.0)
    if BLOCK_SCALE:
        s_ptrs = s_ptr + (rows // 128) * stride_s + tl.program_id(1) * BLOCK_K // 128
        s = tl.load(s_ptrs, mask=rows < N, other=0.0)[:, None]
    else:
        s = tl.load(s_ptr + rows, mask=rows < N, other=0.0)[:, None]
    out = w.to(tl.float32) * s
    out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s, stride_sg, BLOCK_K: tl.constexpr,
    ROUND: tl.constexpr = False,
):  # fmt: skip
    """Row m, 128-column group g of x -> e4m3 q and its scale amax / 448 (at least 1e-10);
    ROUND: round to e4m3 before the cast (the interpreter, see _round_e4m3)."""
    m, g = tl.program_id(0), tl.program_id(1)
    cols = g * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = cols < K
    x = tl.load(x_ptr + m * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10 * 448.0) / 448.0
    q = tl.clamp(x / scale, -448.0, 448.0)
    if ROUND:
        q = _round_e4m3(q)
    tl.store(q_ptr + m * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + m * stride_s + g * stride_sg, scale)


@triton.jit
def _w8a8_kernel(
    a_ptr, as_ptr, w_ptr, s_ptr, y_ptr, M, N, K: tl.constexpr, stride_a, stride_as, stride_w,
    stride_y, stride_s, BLOCK_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """y[BLOCK_M, BLOCK_N] = sum over 128-column chunks of (a_q w_q^T) * a_scale * w_scale."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    m_ok = ms < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kc in range(0, tl.cdiv(K, BLOCK_K)):
        cols = kc * BLOCK_K + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        a = tl.load(
            a_ptr + ms[:, None] * stride_a + cols[None, :],
            mask=m_ok[:, None] & col_ok[None, :], other=0.0,
        )  # fmt: skip
        wt = tl.load(
            w_ptr + rows[None, :] * stride_w + cols[:, None],
            mask=row_ok[None, :] & col_ok[:, None], other=0.0,
        )  # fmt: skip
        if DOT_F32:
            part = tl.dot(a.to(tl.float32), wt.to(tl.float32))
        else:
            part = tl.dot(a, wt)
        a_s = tl.load(as_ptr + ms * stride_as + kc, mask=m_ok, other=0.0)
        if BLOCK_SCALE:
            w_s = tl.load(s_ptr + (rows // 128) * stride_s + kc, mask=row_ok, other=0.0)
            acc += part * a_s[:, None] * w_s[None, :]
        else:
            acc += part * a_s[:, None]
    if not BLOCK_SCALE:
        acc = acc * tl.load(s_ptr + rows, mask=row_ok, other=0.0)[None, :]
    y_ptrs = y_ptr + ms[:, None] * stride_y + rows[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])


@triton.jit
def _splitk_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, stride_x, stride_w, stride_y,
    stride_s, SPLITS, SPLIT: tl.constexpr, BLOCK_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE: tl.constexpr, EVEN: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_N, BLOCK_K] tile of W per program, loaded whole before the wait for the
    previous kernel; rows of x times their block scales, float32 sums. SPLITS == 1: y directly;
    else partials to ws [SPLITS, M, N], and with REDUCE the last program of an N tile (per-tile
    counter) sums them in split order, writes y and resets its counter. SPLIT: SPLITS > 1
    (SPLITS itself is no constexpr, so that one compile serves every K)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < N
    col_ok = cols < K
    w_ptrs = w_ptr + rows[:, None] * stride_w + cols[None, :]
    if EVEN:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    if BLOCK_SCALE:  # BLOCK_N divides 128: one scale row block per program
        s = tl.load(s_ptr + (pid_n * BLOCK_N // 128) * stride_s + cols // 128, mask=col_ok)
    else:
        s = tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    pdl_enter(PDL)  # the W and scale loads above (no earlier kernel's output) stay in flight
    w = w.to(tl.float32)
    for m in tl.static_range(BLOCK_M):
        x = tl.load(x_ptr + m * stride_x + cols, mask=col_ok & (m < M), other=0.0)
        x = x.to(tl.float32)
        if BLOCK_SCALE:
            part = tl.sum(w * (x * s)[None, :], axis=1)
        else:
            part = tl.sum(w * x[None, :], axis=1) * s
        if not SPLIT:
            tl.store(y_ptr + m * stride_y + rows, part.to(y_ptr.dtype.element_ty),
                     mask=row_ok & (m < M))  # fmt: skip
        else:
            tl.store(ws_ptr + (pid_k * M + m) * N + rows, part, mask=row_ok & (m < M))
    if SPLIT and REDUCE:
        tl.debug_barrier()  # every thread's partial stored before the release below
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLITS - 1:
            ms = tl.arange(0, BLOCK_M)
            ok = (ms < M)[:, None] & row_ok[None, :]
            offs = ms[:, None] * N + rows[None, :]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            split = 0
            while split < SPLITS:  # split order: the same bits whoever comes last
                acc += tl.load(ws_ptr + split * M * N + offs, mask=ok, other=0.0,
                               cache_modifier=".cg")  # fmt: skip
                split += 1
            y_ptrs = y_ptr + ms[:, None] * stride_y + rows[None, :]
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # clean for the next launch or replay


@triton.jit
def _stream_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, K: tl.constexpr, stride_w, stride_s,
    BLOCK_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, PRE_K: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One row of x (M = 1): each program owns BLOCK_N whole rows of W and sums them over K
    itself (no partials, no reduction tail). The first PRE_K columns of its rows are loaded
    before the wait for the previous kernel (they stay in flight while it finishes, as
    `_splitk_kernel`'s tile does); the rest streams in BLOCK_K chunks after it. N divides by
    BLOCK_N (which divides 128), K by BLOCK_K, PRE_K by BLOCK_K, PRE_K <= K."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    pre = tl.arange(0, PRE_K)
    scale_row = s_ptr + (pid * BLOCK_N // 128) * stride_s
    w_pre = tl.load(w_ptr + rows[:, None] * stride_w + pre[None, :])
    if BLOCK_SCALE:
        s_pre = tl.load(scale_row + pre // 128)
    pdl_enter(PDL)
    x = tl.load(x_ptr + pre).to(tl.float32)
    if BLOCK_SCALE:
        x = x * s_pre
    out = tl.sum(w_pre.to(tl.float32) * x[None, :], axis=1)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(PRE_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :]).to(tl.float32)
        xk = tl.load(x_ptr + cols).to(tl.float32)
        if BLOCK_SCALE:
            xk = xk * tl.load(scale_row + cols // 128)
        acc += w * xk[None, :]
    out += tl.sum(acc, axis=1)
    if not BLOCK_SCALE:
        out = out * tl.load(s_ptr + rows)
    tl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty))


@triton.jit
def _sum_splits_kernel(
    ws_ptr, y_ptr, MN, SPLITS, BLOCK: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    """y = the sum of ws [SPLITS, M, N] in split order, cast to y's dtype (y contiguous)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    pdl_enter(PDL)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    split = 0
    while split < SPLITS:  # a while loop: the interpreter takes no tensor range bounds
        acc += tl.load(ws_ptr + split * MN + offs, mask=ok, other=0.0)
        split += 1
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _round_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, as the compiled
    cast (cvt.rn) rounds: the interpreter's own cast misrounds. Steps are 2^(e - 3) for
    exponent e >= -6, 2^-9 below (subnormals); scaling by powers of two is exact, and adding
    and taking away 1.5 * 2^23 rounds |t| < 2^22 to an integer, ties to even."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e + 3) << 23).to(tl.float32, bitcast=True)
    return ((v * inv + 12582912.0) - 12582912.0) * step


@triton.jit
def _sk_chunk(
    acc, x_ptr, xs_ptr, w_ptr, s_ptr, rows, ms, row_ok, m_ok, kc, n_chunks, K, stride_x,
    stride_xs, stride_w, stride_s, ACT: tl.constexpr, BLOCK_SCALE: tl.constexpr,
    EVEN: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_N, BLOCK_M] += (W x^T) over the 128 columns of chunk kc, scaled."""
    cols = kc * 128 + tl.arange(0, 128)
    w_ptrs = w_ptr + rows[:, None] * stride_w + cols[None, :]
    x_ptrs = x_ptr + ms[None, :] * stride_x + cols[:, None]
    if EVEN:
        w = tl.load(w_ptrs)
        xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
    else:
        col_ok = cols < K
        w = tl.load(w_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        xt = tl.load(x_ptrs, mask=m_ok[None, :] & col_ok[:, None], other=0.0)
    if ACT == 0:  # W to the activations' dtype in registers
        if DOT_F32:
            part = tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            part = tl.dot(w.to(xt.dtype), xt)
    else:  # FP8 MMA on e4m3 activations with one scale per row m and 128 columns
        if ACT == 1:  # quantised here, as _act_quant_kernel does
            xf = xt.to(tl.float32)
            a_s = tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-10 * 448.0) / 448.0
            q = tl.clamp(xf / a_s[None, :], -448.0, 448.0)
            if DOT_F32:  # the interpreter (see _round_e4m3)
                q = _round_e4m3(q)
            q = q.to(tl.float8e4nv)
        else:  # quantised by _act_quant_kernel: x holds the codes, xs the scales
            q = xt
            a_s = tl.load(xs_ptr + ms * stride_xs + kc, mask=m_ok & (kc < n_chunks), other=0.0)
        if DOT_F32:
            part = tl.dot(w.to(tl.float32), q.to(tl.float32))
        else:
            part = tl.dot(w, q)
        part = part * a_s[None, :]
    if BLOCK_SCALE:
        s = tl.load(s_ptr + (rows // 128) * stride_s + kc, mask=row_ok & (kc < n_chunks),
                    other=0.0)  # fmt: skip
        acc += part * s[:, None]
    else:
        acc += part
    return acc


@triton.jit(do_not_specialize=["M", "CHUNKS", "SPLITS"])
def _sk_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, stride_x, stride_xs,
    stride_w, stride_y, stride_s, CHUNKS, SPLITS, ACT: tl.constexpr, BLOCK_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr,
    DOT_F32: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Split-K tensor-core GEMM for skinny x ("swap AB": acc [BLOCK_N, BLOCK_M] = W_tile x^T,
    the weight rows on the MMA's tall side). Program (n tile, m tile, split) runs CHUNKS
    128-column chunks of K (the last split fewer); ACT 0: W converted to x's dtype (W8A16),
    1: x quantised to e4m3 per row and chunk here, 2: x given as e4m3 codes and scales xs
    (both W8A8 on FP8 MMA). SPLITS == 1 (not SPLIT): y directly. Else each split's float32
    partial goes to ws [SPLITS, m tiles, N, BLOCK_M] and the tile's last program (per-tile
    counter) sums them in split order (the same bits whoever comes last), writes y and resets
    its counter. Under PDL the program's W slice is prefetched into L2 before the wait."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    m_ok = ms < M
    n_chunks = tl.cdiv(K, 128)
    kc0 = pid_k * CHUNKS
    if PDL:  # no earlier kernel writes W: its lines may come in while that kernel runs
        line_ptrs = w_ptr + tl.where(row_ok, rows, 0) * stride_w
        for i in range(0, CHUNKS):
            prefetch_l2(line_ptrs + tl.minimum(kc0 + i, n_chunks - 1) * 128)
    pdl_enter(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if INTERP:  # the interpreter takes no runtime range bounds; compiled, a for loop pipelines
        i = 0
        while i < CHUNKS:
            acc = _sk_chunk(acc, x_ptr, xs_ptr, w_ptr, s_ptr, rows, ms, row_ok, m_ok, kc0 + i,
                            n_chunks, K, stride_x, stride_xs, stride_w, stride_s, ACT,
                            BLOCK_SCALE, EVEN, DOT_F32)  # fmt: skip
            i += 1
    else:
        for i in range(0, CHUNKS):
            acc = _sk_chunk(acc, x_ptr, xs_ptr, w_ptr, s_ptr, rows, ms, row_ok, m_ok, kc0 + i,
                            n_chunks, K, stride_x, stride_xs, stride_w, stride_s, ACT,
                            BLOCK_SCALE, EVEN, DOT_F32)  # fmt: skip
    if not BLOCK_SCALE:
        acc = acc * tl.load(s_ptr + rows, mask=row_ok, other=0.0)[:, None]
    y_ptrs = y_ptr + ms[None, :] * stride_y + rows[:, None]
    y_ok = m_ok[None, :] & row_ok[:, None]
    if not SPLIT:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)
    else:
        m_tiles = tl.num_programs(1)
        bm = tl.arange(0, BLOCK_M)
        offs = (pid_m * N + rows[:, None]) * BLOCK_M + bm[None, :]
        tile_size = m_tiles * N * BLOCK_M
        tl.store(ws_ptr + pid_k * tile_size + offs, acc, mask=row_ok[:, None])
        tl.debug_barrier()  # every thread's partial stored before the release below
        tile = pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if done == SPLITS - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            split = 0
            while split < SPLITS:  # split order: the same bits whoever comes last
                total += tl.load(ws_ptr + split * tile_size + offs, mask=row_ok[:, None],
                                 other=0.0, cache_modifier=".cg")  # fmt: skip
                split += 1
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_ok)
            tl.atomic_xchg(count_ptr + tile, 0)  # clean for the next launch or replay


# ---------------------------------------------------------------------------- launchers


def _check(weight: torch.Tensor, scale: torch.Tensor, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"scale mode {mode!r}: use one of {MODES}")
    n, k = weight.shape
    want = (-(-n // BLOCK), -(-k // BLOCK)) if mode == "block" else (n,)
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        got = f"{scale.dtype} {tuple(scale.shape)}"
        raise ValueError(f"{mode} scales must be float32 {want}, got {got}")


def fma_gemv(x2, weight, scale, mode, config=None):
    """y [M, N] = x2 [M, K] W^T through `_fma_kernel` (M <= 16 or so)."""
    block_n, block_k, warps = config or FMA_CONFIG
    m, k = x2.shape
    n = weight.shape[0]
    block_m = next_power_of_2(m)
    block_k = max(BLOCK, block_k // block_m)  # registers: BLOCK_M x BLOCK_N x BLOCK_K floats
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    pdl = pdl_mode(x2, "gemv")
    even = n % block_n == 0 and k % block_k == 0
    _fma_kernel[(triton.cdiv(n, block_n),)](
        x2, weight, scale, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
        scale.stride(0), BLOCK_SCALE=mode == "block", BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN=even, num_warps=warps, num_stages=2, **pdl_options(pdl),
    )  # fmt: skip
    return y


def stream_plan(n: int, k: int, config=None):
    """(BLOCK_N, PRE_K, BLOCK_K, num_warps) for `_stream_kernel` on an [n, k] weight, or None
    where it does not tile it: config (or STREAM_CONFIG; its sizes powers of two), PRE_K halved
    until it is at most k and a multiple of BLOCK_K."""
    block_n, pre_k, block_k, warps = config or STREAM_CONFIG
    if any(v & (v - 1) for v in (block_n, pre_k, block_k)) or min(block_n, pre_k, block_k) < 1:
        return None
    if n % block_n or 128 % block_n or k % block_k or pre_k < block_k:
        return None
    while pre_k > k:  # ends at the largest power of two <= K: at least BLOCK_K, a multiple
        pre_k //= 2
    return block_n, pre_k, block_k, warps


def stream_gemv(x2, weight, scale, mode, config=None):
    """y [1, N] = x2 [1, K] W^T through `_stream_kernel` (see it); other M, or a weight its
    blocks do not tile, go to fma_gemv."""
    m, k = x2.shape
    n = weight.shape[0]
    plan = stream_plan(n, k, config)
    if m != 1 or plan is None:
        return fma_gemv(x2, weight, scale, mode)
    block_n, pre_k, block_k, warps = plan
    y = torch.empty((1, n), dtype=x2.dtype, device=x2.device)
    _stream_kernel[(n // block_n,)](
        x2, weight, scale, y, k, weight.stride(0), scale.stride(0),
        BLOCK_SCALE=mode == "block", BLOCK_N=block_n, PRE_K=pre_k, BLOCK_K=block_k,
        num_warps=warps, num_stages=2, **pdl_options(pdl_mode(x2, "gemv")),
    )  # fmt: skip
    return y


def split_k_for(programs: int, k: int, block_k: int = BLOCK) -> int:
    """Split-K ways for a grid of `programs`: double while under MIN_PROGRAMS, at most
    MAX_SPLIT_K and at most one K chunk per split."""
    split, chunks = 1, -(-k // block_k)
    while programs * split < MIN_PROGRAMS and split * 2 <= min(MAX_SPLIT_K, chunks):
        split *= 2
    return split


def dot_gemm(x2, weight, scale, mode, config=None, split_k=None):
    """y [M, N] = x2 [M, K] W^T through `_dot_kernel` (W8A16 tensor cores)."""
    block_n, max_block_m, warps, stages = config or DOT_CONFIG
    m, k = x2.shape
    n = weight.shape[0]
    block_m = min(max(16, next_power_of_2(m)), max_block_m)
    grid_n, grid_m = triton.cdiv(n, block_n), triton.cdiv(m, block_m)
    split = split_k if split_k is not None else split_k_for(grid_n * grid_m, k)
    chunks = triton.cdiv(k, BLOCK)
    per_split = triton.cdiv(chunks, split)
    split = triton.cdiv(chunks, per_split)  # no empty splits
    if split == 1:
        out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    else:
        out = torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    pdl = pdl_mode(x2, "gemv") if split == 1 else 0
    _dot_kernel[(grid_n, grid_m, split)](
        x2, weight, scale, out, m, n, k, x2.stride(0), weight.stride(0), n, scale.stride(0),
        m * n, per_split, BLOCK_SCALE=mode == "block", BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=BLOCK, SPLIT=split, DOT_F32=INTERPRET, num_warps=warps, num_stages=stages,
        **pdl_options(pdl),
    )  # fmt: skip
    return out if split == 1 else out.sum(0).to(x2.dtype)


def splitk_gemv(x2, weight, scale, mode, config=None):
    """y [M, N] = x2 [M, K] W^T through `_splitk_kernel` (M <= 8): a grid of N tiles x K
    splits; config (BLOCK_N, BLOCK_K, num_warps, reduce) with reduce "atomic" (the last
    program of a tile sums the splits) or "kernel" (`_sum_splits_kernel` does)."""
    block_n, block_k, warps, reduce = config or SPLITK_CONFIG
    m, k = x2.shape
    n = weight.shape[0]
    if mode == "block" and 128 % block_n:
        raise ValueError(f"split-K BLOCK_N {block_n} must divide 128")
    grid_n, splits = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    atomic = reduce == "atomic" and grid_n <= MAX_COUNTERS
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    ws = y if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x2.device)
    counters = arrival_counters(x2.device) if atomic and splits > 1 else ws
    pdl = pdl_mode(x2, "gemv")
    _splitk_kernel[(grid_n, splits)](
        x2, weight, scale, y, ws, counters, m, n, k, x2.stride(0), weight.stride(0),
        y.stride(0), scale.stride(0), splits, SPLIT=splits > 1, BLOCK_SCALE=mode == "block",
        BLOCK_M=next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, REDUCE=atomic,
        EVEN=n % block_n == 0 and k % block_k == 0, num_warps=warps, **pdl_options(pdl),
    )  # fmt: skip
    if splits > 1 and not atomic:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            ws, y, m * n, splits, BLOCK=block, num_warps=4, **pdl_options(pdl)
        )
    return y


def sk_splits(programs: int, chunks: int, target: int | None = None) -> int:
    """Split-K ways for `_sk_kernel`'s grid of `programs` (N tiles x M tiles): double while
    under `target` (MIN_PROGRAMS) programs, at most one 128-column chunk per split."""
    target = MIN_PROGRAMS if target is None else target
    split = 1
    while programs * split < target and split * 2 <= chunks:
        split *= 2
    return split


def sk_gemm(x2, weight, scale, mode, path="sk_w8a16", config=None, quantized=None):
    """y [M, N] = x2 [M, K] W^T through `_sk_kernel` (split-K tensor cores, splits summed in
    the kernel): `path` sk_w8a16 (W to bf16/fp16 in registers), sk_w8a8 (x quantised per row
    per 128 columns inside the kernel) or sk_w8a8_pre (x quantised by quantize_activations, or
    `quantized` given: see w8a8_gemm). config: (BLOCK_N, BLOCK_M cap, num_warps, num_stages,
    splits), splits 0: sk_splits'."""
    block_n, max_block_m, warps, stages, splits = config or SK_CONFIG
    act = SK_PATHS[path]
    m, k = x2.shape
    n = weight.shape[0]
    block_m = min(max(16, next_power_of_2(m)), max(16, max_block_m))
    grid_n, grid_m = triton.cdiv(n, block_n), triton.cdiv(m, block_m)
    n_chunks = triton.cdiv(k, BLOCK)
    splits = min(splits or sk_splits(grid_n * grid_m, n_chunks), n_chunks)
    chunks = triton.cdiv(n_chunks, splits)
    splits = triton.cdiv(n_chunks, chunks)  # no empty splits
    if splits > 1 and grid_n * grid_m > MAX_COUNTERS:
        raise ValueError(f"split-K FP8 GEMM: {grid_n * grid_m} tiles, at most {MAX_COUNTERS}")
    if act == 2:
        xin, xs = quantized if quantized is not None else quantize_activations(x2)
    else:
        xin, xs = x2, scale  # xs unused
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if splits > 1:
        ws = torch.empty((splits, grid_m, n, block_m), dtype=torch.float32, device=x2.device)
        counters = arrival_counters(x2.device)
    else:
        ws = counters = y  # unused
    even = n % block_n == 0 and k == splits * chunks * BLOCK
    pdl = pdl_mode(x2, "gemv")
    _sk_kernel[(grid_n, grid_m, splits)](
        xin, xs, weight, scale, y, ws, counters, m, n, k, xin.stride(0), xs.stride(0),
        weight.stride(0), y.stride(0), scale.stride(0), chunks, splits, ACT=act,
        BLOCK_SCALE=mode == "block", BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=splits > 1,
        EVEN=even, DOT_F32=INTERPRET, INTERP=INTERPRET, num_warps=warps, num_stages=stages,
        **pdl_options(pdl),
    )  # fmt: skip
    return y


def dequantize(weight, scale, mode, dtype=torch.bfloat16):
    """W [N, K] in `dtype`: e4m3 times its scales (float32 product), by `_dequant_kernel`."""
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    block_n, block_k = 32, BLOCK
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight, scale, out, n, k, weight.stride(0), scale.stride(0), out.stride(0),
        BLOCK_SCALE=mode == "block", BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out


def quantize_activations(x2, column_major: bool = False):
    """(e4m3 [M, K], float32 scales [M, ceil(K/128)]): per token, per 128 columns; the
    scales stored column-major (strides (1, M)) with `column_major`, as cuBLASLt takes them."""
    m, k = x2.shape
    groups = triton.cdiv(k, BLOCK)
    q = torch.empty((m, k), dtype=FP8, device=x2.device)
    if column_major:
        s = torch.empty((groups, m), dtype=torch.float32, device=x2.device).t()
    else:
        s = torch.empty((m, groups), dtype=torch.float32, device=x2.device)
    if m:
        _act_quant_kernel[(m, groups)](
            x2, q, s, k, x2.stride(0), q.stride(0), s.stride(0), s.stride(1), BLOCK_K=BLOCK,
            ROUND=INTERPRET, num_warps=1,
        )  # fmt: skip
    return q, s


def w8a8_gemm(x2, weight, scale, mode, config=None, quantized=None):
    """y [M, N] = x2 [M, K] W^T with x2 quantised per token per 128 columns (FP8 MMA);
    `quantized`: (q, scales) given, e.g. by reference_quantize_activations."""
    block_n, block_m, warps, stages = config or GEMM_CONFIG
    m, k = x2.shape
    n = weight.shape[0]
    q, a_s = quantized if quantized is not None else quantize_activations(x2)
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    block_m = min(block_m, max(16, next_power_of_2(m)))
    _w8a8_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        q, a_s, weight, scale, y, m, n, k, q.stride(0), a_s.stride(0), weight.stride(0),
        y.stride(0), scale.stride(0), BLOCK_SCALE=mode == "block", BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=BLOCK, DOT_F32=INTERPRET, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def scaled_mm(x2, weight, scale, config):
    """y [M, N] = x2 W^T by cuBLASLt's block-wise FP8 GEMM (torch._scaled_mm, 1x128 activation
    groups x 128x128 weight blocks; CUDA only): x2 quantised as quantize_activations does.
    config: the layout benchmarks/fp8_sweep.py's probe found to work, {"api": "v1" (
    torch._scaled_mm) | "v2" (F.scaled_mm), "scale_a": "col" | "row", "scale_b": "t" (the
    [K/128, N/128] transposed view of the block scales) | "t_contig"}."""
    m = x2.shape[0]
    if m % SCALED_MM_ROWS:  # cuBLASLt refuses some row counts (M = 3 on the H200): zero rows
        x2 = F.pad(x2, (0, 0, 0, -m % SCALED_MM_ROWS))
    q, a_s = quantize_activations(x2, column_major=config["scale_a"] == "col")
    b_s = scale.t() if config["scale_b"] == "t" else scale.t().contiguous()
    if config["api"] == "v2":
        from torch.nn.functional import ScalingType

        y = F.scaled_mm(
            q, weight.t(), a_s, ScalingType.BlockWise1x128, b_s, ScalingType.BlockWise128x128,
            output_dtype=x2.dtype,
        )  # fmt: skip
    else:
        y = torch._scaled_mm(q, weight.t(), scale_a=a_s, scale_b=b_s, out_dtype=x2.dtype)
    return y[:m]


def choice(m: int) -> str:
    """The path `linear` takes for M rows: fma | dot | dequant | w8a8 | w8a16 (PATH_TABLE's
    first entry whose M bound holds, when set; else by the thresholds)."""
    if PATH_TABLE:
        for max_m, path in PATH_TABLE:
            if m <= max_m:
                return path
        return PATH_TABLE[-1][1]
    if m <= FMA_MAX_M:
        return "fma"
    if m <= SKINNY_MAX_M:
        return "dot"
    return PREFILL_GEMM


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs a kernel for x (else the caller takes its reference)."""
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == FP8
        and weight.stride(-1) == 1
        and runs_triton(x)
    )


def route(x2: torch.Tensor, n: int, k: int, mode: str):
    """(path, config) for x2 [M, K] times an N x K weight: the tuned table's row for this
    device and shape or one borrowed (block scales only; fp8_table.lookup), else (choice(M),
    None)."""
    m = x2.shape[0]
    if TUNED and mode == "block":
        hit = fp8_table.lookup(TUNED, x2.device, n, k, m)
        if hit is not None:
            return hit
    return choice(m), None


def linear(x, weight, scale, mode, bias=None, path: str | None = None, config=None):
    """x [..., K] W^T (+ bias) for an e4m3 W [N, K] with `mode` scales (see the module doc);
    `path` (and its `config`) forces one of the paths (tests, benchmarks), else route()."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) != k):
        x2 = x2.contiguous()
    m = x2.shape[0]
    if path is None:
        path, config = route(x2, weight.shape[0], k, mode)
    if m == 0:
        y = x2.new_empty((0, weight.shape[0]))
    elif path == "fma":
        y = fma_gemv(x2, weight, scale, mode, config)
    elif path == "splitk":
        y = splitk_gemv(x2, weight, scale, mode, config)
    elif path == "stream":
        y = stream_gemv(x2, weight, scale, mode, config)
    elif path == "dot":
        y = dot_gemm(x2, weight, scale, mode, config)
    elif path == "w8a16":
        y = dot_gemm(x2, weight, scale, mode, config or GEMM_CONFIG, split_k=1)
    elif path == "w8a8":
        y = w8a8_gemm(x2, weight, scale, mode, config)
    elif path in SK_PATHS:
        y = sk_gemm(x2, weight, scale, mode, path, config)
    elif path == "dequant":
        y = F.linear(x2, dequantize(weight, scale, mode, x2.dtype))
    elif path == "scaled_mm" and mode == "block" and x2.is_cuda:
        y = scaled_mm(x2, weight, scale, config or SCALED_MM_CONFIG)
    else:
        raise ValueError(
            f"FP8 GEMM path {path!r}: use fma, splitk, stream, dot, w8a16, w8a8, sk_w8a16, "
            "sk_w8a8, sk_w8a8_pre, dequant or (CUDA, block scales) scaled_mm"
        )
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y


# ---------------------------------------------------------------------------- references


def full_scale(weight: torch.Tensor, scale: torch.Tensor, mode: str) -> torch.Tensor:
    """The float32 scale of every element of W [N, K]."""
    n, k = weight.shape
    if mode == "row":
        return scale.view(n, 1).expand(n, k)
    return scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def reference_linear(x, weight, scale, mode, bias=None, dtype=torch.float32):
    """x W^T with W dequantised, in `dtype` (float32, or float64 for a tight reference)."""
    w = weight.to(dtype) * full_scale(weight, scale, mode).to(dtype)
    return F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))


def reference_quantize_activations(x2: torch.Tensor):
    """The torch twin of quantize_activations."""
    m, k = x2.shape
    groups = -(-k // BLOCK)
    padded = torch.zeros(m, groups * BLOCK, dtype=torch.float32, device=x2.device)
    padded[:, :k] = x2.float()
    blocks = padded.view(m, groups, BLOCK)
    s = blocks.abs().amax(dim=-1).clamp(min=1e-10 * E4M3_MAX) / E4M3_MAX
    q = (blocks / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.view(m, -1)[:, :k], s


def reference_w8a8(x, weight, scale, mode, dtype=torch.float32):
    """x W^T with x quantised as quantize_activations does, both dequantised, in `dtype`."""
    x2 = x.reshape(-1, x.shape[-1])
    q, s = reference_quantize_activations(x2)
    xq = q.to(dtype) * s.to(dtype).repeat_interleave(BLOCK, 1)[:, : x2.shape[1]]
    return reference_linear(xq, weight, scale, mode, dtype=dtype).view(*x.shape[:-1], -1)
