"""SiLU-and-mul: silu(gate) * up from the fused gate-up projection [N, 2I], in one kernel.
Rounds like the torch reference: silu in float32 cast to the activation dtype, then the
product in that dtype."""

import torch

from speculant.kernels import reference
from speculant.kernels.runtime import pdl_enter, pdl_mode, pdl_options, runs_triton, tl, triton

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, width, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * width + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [N, I]."""
    if not runs_triton(gate_up) or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        return reference.silu_and_mul(gate_up)
    n, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, width), dtype=gate_up.dtype, device=gate_up.device)
    if n:
        _silu_and_mul_kernel[(n, -(-width // BLOCK))](
            gate_up, out, gate_up.stride(0), width, BLOCK=BLOCK, num_warps=4,
            **pdl_options(pdl_mode(gate_up, "act")),
        )  # fmt: skip
    return out
