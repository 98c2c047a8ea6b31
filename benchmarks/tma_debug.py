"""Why the TMA W-tile variant of the FP8 split-K kernel was 2.6e-2 off on the H200 (fp8_wave6.md):
a standalone check of (1) an e4m3 tile loaded through a TensorDescriptor vs plain loads (bytes),
(2) tl.dot of that tile with e4m3 activations (FP8 MMA) vs the plain-loaded tile, (3) the same
with the tile converted to bf16 first. Prints where and how much they differ.

    python benchmarks/tma_debug.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _kernel(w_ptr, w_desc, x_ptr, copy_ptr, dot_ptr, K, BN: tl.constexpr, BM: tl.constexpr,
            TMA: tl.constexpr, MODE: tl.constexpr, STAGES_LOOP: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    ms = tl.arange(0, BM)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for kc in range(0, STAGES_LOOP):
        cols = kc * 128 + tl.arange(0, 128)
        if TMA:
            w = w_desc.load([tl.program_id(0) * BN, kc * 128])
        else:
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :])
        if kc == 0:
            tl.store(copy_ptr + rows[:, None] * 128 + tl.arange(0, 128)[None, :], w.to(tl.float32))
        xt = tl.load(x_ptr + ms[None, :] * K + cols[:, None])  # e4m3 [128, BM]
        if MODE == 0:
            acc += tl.dot(w, xt)
        else:
            acc += tl.dot(w.to(tl.bfloat16), xt.to(tl.bfloat16))
    tl.store(dot_ptr + rows[:, None] * BM + ms[None, :], acc)


def run(n, k, m, bn, tma, mode, stages):
    gen = torch.Generator(device="cuda").manual_seed(0)
    fp8 = torch.float8_e4m3fn
    w = (torch.randn(n, k, generator=gen, device="cuda") * 32).clamp(-448, 448).to(fp8)
    x = (torch.randn(m, k, generator=gen, device="cuda") * 32).clamp(-448, 448).to(fp8)
    copy = torch.zeros(n, 128, device="cuda")
    dot = torch.zeros(n, m, device="cuda")
    desc = TensorDescriptor.from_tensor(w, [bn, 128])
    _kernel[(n // bn,)](w, desc, x, copy, dot, k, BN=bn, BM=m, TMA=tma, MODE=mode,
                        STAGES_LOOP=k // 128, num_warps=4, num_stages=stages)  # fmt: skip
    torch.cuda.synchronize()
    ref = w.float() @ x.float().t()
    return copy, dot, w[:, :128].float(), ref


def main():
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    for n, k, m, bn in ((256, 512, 16, 128), (256, 512, 64, 64), (512, 1024, 16, 128)):
        for mode in (0, 1):
            for stages in (1, 3):
                for tma in (False, True):
                    copy, dot, w0, ref = run(n, k, m, bn, tma, mode, stages)
                    copy_bad = (copy != w0).sum().item()
                    err = ((dot - ref).norm() / ref.norm()).item()
                    bad_rows = ((dot - ref).abs() > 1e-3 * ref.abs().max()).any(1).nonzero()
                    bad_cols = ((dot - ref).abs() > 1e-3 * ref.abs().max()).any(0).nonzero()
                    print(f"n{n} k{k} m{m} bn{bn} mode{'fp8' if mode == 0 else 'bf16'} st{stages} "
                          f"tma{int(tma)}: copy mismatches {copy_bad}, dot rel err {err:.2e}, "
                          f"bad rows {bad_rows.flatten()[:8].tolist()} ({len(bad_rows)}), "
                          f"bad cols {bad_cols.flatten()[:8].tolist()} ({len(bad_cols)})",
                          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
