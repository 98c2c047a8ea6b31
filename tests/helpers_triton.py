"""Where the Triton kernel tests run (tests/test_kernels.py, test_fp8_kernels.py, test_race.py):
imported before any kernel module, it makes a machine without CUDA run the kernels through
Triton's interpreter (TRITON_INTERPRET=1: triton reads it once, when first imported). `CPU`
variants need that interpreter; `CUDA` ones (marked gpu) run compiled."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

from speculant.kernels import runtime  # noqa: E402

CPU = pytest.param(
    "cpu",
    marks=[
        pytest.mark.needs("triton"),
        pytest.mark.skipif(
            runtime.HAS_TRITON and not runtime.INTERPRET,
            reason="CPU variants need Triton's interpreter (TRITON_INTERPRET=1 before triton's "
            "import); with CUDA the cuda variants check the kernels",
        ),
    ],
)
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DEVICES = [CPU, CUDA]
