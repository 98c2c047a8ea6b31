"""Weights read into L2 ahead of the GEMVs that need them, on a side stream, while the step's
latency-bound kernels leave HBM idle (an experiment lever, off as shipped: `TritonOps`
`l2_prefetch_bytes`).

At bs 1 a decoder layer's projections stream their weights near the copy bandwidth, but the
attention chain between the QKV and the o projection (RoPE + KV write, attention, the split
merge: ~13 us a layer on an H100) reads ~2 MB and waits on latency. A `SideStreamPrefetch`
forks a side stream from the current one where it is called (after the QKV projection), asks
L2 for the first bytes of the weights read next (the o projection's, then the MLP's gate_up
rows in the order its programs read them) and joins the side stream back when closed (the end
of the forward), so the main chain never waits on it, inside a CUDA graph (a parallel branch)
or not. Prefetching writes nothing: the tokens cannot change, only the time."""

from __future__ import annotations

import torch

from speculant.kernels.runtime import HAS_TRITON, INTERPRET, prefetch_l2, tl, triton

LINE = 128  # bytes a prefetch asks for
LINES_PER_PROGRAM = 1024


@triton.jit
def _prefetch_kernel(ptr, last_line, LINES: tl.constexpr):
    """Lines [pid * LINES, (pid + 1) * LINES) of the bytes at ptr, clamped to `last_line`."""
    lines = tl.program_id(0) * LINES + tl.arange(0, LINES)
    prefetch_l2(ptr + tl.minimum(lines, last_line).to(tl.int64) * 128)


def prefetch_bytes(tensor: torch.Tensor, most: int) -> int:
    """Ask L2 for the first whole lines of a contiguous tensor's bytes, at most `most` bytes, on
    the current stream; the bytes asked for."""
    lines = min(tensor.numel() * tensor.element_size(), most) // LINE
    if lines > 0:
        raw = tensor.view(-1).view(torch.uint8)
        grid = (triton.cdiv(lines, LINES_PER_PROGRAM),)
        _prefetch_kernel[grid](raw, lines - 1, LINES=LINES_PER_PROGRAM, num_warps=4)
    return max(lines, 0) * LINE


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device, kept (a stream made during capture would not be)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class SideStreamPrefetch:
    """Prefetches of up to `budget` bytes per call on a side stream (see the module doc);
    `close()` joins it to the stream it forked from. Does nothing where Triton does not run
    compiled (the CPU, the interpreter: no inline assembly there)."""

    def __init__(self, device: torch.device, budget: int):
        self.budget = budget
        self.enabled = budget > 0 and device.type == "cuda" and HAS_TRITON and not INTERPRET
        self.forked = False
        if self.enabled:
            self.main = torch.cuda.current_stream(device)
            self.side = side_stream(device)

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        """Ask L2 for the first `budget` bytes of `tensors`, in order (each contiguous)."""
        if not self.enabled:
            return
        self.side.wait_stream(self.main)  # after what the main stream launched so far
        self.forked = True
        left = self.budget
        with torch.cuda.stream(self.side):
            for tensor in tensors:
                left -= prefetch_bytes(tensor, left)
                if left < LINE:
                    break

    def close(self) -> None:
        if self.forked:
            self.main.wait_stream(self.side)
            self.forked = False
