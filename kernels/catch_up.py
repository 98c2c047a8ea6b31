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
    offset = 0
    for s in tl.static_range(NUM_SOURCES):
        src = s0 if s == 0 else (s1 if s == 1 else (s2 if s == 2 else s3))
        width: tl.constexpr = W0 if s == 0 else (W1 if s == 1 else (W2 if s == 2 else W3))
        stride = stride0 if s == 0 else (stride1 if s == 1 else (stride2 if s == 2 else stride3))
        for c in range(0, width, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            ok = cols < width
            x = tl.load(src + pid * stride + cols, mask=ok)
            tl.store(out + offset + cols, x.to(buf_ptr.dtype.element_ty), mask=ok)
        offset += width
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
