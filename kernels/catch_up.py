"""One kernel for a plain step's deferred catch-up record (executor/catch_up.py): per batch row,
its token id and its feature row (the concatenation of up to four sources, written in place, so
no concatenated copy is made) go to entry min(count, depth - 1) of its request row, and the
count of a live row grows by one. Six torch ops otherwise; on the step of a small model each
costs about as much as a projection."""

from __future__ import annotations

from speculant.kernels.reference import record_catch_up
from speculant.kernels.runtime import runs_triton, tl, triton

MAX_SOURCES = 4


@triton.jit
def _copy_part(src, stride, out, pid, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Row `pid` of one feature part ([bs, WIDTH], row stride `stride`) to `out`."""
    for c in range(0, WIDTH, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        ok = cols < WIDTH
        x = tl.load(src + pid * stride + cols, mask=ok)
        tl.store(out + cols, x.to(out.dtype.element_ty), mask=ok)


@triton.jit
def _record_kernel(
    rows_ptr, ids_ptr, s0, s1, s2, s3, stride0, stride1, stride2, stride3, W0: tl.constexpr,
    W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
    buf_ids_ptr, buf_ptr, count_ptr, sentinel, DEPTH: tl.constexpr, WIDTH: tl.constexpr,
    HAS_IDS: tl.constexpr, NUM_SOURCES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row = tl.load(rows_ptr + pid)
    count = tl.load(count_ptr + row)
    j = tl.minimum(count, DEPTH - 1)
    entry = row * DEPTH + j
    if HAS_IDS:
        tl.store(buf_ids_ptr + entry, tl.load(ids_ptr + pid))
    out = buf_ptr + entry * WIDTH
    if NUM_SOURCES > 0:
        _copy_part(s0, stride0, out, pid, W0, BLOCK)
    if NUM_SOURCES > 1:
        _copy_part(s1, stride1, out + W0, pid, W1, BLOCK)
    if NUM_SOURCES > 2:
        _copy_part(s2, stride2, out + W0 + W1, pid, W2, BLOCK)
    if NUM_SOURCES > 3:
        _copy_part(s3, stride3, out + W0 + W1 + W2, pid, W3, BLOCK)
    tl.store(count_ptr + row, count + (row != sentinel).to(count.dtype))


def record(rows, ids, sources, buf_ids, buf, count, sentinel: int) -> None:
    """rows [bs] (request rows; padded ones the sentinel, which keeps count 0), ids [bs] or
    None, sources: [bs, w_i] feature parts whose widths sum to buf's [R, depth, width] last
    dimension (none for width 0); buf_ids [R, depth], count [R]."""
    width = buf.shape[-1]
    parts = [s for s in sources if s.shape[-1]]
    usable = len(parts) <= MAX_SOURCES and all(p.stride(-1) == 1 for p in parts)
    if not (runs_triton(rows) and usable and buf.is_contiguous() and buf_ids.is_contiguous()):
        record_catch_up(rows, ids, sources, buf_ids, buf, count, sentinel)
        return
    bs = rows.shape[0]
    if bs == 0:
        return
    padded = parts + [parts[0] if parts else buf] * (MAX_SOURCES - len(parts))
    widths = [p.shape[-1] for p in parts] + [0] * (MAX_SOURCES - len(parts))
    strides = [p.stride(0) if p.dim() > 1 else 0 for p in padded]
    _record_kernel[(bs,)](
        rows, ids if ids is not None else rows, *padded, *strides, *widths, buf_ids, buf, count,
        sentinel, DEPTH=buf.shape[1], WIDTH=width, HAS_IDS=ids is not None,
        NUM_SOURCES=len(parts), BLOCK=1024, num_warps=4,
    )  # fmt: skip
