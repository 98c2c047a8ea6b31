"""Where the Triton kernels run: compiled on CUDA tensors, and on CPU tensors through Triton's
interpreter when TRITON_INTERPRET=1 was set before triton was first imported (the CPU tests;
triton decides at import whether its own helpers are interpreted). Elsewhere the callers take
their torch references. Importing this module imports triton: the package imports the kernel
modules only when a Triton backend is built, so a test can still set TRITON_INTERPRET first.
Without triton installed the kernel modules import all the same (nothing is launched)."""

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the CPU CI installs no triton: every op takes its torch reference

    class _NoTriton:
        """Just enough of `triton` and `triton.language` for kernel definitions to import."""

        constexpr = None

        @staticmethod
        def jit(fn=None, **options):
            return fn if fn is not None else (lambda f: f)

    triton = tl = _NoTriton()
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def runs_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run on x's device."""
    return HAS_TRITON and (x.is_cuda or INTERPRET)


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
