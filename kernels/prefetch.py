"""Weight prefetch into L2 on a side stream while the small kernels of a layer run (bs-1 and
small-batch decode, CUDA only).

At bs 1 a decode layer streams its projection weights in four GEMVs and runs six or seven small
kernels between them (norms, RoPE + KV write, attention and its split merge, SiLU-and-mul) that
leave HBM idle for ~20 us a layer. A `Prefetcher` forks a side stream after a projection's
launch and asks L2 for the first bytes of the next projections' weights there (`prefetch.global
.L2`, no registers written), so those bytes arrive while the small kernels run; the main stream
joins the side stream at the end of the forward (CUDA-graph capture needs every fork joined).
Nothing a kernel computes changes: prefetches only move weight bytes into L2 earlier.

A plan says what to prefetch after which projection: {after: [(target, axis, start, end),
...]} with `after` one of qkv, o, gate_up, down; `target` a projection of the same layer, or
`next.qkv` (the next layer's); `axis` "rows" (rows start..end of the weight, as fractions, all
columns: the order a row-streaming GEMV reads) or "cols" (columns start..end of every row: the
order a split-K GEMV's first splits read)."""

from __future__ import annotations

import torch

from speculant.kernels.runtime import HAS_TRITON, tl, triton

LINE = 128  # bytes of one L2 line
LINES_PER_PROGRAM = 512
POINTS = ("qkv", "o", "gate_up", "down")
TARGETS = ("qkv", "o", "gate_up", "down", "next.qkv")


@triton.jit
def _prefetch_kernel(
    ptr, total, row_lines, row_stride, LINES: tl.constexpr, EVICT_LAST: tl.constexpr
):  # fmt: skip
    """Lines 0 .. total-1 of a [rows, row_lines] slab of 128-byte lines, row-major."""
    idx = tl.program_id(0) * LINES + tl.arange(0, LINES)
    idx = tl.minimum(idx, total - 1).to(tl.int64)
    ptrs = ptr + (idx // row_lines) * row_stride + (idx % row_lines) * 128
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip


def slab(weight: torch.Tensor, axis: str, start: float, end: float) -> torch.Tensor:
    """The bytes of `weight` [N, K] a plan entry names, as a uint8 [rows, bytes] view."""
    if axis not in ("rows", "cols"):
        raise ValueError(f"prefetch axis {axis!r}: use rows or cols")
    raw = weight.detach().view(torch.uint8) if weight.dtype != torch.uint8 else weight
    raw = raw.view(raw.shape[0], -1)
    n, width = raw.shape
    if axis == "rows":
        return raw[int(n * start) : int(n * end)]
    lo = int(width * start) // LINE * LINE
    hi = -(-int(width * end) // LINE) * LINE
    return raw[:, lo : min(hi, width)]


def launch(view: torch.Tensor, evict_last: bool = False) -> None:
    """Prefetch every 128-byte line of a uint8 [rows, bytes] view into L2."""
    rows, width = view.shape
    row_lines = -(-width // LINE)
    total = rows * row_lines
    if total == 0:
        return
    grid = (triton.cdiv(total, LINES_PER_PROGRAM),)
    _prefetch_kernel[grid](
        view, total, row_lines, view.stride(0), LINES=LINES_PER_PROGRAM, EVICT_LAST=evict_last,
        num_warps=4,
    )  # fmt: skip


def _projections(layer) -> dict:
    attn, mlp = layer.self_attn, layer.mlp
    out = {"qkv": attn.qkv_proj, "o": attn.o_proj}
    if hasattr(mlp, "gate_up_proj"):
        out.update(gate_up=mlp.gate_up_proj, down=mlp.down_proj)
    return out


class Prefetcher:
    """Forward hooks on a decoder's projections that prefetch per `plan` (see the module doc)
    on one side stream, joined after the last layer's last projection. `remove()` detaches."""

    def __init__(self, layers, plan: dict, evict_last: bool = False):
        for after, entries in plan.items():
            if after not in POINTS:
                raise ValueError(f"prefetch point {after!r}: use one of {POINTS}")
            for target, *_ in entries:
                if target not in TARGETS:
                    raise ValueError(f"prefetch target {target!r}: use one of {TARGETS}")
        self.layers, self.plan, self.evict_last = list(layers), plan, evict_last
        device = self.layers[0].self_attn.qkv_proj.weight.device
        # made here, not in a hook: no stream creation inside a CUDA-graph capture
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.forked = False  # a fork since the last join (only a fork's stream may be joined)
        self.handles = []
        self.bytes_per_layer = 0
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            mine = _projections(layer)
            nxt = _projections(self.layers[i + 1]) if i < last else {}
            for after, entries in plan.items():
                if after not in mine:
                    continue
                views = []
                for target, axis, start, end in entries:
                    module = nxt.get("qkv") if target == "next.qkv" else mine.get(target)
                    if module is not None:
                        views.append(slab(module.weight, axis, start, end))
                if i == 0:
                    self.bytes_per_layer += sum(v.numel() for v in views)
                self.handles.append(mine[after].register_forward_hook(self._hook(views)))
            final = mine.get("down", mine["o"])
            if i == last:
                self.handles.append(final.register_forward_hook(self._join))

    def _hook(self, views):
        def hook(module, inputs, output):
            if not views or self.stream is None:
                return
            self.stream.wait_stream(torch.cuda.current_stream(output.device))
            self.forked = True
            with torch.cuda.stream(self.stream):
                for view in views:
                    launch(view, self.evict_last)

        return hook

    def _join(self, module, inputs, output):
        if self.forked:
            torch.cuda.current_stream(output.device).wait_stream(self.stream)
            self.forked = False

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def available() -> bool:
    return HAS_TRITON and torch.cuda.is_available()
