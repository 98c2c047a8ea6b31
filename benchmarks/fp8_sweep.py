"""FP8 path sweep per projection shape (issue 24): for every Llama-3.1-8B projection (N x K) and
M = 1 ... 256, time every kernels/fp8.py path and config as the decode graph runs it, check its
output against the torch reference, and write the fastest per (N, K, M) as the tuned table
(kernels/fp8_table.py's format) for this GPU; then, budget permitting, time the 8B graph decode
step at bs 1 and 64 with that table vs bf16 (benchmarks/fp8_gpu.py's stage).

Times: one CUDA graph of LAUNCHES back-to-back calls rotating over enough weight copies that the
50 MB L2 cannot hold them, replayed REPLAYS times; us per call = median replay / LAUNCHES.
GB/s counts the e4m3 weight bytes. A candidate whose relative Frobenius error against the
float32 reference (W8A8 paths: of the same quantised activations) is >= 1e-2 is rejected.
Before the sweep, a probe tries the plausible block-wise scale layouts of torch._scaled_mm.

    python benchmarks/fp8_sweep.py [--budget-s 240] [--json OUT/fp8_sweep.json]
        [--table OUT/fp8_tuned.json] [--skip-decode] [--dry-run] [--merge]
        [--target CHECKPOINT [--tp N]]

`--target`: the projection shapes of that checkpoint (one TP rank's at `--tp`) instead of the
8B ones, for a model whose shapes the shipped table lacks (kernels/fp8_table.py borrows the
nearest measured shape's rows meanwhile); with `--merge` the table keeps every other row.

`--dry-run`: tiny shapes on the CPU through Triton's interpreter (the script's logic and the
table writing; times meaningless). Install a GPU table: copy the written JSON to
kernels/fp8_tuned.json (other devices already there are kept in it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import

import torch  # noqa: E402

from speculant.kernels import fp8 as kernels  # noqa: E402
from speculant.kernels import fp8_table  # noqa: E402

SHAPES_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
SHAPES_DRY = {"a": (256, 384), "b": (200, 320)}
# in priority order: bs-1 decode, bs-64 decode, EAGLE-3 k=3 verify at bs 1 (4 rows), the rest
# by priority (the budget may end the sweep early); then row counts graphs run padded to
# (3: a bs-3 eager forward; 24, 40: decode sizes) so the table is not only powers of two
MS = (1, 64, 4, 2, 8, 16, 32, 128, 256, 3, 24, 40)
MS_DRY = (1, 4, 16, 40)
LAUNCHES, REPLAYS = 20, 10
L2_BYTES = 50 * 2**20
TOL = 1e-2
W8A8_PATHS = ("w8a8", "scaled_mm", "sk_w8a8", "sk_w8a8_pre")  # checked vs quantised x
SPLITK_MAX_M = 16
FMA_CONFIGS = [(16, 512, 4), (8, 512, 4), (32, 256, 8)]
# the one-row streaming GEMV (`stream`, M = 1): (BLOCK_N, PRE_K, BLOCK_K, warps), PRE_K the W
# columns loaded before the PDL wait (cut to K by kernels.stream_plan)
STREAM_CONFIGS = [
    (4, 4096, 512, 4), (4, 8192, 512, 4), (8, 2048, 512, 4), (8, 2048, 1024, 8),
    (8, 4096, 512, 8), (8, 4096, 1024, 8), (8, 8192, 1024, 8), (16, 1024, 512, 8),
    (16, 1024, 1024, 8), (16, 2048, 512, 8), (16, 2048, 1024, 8), (16, 4096, 512, 8),
    (32, 2048, 512, 8),
]  # fmt: skip
DOT_CONFIGS = [(64, 64, 4, 2), (128, 64, 8, 3)]  # (32, 64, 4, 4) never won (wave 3)
GEMM_CONFIGS = [(128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 4), (256, 64, 8, 3)]
SPLITK_TOP = 3  # configs of the M = 1 sweep kept for larger M
# The split-K tensor-core paths (kernels/fp8.py `_sk_kernel`): (BLOCK_N, num_warps, stages)
# tiles, each with the BLOCK_M caps and the split counts of sk_configs. Every config is timed
# at the first M of its BLOCK_M bucket in MS's order (SK_FULL_MS); the other M of the bucket
# time the SK_TOP fastest of it per path (their grids are the same).
SK_PATHS = ("sk_w8a16", "sk_w8a8")
SK_TILES = [(64, 4, 4), (64, 4, 6), (128, 4, 3), (128, 8, 4), (32, 4, 4)]
SK_FULL_MS = (64, 4, 32, 128, 256)
SK_TOP = 4
SK_PROGRAMS = (132, 1100)  # split counts tried: grids of about one to eight programs per SM
# `--wide` (wave 13): every (BLOCK_N, warps, stages) below at each M of `--ms`, with the split
# counts of WIDE_SPLITS (not only powers of two: whole waves over the 132 SMs) in
# WIDE_PROGRAMS programs, and the one-pass W8A8 GEMM at every stage count. The decode
# attention's sweep (wave 12) found Triton's stage count worth 70% -> 97% of bandwidth.
WIDE_TILES = [(bn, w, st) for bn, w in ((64, 4), (128, 4), (128, 8)) for st in (2, 3, 4, 5)] + [
    (256, 8, 2), (256, 8, 3)]  # fmt: skip
WIDE_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
WIDE_PROGRAMS = (128, 800)
WIDE_GEMMS = [(bn, bm, w, st) for bn, bm, w in ((128, 64, 4), (64, 64, 4), (128, 64, 8))
              for st in (2, 3, 4, 5)]  # fmt: skip


def splitk_configs(dry: bool) -> list[tuple]:
    """(BLOCK_N, BLOCK_K, warps): 4-32 K elements of W per program, 32-128 per thread."""
    if dry:
        return [(16, 128, 4), (32, 256, 4)]
    out = []
    for block_n in (8, 16, 32, 64):
        for block_k in (256, 512, 1024, 2048):
            for warps in (4, 8):
                per_thread = block_n * block_k // (32 * warps)
                if 4096 <= block_n * block_k <= 32768 and 32 <= per_thread <= 128:
                    out.append((block_n, block_k, warps))
    return out


def rand_fp8(n: int, k: int, device: str, gen: torch.Generator):
    w = (torch.randn(n, k, generator=gen, device=device) * 64).clamp(-448, 448).to(kernels.FP8)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen, device=device) + 0.5
    return w, scale / (64 * k**0.5)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def time_us(call, weights: list, cuda: bool) -> float:
    """us per call of call(weight) as the decode graph runs it (see the module doc)."""
    for w in weights[: min(len(weights), 2)]:
        call(w)  # compile, allocate the split-K counters, outside the capture
    if not cuda:
        t0 = time.perf_counter()
        call(weights[0])
        return (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAUNCHES):
            call(weights[i % len(weights)])
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) * 1e3 / LAUNCHES


def probe_scaled_mm(cuda: bool) -> dict:
    """Which block-wise scale layout of torch._scaled_mm / F.scaled_mm gives x W^T here:
    {"works": config or None, "tried": {label: error or rel_err}}."""
    out: dict = {"works": None, "tried": {}}
    if not cuda:
        out["tried"]["cpu"] = "no CUDA: scaled_mm is a CUDA path"
        return out
    gen = torch.Generator(device="cuda").manual_seed(5)
    w, scale = rand_fp8(512, 1024, "cuda", gen)
    for m in (64, 1):
        x = torch.randn(m, 1024, generator=gen, device="cuda").to(torch.bfloat16)
        ref = kernels.reference_w8a8(x, w, scale, "block")
        for api in ("v1", "v2"):
            for scale_a in ("col", "row"):
                for scale_b in ("t", "t_contig"):
                    config = {"api": api, "scale_a": scale_a, "scale_b": scale_b}
                    label = f"M{m}/{api}/{scale_a}/{scale_b}"
                    try:
                        err = rel_err(kernels.scaled_mm(x, w, scale, config), ref)
                        out["tried"][label] = err
                        if err < TOL and out["works"] is None and m == 64:
                            out["works"] = config
                    except Exception as exc:
                        out["tried"][label] = f"{type(exc).__name__}: {exc}"[:240]
    if out["works"] is not None:
        label = "M1/{api}/{scale_a}/{scale_b}".format(**out["works"])
        out["works_at_m1"] = isinstance(out["tried"].get(label), float)
    return out


def sk_bucket(m: int, cap: int = 128) -> int:
    """The BLOCK_M `_sk_kernel` runs M rows with (at most `cap`)."""
    return min(max(16, 1 << max(m - 1, 0).bit_length()), cap)


def sk_configs(m: int, n: int, k: int, dry: bool) -> list[tuple]:
    """(BLOCK_N, BLOCK_M cap, warps, stages, splits) of `_sk_kernel` for M rows of an N x K
    weight: the SK_TILES tiles (fewer from M = 32 on), BLOCK_M cap 64 (128 from M = 128),
    power-of-two split counts whose grids have SK_PROGRAMS programs, else the launcher's own
    choice (0)."""
    tiles = [(64, 4, 2)] if dry else SK_TILES if m < 32 else SK_TILES[:4] if m < 128 else [
        SK_TILES[0], SK_TILES[2], SK_TILES[3]]  # fmt: skip
    caps = (128,) if m >= 128 and not dry else (64,)
    chunks = -(-k // kernels.BLOCK)
    out = []
    for block_n, warps, stages in tiles:
        for cap in caps:
            grid = -(-n // block_n) * -(-m // sk_bucket(m, cap))
            splits = [s for s in (1, 2, 4, 8, 16, 32) if s <= chunks
                      and SK_PROGRAMS[0] <= grid * s <= SK_PROGRAMS[1]]  # fmt: skip
            for split in (splits[:2] if dry else splits) or [0]:
                out.append((block_n, cap, warps, stages, split))
    return out


def wide_sk_configs(m: int, n: int, k: int) -> list[tuple]:
    """`--wide`: (BLOCK_N, BLOCK_M cap, warps, stages, splits) over WIDE_TILES x WIDE_SPLITS."""
    chunks = -(-k // kernels.BLOCK)
    out = []
    for block_n, warps, stages in WIDE_TILES:
        grid = -(-n // block_n) * -(-m // sk_bucket(m, 64))
        for split in WIDE_SPLITS:
            if split <= chunks and WIDE_PROGRAMS[0] <= grid * split <= WIDE_PROGRAMS[1]:
                out.append((block_n, 64, warps, stages, split))
    return out


def wide_candidates(m: int, n: int, k: int, scaled_mm: dict | None) -> list[tuple]:
    """`--wide`: the tensor-core paths at M rows, every stage count (see WIDE_TILES), and the
    shipped table's choice for (N, K, M) timed in the same run. (Wave 13 also timed the W tiles
    through a TMA tensor descriptor, f73e52e: correct, and within 2% of the plain loads;
    dropped, results/fp8_wave6.md.)"""
    sk = wide_sk_configs(m, n, k)
    if m < 32:  # fewer below (wave 4: 2 to 4 stages and BLOCK_N <= 128 won there)
        sk = [c for c in sk if c[3] <= 4 and c[0] <= 128]
    out = [("sk_w8a8", c) for c in sk]
    out += [("sk_w8a8_pre", c) for c in sk if c[3] <= 3 and m >= 32]
    if m >= 8:
        out += [("w8a8", c) for c in WIDE_GEMMS]
    if scaled_mm is not None and m >= 2:
        out.append(("scaled_mm", scaled_mm))
    if torch.cuda.is_available():
        shipped = fp8_table.lookup(fp8_table.load(), torch.device("cuda"), n, k, m)
        if shipped is not None and shipped not in out:
            out.append(shipped)
    return out


def candidates(
    m: int, n: int, k: int, splitk: list, scaled_mm: dict | None, dry: bool, sk: dict
) -> list[tuple]:
    """(path, config) pairs to time at M rows of an [n, k] weight; sk: {path: [config, ...]}
    of the split-K tensor-core paths (chosen by the caller)."""
    out: list[tuple] = []
    if m <= SPLITK_MAX_M:
        out += [("splitk", c) for c in splitk]
    if m == 1:  # the configs that tile this weight (else stream_gemv takes the FMA kernel)
        out += [("stream", c) for c in STREAM_CONFIGS if kernels.stream_plan(n, k, c)]
    if m <= 2:  # it never won above M = 1 (wave 3)
        out += [("fma", c) for c in FMA_CONFIGS[:1]]
    if m >= 2:
        out += [("dot", c) for c in (DOT_CONFIGS[:1] if dry else DOT_CONFIGS)]
    for path, configs in sk.items():
        out += [(path, c) for c in configs]
    if m >= 8:
        gemms = GEMM_CONFIGS[:1] if dry else GEMM_CONFIGS
        out += [("w8a8", c) for c in gemms]
    if m >= 128:
        out += [("w8a16", c) for c in (GEMM_CONFIGS[:1] if dry else GEMM_CONFIGS[:2])]
        out.append(("dequant", None))
    if scaled_mm is not None:
        out.append(("scaled_mm", scaled_mm))
    return out


def sk_candidates(m: int, n: int, k: int, dry: bool, best: dict) -> dict:
    """{path: configs} of the split-K tensor-core paths at M rows: all of sk_configs at M = 1
    (the launcher's choice only) and at SK_FULL_MS, else `best`'s fastest of the bucket's
    full M (also every config when that M was not measured); sk_w8a8_pre from M = 32."""
    paths = SK_PATHS + (("sk_w8a8_pre",) if m >= 32 else ())
    if m == 1:
        return {path: [(64, 64, 4, 4, 0), (128, 64, 4, 3, 0)] for path in SK_PATHS}
    full = sk_configs(m, n, k, dry)
    out = {}
    for path in paths:
        kept = best.get((path, sk_bucket(m)))
        out[path] = full if dry or m in SK_FULL_MS or not kept else kept
        if path == "sk_w8a8_pre" and out[path] is full:
            out[path] = full[::2]
    return out


def swept_shapes(args) -> dict:
    """{name: (N, K)}: the --target checkpoint's (args.shapes), else the dry run's or the 8B."""
    return getattr(args, "shapes", None) or (SHAPES_DRY if args.dry_run else SHAPES_8B)


def sweep(args, report: dict, deadline: float) -> dict:
    """report["kernels"][name/M] = {label: {us, GBps, err} or {error}}; returns the table rows
    {(N, K): [(M, path, config, us), ...]}."""
    cuda = not args.dry_run
    device = "cuda" if cuda else "cpu"
    shapes = swept_shapes(args)
    ms = MS_DRY if args.dry_run else MS
    if args.ms:
        ms = tuple(int(v) for v in args.ms.split(","))
    gen = torch.Generator(device=device).manual_seed(0)
    probe = report["scaled_mm_probe"]
    scaled_config = probe["works"]
    all_splitk = [c + (r,) for c in splitk_configs(args.dry_run) for r in ("atomic",)]
    weights, rows = {}, {}
    for name, (n, k) in shapes.items():
        w, scale = rand_fp8(n, k, device, gen)
        copies = max(3, math.ceil(3 * L2_BYTES / w.numel())) if cuda else 1
        fp8 = [(w, scale)] + [(w.clone(), scale.clone()) for _ in range(copies - 1)]
        dense = (w.float() * kernels.full_scale(w, scale, "block")).to(torch.bfloat16)
        bf16 = [dense] + [dense.clone() for _ in range(copies - 1)]
        weights[name] = (fp8, bf16)
    best_splitk: dict = {}
    best_sk: dict = {}  # name -> {(path, BLOCK_M bucket): fastest configs}
    for m in ms:
        for name, (n, k) in shapes.items():
            if time.time() > deadline:
                report["stopped_at"] = f"{name}/{m}: budget spent"
                return rows
            fp8, bf16 = weights[name]
            w, scale = fp8[0]
            x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
            ref = kernels.reference_linear(x, w, scale, "block")
            ref8 = kernels.reference_w8a8(x, w, scale, "block")
            dense_us = time_us(lambda d, x=x: torch.nn.functional.linear(x, d), bf16, cuda)
            entry = {"bf16": {"us": dense_us, "GBps": 2 * w.numel() / dense_us / 1e3}}
            if m == 1:  # every config; the other reduction for a few
                splitk = all_splitk + [c[:3] + ("kernel",) for c in all_splitk[::7]]
            else:  # the best at M = 1, both reductions for the two best
                splitk = best_splitk.get(name, all_splitk[:SPLITK_TOP])
                splitk = splitk + [c[:3] + ("kernel",) for c in splitk[:2]]
            sk = sk_candidates(m, n, k, args.dry_run, best_sk.get(name, {}))
            if args.wide:
                chosen = wide_candidates(m, n, k, scaled_config)
            else:
                chosen = candidates(m, n, k, splitk, scaled_config, args.dry_run, sk)
            if args.paths:
                chosen = [(p, c) for p, c in chosen if p in args.paths.split(",")]
            for path, config in chosen:
                label = f"{path}{list(config) if isinstance(config, tuple) else ''}"
                want = ref8 if path in W8A8_PATHS else ref
                entry[label] = measure(path, config, x, fp8, want, cuda)
            report["kernels"][f"{name}/{m}"] = entry
            if m in SK_FULL_MS:  # the fastest per path for the bucket's other M
                for path, configs in sk.items():
                    timed = [c for c in configs if "us" in entry.get(f"{path}{list(c)}", {})]
                    timed.sort(key=lambda c, p=path: entry[f"{p}{list(c)}"]["us"])
                    best_sk.setdefault(name, {})[(path, sk_bucket(m))] = timed[:SK_TOP]
            if m == 1:
                timed = [c for c in all_splitk if "us" in entry.get(f"splitk{list(c)}", {})]
                timed.sort(key=lambda c: entry[f"splitk{list(c)}"]["us"])
                best_splitk[name] = timed[:SPLITK_TOP]
            good = {lab: e for lab, e in entry.items() if lab != "bf16" and "us" in e}
            if good:
                label = min(good, key=lambda lab: good[lab]["us"])
                rows.setdefault((n, k), []).append(
                    (m, good[label]["path"], good[label]["config"], good[label]["us"])
                )
                print(
                    f"  {name:8s} M={m:4d}: bf16 {entry['bf16']['us']:7.1f} us, best {label} "
                    f"{good[label]['us']:7.1f} us {good[label]['GBps']:6.0f} GB/s "
                    f"(err {good[label]['err']:.1e}; {time.time() - report['t0']:.0f} s)",
                    flush=True,
                )
    return rows


def measure(path, config, x, fp8: list, ref, cuda: bool) -> dict:
    """One candidate: its error on the first weight copy, then its time (rejected if wrong)."""
    try:
        w, scale = fp8[0]
        err = rel_err(kernels.linear(x, w, scale, "block", path=path, config=config), ref)
        out = {"path": path, "config": list(config) if isinstance(config, tuple) else config}
        out["err"] = err
        if not err < TOL:
            return {**out, "error": f"rejected: relative error {err:.2e}"}
        us = time_us(lambda c: kernels.linear(x, *c, "block", path=path, config=config), fp8, cuda)
        return {**out, "us": us, "GBps": w.numel() / us / 1e3}
    except Exception as exc:
        return {"path": path, "error": f"{type(exc).__name__}: {exc}"[:300]}


def model_shapes(target: str, tp: int = 1) -> dict:
    """{name: (N, K)} of the FP8 projections one TP rank of the checkpoint in `target` runs
    (its config.json; KV heads replicated where fewer than tp, as models/layers.py does): qkv,
    o and, with a dense MLP, gate_up and down (MoE experts dequantise: not routed here); names
    of one shape joined ("o+down"), each shape once."""
    from speculant.config import ModelConfig

    cfg = ModelConfig.from_dir(target)
    heads, kv = cfg.num_heads // tp, cfg.num_kv_heads * max(1, tp // cfg.num_kv_heads) // tp
    hidden, d = cfg.hidden_size, cfg.head_dim
    shapes = {"qkv": ((heads + 2 * kv) * d, hidden), "o": (hidden, heads * d)}
    if len(cfg.moe_layer_ids) < cfg.num_layers:  # some layers have the dense MLP
        inner = cfg.intermediate_size // tp
        shapes.update(gate_up=(2 * inner, hidden), down=(hidden, inner))
    names: dict = {}
    for name, shape in shapes.items():
        names.setdefault(shape, []).append(name)
    return {"+".join(group): shape for shape, group in names.items()}


def layer_sums(report: dict, shapes: dict) -> dict:
    """Per M with every shape measured: one layer's four projections, best FP8 vs bf16 (us)."""
    sums: dict = {}
    for m in sorted({int(key.split("/")[1]) for key in report["kernels"]}):
        entries = [report["kernels"].get(f"{name}/{m}") for name in shapes]
        if not all(entries):
            continue
        best = [min((e["us"] for lab, e in x.items() if lab != "bf16" and "us" in e),
                    default=math.inf) for x in entries]  # fmt: skip
        sums[m] = {"fp8_us": sum(best), "bf16_us": sum(x["bf16"]["us"] for x in entries)}
        print(
            f"  layer M={m:4d}: fp8 {sums[m]['fp8_us']:7.1f} us, bf16 {sums[m]['bf16_us']:7.1f} us"
        )
    return sums


def write_table(
    rows: dict, device_name: str, path: Path, merge: bool = False, capability=None
) -> dict:
    """The tuned table: this device's rows (and its compute `capability`, which lets GPUs of
    the same one borrow them), next to the other devices of kernels/fp8_tuned.json; `merge`:
    the shipped rows of this device kept except at the M this sweep measured."""
    doc = {"devices": {}}
    if fp8_table.TUNED_PATH.exists():
        doc = json.loads(fp8_table.TUNED_PATH.read_text())
    if capability is not None:
        doc.setdefault("capability", {})[device_name] = list(capability)
    new = fp8_table.to_json({device_name: rows})["devices"].get(device_name, {})
    if merge:
        old = doc.get("devices", {}).get(device_name, {})
        for shape, swept in new.items():
            measured = {r["max_m"] for r in swept}
            kept = [r for r in old.get(shape, []) if r["max_m"] not in measured]
            new[shape] = sorted(kept + swept, key=lambda r: r["max_m"])
        new = {**old, **new}
    doc.setdefault("devices", {})[device_name] = new
    doc["comment"] = (
        "benchmarks/fp8_sweep.py: fastest kernels/fp8.py path per GPU, (N x K) and M (us per "
        "call in a CUDA graph, weights not L2-resident)"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_table(doc))
    return doc


def format_table(doc: dict) -> str:
    """The table as JSON with one row per line (reviewable diffs)."""
    lines = ["{", f' "comment": {json.dumps(doc.get("comment", ""))},']
    if doc.get("capability"):
        lines.append(f' "capability": {json.dumps(doc["capability"])},')
    lines.append(' "devices": {')
    devices = list(doc["devices"].items())
    for i, (device, shapes) in enumerate(devices):
        lines.append(f"  {json.dumps(device)}: {{")
        for j, (shape, rows) in enumerate(shapes.items()):
            lines.append(f"   {json.dumps(shape)}: [")
            lines += [f"    {json.dumps(r)}," for r in rows]
            lines[-1] = lines[-1].rstrip(",")
            lines.append("   ]" + ("," if j < len(shapes) - 1 else ""))
        lines.append("  }" + ("," if i < len(devices) - 1 else ""))
    return "\n".join(lines + [" }", "}", ""])


def decode(args, report: dict, table_path: Path) -> None:
    """Graph decode step bs 1 and 64: FP8 with the new table, bf16 (fp8_gpu.decode_stage)."""
    from fp8_gpu import decode_stage, targets

    paths = targets()
    kernels.TUNED = fp8_table.load(table_path)
    for kind in ("fp8", "bf16"):
        t0 = time.time()
        try:
            report["decode"][kind] = decode_stage(paths[kind], kind, args)
        except Exception as exc:
            report["decode"][kind] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"  decode {kind}: {time.time() - t0:.0f} s", flush=True)
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    out_dir = Path(os.environ.get("OUT", "."))
    parser.add_argument("--json", type=Path, default=out_dir / "fp8_sweep.json")
    parser.add_argument("--table", type=Path, default=out_dir / "fp8_tuned.json")
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--decode-reserve-s", type=float, default=80.0)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--ms", default="", help="comma-separated row counts (default: MS)")
    parser.add_argument("--wide", action="store_true", help="every stage count (WIDE_TILES)")
    parser.add_argument("--paths", default="", help="comma-separated paths to time (default all)")
    parser.add_argument(
        "--merge", action="store_true",
        help="write the table as the shipped one with only the swept M rows replaced",
    )  # fmt: skip
    parser.add_argument(
        "--target", default=None,
        help="a checkpoint folder: sweep its projections' shapes (one TP rank's: --tp), not "
        "the Llama-3.1-8B ones; no decode stage",
    )  # fmt: skip
    parser.add_argument("--tp", type=int, default=1, help="with --target: the TP size it runs at")
    args = parser.parse_args()
    t0 = time.time()
    cuda = not args.dry_run
    args.shapes = model_shapes(args.target, args.tp) if args.target else None
    decode_on = cuda and not args.skip_decode and not args.target
    device_name = fp8_table.device_name(torch.device("cuda" if cuda else "cpu"))
    report: dict = {
        "t0": t0,
        "gpu": device_name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["python"] + sys.argv),
        "kernels": {},
        "decode": {},
    }
    report["scaled_mm_probe"] = probe_scaled_mm(cuda)
    print(f"  scaled_mm probe: works = {report['scaled_mm_probe']['works']}", flush=True)
    deadline = t0 + args.budget_s - (args.decode_reserve_s if decode_on else 0)
    rows = sweep(args, report, deadline)
    shapes = swept_shapes(args)
    report["shapes"] = {name: list(shape) for name, shape in shapes.items()}
    report["layer_sums"] = layer_sums(report, shapes)
    capability = fp8_table.device_capability(torch.device("cuda")) if cuda else None
    doc = write_table(rows, device_name, args.table, args.merge, capability)
    report["table"] = doc["devices"][device_name]
    print(f"  table: {sum(len(r) for r in rows.values())} rows -> {args.table}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=str))
    if decode_on:
        torch.cuda.empty_cache()
        decode(args, report, args.table)
        for kind, res in report["decode"].items():
            steps = {k: v for k, v in res.items() if k.startswith("graph_ms")}
            print(f"  decode {kind}: {steps or res.get('error')}", flush=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))
    print(f"  done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
