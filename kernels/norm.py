"""RMSNorm, and residual-add + RMSNorm in one pass. Both round like the torch reference
(kernels/reference.py, the models' RMSNorm): the add in the activation dtype, the norm in
float32 cast back to that dtype, then the weight product in the output dtype; only the order of
the float32 sum of squares differs."""

import torch

from speculant.kernels import reference
from speculant.kernels.runtime import (
    next_power_of_2,
    pdl_enter,
    pdl_mode,
    pdl_options,
    runs_triton,
    tl,
    triton,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    w_ptr,
    out_ptr,
    residual_out_ptr,
    rows_per_token,
    stride_xt,
    stride_xr,
    eps,
    N_COLS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    # one program per row; x is [tokens, rows_per_token, N_COLS] with a contiguous last dim
    row = tl.program_id(0).to(tl.int64)
    token, sub = row // rows_per_token, row % rows_per_token
    cols = tl.arange(0, BLOCK)
    mask = cols < N_COLS
    x = tl.load(x_ptr + token * stride_xt + sub * stride_xr + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * N_COLS + cols, mask=mask, other=0.0)
        summed = (x + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * N_COLS + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N_COLS + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N_COLS + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps):
    cols = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    x3 = x if x.dim() == 3 else x.reshape(-1, 1, cols)
    rows = x3.shape[0] * x3.shape[1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    residual_out = torch.empty_like(residual) if residual is not None else None
    block = next_power_of_2(cols)
    if rows:
        _rms_norm_kernel[(rows,)](
            x3,
            residual.contiguous() if residual is not None else x3,
            weight,
            out,
            residual_out if residual is not None else out,
            x3.shape[1],
            x3.stride(0),
            x3.stride(1),
            eps,
            N_COLS=cols,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=max(1, min(16, block // 512)),
            **pdl_options(pdl_mode(x, "norm")),
        )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] (2-D, or 3-D with strided rows such as a q/k
    view of the fused QKV output)."""
    if not runs_triton(x) or x.dim() not in (2, 3):
        return reference.rms_norm(x, weight, eps)
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) in one kernel; x and residual are [N, D]."""
    if not runs_triton(x) or x.dim() != 2 or residual.dtype != x.dtype:
        return reference.add_rms_norm(x, residual, weight, eps)
    return _launch(x, residual, weight, eps)
