"""Which levers move the Llama-3.1-8B-shape bs=1 decode step (issue 10's "where the time goes"):
one GPU, one run, dummy bf16 weights, Triton attention backend, context 512, graph replay.

    python3 benchmarks/levers.py --json OUT.json

1. The whole graph step under variants (`--variants`, names from VARIANTS), each with a kernel
   profile (device time, launches, top kernels): the default; torch's cuBLASLt BLAS backend
   (`preferred_blas_library`); the paged-attention split plan (MIN_KEYS_PER_SPLIT 128 / 1024,
   i.e. more splits / one split at this max_model_len); programmatic dependent launch off / in
   mode 1 or 2 (kernels/runtime.py) with the GEMV's L2 prefetch of 0, 16 or 64 KiB a program.
2. The four projection shapes at M = 1 (qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
   down 4096x14336): torch `F.linear` under cuBLAS and cuBLASLt, and a plain Triton GEMV over a
   few block configurations; each timed as one CUDA graph over 8 weight copies (more than L2),
   per call, with the bandwidth it reaches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from decode import kernel_profile
from graphs import SHAPES, copy_bandwidth, live_rows, time_ms, write_config

from speculant import Engine
from speculant.kernels import gemv, runtime
from speculant.kernels import paged_attention as pa
from speculant.kernels.gemv import _gemv_kernel

PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
               "down": (4096, 14336)}  # fmt: skip
COPIES = 8
DEFAULTS = {"blas": "cublas", "min_keys": 256, "pdl": runtime.PDL_MODE,
            "prefetch": gemv.PREFETCH_BYTES, "gemv_rows": gemv.MAX_ROWS}  # fmt: skip
VARIANTS = {
    "default": {},
    "cublaslt": {"blas": "cublaslt"},
    "min_keys_128": {"min_keys": 128},
    "one_split": {"min_keys": 1024},
    "no_pdl": {"pdl": 0},
    "pdl1_no_prefetch": {"pdl": 1, "prefetch": 0},
    "pdl1_prefetch_8k": {"pdl": 1, "prefetch": 8192},
    "pdl1_prefetch_16k": {"pdl": 1, "prefetch": 16384},
    "pdl1_prefetch_32k": {"pdl": 1, "prefetch": 32768},
    "pdl1_prefetch_64k": {"pdl": 1, "prefetch": 65536},
    "pdl2_no_prefetch": {"pdl": 2, "prefetch": 0},
    "pdl2_prefetch_8k": {"pdl": 2, "prefetch": 8192},
    "pdl2_prefetch_16k": {"pdl": 2, "prefetch": 16384},
    "pdl2_prefetch_64k": {"pdl": 2, "prefetch": 65536},
    "gemv_gate_up": {"gemv_rows": 32768},  # the Triton GEMV on gate_up too (not the LM head)
}


def step_variant(target, vocab, blas, min_keys, pdl, prefetch, gemv_rows) -> dict:
    torch.backends.cuda.preferred_blas_library(blas)
    pa.MIN_KEYS_PER_SPLIT = min_keys
    runtime.PDL_MODE, gemv.PREFETCH_BYTES, gemv.MAX_ROWS = pdl, prefetch, gemv_rows
    engine = Engine(target, device="cuda", dtype="bfloat16", load_format="dummy", max_num_seqs=1,
                    max_model_len=1024, capture_sizes=[1], attention_backend="triton")  # fmt: skip
    try:
        rows = live_rows(engine, 1, vocab, 512, torch.Generator().manual_seed(1))
        graph = engine.graphs.graph("greedy", 1)
        ms = time_ms(graph.replay, 100)
        prof = kernel_profile(graph.replay, steps=5, top=12)
        for row in rows:
            engine.kv.free(row)
        return {"graph_ms": ms, "profile": prof}
    finally:
        del engine
        torch.cuda.empty_cache()
        torch.backends.cuda.preferred_blas_library(DEFAULTS["blas"])
        pa.MIN_KEYS_PER_SPLIT = DEFAULTS["min_keys"]
        runtime.PDL_MODE, gemv.PREFETCH_BYTES = DEFAULTS["pdl"], DEFAULTS["prefetch"]
        gemv.MAX_ROWS = DEFAULTS["gemv_rows"]


def triton_gemv(x, w, y, block_n, block_k, warps, stages):
    N, K = w.shape
    _gemv_kernel[(N // block_n,)](x, w, y, w.stride(0), K=K, BLOCK_N=block_n, BLOCK_K=block_k,
                                  PREFETCH_LINES=0, LINE=64, PDL=0, num_warps=warps,
                                  num_stages=stages)  # fmt: skip


def graph_us(fn_per_copy) -> float:
    """Per-call us of a graph running fn_per_copy(i) for every weight copy."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(COPIES):
            fn_per_copy(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(COPIES):
            fn_per_copy(i)
    return time_ms(graph.replay, 50) * 1e3 / COPIES


def gemv_row(N: int, K: int, bandwidth: float, configs: list) -> dict:
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
    row: dict = {"roofline_us": N * K * 2 / bandwidth * 1e6}
    for blas in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(blas)
        row[blas] = graph_us(lambda i: F.linear(x, ws[i]))
    torch.backends.cuda.preferred_blas_library("cublas")
    expected = F.linear(x, ws[0]).float()
    best = None
    for cfg in configs:
        try:
            triton_gemv(x, ws[0], y, *cfg)
            err = ((y.float() - expected).norm() / expected.norm()).item()
            us = graph_us(lambda i, c=cfg: triton_gemv(x, ws[i], y, *c))
        except Exception as exc:  # a config that does not compile or fit
            row.setdefault("failed", []).append(f"{cfg}: {exc!r}"[:200])
            continue
        if err < 1e-2 and (best is None or us < best[1]):
            best = (cfg, us, err)
    if best:
        row["triton_best"] = {"config": best[0], "us": best[1], "rel_err": best[2]}
    return row


def gemv_stage(bandwidth: float) -> dict:
    out = {}
    configs = [(bn, bk, w, s) for bn in (8, 16, 32) for bk in (256, 512) for w in (4, 8)
               for s in (2, 4)]  # fmt: skip
    for name, (N, K) in PROJECTIONS.items():
        out[name] = gemv_row(N, K, bandwidth, configs)
        torch.cuda.empty_cache()
        print(name, json.dumps(out[name], default=str), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument(
        "--variants",
        default="default,cublaslt,min_keys_128,one_split",
        help=f"comma-separated step variants from {', '.join(VARIANTS)}",
    )
    parser.add_argument("--skip-gemv", action="store_true", help="no per-projection stage")
    args = parser.parse_args()
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "triton": triton.__version__,
                    "command": " ".join(sys.argv), "steps": {}, "errors": {}}  # fmt: skip
    bandwidth = copy_bandwidth()
    report["copy_tb_s"] = bandwidth / 1e12
    target = write_config(SHAPES["llama8b"])
    vocab = SHAPES["llama8b"]["vocab_size"]
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    report["defaults"] = DEFAULTS
    for i, name in enumerate(names):  # a name may repeat (drift between variants)
        try:
            key = name if name not in report["steps"] else f"{name}#{names[: i + 1].count(name)}"
            report["steps"][key] = step_variant(target, vocab, **{**DEFAULTS, **VARIANTS[name]})
            print(key, f"{report['steps'][key]['graph_ms']:.3f} ms", flush=True)
        except Exception:
            report["errors"][name] = traceback.format_exc(limit=3)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    try:
        if not args.skip_gemv:
            report["gemv"] = gemv_stage(bandwidth)
    except Exception:
        report["errors"]["gemv"] = traceback.format_exc(limit=3)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"\ncopy {report['copy_tb_s']:.2f} TB/s")
    for name, step in report["steps"].items():
        prof = step["profile"]
        print(f"{name}: {step['graph_ms']:.3f} ms, kernels {prof['kernel_us_per_step']:.0f} us, "
              f"{prof['launches_per_step']:.0f} launches")  # fmt: skip
        for k in prof["top"][:10]:
            print(f"    {k['us_per_step']:8.1f} us {k['calls_per_step']:5.0f}x {k['kernel'][:70]}")
    for name, row in report.get("gemv", {}).items():
        best = row.get("triton_best", {})
        print(f"{name}: roofline {row['roofline_us']:.1f} us, cublas {row['cublas']:.1f}, "
              f"cublaslt {row['cublaslt']:.1f}, triton {best.get('us', float('nan')):.1f} "
              f"{best.get('config')}")  # fmt: skip
    for name, err in report["errors"].items():
        print(f"error {name}: {err.strip().splitlines()[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
