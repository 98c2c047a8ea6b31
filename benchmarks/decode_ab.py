"""Graph decode step of the Llama-3.1-8B shape (or `--shape qwen3_8b`; dummy weights, `triton`
backend), bf16 and block-wise FP8, at bs 1 and 64 with every row at `--context` tokens: the
figure kernel changes move. Times whatever `speculant` is importable, so that
benchmarks/gpu_fusion_x1.sh can run it on the previous tree and this one in the same call
(PYTHONPATH) and compare.

    python benchmarks/decode_ab.py --label new --json OUT.json [--rounds 3] [--profile]

Each (dtype, bs) is timed `--rounds` times (median of 30 replays each, after warm-up),
alternating sizes; `--profile` adds the bs-1 step's top kernels (torch profiler) per dtype,
and every engine checks graph replay == eager tokens for 1 and 3 requests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def measure(kind: str, args) -> dict:
    from decode import build_engine, free, kernel_profile
    from fp8_gpu import targets
    from graphs import SHAPES, check_equal, live_rows, time_ms

    target = targets(args.shape)[kind]
    start = time.perf_counter()
    engine = build_engine(target, "triton", args.context, [1, 64], piecewise=False)
    out: dict = {"startup_s": time.perf_counter() - start, "graph_ms": {}}
    try:
        vocab = SHAPES[args.shape]["vocab_size"]
        gen = torch.Generator().manual_seed(1)
        rows = live_rows(engine, 64, vocab, args.context, gen)  # bs 1 replays the first
        for _ in range(args.rounds):
            for bs in (1, 64):
                ms = time_ms(engine.graphs.graph("greedy", bs).replay, 30)
                out["graph_ms"].setdefault(str(bs), []).append(ms)
        if args.profile:
            out["profile_bs1"] = kernel_profile(engine.graphs.graph("greedy", 1).replay)
        for row in rows:
            engine.kv.free(row)
        for key, want_kind, wanted, run in (
            ("lever_variants", "fp8 bf16", args.levers, lever_variants),
            ("table_variants", "fp8", args.fp8_tables, table_variants),
            ("m1_variants", "fp8", args.fp8_m1, m1_variants),
            ("free_variants", "fp8 bf16", args.free_ops, free_variants),
        ):
            if kind not in want_kind.split() or not wanted:
                continue
            try:
                out[key] = run(engine, vocab, args, gen)
            except Exception as exc:  # keep the figures above
                out[key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                print(f"  {args.label} {key}: {out[key]['error']}", flush=True)
        if any(key in out for key in VARIANT_KEYS):
            engine.clear_graphs()  # the last variant's graphs: capture the shipped ones
            engine.capture_graphs()
        out["graph_equals_eager"] = check_equal(engine, vocab, sizes=(1, 3))
    finally:
        free(engine)
    medians = {bs: sorted(v)[len(v) // 2] for bs, v in out["graph_ms"].items()}
    print(f"  {args.label} {kind}: " + ", ".join(f"bs {b} {m:.3f} ms" for b, m in medians.items()))
    out["median_ms"] = medians
    return out


VARIANT_KEYS = ("lever_variants", "table_variants", "m1_variants", "free_variants")
LEVERS = {  # name: what it sets (see apply_levers)
    "base": "no launch modes of the model's own: every kernel at SPECULANT_PDL's mode",
    "unfused / fused": "as shipped, RoPE + KV write, attention and the merge in three launches "
    "or in one (kernels/decode_attention.py)",
    "keys64": "MIN_KEYS_PER_SPLIT 64",
    "norm2 / act2 / merge2 / attention2 / gemv2 / rope2 / plan2": "that kind at PDL mode 2",
}


def apply_levers(engine, variant: str | None, saved: dict) -> None:
    """Set the target's launch modes (models/llama.py CausalLM.launch_modes) and the kernels'
    levers as the "+"-joined names of `variant` say (LEVERS; None or "shipped": as shipped).
    `saved` keeps the shipped values between calls."""
    from speculant.executor.triton_attention import TritonPagedAttention
    from speculant.kernels import paged_attention

    model = engine.model
    if not saved:
        saved.update(modes=model.launch_modes, keys=paged_attention.MIN_KEYS_PER_SPLIT,
                     fuse=TritonPagedAttention.fuse_decode)  # fmt: skip
    model.launch_modes = saved["modes"]
    paged_attention.MIN_KEYS_PER_SPLIT = saved["keys"]
    TritonPagedAttention.fuse_decode = saved["fuse"]
    if variant in ("unfused", "fused"):  # as shipped, RoPE, attention and the merge in three
        TritonPagedAttention.fuse_decode = variant == "fused"  # launches or in one
    if variant in (None, "shipped", "unfused", "fused"):
        return
    from speculant.kernels import runtime

    model.launch_modes = {}
    for name in variant.split("+"):
        if name.startswith("keys"):
            paged_attention.MIN_KEYS_PER_SPLIT = int(name[4:])
        elif name[:-1] in runtime.PDL_KINDS and name[-1] in "12":
            model.launch_modes[name[:-1]] = int(name[-1])
        elif name != "base":
            raise SystemExit(f"lever {name!r}: use {', '.join(LEVERS)}")


def recapture_with(engine, variant: str, saved: dict) -> None:
    """The engine's graphs captured again with `variant`'s levers (apply_levers)."""
    apply_levers(engine, variant, saved)
    engine.clear_graphs()
    engine.capture_graphs()


def rotations(names: list[str], rounds: int):
    """(round, name) for `rounds` rounds over `names`, each round's order rotated by one."""
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            yield r, name


def lever_variants(engine, vocab: int, args, gen) -> dict:
    """The bs-1 and bs-64 graph steps per lever variant (apply_levers; graphs recaptured for
    each), `--rounds` rounds with the order rotated: {variant: {bs: [ms, ...]}}."""
    from graphs import live_rows, time_ms

    saved: dict = {}
    names = args.levers.split(";")
    results: dict = {}
    tokens: dict = {}
    try:
        for r, name in rotations(names, args.rounds):
            recapture_with(engine, name, saved)
            for bs in (1, 64):
                rows = live_rows(engine, bs, vocab, args.context, gen)
                ms = time_ms(engine.graphs.graph("greedy", bs).replay, 30)
                results.setdefault(name, {}).setdefault(str(bs), []).append(ms)
                for row in rows:
                    engine.kv.free(row)
            if r == 0:  # graph tokens of fixed prompts: a lever must not change them
                tokens[name] = graph_tokens(engine, vocab)
    finally:
        apply_levers(engine, None, saved)
    first = tokens[names[0]]
    for name, by_bs in results.items():
        medians = ", ".join(f"bs {b} {sorted(v)[len(v) // 2]:.3f} ms" for b, v in by_bs.items())
        same = tokens[name] == first
        by_bs["tokens_equal_first"] = same
        print(f"  {args.label} levers {name}: {medians}, tokens == {names[0]}'s: {same}",
              flush=True)  # fmt: skip
    return results


def spec_lever_variants(target: str, args) -> dict:
    """The EAGLE-3 k=3 graph step (dummy 8B-shape head; whole step and verify, bs 1 and 64) on
    `target` per lever variant (`--spec-levers`, as `--levers`), graphs recaptured for each,
    `--rounds` rounds with the order rotated: {variant: {bs: [{step_ms, verify_ms}, ...]}}."""
    from decode import build_engine, free
    from graphs import SHAPES
    from spec_step import timings, write_head

    shape = SHAPES[args.shape]
    spec = dict(algo="eagle3", draft=write_head(shape), num_draft_tokens=3)
    engine = build_engine(target, "triton", args.context, [1, 64], piecewise=False, **spec)
    names = args.spec_levers.split(";")
    saved: dict = {}
    results: dict = {}
    try:
        for _, name in rotations(names, args.rounds):
            recapture_with(engine, name, saved)
            steps = timings(engine, shape["vocab_size"], args.context, 3, (1, 64))
            for bs, entry in steps.items():
                results.setdefault(name, {}).setdefault(str(bs), []).append(entry)
        apply_levers(engine, None, saved)
    finally:
        free(engine)
    for name, by_bs in results.items():
        text = ", ".join(
            f"bs {b} step {sorted(e['step_ms'] for e in v)[len(v) // 2]:.3f} ms"
            for b, v in by_bs.items()
        )
        print(f"  {args.label} EAGLE-3 levers {name}: {text}", flush=True)
    return results


def graph_tokens(engine, vocab: int) -> list:
    """Greedy tokens of 1 and then 3 fixed random prompts (16 each), graphs on."""
    from speculant import SamplingParams

    gen = torch.Generator().manual_seed(7)
    out = []
    for bs in (1, 3):
        lengths = [40 + 9 * i for i in range(bs)]
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        out.append([o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)])
    return out


def set_m1_route(variant: str, saved: dict) -> None:
    """Route the M = 1 rows of the tuned FP8 table on this GPU as `variant` says: "table" (as
    shipped) or "+"-joined "[NxK@]PATH:CONFIG" items (a kernels/fp8.py path and its config,
    comma-separated, e.g. "splitk:16,1024,4,atomic"; with NxK only that shape, else every
    shape; later items win; shapes no item names keep the table's row)."""
    from fp8_sweep import SHAPES_8B

    from speculant.kernels import fp8 as kernels
    from speculant.kernels import fp8_table

    shapes = kernels.TUNED.setdefault(fp8_table.device_name(torch.device("cuda")), {})
    for shape in SHAPES_8B.values():
        shapes.setdefault(shape, [])  # a GPU without table rows: M > 1 borrows or takes choice()
    for shape in shapes:
        saved.setdefault(shape, list(shapes[shape]))
        shapes[shape] = list(saved[shape])
    for item in variant.split("+") if variant != "table" else ():
        named, _, route = item.rpartition("@")
        path, _, config = route.partition(":")
        values = tuple(int(v) if v.isdigit() else v for v in config.split(",") if v)
        for shape, original in saved.items():
            if named and named != f"{shape[0]}x{shape[1]}":
                continue
            shapes[shape] = [(1, path, values or None)] + [r for r in original if r[0] > 1]
    kernels.TUNED.changed()  # rows changed in place: no kept lookups


def bs1_variants(engine, vocab: int, args, gen, names: list, apply, what: str) -> dict:
    """The bs-1 graph step per variant name (`apply(name)` sets it up; graphs recaptured for
    each), `--rounds` rounds with the order rotated: {name: [ms, ...]}; `apply(None)` after."""
    from graphs import live_rows, time_ms

    results: dict = {}
    try:
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                apply(name)
                engine.clear_graphs()
                engine.capture_graphs()
                rows = live_rows(engine, 1, vocab, args.context, gen)
                ms = time_ms(engine.graphs.graph("greedy", 1).replay, 30)
                results.setdefault(name, []).append(ms)
                for row in rows:
                    engine.kv.free(row)
    finally:
        apply(None)
    for name, times in results.items():
        median = sorted(times)[len(times) // 2]
        print(f"  {args.label} {what} {name}: bs 1 {median:.3f} ms", flush=True)
    return results


def free_variants(engine, vocab: int, args, gen) -> dict:
    """What fusing the norms or SiLU-and-mul into the projections could give at most: the bs-1
    step with those kernels left out (wrong tokens; timing only): "none" | "norm" | "silu" |
    "norm+silu"."""
    from speculant.executor.triton_attention import TritonPagedAttention

    ops = TritonPagedAttention.ops
    shipped = dict(ops.__dict__)

    def apply(name):
        ops.__dict__.update(shipped)
        if name and "norm" in name:
            ops.rms_norm = lambda x, weight, eps: x
            ops.add_rms_norm = lambda x, residual, weight, eps: (x, residual)
        if name and "silu" in name:
            ops.silu_and_mul = lambda gate_up: gate_up[:, : gate_up.shape[1] // 2]

    names = args.free_ops.split(";")
    return bs1_variants(engine, vocab, args, gen, names, apply, "without")


def m1_variants(engine, vocab: int, args, gen) -> dict:
    """The bs-1 graph step per M = 1 route (see set_m1_route)."""
    saved: dict = {}

    def apply(variant):
        set_m1_route(variant or "table", saved)

    names = args.fp8_m1.split(";")
    return bs1_variants(engine, vocab, args, gen, names, apply, "fp8 M1 route")


def table_variants(engine, vocab: int, args, gen) -> dict:
    """The bs-1 and bs-64 graph steps per FP8 path table (graphs recaptured for each), in
    `--rounds` rounds with the tables' order rotated: {table: {bs: [ms, ...]}}. A name is
    "shipped" or a table file; "@exact" after it: that table without borrowing (exact rows
    only, fp8_table.lookup)."""
    from graphs import live_rows, time_ms

    from speculant.kernels import fp8 as kernels
    from speculant.kernels import fp8_table

    shipped = kernels.TUNED
    tables = args.fp8_tables.split(";")
    results: dict = {}
    try:
        for r in range(args.rounds):
            for name in tables[r % len(tables) :] + tables[: r % len(tables)]:
                source, _, exact = name.partition("@")
                source = fp8_table.TUNED_PATH if source == "shipped" else source
                kernels.TUNED = fp8_table.load(source, borrow=exact != "exact")
                engine.clear_graphs()
                engine.capture_graphs()
                for bs in (1, 64):
                    rows = live_rows(engine, bs, vocab, args.context, gen)
                    ms = time_ms(engine.graphs.graph("greedy", bs).replay, 30)
                    results.setdefault(name, {}).setdefault(str(bs), []).append(ms)
                    for row in rows:
                        engine.kv.free(row)
    finally:
        kernels.TUNED = shipped
    for name, by_bs in results.items():
        medians = ", ".join(f"bs {b} {sorted(v)[len(v) // 2]:.3f} ms" for b, v in by_bs.items())
        print(f"  {args.label} fp8 table {name}: {medians}", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default="bf16,fp8")
    parser.add_argument("--shape", default="llama8b", choices=("llama8b", "qwen3_8b"))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--fp8-m1", default="", help='";"-separated M = 1 routes to time: table | PATH:CONFIG'
    )
    parser.add_argument(
        "--free-ops", default="", help='";"-separated: none | norm | silu | norm+silu (timing only)'
    )
    parser.add_argument(
        "--levers",
        default="",
        help='";"-separated lever variants ("+"-joined names: base, '
        "keys64, norm2, act2, ...; or unfused / fused alone; see LEVERS) timed at bs 1 and 64",
    )
    parser.add_argument(
        "--spec-levers", default="", help="lever variants of the EAGLE-3 k=3 step on the FP8 target"
    )
    parser.add_argument(
        "--fp8-tables",
        default="",
        help='";"-separated FP8 path tables to time: shipped | PATH; "@exact" after one: '
        "without borrowed rows",
    )
    args = parser.parse_args()
    import speculant

    report = {
        "label": args.label,
        "speculant": str(Path(speculant.__file__).resolve().parent),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
        "context": args.context,
        "shape": args.shape,
    }
    if args.spec_levers:
        from fp8_gpu import targets

        try:
            report["spec_levers"] = spec_lever_variants(targets(args.shape)["fp8"], args)
        except Exception as exc:  # keep what the decode steps give
            report["spec_levers"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"  {args.label} spec levers: {report['spec_levers']['error']}", flush=True)
    for kind in filter(None, args.kinds.split(",")):
        try:
            report[kind] = measure(kind, args)
        except Exception as exc:  # keep what the other kind gives
            report[kind] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"  {args.label} {kind}: {report[kind]['error']}", flush=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
