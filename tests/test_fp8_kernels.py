"""The FP8 Triton kernels (kernels/fp8.py, issue 24 item 2) against their torch references, and
models/fp8.py routing FP8 layers through them on the Triton backend. Without CUDA the kernels
run through Triton's interpreter (TRITON_INTERPRET=1, set below before triton is imported) at
small shapes, non-multiples of 128 included; the `cuda` variants (marked gpu) run compiled at the
Llama-3.1-8B shapes.

Tolerance: relative Frobenius error < 1e-2 against the float64 reference of the dequantised
weight (bf16 output rounding is ~3e-3); the FP8 tensor-core path against the float64 reference
of the same per-token-per-128 quantised activations. Under the interpreter the kernels round
float32 to the e4m3 grid themselves before casting (the interpreter's cast misrounds; the
compiled cast rounds to nearest even as they do), so activation codes are checked exactly on
the CPU too."""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch
from helpers_triton import CPU, CUDA, DEVICES  # noqa: E402, F401 - sets the interpreter first

from speculant.kernels import fp8 as kernels  # noqa: E402
from speculant.kernels import runtime  # noqa: E402

TOL = 1e-2
PATHS = ("fma", "splitk", "stream", "dot", "w8a16", "w8a8", "dequant")
# (M, N, K) per device: partial 128-blocks in both dimensions, and the 8B projections
SHAPES = {
    "cpu": [(1, 200, 320), (3, 256, 384), (17, 130, 200), (70, 96, 260)],
    "cuda": [
        (m, n, k)
        for m in (1, 4, 16, 64, 300)
        for n, k in ((6144, 4096), (4096, 14336), (1000, 328))
    ],
}


def generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def random_fp8(gen, n: int, k: int, mode: str, device: str):
    """An e4m3 weight of N(0, 64^2) values and positive scales in `mode`'s layout."""
    w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(kernels.FP8)
    if mode == "block":
        scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen) + 0.5
    else:
        scale = torch.rand(n, generator=gen) + 0.5
    return w.to(device), (scale / (64 * k**0.5)).to(device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", kernels.MODES)
@pytest.mark.parametrize("path", PATHS)
def test_kernel_matches_reference(device, mode, path):
    for m, n, k in SHAPES[device]:
        if (device == "cuda" and path == "fma" or path == "splitk") and m > 16:
            continue  # the FMA and split-K kernels are for a few rows
        if path == "stream" and m > 1:
            continue  # one row (other M take the FMA kernel: test_stream_gemv_tiles_and_falls_back)
        gen = generator(path, mode, m, n, k)
        w, scale = random_fp8(gen, n, k, mode, device)
        x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
        if path == "w8a8":
            ref = kernels.reference_w8a8(x, w, scale, mode, dtype=torch.float64)
            quantized = None
            if device == "cpu":  # see the module doc: torch's activation codes
                quantized = kernels.reference_quantize_activations(x)
            out = kernels.w8a8_gemm(x, w, scale, mode, quantized=quantized)
        else:
            ref = kernels.reference_linear(x, w, scale, mode, dtype=torch.float64)
            out = kernels.linear(x, w, scale, mode, path=path)
        assert out.dtype == torch.bfloat16
        err = rel_err(out, ref)
        assert err < TOL, f"{path} {mode} M={m} N={n} K={k}: relative error {err:.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_and_bias(device):
    """Every split-K way gives the same product (up to float32 order); bias and a 3-d x."""
    gen = generator("split", device)
    w, scale = random_fp8(gen, 256, 1024 if device == "cuda" else 640, "block", device)
    x = torch.randn(2, 3, w.shape[1], generator=gen).to(device=device, dtype=torch.bfloat16)
    bias = torch.randn(256, generator=gen).to(device=device, dtype=torch.bfloat16)
    ref = kernels.reference_linear(x, w, scale, "block", bias, dtype=torch.float64)
    for split in (1, 2, 3, 5):
        out = kernels.dot_gemm(x.reshape(6, -1), w, scale, "block", split_k=split)
        assert rel_err(out.view(2, 3, -1) + bias, ref) < TOL, split
    for path in ("fma", "dot", "dequant"):
        out = kernels.linear(x, w, scale, "block", bias, path=path)
        assert out.shape == (2, 3, 256) and rel_err(out, ref) < TOL, path


def test_split_k_for_small_grids_and_path_choice(monkeypatch):
    assert kernels.split_k_for(1000, 4096) == 1
    assert kernels.split_k_for(64, 4096) == 8 and kernels.split_k_for(64, 256) == 2
    # the measured table (benchmarks/results/fp8_2026-12-01.md): first bound that holds, the
    # last path above the last bound
    chosen = {m: kernels.choice(m) for m in (1, 2, 3, 5, 9, 17, 64, 65, 2048, 5000)}
    assert chosen == {
        1: "fma", 2: "fma", 3: "dot", 5: "dot", 9: "w8a8", 17: "dot", 64: "dot",
        65: "dequant", 2048: "dequant", 5000: "dequant",
    }  # fmt: skip
    monkeypatch.setattr(kernels, "PATH_TABLE", None)  # the thresholds
    assert kernels.choice(kernels.FMA_MAX_M) == "fma"
    assert kernels.choice(kernels.FMA_MAX_M + 1) == kernels.choice(kernels.SKINNY_MAX_M) == "dot"
    assert kernels.choice(kernels.SKINNY_MAX_M + 1) == kernels.PREFILL_GEMM


# (M, N, K, BLOCK_N, BLOCK_K): ragged N and K, one split (no workspace), M = 1 ... 8
SPLITK_CASES = {
    "cpu": [(1, 200, 320, 16, 128), (3, 136, 384, 8, 256), (8, 64, 1000, 32, 256),
            (5, 130, 128, 16, 256)],
    "cuda": [(m, n, k, 16, 1024) for m in (1, 4, 8) for n, k in ((6144, 4096), (4096, 14336))]
    + [(2, 1000, 328, 32, 256)],
}  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", kernels.MODES)
def test_splitk_gemv_matches_reference_and_repeats_exactly(device, mode):
    """Both split reductions against the float64 reference; they sum in the same order, so
    their outputs are equal, and a repeated call (counters reset by the last launch) too."""
    for m, n, k, block_n, block_k in SPLITK_CASES[device]:
        gen = generator("splitk", mode, m, n, k)
        w, scale = random_fp8(gen, n, k, mode, device)
        x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
        ref = kernels.reference_linear(x, w, scale, mode, dtype=torch.float64)
        atomic = kernels.splitk_gemv(x, w, scale, mode, (block_n, block_k, 4, "atomic"))
        err = rel_err(atomic, ref)
        assert err < TOL, f"{mode} M={m} N={n} K={k}: relative error {err:.2e}"
        again = kernels.linear(x, w, scale, mode, path="splitk",
                               config=(block_n, block_k, 4, "atomic"))  # fmt: skip
        summed = kernels.splitk_gemv(x, w, scale, mode, (block_n, block_k, 4, "kernel"))
        assert torch.equal(atomic, again) and torch.equal(atomic, summed), (m, n, k)
    assert not runtime.arrival_counters(torch.device(device)).any()


def test_tuned_table_lookup_and_fallback(tmp_path, monkeypatch):
    """A device/shape hit gives the table's path and config (first max_m that holds); another
    shape borrows the nearest measured one's row; a miss (other device, M above the last row,
    row scales, borrowing off) falls back to choice(M); scaled_mm is never taken off CUDA."""
    from speculant.kernels import fp8_table

    doc = {"devices": {"cpu": {"256x384": [
        {"max_m": 4, "path": "dot", "config": [32, 64, 4, 4], "us": 2.0},
        {"max_m": 1, "path": "splitk", "config": [16, 128, 4, "atomic"], "us": 1.0},
        {"max_m": 8, "path": "scaled_mm", "config": {"api": "v1"}, "us": 3.0},
    ]}, "NVIDIA H200": {"256x384": [{"max_m": 1, "path": "fma", "config": None}]}}}  # fmt: skip
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(doc))
    table = fp8_table.load(path)
    cpu = torch.device("cpu")
    assert fp8_table.lookup(table, cpu, 256, 384, 1) == ("splitk", (16, 128, 4, "atomic"))
    assert fp8_table.lookup(table, cpu, 256, 384, 3) == ("dot", (32, 64, 4, 4))
    assert fp8_table.lookup(table, cpu, 256, 384, 8) is None  # scaled_mm: CUDA only
    assert fp8_table.lookup(table, cpu, 256, 384, 9) is None
    assert fp8_table.lookup(table, cpu, 384, 256, 1) == ("splitk", (16, 128, 4, "atomic"))
    exact = fp8_table.load(path, borrow=False)
    assert fp8_table.lookup(exact, cpu, 256, 384, 1) == ("splitk", (16, 128, 4, "atomic"))
    assert fp8_table.lookup(exact, cpu, 384, 256, 1) is None
    assert fp8_table.load(tmp_path / "none.json") == {}
    monkeypatch.setattr(kernels, "TUNED", table)
    x = torch.zeros(2, 384, dtype=torch.bfloat16)
    assert kernels.route(x, 256, 384, "block") == ("dot", (32, 64, 4, 4))
    assert kernels.route(x, 256, 384, "row") == (kernels.choice(2), None)
    assert kernels.route(torch.zeros(6, 384), 256, 384, "block") == (kernels.choice(6), None)
    assert kernels.route(x, 200, 384, "block") == ("dot", (32, 64, 4, 4))
    monkeypatch.setattr(kernels, "TUNED", exact)
    assert kernels.route(x, 200, 384, "block") == (kernels.choice(2), None)
    monkeypatch.setattr(kernels, "TUNED", table)
    monkeypatch.setattr(fp8_table, "device_name", lambda device: "NVIDIA H200")
    assert kernels.route(torch.zeros(1, 384), 256, 384, "block") == ("fma", None)
    with pytest.raises(ValueError, match="scaled_mm"):  # CUDA only, even when forced
        kernels.linear(x, torch.zeros(256, 384, dtype=kernels.FP8), torch.ones(2, 3), "block",
                       path="scaled_mm")  # fmt: skip


def test_table_borrows_the_nearest_shape_then_gpus_of_the_same_capability(tmp_path, monkeypatch):
    """Where a GPU's table has no row for (N, K, M): its own nearest measured shape with a row
    for M, then a GPU of the same compute capability (exact shape first), never another
    architecture's; a GPU of unknown capability borrows nothing from other GPUs."""
    from speculant.kernels import fp8_table

    def rows(*entries):
        return [{"max_m": m, "path": p, "config": c} for m, p, c in entries]

    doc = {
        "capability": {"A": [9, 0], "B": [9, 0], "C": [8, 0]},
        "devices": {
            "A": {"4096x4096": rows((1, "splitk", [1]), (64, "w8a8", [2])),
                  "4096x14336": rows((1, "splitk", [3]), (64, "sk_w8a8", [4]))},
            "B": {"4096x4096": rows((1, "stream", [5])), "28672x4096": rows((1, "stream", [6]))},
            "C": {"4096x4096": rows((64, "dot", [7]))},
        },
    }  # fmt: skip
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(doc))
    table = fp8_table.load(path)
    gpu = torch.device("cuda")
    capability = {"A": (9, 0), "B": (9, 0), "C": (8, 0), "D": (9, 0), "E": (8, 0), "F": None}
    monkeypatch.setattr(fp8_table, "device_capability", lambda device: capability[name])
    monkeypatch.setattr(fp8_table, "device_name", lambda device: name)

    for name, n, k, m, want in (
        ("B", 4096, 4096, 1, ("stream", (5,))),  # its own row
        ("B", 4096, 4096, 2, ("w8a8", (2,))),  # M above its rows: A's (same capability)
        ("B", 24576, 4096, 1, ("stream", (6,))),  # its own nearest shape
        ("B", 4096, 12288, 4, ("sk_w8a8", (4,))),  # A's nearest shape
        ("A", 4096, 4096, 65, None),  # M above every row
        ("D", 4096, 14336, 1, ("splitk", (3,))),  # not in the table, capability 9.0: A first
        ("E", 4096, 4096, 1, ("dot", (7,))),  # 8.0: only C
        ("F", 4096, 4096, 1, None),  # capability unknown
    ):
        assert fp8_table.lookup(table, gpu, n, k, m) == want, (name, n, k, m)
    name = "B"
    table["B"][(4096, 4096)] = [(2, "fma", None)]  # rows changed in place: kept answers stay
    assert fp8_table.lookup(table, gpu, 4096, 4096, 2) == ("w8a8", (2,))
    table.changed()  # ... until told
    assert fp8_table.lookup(table, gpu, 4096, 4096, 2) == ("fma", None)
    exact = fp8_table.load(path, borrow=False)
    assert fp8_table.lookup(exact, gpu, 4096, 4096, 1) == ("stream", (5,))
    assert fp8_table.lookup(exact, gpu, 4096, 4096, 2) is None
    assert fp8_table.lookup(exact, gpu, 24576, 4096, 1) is None


@pytest.mark.needs("triton")
@pytest.mark.skipif(not runtime.INTERPRET, reason="the CPU check needs the interpreter")
def test_every_checked_in_config_is_right_on_a_shape_it_was_not_measured_on():
    """Borrowed rows run their configs on other shapes: each (path, config) of
    kernels/fp8_tuned.json (scaled_mm aside: cuBLASLt) gives x W^T at a shape no table names
    (N a partial 128-block), at 1 row and at a few."""
    from speculant.kernels import fp8_table

    routes = {(path, config) for shapes in fp8_table.load().values() for rows in shapes.values()
              for _, path, config in rows if path not in fp8_table.GPU_ONLY}  # fmt: skip
    assert routes
    gen = generator("borrowed")
    n, k = 208, 1024  # N a partial block (16s: stream tiles it), K whole blocks, as published
    w, scale = random_fp8(gen, n, k, "block", "cpu")
    for path, config in sorted(routes, key=repr):
        for m in (1, 5) if path != "stream" else (1,):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            w8a8 = path in ("w8a8", "sk_w8a8", "sk_w8a8_pre")
            reference = kernels.reference_w8a8 if w8a8 else kernels.reference_linear
            ref = reference(x, w, scale, "block", dtype=torch.float64)
            out = kernels.linear(x, w, scale, "block", path=path, config=config)
            assert rel_err(out, ref) < TOL, (path, config, m)


def test_checked_in_table_loads_and_names_known_paths():
    """kernels/fp8_tuned.json (when present) parses and names only known paths."""
    from speculant.kernels import fp8_table

    known = {"fma", "splitk", "stream", "dot", "w8a16", "w8a8", "dequant", "scaled_mm",
             *kernels.SK_PATHS}  # fmt: skip
    for shapes in fp8_table.load().values():
        for rows in shapes.values():
            assert {path for _, path, _ in rows} <= known


def load_sweep():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fp8_sweep", Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_sweep.py"
    )
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


@pytest.mark.needs("triton")
@pytest.mark.skipif(not runtime.INTERPRET, reason="the sweep's dry run needs the interpreter")
def test_sweep_dry_run_writes_a_table_the_router_takes(tmp_path, monkeypatch):
    """benchmarks/fp8_sweep.py on one tiny shape: every row it writes is a candidate that
    passed the reference check, the table loads, and linear() then routes by it."""
    from speculant.kernels import fp8_table

    sweep = load_sweep()
    monkeypatch.setattr(sweep, "SHAPES_DRY", {"a": (64, 256)})
    monkeypatch.setattr(sweep, "MS_DRY", (1, 2))
    args = argparse.Namespace(dry_run=True, ms="", wide=False, paths="")
    report = {"t0": 0.0, "kernels": {}, "scaled_mm_probe": sweep.probe_scaled_mm(False)}
    assert report["scaled_mm_probe"]["works"] is None
    rows = sweep.sweep(args, report, deadline=float("inf"))
    assert [m for m, *_ in rows[(64, 256)]] == [1, 2]
    for m, path, config, _ in rows[(64, 256)]:
        entry = report["kernels"][f"a/{m}"]
        assert all("scaled_mm" not in label for label in entry)
        assert any(
            (e.get("path"), e.get("config")) == (path, config) and e["err"] < TOL
            for e in entry.values()
        )
    sweep.write_table(rows, "cpu", tmp_path / "tuned.json")
    table = fp8_table.load(tmp_path / "tuned.json")
    monkeypatch.setattr(kernels, "TUNED", table)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert kernels.route(x, 64, 256, "block") == table["cpu"][(64, 256)][0][1:]
    # --merge (a sweep of some M): the other M keep the installed table's rows
    monkeypatch.setattr(fp8_table, "TUNED_PATH", tmp_path / "tuned.json")
    sweep.write_table({(64, 256): [(1, "dot", (64, 64, 4, 2), 1.0)]}, "cpu",
                      tmp_path / "merged.json", merge=True)  # fmt: skip
    merged = fp8_table.load(tmp_path / "merged.json")["cpu"][(64, 256)]
    assert [m for m, *_ in merged] == [1, 2] and merged[0][1:] == ("dot", (64, 64, 4, 2))
    assert merged[1] == table["cpu"][(64, 256)][1]


@pytest.mark.parametrize("tp", [1, 2, 4])  # 4: more ranks than the tiny model's 2 KV heads
def test_sweep_takes_a_checkpoints_projection_shapes(llama_dir, tp):
    """`fp8_sweep.py --target DIR --tp N` sweeps the (N, K) one TP rank of that model runs:
    those of the model's own parallel layers built at that tp size, each shape once."""
    from types import SimpleNamespace

    from speculant.config import ModelConfig
    from speculant.models.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    cfg = ModelConfig.from_dir(llama_dir)
    pctx = SimpleNamespace(tp_size=tp, tp_rank=0)  # only the sizes are read
    hidden, inner = cfg.hidden_size, cfg.intermediate_size
    layers = {
        "qkv": QKVParallelLinear(hidden, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, False,
                                 pctx),  # fmt: skip
        "o": RowParallelLinear(cfg.num_heads * cfg.head_dim, hidden, False, pctx),
        "gate_up": ColumnParallelLinear(hidden, [inner, inner], False, pctx),
        "down": RowParallelLinear(inner, hidden, False, pctx),
    }
    shapes = load_sweep().model_shapes(str(llama_dir), tp)
    assert len(set(shapes.values())) == len(shapes)
    named = {name: shape for names, shape in shapes.items() for name in names.split("+")}
    assert named == {name: tuple(layer.weight.shape) for name, layer in layers.items()}


@pytest.mark.gpu
def test_scaled_mm_layout_of_the_table_matches_reference():
    """The default scaled_mm config and each one the checked-in table names for this GPU or
    one it may borrow from (same compute capability) give x W^T, at any row count (cuBLASLt
    refused M = 3 before the rows were padded)."""
    from speculant.kernels import fp8_table

    table, gpu = fp8_table.load(), torch.device("cuda")
    own = fp8_table.device_capability(gpu)
    rows = [shape for name, shapes in table.items() for shape in shapes.values()
            if name == fp8_table.device_name(gpu) or table.capability.get(name) == own]  # fmt: skip
    configs = {repr(c): c for shape in rows for _, p, c in shape if p == "scaled_mm"}
    configs[repr(kernels.SCALED_MM_CONFIG)] = kernels.SCALED_MM_CONFIG
    gen = generator("scaled_mm")
    w, scale = random_fp8(gen, 512, 1024, "block", "cuda")
    for m in (1, 3, 5, 24, 40, 64, 100):
        x = torch.randn(m, 1024, generator=gen).to(device="cuda", dtype=torch.bfloat16)
        ref = kernels.reference_w8a8(x, w, scale, "block", dtype=torch.float64)
        for config in configs.values():
            assert rel_err(kernels.linear(x, w, scale, "block", path="scaled_mm", config=config),
                           ref) < TOL, config  # fmt: skip


@pytest.mark.gpu
def test_routes_on_this_gpu_match_reference():
    """What linear() runs on this GPU without a forced path (the table's rows, borrowed ones,
    the per-M fallback) gives x W^T for the 8B projections and the Qwen3-8B ones no table
    measured, from one row to prefill sizes."""
    shapes = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (24576, 4096),
              (4096, 12288))  # fmt: skip
    for n, k in shapes:
        gen = generator("route", n, k)
        w, scale = random_fp8(gen, n, k, "block", "cuda")
        for m in (1, 2, 4, 24, 64, 128, 256, 300):
            x = torch.randn(m, k, generator=gen).to(device="cuda", dtype=torch.bfloat16)
            path, config = kernels.route(x, n, k, "block")
            w8a8 = path in ("w8a8", "scaled_mm", "sk_w8a8", "sk_w8a8_pre")
            reference = kernels.reference_w8a8 if w8a8 else kernels.reference_linear
            err = rel_err(kernels.linear(x, w, scale, "block"),
                          reference(x, w, scale, "block", dtype=torch.float64))  # fmt: skip
            assert err < TOL, (n, k, m, path, config, err)


@pytest.mark.parametrize("device", DEVICES)
def test_activation_quantisation(device):
    gen = generator("act", device)
    x = (torch.randn(5, 260, generator=gen) * 3).to(device=device, dtype=torch.bfloat16)
    x[1, 128:256] = 0  # an all-zero group keeps a finite scale
    q, s = kernels.quantize_activations(x)
    rq, rs = kernels.reference_quantize_activations(x)
    assert q.dtype == kernels.FP8 and s.shape == (5, 3)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), rq.float())  # the interpreter rounds as the GPU does too


@pytest.mark.needs("triton")
def test_scale_checks_and_unknown_path():
    w = torch.zeros(200, 320, dtype=kernels.FP8)
    kernels._check(w, torch.ones(2, 3), "block")
    kernels._check(w, torch.ones(200), "row")
    with pytest.raises(ValueError, match="block scales must be float32"):
        kernels._check(w, torch.ones(1, 3), "block")
    with pytest.raises(ValueError, match="path 'nope'"):
        kernels.linear(torch.zeros(1, 320, dtype=torch.bfloat16), w, torch.ones(200), "row",
                       path="nope")  # fmt: skip


# ------------------------------------------------------------------- models/fp8.py routing


def fp8_engine(path, backend: str, device: str, **options):
    from speculant import Engine

    return Engine(
        str(path), device=device, dtype="bfloat16", max_num_seqs=2, max_model_len=64,
        page_size=8, attention_backend=backend, **options,
    )  # fmt: skip


@pytest.fixture(scope="module")
def fp8_block_dirs(tmp_path_factory):
    """fp8 block checkpoints: intermediate 512 (whole blocks: kernels) and 320 (a partial
    block per merged part: the reference)."""
    from helpers_ckpt import save_hf_model
    from test_fp8 import SIZES, write_fp8_checkpoint

    dirs = {}
    for inter in (320, 512):
        sizes = {**SIZES, "num_hidden_layers": 2, "intermediate_size": inter}
        src = save_hf_model(tmp_path_factory.mktemp(f"f{inter}"), "llama", seed=5, **sizes)
        dirs[inter] = write_fp8_checkpoint(src, tmp_path_factory.mktemp(f"b{inter}"), "fp8_block")
    return dirs


@pytest.mark.parametrize("device", DEVICES)
def test_triton_backend_runs_fp8_layers_through_the_kernels(fp8_block_dirs, device, monkeypatch):
    """On the Triton backend every FP8 projection with whole 128-row blocks per merged part
    goes through kernels.linear (prefill and decode); gate_up with 320-row parts takes the
    reference. Logits: against the plain bf16 model of the dequantised weights on the same
    backend, no further than that model is from itself on the torch backend (this random tiny
    model turns bf16 rounding differences into ~10% logit differences; the kernels' own
    accuracy is the checks above). The counted engine is eager (on CUDA, graphs would replay
    decode and prefill without calling kernels.linear) and its calls are counted from after its
    start-up (warm-up and memory profiling forwards call the kernels too)."""
    from test_fp8 import PROMPT, our_logits

    from speculant.kernels import fp8_table

    # the per-M paths (activations in bf16), not the tuned table's: on an H100 / H200 it routes
    # this model's M = 20 to a borrowed sk_w8a8 row, whose e4m3 activations add ~2.6% a projection
    # (sk_w8a8 equals its own w8a8 reference to 3.3e-3: the kernel tests), which this random
    # model amplifies to ~30% in the logits (benchmarks/results/wave30.md, call 5)
    monkeypatch.setattr(kernels, "TUNED", fp8_table.Table())
    calls = []
    real = kernels.linear
    monkeypatch.setattr(
        kernels, "linear", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw)
    )
    path, prompt = fp8_block_dirs[512], PROMPT[:20]
    # every engine compared eager, so that only the FP8 linear differs between them
    plain = our_logits(fp8_engine(path / "reference", "triton", device, enforce_eager=True), prompt)
    plain_torch = our_logits(
        fp8_engine(path / "reference", "torch", device, enforce_eager=True), prompt
    )
    our_logits(fp8_engine(path, "torch", device), prompt)
    assert not calls
    engine = fp8_engine(path, "triton", device, enforce_eager=True)
    layers = len(engine.model.model.layers)
    calls.clear()
    ours = our_logits(engine, prompt)
    assert len(calls) == 4 * layers  # qkv, o, gate_up, down
    # on an H200 this measured 4.9e-2 with graphs in the reference run (bf16 rounding of the
    # random tiny model amplified; the 8B-shape kernel checks above are at 3e-3)
    assert rel_err(ours, plain) < max(5e-2, 2 * rel_err(plain_torch, plain))
    calls.clear()
    engine.generate([PROMPT[:5]], _greedy(3))
    assert len(calls) >= 3 * 4 * layers  # prefill + 2 decode steps at least
    partial = fp8_engine(fp8_block_dirs[320], "triton", device)
    mlp = partial.model.model.layers[0].mlp
    assert mlp.gate_up_proj.fp8.kernel_scale(mlp.gate_up_proj) is None
    assert mlp.down_proj.fp8.kernel_scale(mlp.down_proj)[1] == "block"


@pytest.mark.gpu
def test_fp8_launch_modes_give_the_tokens_of_plain_launches(fp8_block_dirs, monkeypatch):
    """An FP8 target's own PDL modes (models/fp8.py FP8_LAUNCH_MODES: the small kernels let the
    next FP8 projection launch before their wait) in its CUDA graphs: greedy tokens equal to
    an engine launching every kernel without PDL, for one request and for several."""
    from test_fp8 import PROMPT

    from speculant.kernels import runtime
    from speculant.models.fp8 import FP8_LAUNCH_MODES

    prompts = [PROMPT[:5], PROMPT[3:20], PROMPT[:9]]

    def tokens(engine):
        return [[o.token_ids for o in engine.generate(batch, _greedy(12))]
                for batch in (prompts[:1], prompts)]  # fmt: skip

    chained = fp8_engine(fp8_block_dirs[512], "triton", "cuda")
    assert chained.model.launch_modes == FP8_LAUNCH_MODES
    with_modes = tokens(chained)
    del chained
    monkeypatch.setattr(runtime, "PDL_MODE", 0)
    assert with_modes == tokens(fp8_engine(fp8_block_dirs[512], "triton", "cuda"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", kernels.MODES)
def test_stream_gemv_tiles_and_falls_back(device, mode):
    """The one-row streaming GEMV for W loaded before the wait only (PRE_K = K), before the wait
    and streamed after it, and PRE_K cut to K; M > 1 and untiled weights take the FMA kernel."""
    cases = [((256, 512), (16, 512, 128, 4)), ((128, 1024), (8, 256, 256, 4)),
             ((256, 384), (16, 1024, 128, 4)), ((64, 2048), (16, 1024, 512, 8))]  # fmt: skip
    if device == "cuda":
        cases += [((6144, 4096), None), ((4096, 14336), (16, 2048, 1024, 8)),
                  ((28672, 4096), (32, 4096, 512, 8))]  # fmt: skip
    for (n, k), config in cases:
        block_n, pre_k, block_k, _ = kernels.stream_plan(n, k, config)
        assert pre_k <= k and pre_k % block_k == 0 and n % block_n == 0, (n, k, config)
        gen = generator("stream", mode, n, k)
        w, scale = random_fp8(gen, n, k, mode, device)
        x = torch.randn(1, k, generator=gen).to(device=device, dtype=torch.bfloat16)
        ref = kernels.reference_linear(x, w, scale, mode, dtype=torch.float64)
        out = kernels.linear(x, w, scale, mode, path="stream", config=config)
        err = rel_err(out, ref)
        assert err < TOL, f"stream {mode} N={n} K={k} {config}: relative error {err:.2e}"
        assert torch.equal(out, kernels.stream_gemv(x, w, scale, mode, config))
    assert kernels.stream_plan(200, 320, (16, 1024, 512, 8)) is None  # 16 does not divide 200
    assert kernels.stream_plan(256, 3072, (16, 3072, 512, 8)) is None  # PRE_K no power of two
    gen = generator("stream fallback", mode)
    w, scale = random_fp8(gen, 200, 320, mode, device)
    for m in (1, 3):
        x = torch.randn(m, 320, generator=gen).to(device=device, dtype=torch.bfloat16)
        fma = kernels.fma_gemv(x, w, scale, mode)
        assert torch.equal(kernels.linear(x, w, scale, mode, path="stream"), fma)


def _greedy(n: int):
    from speculant import SamplingParams

    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.mark.gpu
def test_kernels_capture_in_a_cuda_graph():
    """Every path replays from a CUDA graph with new inputs and equals its eager result."""
    gen = generator("graph")
    w, scale = random_fp8(gen, 4096, 4096, "block", "cuda")
    cases = (("fma", 1), ("splitk", 1), ("splitk", 8), ("stream", 1), ("dot", 16), ("dot", 64),
             ("w8a8", 256), ("dequant", 256), ("sk_w8a16", 4), ("sk_w8a8", 16),
             ("sk_w8a8_pre", 64))  # fmt: skip
    for path, m in cases:
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        kernels.linear(x, w, scale, "block", path=path)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = kernels.linear(x, w, scale, "block", path=path)
        x.copy_(torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, kernels.linear(x, w, scale, "block", path=path)), path


COMPILE_SPLITK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from speculant.kernels.fp8 import _splitk_kernel, _sum_splits_kernel

ints = ("M", "N", "K", "stride_x", "stride_w", "stride_y", "stride_s", "SPLITS")
flags = ("SPLIT", "BLOCK_SCALE", "BLOCK_M", "BLOCK_N", "BLOCK_K", "REDUCE", "EVEN", "PDL")
sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16",
       "ws_ptr": "*fp32", "count_ptr": "*i32", **dict.fromkeys(ints, "i32"),
       **dict.fromkeys(flags, "constexpr")}
target = GPUTarget("cuda", 90, 32)
for block_n, block_k, block_m, split, reduce, pdl in (
    (16, 2048, 1, True, True, 1), (64, 512, 2, True, False, 1), (16, 1024, 8, False, False, 0),
):
    constants = {"SPLIT": split, "BLOCK_SCALE": True, "BLOCK_M": block_m, "BLOCK_N": block_n,
                 "BLOCK_K": block_k, "REDUCE": reduce, "EVEN": True, "PDL": pdl}
    assert triton.compile(ASTSource(_splitk_kernel, sig, constants), target=target).asm["ptx"]
sig = {"ws_ptr": "*fp32", "y_ptr": "*bf16", "MN": "i32", "SPLITS": "i32", "BLOCK": "constexpr",
       "PDL": "constexpr"}
source = ASTSource(_sum_splits_kernel, sig, {"BLOCK": 1024, "PDL": 1})
assert triton.compile(source, target=target).asm["ptx"]
print("compiled")
"""


@pytest.mark.needs("triton")
def test_splitk_kernels_compile_for_sm90():
    """The split-K GEMV (atomic and kernel reductions, with PDL) and its sum kernel compile for
    sm_90 without a GPU (the interpreter accepts code compiled Triton refuses), in a process
    without the TRITON_INTERPRET the test session sets."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_SPLITK], env=env, timeout=240,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]


# (M, N, K, config) of the split-K tensor-core kernel: config (BLOCK_N, BLOCK_M cap, warps,
# stages, splits): ragged N and K, splits that do not divide the chunks, one split (no
# workspace), the launcher's choice (0), several M tiles (M 40 at cap 16), M not a power of 2
SK_CASES = {
    "cpu": [(1, 200, 320, (64, 64, 4, 2, 2)), (3, 256, 384, (32, 16, 4, 2, 3)),
            (5, 130, 200, (64, 64, 4, 2, 0)), (20, 64, 512, (64, 64, 4, 2, 1)),
            (40, 96, 640, (32, 16, 4, 2, 2)), (2, 128, 1024, (64, 64, 4, 2, 8))],
    # few, and (block scales) tiles benchmarks/fp8_sweep.py compiles first: the GPU script's
    # pytest step has little time left
    "cuda": [(3, 4096, 14336, (64, 64, 4, 4, 8)), (40, 6144, 4096, (128, 64, 8, 4, 4)),
             (256, 4096, 4096, (128, 128, 8, 4, 2)), (24, 1000, 328, (32, 16, 4, 4, 3))],
}  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", kernels.MODES)
@pytest.mark.parametrize("path", sorted(kernels.SK_PATHS))
def test_sk_gemm_matches_reference_and_repeats_exactly(device, mode, path):
    """Each split-K tensor-core path against the float64 reference (W8A8 paths: of the same
    quantised activations); a repeated call is bit-equal (splits summed in split order by the
    tile's last program, whichever that is), and the counters are left zero. On the CPU the
    in-kernel activation quantisation (sk_w8a8) gives exactly what sk_w8a8_pre gives with
    torch's quantised activations."""
    cases = SK_CASES[device]
    if device == "cpu" and mode == "row":  # the interpreter's minutes: the tile edge cases are
        cases = cases[1::2]  # the block mode's; per-row scales need only a few shapes
    for m, n, k, config in cases:
        gen = generator("sk", path, mode, m, n, k)
        w, scale = random_fp8(gen, n, k, mode, device)
        x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
        if path == "sk_w8a16":
            ref = kernels.reference_linear(x, w, scale, mode, dtype=torch.float64)
        else:
            ref = kernels.reference_w8a8(x, w, scale, mode, dtype=torch.float64)
        out = kernels.linear(x, w, scale, mode, path=path, config=config)
        assert out.dtype == torch.bfloat16
        err = rel_err(out, ref)
        assert err < TOL, f"{path} {mode} M={m} N={n} K={k} {config}: relative error {err:.2e}"
        assert torch.equal(out, kernels.sk_gemm(x, w, scale, mode, path, config)), (m, config)
        if device == "cpu" and path == "sk_w8a8":
            pre = kernels.sk_gemm(x, w, scale, mode, "sk_w8a8_pre", config,
                                  quantized=kernels.reference_quantize_activations(x))  # fmt: skip
            assert torch.equal(out, pre), (m, n, k, config)
    assert not runtime.arrival_counters(torch.device(device)).any()


def test_sk_splits_fill_the_gpu():
    """The launcher's split-K choice: at least MIN_PROGRAMS programs where K allows it, never
    more splits than 128-column chunks."""
    assert kernels.sk_splits(64, 32) == 8 and kernels.sk_splits(32, 32) == 16
    assert kernels.sk_splits(448, 32) == 1 and kernels.sk_splits(64, 3) == 2
    assert kernels.sk_splits(1, 1) == 1


@pytest.mark.needs("triton")
@pytest.mark.skipif(not runtime.INTERPRET, reason="the CPU route check needs the interpreter")
def test_router_runs_the_sk_paths_of_a_table(monkeypatch):
    """A tuned-table row naming a split-K tensor-core path (config as the JSON loads it) is
    what linear() runs without a forced path."""
    from speculant.kernels import fp8_table

    table = {"cpu": {(256, 384): [(2, "sk_w8a16", (64, 64, 4, 2, 2)),
                                  (8, "sk_w8a8", (32, 16, 4, 2, 0))]}}  # fmt: skip
    monkeypatch.setattr(kernels, "TUNED", table)
    calls = []
    real = kernels.sk_gemm
    monkeypatch.setattr(kernels, "sk_gemm", lambda *a, **kw: calls.append(a[4]) or real(*a, **kw))
    gen = generator("sk-route")
    w, scale = random_fp8(gen, 256, 384, "block", "cpu")
    for m, path in ((2, "sk_w8a16"), (5, "sk_w8a8")):
        x = torch.randn(m, 384, generator=gen).to(torch.bfloat16)
        assert fp8_table.lookup(table, x.device, 256, 384, m)[0] == path
        reference = kernels.reference_linear if path == "sk_w8a16" else kernels.reference_w8a8
        ref = reference(x, w, scale, "block", dtype=torch.float64)
        assert rel_err(kernels.linear(x, w, scale, "block"), ref) < TOL
        assert calls[-1] == path


COMPILE_SK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from speculant.kernels.fp8 import _act_quant_kernel, _sk_kernel

ints = ("M", "N", "K", "stride_x", "stride_xs", "stride_w", "stride_y", "stride_s", "CHUNKS",
        "SPLITS")
flags = ("ACT", "BLOCK_SCALE", "BLOCK_M", "BLOCK_N", "SPLIT", "EVEN", "DOT_F32", "INTERP", "PDL")
target = GPUTarget("cuda", 90, 32)
# (ACT, BLOCK_N, BLOCK_M, warps, stages, SPLIT, EVEN, PDL, BLOCK_SCALE)
for act, block_n, block_m, warps, stages, split, even, pdl, block in (
    (0, 64, 16, 4, 4, True, True, 1, True), (1, 64, 16, 4, 6, True, True, 1, True),
    (2, 128, 64, 8, 4, True, True, 2, True), (1, 128, 128, 8, 3, False, False, 0, False),
    (0, 32, 32, 4, 4, True, False, 1, True), (0, 128, 128, 8, 3, True, True, 1, True),
):
    sig = {"x_ptr": "*fp8e4nv" if act == 2 else "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv",
           "s_ptr": "*fp32", "y_ptr": "*bf16", "ws_ptr": "*fp32", "count_ptr": "*i32",
           **dict.fromkeys(ints, "i32"), **dict.fromkeys(flags, "constexpr")}
    names = list(sig)  # what the JIT assumes at the 8B shapes: 16-aligned pointers and sizes
    aligned = [a for a in names if sig[a][0] == "*" or a in ints[1:8]]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    constants = {"ACT": act, "BLOCK_SCALE": block, "BLOCK_M": block_m, "BLOCK_N": block_n,
                 "SPLIT": split, "EVEN": even, "DOT_F32": False, "INTERP": False, "PDL": pdl}
    options = {"num_warps": warps, "num_stages": stages}
    ptx = triton.compile(ASTSource(_sk_kernel, sig, constants, attrs), target=target,
                         options=options).asm["ptx"]
    assert "cp.async" in ptx, "the K loop is not pipelined"
    assert block_n < 64 or "wgmma.mma_async" in ptx
    assert ("prefetch.global.L2" in ptx) == bool(pdl)
sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "stride_x": "i32",
       "stride_q": "i32", "stride_s": "i32", "stride_sg": "i32", "BLOCK_K": "constexpr",
       "ROUND": "constexpr"}
for rnd in (False, True):
    source = ASTSource(_act_quant_kernel, sig, {"BLOCK_K": 128, "ROUND": rnd})
    assert triton.compile(source, target=target, options={"num_warps": 1}).asm["ptx"]
print("compiled")
"""


@pytest.mark.needs("triton")
def test_sk_kernel_compiles_for_sm90():
    """The split-K tensor-core kernel (each ACT, wgmma and mma.sync tiles, one and several
    splits, ragged and whole shapes, PDL modes) and the activation quantisation compile for
    sm_90 without a GPU, its K loop pipelined (cp.async) and its W slice prefetched under
    PDL; in a process without the TRITON_INTERPRET the test session sets."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_SK], env=env, timeout=240,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]
