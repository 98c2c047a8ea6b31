"""Compile the package's Triton kernels for sm_90 on a machine without a GPU, with the arguments
their launch sites pass: each case calls a kernel's wrapper (rms_norm, paged_attention, ...) on
meta tensors with `runs_triton` and `pdl_mode` forced on, the kernels stand aside and record
their launches, and each distinct launch is then specialized as Triton's JIT would on a CUDA
device (dtypes, 16-byte alignment, ints equal to 1 made constant) and compiled with its launch
options (num_warps, launch_pdl). Triton's interpreter (the CPU tests) runs code that compiled
Triton refuses, such as a reassigned constexpr; this finds it without a GPU.

Run as a script, in a process without TRITON_INTERPRET (tests/test_triton_compile.py does):
one line per compiled launch, `ok LABEL` or `FAIL LABEL: the compiler's first error line`, then
`kernel PATH:NAME` for every kernel compiled, then `done`. `--only TEXT` keeps the cases whose
label contains TEXT. The `selfcheck` case launches a kernel with a reassigned constexpr (the bug
the catch-up record kernel once took to an H200): it must be reported as failing."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import speculant
from speculant.kernels import (
    activation,
    catch_up,
    decode_attention,
    fp8,
    fp8_table,
    gemv,
    logprobs,
    norm,
    paged_attention,
    race,
    rank_filter,
    rope,
)

TARGET = GPUTarget("cuda", 90, 32)
H200_SMS = 132
BF16, FP16, FP32, I32, I64 = torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64
MODULES = (activation, catch_up, decode_attention, fp8, gemv, logprobs, norm,
           paged_attention, race, rank_filter, rope)  # fmt: skip
H200 = "NVIDIA H200"


@triton.jit
def _reassigned_constexpr_kernel(out_ptr, BLOCK: tl.constexpr):
    """Runs in the interpreter; compiled Triton refuses `width` (assigned once per unrolled
    iteration)."""
    for s in tl.static_range(2):
        width: tl.constexpr = BLOCK if s == 0 else BLOCK // 2
        tl.store(out_ptr + tl.arange(0, width), s)


def t(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta")


# ------------------------------------------------------------------------------ the cases
# Shapes of the models the engine serves: Llama-3.1-8B (hidden 4096, 32 heads / 8 KV heads of
# 128, MLP 14336; EAGLE-3 heads take 2 x hidden into their QKV), Llama-3.1-70B over TP 8 (8 / 1
# heads per rank, MLP 3584), Qwen3-0.6B (qk-norm over 16 / 8 heads of 128), Qwen3-30B-A3B (32 / 4
# heads, experts 768 wide), DFlash blocks of 16 and the bundled tiny target (4 / 2 heads of 64).


def _norm(x_shape, dtype, residual, cols_view=None):
    def run():
        x = t(*x_shape, dtype=dtype)
        if cols_view is not None:  # a q view of the fused QKV output: [N, heads, d], strided
            n, heads, d = cols_view
            x = x[:, : heads * d].view(n, heads, d)
        w = t(x.shape[-1], dtype=dtype)
        if residual:
            norm.add_rms_norm(x, t(*x.shape, dtype=dtype), w, 1e-5)
        else:
            norm.rms_norm(x, w, 1e-5)

    return run


def _silu(n, width, dtype):
    return lambda: activation.silu_and_mul(t(n, 2 * width, dtype=dtype))


def _rope(n, heads, kv_heads, d, dtype, fused_qkv=True):
    def run():
        if fused_qkv:  # q, k, v: views of the QKV projection's output
            qkv = t(n, (heads + 2 * kv_heads) * d, dtype=dtype)
            q = qkv[:, : heads * d].view(n, heads, d)
            k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
            v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
        else:  # after qk-norm: q and k contiguous, v still a view
            q, k = t(n, heads, d, dtype=dtype), t(n, kv_heads, d, dtype=dtype)
            v = t(n, (heads + 2 * kv_heads) * d, dtype=dtype)[:, (heads + kv_heads) * d :]
            v = v.view(n, kv_heads, d)
        cos = t(n, d, dtype=dtype).unsqueeze(1)  # RotaryEmbedding.lookup: [N, 1, d]
        sin = t(n, d, dtype=dtype).unsqueeze(1)
        pool = (1024 * 16, kv_heads, d)
        rope.rope_and_write_kv(q, k, v, cos, sin, t(*pool, dtype=dtype), t(*pool, dtype=dtype),
                               t(n, dtype=I64))  # fmt: skip

    return run


def _top_logprobs(rows, vocab, num_top):
    return lambda: logprobs.top_logprobs(t(rows, vocab, dtype=FP32), num_top)


def _race(rows, vocab, ids):
    """The sampler's race (executor/sampling.py on CUDA): ids None, one map [V] or one per row."""
    shape = {"none": None, "shared": (vocab,), "rows": (rows, vocab)}[ids]

    def run():
        index = None if shape is None else t(*shape, dtype=I64)
        race.race(t(rows, vocab, dtype=FP32), t(rows, dtype=I64), index)

    return run


def _rank(rows, vocab, dtype):
    """The sampler's top-k / top-p cut (executor/sampling.py on CUDA, from 64 rows)."""
    return lambda: rank_filter.rank_filter_(t(rows, vocab, dtype=FP32), t(rows, vocab, dtype=dtype),
                                            t(rows, dtype=I64), t(rows, dtype=FP32))  # fmt: skip


def _gemv(n, k, dtype):
    return lambda: gemv.linear(t(1, k, dtype=dtype), t(n, k, dtype=dtype))


def _attention(
    bs, tokens, heads, kv_heads, d, kv_len, dtype, page_size=16, seq_lens=None, layout=None
):
    """Decode / verify (`tokens` per row), a DFlash block (tokens = 16) or, with `seq_lens`, a
    packed prefill; `layout` "plan" (a step's RowPlan) or "order" (rows longest first)."""

    def run():
        n = sum(seq_lens) if seq_lens else bs * tokens
        pool = (4096 * page_size, kv_heads, d)
        varlen = plan = order = None
        if seq_lens:
            varlen = paged_attention.varlen_tiles(seq_lens, heads // kv_heads, "meta")
        if layout == "plan":
            plan = paged_attention.row_plan(t(n, dtype=I64), bs, tokens, kv_len, kv_heads)
        elif layout == "order":
            order = t(bs, dtype=I32)
        paged_attention.paged_attention(
            t(n, (heads + 2 * kv_heads) * d, dtype=dtype)[:, : heads * d].view(n, heads, d),
            t(*pool, dtype=dtype), t(*pool, dtype=dtype), t(513, 64, dtype=I32),
            t(len(seq_lens) if seq_lens else bs, dtype=I64), t(n, dtype=I64), page_size,
            kv_len, tokens, varlen=varlen, plan=plan, row_order=order,
        )  # fmt: skip

    return run


def _fused_decode(bs, heads, kv_heads, d, kv_len, dtype, early=True, page_size=16):
    """One-token decode with RoPE, the KV write and the merge in one launch (bs 1: the engine's
    bs-1 decode and draft steps)."""

    def run():
        qkv = t(bs, (heads + 2 * kv_heads) * d, dtype=dtype)
        q = qkv[:, : heads * d].view(bs, heads, d)
        k = qkv[:, heads * d : (heads + kv_heads) * d].view(bs, kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d :].view(bs, kv_heads, d)
        cos, sin = t(bs, 1, d, dtype=dtype), t(bs, 1, d, dtype=dtype)
        pool = (4096 * page_size, kv_heads, d)
        decode_attention.fused_decode_attention(
            q, k, v, cos, sin, t(*pool, dtype=dtype), t(*pool, dtype=dtype), t(bs, dtype=I64),
            t(513, 64, dtype=I32), t(bs, dtype=I64), t(bs, dtype=I64), page_size, kv_len,
            early=early,
        )  # fmt: skip

    return run


def _record(bs, widths, dtype, ids=True):
    """A plain step's catch-up record: EAGLE-3 (ids and the target's aux hidden states),
    DFlash (features only), a draft model (ids only)."""

    def run():
        rows = 513
        parts = [t(bs, w, dtype=dtype) for w in widths]
        catch_up.record(t(bs, dtype=I64), t(bs, dtype=I64) if ids else None, parts,
                        t(rows, 8, dtype=I64), t(rows, 8, sum(widths), dtype=dtype),
                        t(rows, dtype=I64), rows - 1)  # fmt: skip

    return run


def _prefill(seq_lens, heads, kv_heads, d, kv_len, dtype):
    return _attention(0, 0, heads, kv_heads, d, kv_len, dtype, seq_lens=seq_lens)


# FP8 linears (kernels/fp8.py): the Llama-3.1-8B projections (N, K) with an e4m3 weight
QKV, O_PROJ, GATE_UP, DOWN = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)
LLAMA_8B_FP8 = {"qkv": QKV, "o": O_PROJ, "gate_up": GATE_UP, "down": DOWN}
RAGGED = (1000, 328)  # partial 128-blocks: the launchers' EVEN=False variants
FP8_MS = (1, 2, 4, 16, 64, 256)


def _fp8_operands(m, n, k, mode, dtype):
    scale = t(-(-n // 128), -(-k // 128), dtype=FP32) if mode == "block" else t(n, dtype=FP32)
    return t(m, k, dtype=dtype), t(n, k, dtype=fp8.FP8), scale


def fp8_h200_route(m, n, k, mode):
    """(path, config) fp8.route takes on an H200 for M rows (the tuned table's row for the
    shape, scaled_mm included, else fp8.choice): the meta tensors' own route sees no GPU."""
    saved = fp8_table.device_name
    fp8_table.device_name = lambda device: H200
    try:
        return fp8.route(SimpleNamespace(shape=(m, k), device=torch.device("cuda")), n, k, mode)
    finally:
        fp8_table.device_name = saved


def _fp8_linear(m, shape, mode, dtype=BF16):
    """kernels/fp8.linear on the path an H200 routes M rows to; scaled_mm (cuBLASLt, no
    Triton GEMM) launches its activation quantisation (column-major scales)."""

    def run():
        x, w, scale = _fp8_operands(m, *shape, mode, dtype)
        path, config = fp8_h200_route(m, *shape, mode)
        if path == "scaled_mm":  # linear takes it on CUDA tensors only
            fp8.scaled_mm(x, w, scale, config or fp8.SCALED_MM_CONFIG)
        else:
            fp8.linear(x, w, scale, mode, path=path, config=config)

    return run


def _fp8(wrapper, m, shape, mode, dtype=BF16, **options):
    """One kernels/fp8.py launcher (fma_gemv, dot_gemm, sk_gemm, ...) on M x K times `shape`
    (N, K)."""

    def run():
        x, w, scale = _fp8_operands(m, *shape, mode, dtype)
        if wrapper is fp8.dequantize:
            wrapper(w, scale, mode, dtype)
        elif wrapper is fp8.quantize_activations:
            wrapper(x, **options)
        else:
            wrapper(x, w, scale, mode, **options)

    return run


def _fp8_routes():
    """A case per Llama-8B projection, M and scale mode, labelled with the H200's path."""
    cases = []
    for mode in fp8.MODES:
        for proj, shape in LLAMA_8B_FP8.items():
            for m in FP8_MS:
                path = fp8_h200_route(m, *shape, mode)[0]
                cases.append((f"fp8 {proj} M{m} {mode} {path}", 1, _fp8_linear(m, shape, mode)))
    return cases


# each launcher directly: configs and split-K ways the routes above miss, ragged shapes, fp16,
# both activation-scale layouts, PDL modes 0 and 2
SK = fp8.sk_gemm
FP8_CASES = [
    ("fp8 o M1 block fp16 splitk", 1, _fp8_linear(1, O_PROJ, "block", FP16)),
    ("fp8 o M2 block fma", 2, _fp8(fp8.fma_gemv, 2, O_PROJ, "block")),
    ("fp8 ragged M3 row fma", 0, _fp8(fp8.fma_gemv, 3, RAGGED, "row")),
    ("fp8 o M16 block dot 1 split", 1, _fp8(fp8.dot_gemm, 16, O_PROJ, "block", split_k=1)),
    ("fp8 qkv M4 block dot split-K 2", 1, _fp8(fp8.dot_gemm, 4, QKV, "block", split_k=2)),
    ("fp8 ragged M24 row dot", 1, _fp8(fp8.dot_gemm, 24, RAGGED, "row")),
    ("fp8 o M256 block w8a16", 1, _fp8(fp8.linear, 256, O_PROJ, "block", path="w8a16")),
    ("fp8 qkv M1 row splitk atomic", 1, _fp8(fp8.splitk_gemv, 1, QKV, "row")),
    ("fp8 qkv M1 block stream", 1, _fp8(fp8.stream_gemv, 1, QKV, "block")),
    ("fp8 gate_up M1 block stream (the H100 table's)", 1,
     _fp8(fp8.stream_gemv, 1, GATE_UP, "block", config=(4, 8192, 512, 4))),
    ("fp8 down M1 row stream", 1,
     _fp8(fp8.stream_gemv, 1, DOWN, "row", config=(8, 2048, 1024, 8))),
    ("fp8 down M4 row splitk kernel", 1,
     _fp8(fp8.splitk_gemv, 4, DOWN, "row", config=(16, 1024, 4, "kernel"))),
    ("fp8 ragged M2 block splitk", 0,
     _fp8(fp8.splitk_gemv, 2, (200, 320), "block", config=(8, 256, 4, "atomic"))),
    *[(f"fp8 o M{m} block {path}", 1, _fp8(SK, m, O_PROJ, "block", path=path))
      for path in fp8.SK_PATHS for m in (4, 64)],
    *[(f"fp8 down M16 row {path}", 2, _fp8(SK, 16, DOWN, "row", path=path))
      for path in fp8.SK_PATHS],
    ("fp8 gate_up M256 block sk_w8a16 1 split", 1,
     _fp8(SK, 256, GATE_UP, "block", config=(128, 128, 8, 3, 1))),
    ("fp8 ragged M5 block sk_w8a8 no PDL", 0, _fp8(SK, 5, (130, 200), "block", path="sk_w8a8")),
    ("fp8 o dequant block", 0, _fp8(fp8.dequantize, 0, O_PROJ, "block")),
    ("fp8 o dequant block fp16", 0, _fp8(fp8.dequantize, 0, O_PROJ, "block", FP16)),
    ("fp8 act quant M256 row-major", 0, _fp8(fp8.quantize_activations, 256, O_PROJ, "row")),
    ("fp8 act quant M16 column-major", 0,
     _fp8(fp8.quantize_activations, 16, O_PROJ, "row", column_major=True)),
    ("fp8 o M256 block w8a8", 0, _fp8(fp8.w8a8_gemm, 256, O_PROJ, "block")),
    ("fp8 down M64 row w8a8", 0, _fp8(fp8.w8a8_gemm, 64, DOWN, "row")),
]  # fmt: skip


# (label, PDL mode, the launch site to run); each distinct launch compiles once
CASES = [
    ("norm bf16 4096", 1, _norm((5, 4096), BF16, False)),
    ("norm bf16 4096 residual", 1, _norm((5, 4096), BF16, True)),
    ("norm fp16 4096 residual", 1, _norm((5, 4096), FP16, True)),
    ("norm fp32 4096 residual", 1, _norm((3, 4096), FP32, True)),
    ("norm bf16 8192 residual bs1", 2, _norm((1, 8192), BF16, True)),
    ("norm bf16 qk-norm 16x128", 1, _norm((5, 32 * 128), BF16, False, (5, 16, 128))),
    ("norm fp16 1024 residual", 0, _norm((7, 1024), FP16, True)),
    ("norm bf16 tiny 256", 0, _norm((3, 256), BF16, False)),
    ("norm bf16 5120 residual", 1, _norm((2, 5120), BF16, True)),
    ("silu bf16 14336", 1, _silu(5, 14336, BF16)),
    ("silu fp16 14336", 1, _silu(5, 14336, FP16)),
    ("silu fp32 3584", 1, _silu(3, 3584, FP32)),
    ("silu bf16 768 bs1", 2, _silu(1, 768, BF16)),
    ("silu bf16 768 bs1 no PDL", 0, _silu(1, 768, BF16)),
    ("rope bf16 32/8x128", 1, _rope(5, 32, 8, 128, BF16)),
    ("rope fp16 32/8x128", 1, _rope(5, 32, 8, 128, FP16)),
    ("rope bf16 tp8 8/1x128", 2, _rope(1, 8, 1, 128, BF16)),
    ("rope bf16 qk-norm 16/8x128", 0, _rope(3, 16, 8, 128, BF16, fused_qkv=False)),
    ("rope fp32 tiny 4/2x64", 1, _rope(3, 4, 2, 64, FP32)),
    ("rope fp16 head_dim 96", 1, _rope(3, 8, 2, 96, FP16)),
    ("gemv bf16 qkv 6144x4096", 1, _gemv(6144, 4096, BF16)),
    ("gemv bf16 down 4096x14336", 1, _gemv(4096, 14336, BF16)),
    ("gemv fp16 o_proj 4096x4096", 1, _gemv(4096, 4096, FP16)),
    ("gemv bf16 eagle qkv 6144x8192", 2, _gemv(6144, 8192, BF16)),
    ("gemv bf16 tp8 down 8192x3584", 0, _gemv(8192, 3584, BF16)),
    ("gemv bf16 tiny 768x256", 1, _gemv(768, 256, BF16)),
    ("gemv bf16 tp8 down 4096x1792", 1, _gemv(4096, 1792, BF16)),
    ("attention bf16 decode split", 1, _attention(4, 1, 32, 8, 128, 4096, BF16)),
    ("attention fp16 decode", 1, _attention(64, 1, 32, 8, 128, 256, FP16)),
    ("attention bf16 verify 4", 1, _attention(8, 4, 32, 8, 128, 2048, BF16)),
    ("attention fp16 verify 8 split", 2, _attention(2, 8, 32, 8, 128, 8192, FP16)),
    ("attention bf16 prefill varlen", 1, _prefill([37, 5, 1], 32, 8, 128, 1024, BF16)),
    ("attention bf16 dflash block 16", 2, _attention(2, 16, 32, 8, 128, 1024, BF16)),
    ("attention fp32 decode split", 0, _attention(4, 1, 32, 8, 128, 4096, FP32)),
    ("attention bf16 qwen3-moe 32/4 prefill", 1, _prefill([9, 3], 32, 4, 128, 512, BF16)),
    ("attention bf16 tiny 4/2x64 page 32", 0, _attention(3, 2, 4, 2, 64, 512, BF16, 32)),
    ("attention bf16 tp8 8/1 decode", 1, _attention(1, 1, 8, 1, 128, 4096, BF16)),
    ("attention bf16 decode", 1, _attention(64, 1, 32, 8, 128, 256, BF16)),
    ("fused decode bf16 8B split", 1, _fused_decode(1, 32, 8, 128, 1024, BF16)),
    ("fused decode fp16 one split late keys", 2, _fused_decode(1, 32, 8, 128, 128, FP16, False)),
    ("fused decode bf16 qwen3 tp2", 1, _fused_decode(1, 16, 4, 128, 8192, BF16)),
    ("fused decode bf16 head_dim 8", 1, _fused_decode(1, 4, 2, 8, 2048, BF16)),
    ("attention bf16 decode plan", 1, _attention(192, 1, 32, 8, 128, 4352, BF16, layout="plan")),
    ("attention fp16 verify 4 plan", 2, _attention(96, 4, 32, 8, 128, 2048, FP16, layout="plan")),
    ("attention bf16 verify 20 plan", 0, _attention(5, 20, 32, 8, 128, 512, BF16, layout="plan")),
    ("attention bf16 decode order", 1, _attention(192, 1, 32, 8, 128, 4352, BF16, layout="order")),
    ("attention fp16 prefill varlen", 1, _prefill([48, 16], 16, 8, 128, 64, FP16)),
    ("attention fp16 head_dim 96 page 1", 0, _attention(4, 3, 8, 2, 96, 128, FP16, 1)),
    ("top logprobs 5 of 128256 bs1", 1, _top_logprobs(1, 128256, 5)),
    ("top logprobs 5 of 151936 bs64x4", 1, _top_logprobs(256, 151936, 5)),
    ("top logprobs 20 of 128256 bs512", 0, _top_logprobs(512, 128256, 20)),
    ("top logprobs 0 of 32000 bs3", 2, _top_logprobs(3, 32000, 0)),
    ("race 151936 bs64x4", 0, _race(256, 151936, "none")),
    ("race 32000 bs1 draft vocab map", 0, _race(1, 32000, "shared")),
    ("race dflash2 candidates bs8", 0, _race(8, 32, "rows")),
    ("rank cut bf16 151936 bs64x4", 0, _rank(256, 151936, BF16)),
    ("rank cut fp32 32000 bs64", 0, _rank(64, 32000, FP32)),
    ("record bf16 eagle-3 3x4096", 0, _record(5, (4096, 4096, 4096), BF16)),
    ("record fp16 dflash 2x4096", 0, _record(5, (4096, 4096), FP16, ids=False)),
    ("record draft model ids only", 0, _record(1, (), BF16)),
    *_fp8_routes(),
    *FP8_CASES,
]


# ------------------------------------------------------------------------------ the machinery


class _Capture:
    """Stands in for a kernel in its module: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, fn: JITFunction, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


@contextlib.contextmanager
def _recording(launches: list, pdl: int):
    """While inside: every kernel of MODULES records its launches, Triton runs on any tensor and
    PDL is `pdl`; all restored after (the kernels call each other through module globals)."""
    saved = []
    for module in MODULES:
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                saved.append((module, name, value))
                setattr(module, name, _Capture(value, launches))
        for name, value in (("runs_triton", lambda x: True), ("pdl_mode", lambda x, kind="": pdl)):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, value)
    saved.append((paged_attention, "_num_sms", paged_attention._num_sms))
    paged_attention._num_sms = lambda device: H200_SMS
    saved.append((logprobs, "_programs_wanted", logprobs._programs_wanted))
    logprobs._programs_wanted = lambda device: 2 * H200_SMS
    saved.append((race, "_programs_wanted", race._programs_wanted))
    race._programs_wanted = lambda device: 2 * H200_SMS
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def _on_cuda(kwargs: dict) -> dict:
    """A launch's keywords as a CUDA tensor's launch passes them."""
    if "UPCAST" in kwargs:  # computed from `not q.is_cuda`: meta tensors are not CUDA ones
        kwargs = {**kwargs, "UPCAST": False}
    return kwargs


def _specialize(fn: JITFunction, args, kwargs, backend):
    """The ASTSource and options Triton's JIT makes for this launch on a CUDA device."""
    kwargs = {"debug": False, **kwargs}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization,
                                                          options)  # fmt: skip
    return ASTSource(fn, signature, constexprs, attrs), options


def _describe(fn: JITFunction, args, kwargs) -> str:
    names = {p.name for p in fn.params}
    bound = fn.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()  # (constexprs left at their defaults named too)
    dtypes = sorted({str(a.dtype).removeprefix("torch.") for a in args if hasattr(a, "dtype")})
    consts = [f"{p.name}={bound.arguments[p.name]}" for p in fn.params if p.is_constexpr]
    warps = kwargs.get("num_warps", 4)
    return f"{fn.__name__}({'/'.join(dtypes)}; {' '.join(consts)}; num_warps={warps})"


def _first_error_line(error: Exception, stderr: str) -> str:
    """The compiler's message: a CompilationError's last line (with its `at L:C`), else the
    first `error:` line MLIR printed, else the exception's first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if type(error).__name__ == "CompilationError" and lines:
        where = lines[0].rstrip(":") if lines[0].startswith("at ") else ""
        return f"{lines[-1]} ({where})" if where else lines[-1]
    mlir = [line.strip() for line in stderr.splitlines() if "error:" in line]
    first = lines[0] if lines else ""
    return f"{type(error).__name__}: {mlir[0] if mlir else first}"


@contextlib.contextmanager
def _stderr_into(path: Path):
    """fd 2 (where MLIR prints its diagnostics) into `path` while inside."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def main(only: str | None) -> None:
    backend = make_backend(TARGET)
    root = Path(speculant.__file__).resolve().parent
    cases = [(label, pdl, run) for label, pdl, run in CASES if only is None or only in label]
    launches_of = []
    for label, pdl, run in cases:
        launches = []
        with _recording(launches, pdl):
            run()
        assert launches, f"{label}: the launch site launched no kernel"
        launches_of.append((label, launches))
    if only is None or only in "selfcheck":
        launches_of.append(("selfcheck", [(_reassigned_constexpr_kernel, (t(64, dtype=FP32),),
                                           {"BLOCK": 64})]))  # fmt: skip
    seen, kernels = set(), set()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "stderr"
        for label, launches in launches_of:
            for fn, args, kwargs in launches:
                kwargs = _on_cuda(kwargs)
                source, options = _specialize(fn, args, kwargs, backend)
                key = source.hash() + options.hash()
                if key in seen:
                    continue
                seen.add(key)
                name = f"{label} | {_describe(fn, args, kwargs)}"
                start = time.perf_counter()
                try:
                    with _stderr_into(log):
                        kernel = triton.compile(source, target=TARGET, options=options.__dict__)
                    assert kernel.asm["ptx"]
                except Exception as error:  # every failure is reported, by name
                    print(f"FAIL {name}: {_first_error_line(error, log.read_text())}", flush=True)
                    continue
                print(f"ok {name} ({time.perf_counter() - start:.1f} s)", flush=True)
                path = Path(inspect.getsourcefile(fn.fn)).resolve()
                if path.is_relative_to(root):
                    kernels.add(f"{path.relative_to(root)}:{fn.__name__}")
    for kernel in sorted(kernels):
        print(f"kernel {kernel}")
    print("done")


if __name__ == "__main__":
    main(sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--only" else None)
