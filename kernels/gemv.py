"""y = x W^T for a single row x (M = 1: decode at bs 1, and each draft step of a bs-1 request),
bf16/fp16 weights, as a Triton matrix-vector kernel that streams W once.

At M = 1 cuBLAS picks tensor-core GEMM tiles 8 rows tall and, for the narrow o_proj / down_proj
shapes, a split-K plan with a separate reduce kernel; on one H200 this kernel was faster on the
Llama-3.1-8B qkv, o_proj and down_proj shapes and needs no reduce, but slower on the tall
gate_up (benchmarks/levers.py, benchmarks/results/levers.md). Computing SiLU-and-mul inside the
down projection's GEMV (one kernel fewer) made it slower: every program recomputes the whole
activation row.

Each program owns BLOCK_N output rows and walks K in BLOCK_K chunks, accumulating in float32
registers, then reduces once. Other shapes and dtypes (M > 1, float32, tall weights, sizes the
blocks do not divide) go to F.linear."""

import torch
import torch.nn.functional as F

from speculant.kernels.runtime import (
    next_power_of_2,
    pdl_enter,
    pdl_mode,
    pdl_options,
    prefetch_l2,
    runs_triton,
    tl,
    triton,
)

BLOCK_N = 8
# Taller weights (gate_up at 28672 rows, LM heads) stay on cuBLAS: inside the whole 8B step its
# GEMM streams them at the copy bandwidth (55 us for gate_up) where this kernel took ~63 us.
MAX_ROWS = 8192
# Under PDL (kernels/runtime.py) each program asks L2 for the first bytes of its weight rows
# before it waits for the kernel that produces x: the weight stream starts while that kernel
# runs. Bytes per program (power of two; 0: none).
PREFETCH_BYTES = 16384


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, stride_w, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH_LINES > 0:  # weights only: nothing an earlier kernel writes
        lines = tl.arange(0, PREFETCH_LINES) * LINE
        prefetch_l2(w_ptr + rows[:, None] * stride_w + lines[None, :])
    pdl_enter(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + cols).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :]).to(tl.float32)
        acc += w * x[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))


def gemv_plan(n: int, k: int) -> tuple[int, int] | None:
    """(BLOCK_K, num_warps) for an [n, k] weight, or None for cuBLAS: weights taller than
    MAX_ROWS, or sizes the blocks do not tile. Measured best on the H200: BLOCK_K 512 (or the
    largest power of two that divides k), 8 warps for long rows (down_proj)."""
    if n % BLOCK_N or n > MAX_ROWS:
        return None
    block_k = 512
    while block_k >= 64 and k % block_k:
        block_k //= 2
    if k % block_k:
        return None
    return block_k, 8 if k >= 8192 else 4


def _prefetch_lines(row_lines: int, budget: int) -> int:
    """128-byte lines per weight row to prefetch: the budget, at most the row, a power of 2."""
    lines = min(row_lines, budget)
    return next_power_of_2(lines + 1) // 2 if lines > 0 else 0


def uses_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.numel() == x.shape[-1]
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
        and runs_triton(x)
        and gemv_plan(*weight.shape) is not None
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear(x, weight, bias), through the GEMV kernel when x is one row (see above)."""
    if not uses_gemv(x, weight):
        return F.linear(x, weight, bias)
    n, k = weight.shape
    block_k, warps = gemv_plan(n, k)
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    pdl = pdl_mode(x, "gemv")
    line = 128 // weight.element_size()
    lines = _prefetch_lines(k // line, PREFETCH_BYTES // 128 // BLOCK_N) if pdl else 0
    _gemv_kernel[(n // BLOCK_N,)](
        x.contiguous(), weight, y, weight.stride(0), K=k, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
        PREFETCH_LINES=lines, LINE=line, num_warps=warps, num_stages=2, **pdl_options(pdl),
    )  # fmt: skip
    return y + bias if bias is not None else y
