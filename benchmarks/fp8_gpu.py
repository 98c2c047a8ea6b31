"""FP8 targets on one GPU (issue 24), in one process, every stage caught and recorded so that one
call gives all it can: a Llama-3.1-8B-shape target with `--load-format dummy` and a block-wise
FP8 `quantization_config` (e4m3 weights, 128x128 `weight_scale_inv`) next to the same shape in
bf16.

1. kernels (kernels/fp8.py) at the 8B projection shapes for M = 1 ... 2048: max abs / relative
   error of every path against the torch reference (float32 dequantised weight; the W8A8 path
   against the reference of the same quantised activations), and its time next to bf16 F.linear
   (and the bf16 GEMV at M = 1);
2. a sweep of the FMA and dot kernels' tile configs; the fastest per shape class, and the
   fastest path per M (the GEMM choice), are then set in kernels/fp8.py for the engine stages;
3. graph decode step at bs 1 and 64, context 512, FP8 vs bf16 (same run), roofline from the
   measured copy bandwidth, the bs-1 FP8 step's top kernels, graph replay == eager tokens;
4. an EAGLE-3 k=3 step (dummy 8B-shape head) on the FP8 target: whole step, verify and draft;
   speculative greedy tokens vs plain greedy on the same weights;
5. prefill tokens/s of one 2048-token prompt, FP8 (each prefill GEMM) vs bf16.

    python benchmarks/fp8_gpu.py --json OUT.json [--budget-s 200] [--quick] [--device cpu]

`--device cpu` checks the script itself (tiny shapes, the Triton interpreter, no engines).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import

import torch  # noqa: E402

BLOCK_FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
# name -> (N, K) of the Llama-3.1-8B projections (qkv, o, gate_up, down)
SHAPES_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
CPU_MS = (1, 3, 70)
SHAPES_CPU = {"a": (256, 384), "b": (200, 320)}
MS = (1, 2, 4, 8, 16, 32, 64, 256, 2048)
FMA_CONFIGS = [(8, 512, 4), (16, 512, 4), (16, 256, 4), (32, 256, 8), (8, 1024, 8)]
DOT_CONFIGS = [(64, 64, 4, 4), (128, 64, 8, 3), (32, 64, 4, 4), (64, 64, 4, 2)]
GEMM_CONFIGS = [(128, 128, 8, 3), (128, 64, 4, 4), (128, 128, 4, 4)]


def timer(cuda: bool):
    from graphs import time_ms

    return lambda fn, iters: time_ms(fn, iters, cuda=cuda)


def rand_fp8(n: int, k: int, device: str, gen: torch.Generator):
    from speculant.kernels import fp8 as kernels

    w = (torch.randn(n, k, generator=gen, device=device) * 64).clamp(-448, 448).to(kernels.FP8)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen, device=device) + 0.5
    return w, scale / (64 * k**0.5)


def kernels_stage(args, report: dict) -> dict:
    """Errors and times per (shape, M, path); the fastest path per M."""
    from speculant.kernels import fp8 as kernels
    from speculant.kernels import gemv

    cuda, device = args.device == "cuda", args.device
    shapes = SHAPES_8B if cuda else SHAPES_CPU
    ms = MS if cuda else CPU_MS
    iters = 20 if cuda else 1
    time_ms = timer(cuda)
    gen = torch.Generator(device=device).manual_seed(0)
    out: dict = {}
    for name, (n, k) in shapes.items():
        w, scale = rand_fp8(n, k, device, gen)
        w_bf16 = (w.float() * kernels.full_scale(w, scale, "block")).to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
            ref = kernels.reference_linear(x, w, scale, "block")
            ref8 = kernels.reference_w8a8(x, w, scale, "block")
            dense = (x, w_bf16)
            entry = {"bf16_ms": time_ms(lambda d=dense: torch.nn.functional.linear(*d), iters)}
            if m == 1 and cuda:
                entry["bf16_gemv_ms"] = time_ms(lambda d=dense: gemv.linear(*d), iters)
            case = (x, w, scale)
            for path in ("fma", "dot", "w8a16", "w8a8", "dequant"):
                if path == "fma" and m > 16:
                    continue
                if path in ("w8a16", "w8a8", "dequant") and m < 8 and cuda:
                    continue
                try:
                    y = kernels.linear(x, w, scale, "block", path=path).float()
                    r = ref8 if path == "w8a8" else ref
                    diff = (y - r).abs()
                    entry[path] = {
                        "max_abs_err": diff.max().item(),
                        "max_rel_err": (diff.max() / r.abs().max()).item(),
                        "rel_fro_err": ((y - r).norm() / r.norm()).item(),
                        "ms": time_ms(
                            lambda p=path, c=case: kernels.linear(*c, "block", path=p), iters
                        ),
                    }
                except Exception as exc:
                    entry[path] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            out[f"{name}/{m}"] = entry
            best = min(
                (p for p in entry if isinstance(entry[p], dict) and "ms" in entry[p]),
                key=lambda p: entry[p]["ms"],
                default=None,
            )
            entry["fastest"] = best
            if best:
                print(
                    f"  {name:8s} M={m:5d}: bf16 {entry['bf16_ms'] * 1e3:8.1f} us, "
                    f"fastest {best} {entry[best]['ms'] * 1e3:8.1f} us "
                    f"(err {entry[best]['rel_fro_err']:.1e})",
                    flush=True,
                )
    return out


def gemm_choice(results: dict, ms) -> dict:
    """Per M, the path with the least time summed over the shapes (only paths run for all)."""
    choice = {}
    for m in ms:
        entries = [e for key, e in results.items() if key.endswith(f"/{m}")]
        paths = {p for e in entries for p in e if isinstance(e[p], dict) and "ms" in e[p]}
        totals = {
            p: sum(e[p]["ms"] for e in entries)
            for p in paths
            if all(isinstance(e.get(p), dict) and "ms" in e[p] for e in entries)
        }
        if totals:
            best = min(totals, key=totals.get)
            bf16 = sum(e["bf16_ms"] for e in entries)
            choice[m] = {"path": best, "fp8_ms": totals[best], "bf16_ms": bf16, "all": totals}
    return choice


def sweep_stage(args) -> dict:
    """Tile configs: FMA at M = 1 and 4, dot at M = 16 and 64, GEMMs at M = 2048 (sum over
    the 8B shapes)."""
    from speculant.kernels import fp8 as kernels

    cuda, device = args.device == "cuda", args.device
    shapes = SHAPES_8B if cuda else SHAPES_CPU
    time_ms = timer(cuda)
    iters = 20 if cuda else 1
    gen = torch.Generator(device=device).manual_seed(1)
    weights = {name: rand_fp8(n, k, device, gen) for name, (n, k) in shapes.items()}
    out: dict = {"fma": {}, "dot": {}, "w8a16": {}, "w8a8": {}}

    def total(fn, m) -> float:
        t = 0.0
        for w, scale in weights.values():
            x = torch.randn(m, w.shape[1], device=device).to(torch.bfloat16)
            t += time_ms(lambda w=w, s=scale, x=x: fn(x, w, s), iters)
        return t

    fma_ms = (1,)
    for config in FMA_CONFIGS if cuda else FMA_CONFIGS[:2]:
        for m in fma_ms:
            key = f"{config}/{m}"
            try:
                out["fma"][key] = total(
                    lambda x, w, s, c=config: kernels.fma_gemv(x, w, s, "block", c), m
                )
            except Exception as exc:
                out["fma"][key] = f"{type(exc).__name__}: {exc}"[:200]
    for config in DOT_CONFIGS if cuda else DOT_CONFIGS[:2]:
        for m in (16,):
            key = f"{config}/{m}"
            try:
                out["dot"][key] = total(
                    lambda x, w, s, c=config: kernels.dot_gemm(x, w, s, "block", c), m
                )
            except Exception as exc:
                out["dot"][key] = f"{type(exc).__name__}: {exc}"[:200]
    m = 2048 if cuda else 70
    for config in GEMM_CONFIGS if cuda else GEMM_CONFIGS[:1]:
        for path, fn in (
            ("w8a16", lambda x, w, s, c=config: kernels.dot_gemm(x, w, s, "block", c, split_k=1)),
            ("w8a8", lambda x, w, s, c=config: kernels.w8a8_gemm(x, w, s, "block", c)),
        ):
            try:
                out[path][str(config)] = total(fn, m)
            except Exception as exc:
                out[path][str(config)] = f"{type(exc).__name__}: {exc}"[:200]

    def best(table: dict, suffix: str = ""):
        timed = {k: v for k, v in table.items() if isinstance(v, float) and k.endswith(suffix)}
        return min(timed, key=timed.get) if timed else None

    fma_best = best(out["fma"], "/1")
    dot_best = best(out["dot"], "/16")
    gemm_best = best(out["w8a8"])
    out["chosen"] = {"fma": fma_best, "dot": dot_best, "w8a8_gemm": gemm_best}
    # set them for the rest of the run
    if fma_best:
        kernels.FMA_CONFIG = tuple(
            json.loads(fma_best.split("/")[0].replace("(", "[").replace(")", "]"))
        )
    if dot_best:
        kernels.DOT_CONFIG = tuple(
            json.loads(dot_best.split("/")[0].replace("(", "[").replace(")", "]"))
        )
    if gemm_best:
        kernels.GEMM_CONFIG = tuple(json.loads(gemm_best.replace("(", "[").replace(")", "]")))
    print(f"  chosen configs: {out['chosen']}", flush=True)
    return out


def apply_choice(choice: dict) -> dict:
    """kernels.PATH_TABLE from the fastest path per measured M (the engine stages use it)."""
    from speculant.kernels import fp8 as kernels

    table = tuple(sorted((int(m), c["path"]) for m, c in choice.items()))
    if table:
        kernels.PATH_TABLE = table
    return {
        "PATH_TABLE": kernels.PATH_TABLE,
        "FMA_CONFIG": kernels.FMA_CONFIG,
        "DOT_CONFIG": kernels.DOT_CONFIG,
        "GEMM_CONFIG": kernels.GEMM_CONFIG,
    }


# ---------------------------------------------------------------------------- engines


def targets(shape: str = "llama8b") -> dict:
    from graphs import SHAPES, write_config

    bf16 = write_config(SHAPES[shape])
    fp8 = write_config(SHAPES[shape])
    config = json.loads((Path(fp8) / "config.json").read_text())
    config["quantization_config"] = BLOCK_FP8
    (Path(fp8) / "config.json").write_text(json.dumps(config))
    return {"bf16": bf16, "fp8": fp8}


def decode_stage(target: str, kind: str, args) -> dict:
    from decode import build_engine, free, kernel_profile
    from graphs import SHAPES, check_equal, live_rows, time_ms

    from speculant.models.fp8 import FP8

    engine = build_engine(target, "triton", args.context, [1, 64])
    out: dict = {}
    try:
        qkv = engine.model.model.layers[0].self_attn.qkv_proj
        out["qkv_dtype"] = str(qkv.weight.dtype)
        out["weight_bytes"] = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        if kind == "fp8" and qkv.weight.dtype != FP8:
            raise RuntimeError("--load-format dummy did not honour the quantization_config")
        vocab = SHAPES["llama8b"]["vocab_size"]
        gen = torch.Generator().manual_seed(1)
        for bs in (1, 64):
            rows = live_rows(engine, bs, vocab, args.context, gen)
            graph = engine.graphs.graph("greedy", bs)
            out[f"graph_ms/{bs}"] = time_ms(graph.replay, 30)
            if bs == 1 and kind == "fp8":
                try:
                    out["profile_bs1_graph"] = kernel_profile(graph.replay)
                except Exception as exc:
                    out["profile_bs1_graph"] = {"error": f"{type(exc).__name__}: {exc}"}
            for row in rows:
                engine.kv.free(row)
            print(f"  {kind} bs {bs}: {out[f'graph_ms/{bs}']:.3f} ms", flush=True)
        if kind == "fp8":
            try:
                out["graph_equals_eager"] = check_equal(engine, vocab, sizes=(1, 3))
            except Exception as exc:
                out["graph_equals_eager"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        free(engine)
    return out


def spec_stage(target: str, args) -> dict:
    from decode import build_engine, free
    from graphs import SHAPES
    from spec_step import timings, write_head

    from speculant import SamplingParams

    shape = SHAPES["llama8b"]
    spec = dict(algo="eagle3", draft=write_head(shape), num_draft_tokens=3)
    engine = build_engine(target, "triton", args.context, [1, 64], **spec)
    out: dict = {}
    try:
        out["timings"] = timings(engine, shape["vocab_size"], args.context, 3, (1, 64))
        gen = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in (17, 40, 5)]
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        spec_tokens = [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        free(engine)
    plain = build_engine(target, "triton", args.context, [1, 64])
    try:
        plain_tokens = [o.token_ids for o in plain.generate(prompts, params)]
    finally:
        free(plain)
    out["spec_equals_plain"] = spec_tokens == plain_tokens
    out["first_difference"] = next(
        (
            (i, next(j for j, (a, b) in enumerate(zip(s, p, strict=False)) if a != b))
            for i, (s, p) in enumerate(zip(spec_tokens, plain_tokens, strict=True))
            if s != p
        ),
        None,
    )
    print(f"  EAGLE-3 k=3 on FP8: {out['timings']}; spec == plain: {out['spec_equals_plain']}")
    return out


def prefill_stage(target: str, kind: str, args) -> dict:
    from decode import build_engine, free
    from graphs import time_ms

    from speculant.kernels import fp8 as kernels

    engine = build_engine(target, "triton", args.prefill_tokens, [1])
    out: dict = {}
    try:
        gen = torch.Generator().manual_seed(3)
        ids = torch.randint(3, 32000, (args.prefill_tokens,), generator=gen).tolist()
        row = engine.kv.allocate(args.prefill_tokens + 1)

        def prefill():
            engine.runner.forward_prefill([row], [ids], [0])

        gemms = ("dequant", "w8a8", "w8a16") if kind == "fp8" else ("bf16",)
        keep = kernels.PATH_TABLE
        for gemm in gemms:
            if kind == "fp8":  # every projection of a 2048-token prefill takes `gemm`
                kernels.PATH_TABLE = ((1 << 62, gemm),)
            try:
                ms = time_ms(prefill, 5)
                out[gemm] = {"ms": ms, "tokens_per_s": args.prefill_tokens / ms * 1e3}
                print(f"  prefill {kind} {gemm}: {out[gemm]['tokens_per_s']:.0f} tok/s", flush=True)
            except Exception as exc:
                out[gemm] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        kernels.PATH_TABLE = keep
        engine.kv.free(row)
    finally:
        free(engine)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument(
        "--skip", default="", help="comma-separated: kernels,sweep,decode,spec,prefill"
    )
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    from decode import Stages

    cuda = args.device == "cuda"
    report: dict = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["python"] + sys.argv),
        "quantization_config": BLOCK_FP8,
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError as exc:
        report["import_error"] = str(exc)
    stages = Stages(report, args.budget_s, args.json)
    if not cuda:  # Stages frees CUDA memory after each stage
        torch.cuda.empty_cache = lambda: None
    if cuda:
        from graphs import copy_bandwidth

        report["copy_bandwidth_Bps"] = stages.run("copy bandwidth", copy_bandwidth)
    if "sweep" not in skip:
        report["sweep"] = stages.run("config sweep", sweep_stage, args)
        stages.save()
    if "kernels" not in skip:
        report["kernels"] = stages.run("kernels vs reference", kernels_stage, args, report)
        if report["kernels"]:
            ms = MS if cuda else CPU_MS
            report["gemm_choice"] = gemm_choice(report["kernels"], ms)
            report["applied"] = apply_choice(report["gemm_choice"])
            print(f"  applied: {report['applied']}", flush=True)
        stages.save()
    if not cuda:
        print(
            json.dumps(
                {k: report.get(k) for k in ("gemm_choice", "applied", "errors")}, default=str
            )
        )
        return 1 if report["errors"] else 0
    paths = stages.run("targets", targets) or {}
    report["decode"] = {}
    for kind in ("fp8", "bf16") if "decode" not in skip else ():
        report["decode"][kind] = stages.run(f"decode {kind}", decode_stage, paths[kind], kind, args)
        stages.save()
    if "spec" not in skip:
        report["spec_fp8"] = stages.run("EAGLE-3 k=3 on FP8", spec_stage, paths["fp8"], args)
        stages.save()
    report["prefill"] = {}
    for kind in ("fp8", "bf16") if "prefill" not in skip else ():
        report["prefill"][kind] = stages.run(
            f"prefill {kind}", prefill_stage, paths[kind], kind, args
        )
        stages.save()
    summary(report)
    stages.save()
    return 0


def summary(report: dict) -> None:
    bw = report.get("copy_bandwidth_Bps")
    dec = report.get("decode") or {}
    lines = [
        "| what | bs | fp8 ms | bf16 ms | fp8 target | note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    targets_ms = {1: 2.5, 64: 4.0}
    for bs in (1, 64):
        f = (dec.get("fp8") or {}).get(f"graph_ms/{bs}")
        b = (dec.get("bf16") or {}).get(f"graph_ms/{bs}")
        roof = ""
        if bw and (dec.get("fp8") or {}).get("weight_bytes"):
            roof = f"weights-only roofline {dec['fp8']['weight_bytes'] / bw * 1e3:.3f} ms"
        cells = [
            f"graph decode step ctx {report.get('context', 512)}",
            str(bs),
            f"{f:.3f}" if f else "-",
            f"{b:.3f}" if b else "-",
            f"<= {targets_ms[bs]}" + (" met" if f and f <= targets_ms[bs] else " NOT met"),
            roof,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    spec = (report.get("spec_fp8") or {}).get("timings") or {}
    for bs, t in spec.items():
        lines.append(
            f"| EAGLE-3 k=3 step (FP8 target) | {bs} | {t['step_ms']:.3f} | - | - | verify "
            f"{t['verify_ms']:.3f} ms, draft {t['draft_ms']:.3f} ms |"
        )
    pre = report.get("prefill") or {}
    bf = ((pre.get("bf16") or {}).get("bf16") or {}).get("tokens_per_s")
    for gemm, t in (pre.get("fp8") or {}).items():
        if "tokens_per_s" in t:
            lines.append(
                f"| prefill 2048 tok/s ({gemm}) | 1 | {t['tokens_per_s']:.0f} | "
                f"{bf or 0:.0f} | - | ms {t['ms']:.1f} |"
            )
    print("\n".join(lines))
    print(f"errors: {sorted(report.get('errors', {})) or 'none'}")
    print(f"applied kernel settings: {report.get('applied')}")


if __name__ == "__main__":
    sys.exit(main())
