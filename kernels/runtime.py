"""Where the Triton kernels run: compiled on CUDA tensors, and on CPU tensors through Triton's
interpreter when TRITON_INTERPRET=1 was set before triton was first imported (the CPU tests;
triton decides at import whether its own helpers are interpreted). Elsewhere the callers take
their torch references. Importing this module imports triton: the package imports the kernel
modules only when a Triton backend is built, so a test can still set TRITON_INTERPRET first.
Without triton installed the kernel modules import all the same (nothing is launched)."""

import contextlib
import functools
import os

import torch

from speculant.errors import SpeculantError

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # no triton installed: every op takes its torch reference

    class _NoTriton:
        """Just enough of `triton` and `triton.language` for kernel definitions to import."""

        constexpr = None

        @staticmethod
        def jit(fn=None, **options):
            return fn if fn is not None else (lambda f: f)

    triton = tl = _NoTriton()
    HAS_TRITON = False
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # no triton, or one before 3.3: no programmatic dependent launch
    gdc_launch_dependents = gdc_wait = None
    HAS_GDC = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

# Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the
# kernel before it in the stream (or CUDA graph) still runs; it does only work that reads no
# earlier kernel's output (weights, or step inputs written before the forward's first kernel
# without PDL) before `griddepcontrol.wait`, which returns once that kernel has finished and its
# writes are visible. 0: off; 1: each kernel lets its successor launch once it has passed its
# own wait (one kernel of look-ahead); 2: before it (a chain of waiting kernels up to the next
# launch without PDL). Set by SPECULANT_PDL: a mode for every kernel, then `kind=mode` items for
# kinds of kernel (PDL_KINDS), e.g. "1,norm=2,act=2"; mode 0 turns PDL off for all. A model may
# set modes for the kinds its forward launches (`launch_modes`).
PDL_KINDS = ("gemv", "norm", "rope", "act", "attention", "merge", "plan", "logprobs")


def parse_pdl(setting: str) -> tuple[int, dict[str, int]]:
    """(mode, {kind: mode}) of a SPECULANT_PDL value (see above), or SpeculantError naming it."""
    first, *items = [part.strip() for part in setting.split(",")]
    usage = (
        f"SPECULANT_PDL={setting}: use 0 (off), 1 or 2, optionally followed by kind=mode items "
        f"(kinds: {', '.join(PDL_KINDS)}), e.g. 1,norm=2"
    )
    if first not in ("0", "1", "2"):
        raise SpeculantError(usage)
    kinds = {}
    for item in items:
        kind, _, mode = (part.strip() for part in item.partition("="))
        if kind not in PDL_KINDS or mode not in ("1", "2"):
            raise SpeculantError(usage)
        kinds[kind] = int(mode)
    return int(first), kinds


PDL_MODE, ENV_KIND_MODES = parse_pdl(os.environ.get("SPECULANT_PDL", "1"))
PDL_KIND_MODES: dict[str, int] = dict(ENV_KIND_MODES)  # in force now (see launch_modes)


@contextlib.contextmanager
def launch_modes(modes: dict[str, int] | None):
    """Kernels launched inside take `modes` ({kind: PDL mode}) for their kinds: a model's
    forward sets what its own projections measured best with (models/fp8.py); kinds that
    SPECULANT_PDL names keep its modes."""
    global PDL_KIND_MODES
    if not modes:  # (a bf16 model's forward: nothing to set)
        yield
        return
    saved = PDL_KIND_MODES
    PDL_KIND_MODES = {**saved, **modes, **ENV_KIND_MODES}
    try:
        yield
    finally:
        PDL_KIND_MODES = saved


MAX_COUNTERS = 1 << 16  # arrival counters one launch may use
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The int32 arrival counters of the kernels whose last program to arrive finishes the
    work (kernels/fp8.py split-K, kernels/decode_attention.py): zeros, and every launch leaves
    them zero, so launches on one stream share them (each touches them after its PDL wait,
    when the launch before has finished)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("arrival counters: run the kernel once outside graph capture first")
        counters = _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return counters


def runs_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run on x's device."""
    return HAS_TRITON and (x.is_cuda or INTERPRET)


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_mode(x: torch.Tensor, kind: str = "") -> int:
    """The PDL mode for a launch of a `kind` kernel (PDL_KINDS) on x's device: PDL_KIND_MODES'
    or PDL_MODE on compiled sm_90+ CUDA with a triton that has it (3.3+), else 0."""
    if PDL_MODE == 0 or not (HAS_GDC and x.is_cuda) or INTERPRET:
        return 0
    return PDL_KIND_MODES.get(kind, PDL_MODE) if _has_pdl(x.device) else 0


def pdl_options(mode: int) -> dict:
    """Launch options for a kernel that calls `pdl_enter(mode)` first."""
    return {"PDL": mode, "launch_pdl": True} if mode else {"PDL": 0}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Call before a kernel's first read of an earlier kernel's output (see PDL_MODE)."""
    if PDL == 1:
        gdc_wait()
        gdc_launch_dependents()
    elif PDL == 2:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at `ptrs` (no registers written; compiled CUDA only: the
    interpreter has no inline assembly)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
