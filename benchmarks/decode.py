"""Decode-step benchmark on one GPU, in one process and one run, for a dummy-weight model of a
given shape (default Llama-3.1-8B, bf16):

1. the HBM roofline from a measured device copy bandwidth: weight bytes, and weight + live KV
   bytes, over that bandwidth;
2. per attention backend (triton, torch): the plain decode step, graph replay and eager, at
   bs 1, 16, 64 and context 512, 2048; the share of attention in the bs=64 context-2048 step;
   per-kernel device times of the bs=1 step (torch.profiler, top 15);
3. per backend: the speculative step (EAGLE-3-shape head, k = 3, context 512) split into verify
   (a captured graph of the target half) and draft (whole step - verify);
4. peers: transformers `generate`, and a transformers forward loop on its StaticCache (eager,
   and replayed as a CUDA graph when it captures), random bf16 weights of the same shape.

Attention share: `prepare` plus every layer's `forward` of the step's attention backend (KV
write and attention; the triton backend's RoPE is fused into its KV write and so counted) on
random q/k/v of the step's shapes, captured as one graph over all layers, divided by the whole
graph step at the same batch and context.

Every stage is wrapped: a failure (a peer, say) is recorded in the JSON and the rest still runs;
a stage that would start after --budget-s is skipped and recorded so. Prints one markdown table
last and writes the JSON.

    timeout 560 python benchmarks/decode.py --json OUT.json [--model llama8b] [--budget-s 500]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from graphs import SHAPES, copy_bandwidth, live_rows, time_ms, write_config
from spec_step import capture, timings, write_head

from speculant import Engine
from speculant.executor.forward_batch import ForwardBatch, ForwardMode


class Stages:
    """Runs named stages, recording each one's result, error or skip under `report`."""

    def __init__(self, report: dict, budget_s: float, json_path: str | None):
        self.report, self.budget_s, self.start = report, budget_s, time.perf_counter()
        self.json_path = json_path
        report.setdefault("errors", {})

    def save(self) -> None:
        """Write the report so far (a run killed by its timeout still leaves its figures)."""
        if self.json_path:
            self.report["total_s"] = self.elapsed()
            Path(self.json_path).write_text(json.dumps(self.report, indent=2, default=str))

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def run(self, name: str, fn, *args, **kwargs):
        if self.elapsed() > self.budget_s:
            self.report["errors"][name] = f"skipped: {self.elapsed():.0f} s > budget"
            print(f"[{self.elapsed():6.1f}s] {name}: skipped (budget)", flush=True)
            return None
        print(f"[{self.elapsed():6.1f}s] {name} ...", flush=True)
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # recorded; the other stages still run
            self.report["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            result = None
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        return result

    def record(self, section: str, key: str, value) -> None:
        self.report[section][key] = value
        self.save()


def free(engine: Engine | None) -> None:
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def build_engine(target: str, backend: str, max_context: int, sizes: list[int], **spec) -> Engine:
    return Engine(
        target,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        max_num_seqs=max(sizes),
        max_model_len=max_context + 512,
        capture_sizes=sizes,
        attention_backend=backend,
        **spec,
    )


def decode_batch(engine: Engine, bs: int) -> ForwardBatch:
    """The batch `verify_step` builds for the first bs rows of the input buffers."""
    runner, kv = engine.runner, engine.kv
    rows = runner.buffers.req_pool_indices[:bs]
    positions = kv.cache_lens[rows].unsqueeze(1) + runner.offsets
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        bs=bs,
        tokens_per_req=runner.tokens_per_req,
        input_ids=runner.buffers.input_ids[:bs].reshape(-1),
        positions=positions.reshape(-1),
        req_pool_indices=rows,
        out_cache_loc=kv.slots(rows, positions).reshape(-1),
        kv_len=kv.max_tokens_per_req,
    )


def attention_ms(engine: Engine, bs: int) -> float:
    """One captured graph of the backend's prepare + forward over every layer (see above)."""
    batch, attn = decode_batch(engine, bs), engine.runner.attn
    layer = engine.model.model.layers[0].self_attn
    n, d = batch.input_ids.shape[0], layer.head_dim
    gen = torch.Generator(device="cuda").manual_seed(5)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(n, heads, d, device="cuda", generator=gen).to(engine.dtype)

    q, k, v = rand(layer.num_heads), rand(layer.num_kv_heads), rand(layer.num_kv_heads)
    rope = engine.model.model.rotary.lookup(batch.positions, engine.dtype)
    num_layers = len(engine.model.model.layers)

    def attention_only():
        attn.prepare(batch)
        for i in range(num_layers):
            if attn.ops.fuses_rope:
                attn.forward(i, q, k, v, rope)
            else:
                attn.forward(i, q, k, v)

    with torch.inference_mode():
        graph = capture(attention_only)
    return time_ms(graph.replay, 30)


def kernel_profile(fn, steps: int = 5, top: int = 15) -> dict:
    """Device time per step of the `top` most expensive kernels while `fn` runs `steps` times."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
    ]
    total = sum(e.self_device_time_total for e in kernels)
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {
        "kernel_us_per_step": total / steps,
        "launches_per_step": sum(e.count for e in kernels) / steps,
        "top": [
            {
                "kernel": e.key[:160],
                "calls_per_step": e.count / steps,
                "us_per_step": e.self_device_time_total / steps,
                "share": e.self_device_time_total / total if total else 0.0,
            }
            for e in kernels[:top]
        ],
    }


def plain_stage(target, backend, args, report_models: dict, kv_bytes_per_token: list) -> dict:
    """Graph and eager steps per context and bs, attention share, bs=1 kernel profile."""
    shape, sizes = SHAPES[args.model], args.batch_sizes
    t0 = time.perf_counter()
    engine = build_engine(target, backend, max(args.contexts), sizes)
    out = {"backend": engine.attention_backend, "build_and_capture_s": time.perf_counter() - t0}
    mc = engine.model_config
    layer = engine.model.model.layers[0].self_attn
    kv_bytes_per_token[:] = [2 * mc.num_layers * layer.num_kv_heads * mc.head_dim * 2]
    report_models["weight_bytes"] = sum(
        p.numel() * p.element_size() for p in engine.model.parameters()
    )
    gen = torch.Generator().manual_seed(1)
    steps = {}
    for context in args.contexts:
        for bs in sizes:
            rows = live_rows(engine, bs, shape["vocab_size"], context, gen)
            step = lambda b=bs: engine.runner.decode_step(b, "greedy")  # noqa: E731
            graph = engine.graphs.graph("greedy", bs)
            entry = {"graph_ms": time_ms(graph.replay, args.iters), "eager_ms": time_ms(step, 10)}
            if bs == max(sizes) and context == max(args.contexts):
                try:
                    entry["attention_ms"] = attention_ms(engine, bs)
                    entry["attention_share"] = entry["attention_ms"] / entry["graph_ms"]
                except Exception as exc:
                    entry["attention_error"] = f"{type(exc).__name__}: {exc}"
            if bs == 1 and context == min(args.contexts):
                for name, fn in (("profile_eager", step), ("profile_graph", graph.replay)):
                    try:
                        entry[name] = kernel_profile(fn)
                    except Exception as exc:
                        entry[name] = {"error": f"{type(exc).__name__}: {exc}"}
            steps[f"{context}/{bs}"] = entry
            for row in rows:
                engine.kv.free(row)
            print(f"  {backend} context {context} bs {bs}: {entry['graph_ms']:.3f} ms", flush=True)
    out["steps"] = steps
    free(engine)
    return out


def spec_stage(target, backend, args) -> dict:
    shape = SHAPES[args.model]
    spec = dict(algo="eagle3", draft=write_head(shape), num_draft_tokens=args.k)
    engine = build_engine(target, backend, args.spec_context, args.batch_sizes, **spec)
    try:
        return timings(engine, shape["vocab_size"], args.spec_context, args.k, args.batch_sizes)
    finally:
        free(engine)


# ---------------------------------------------------------------------------- peers


def hf_model(target: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = json.loads((Path(target) / "config.json").read_text())
    model_type = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[hf["architectures"][0]]
    config = AutoConfig.for_model(model_type, **hf)
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    return model.to(device="cuda", dtype=torch.bfloat16).eval()


def hf_generate(model, bs: int, context: int, new_tokens: int, vocab: int) -> dict:
    """Decode step of `generate` = (time for 1 + n new tokens - time for 1) / n."""
    gen = torch.Generator().manual_seed(bs)
    ids = torch.randint(3, vocab, (bs, context), generator=gen).cuda()
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)

    def seconds(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    seconds(2)  # warm-up
    first = seconds(1)
    step_ms = (seconds(new_tokens + 1) - first) / new_tokens * 1e3
    return {"step_ms": step_ms, "tokens_per_s": bs * 1e3 / step_ms, "prefill_s": first}


def hf_static_loop(model, bs: int, context: int, new_tokens: int, vocab: int) -> dict:
    """Greedy decode steps of model(...) on a StaticCache: eager, then one captured step."""
    from transformers import StaticCache

    max_len = context + 2 * new_tokens + 32
    try:
        cache = StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # transformers 4.x
        cache = StaticCache(
            config=model.config,
            max_batch_size=bs,
            max_cache_len=max_len,
            device="cuda",
            dtype=torch.bfloat16,
        )
    gen = torch.Generator().manual_seed(bs)
    ids = torch.randint(3, vocab, (bs, context), generator=gen).cuda()
    out = {}
    with torch.inference_mode():
        logits = model(
            input_ids=ids,
            past_key_values=cache,
            cache_position=torch.arange(context, device="cuda"),
            use_cache=True,
            logits_to_keep=1,
        ).logits
        token = logits[:, -1:].argmax(-1)
        position = torch.tensor([context], device="cuda")

        def step():
            logits = model(
                input_ids=token, past_key_values=cache, cache_position=position, use_cache=True
            ).logits
            token.copy_(logits[:, -1:].argmax(-1))
            position.add_(1)

        out["eager_step_ms"] = time_ms(step, new_tokens)
        out["eager_tokens_per_s"] = bs * 1e3 / out["eager_step_ms"]
        try:
            graph = capture(step)
            out["graph_step_ms"] = time_ms(graph.replay, new_tokens)
            out["graph_tokens_per_s"] = bs * 1e3 / out["graph_step_ms"]
        except Exception as exc:
            out["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def peers_stage(target: str, args, stages: Stages) -> dict:
    shape, out = SHAPES[args.model], {}
    model = hf_model(target)
    context = min(args.contexts)
    for bs in (min(args.batch_sizes), max(args.batch_sizes)):
        out[f"generate/{bs}"] = stages.run(
            f"peer generate bs={bs}",
            hf_generate,
            model,
            bs,
            context,
            args.new_tokens,
            shape["vocab_size"],
        )
        out[f"static/{bs}"] = stages.run(
            f"peer static-cache loop bs={bs}",
            hf_static_loop,
            model,
            bs,
            context,
            args.new_tokens,
            shape["vocab_size"],
        )
    del model
    return out


# ---------------------------------------------------------------------------- report


def table(report: dict, args) -> list[str]:
    """One markdown table: ours per backend and step, the speculative split, the peers."""
    bw, weights = report.get("copy_bandwidth_Bps"), report.get("weight_bytes")
    per_token = report.get("kv_bytes_per_token")
    lines = [
        "| what | backend | bs | context | ms/step | tokens/s | roofline ms | of roofline | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def roofline(bs, context):
        if not (bw and weights and per_token):
            return None
        return (weights + bs * context * per_token) / bw * 1e3

    def row(what, backend, bs, context, ms, note="", tokens=None):
        roof = roofline(bs, context)
        tokens = tokens if tokens is not None else (bs * 1e3 / ms if ms else None)
        cells = [
            what,
            backend,
            str(bs),
            str(context),
            f"{ms:.3f}" if ms else "-",
            f"{tokens:.0f}" if tokens else "-",
            f"{roof:.3f}" if roof else "-",
            f"{roof / ms:.0%}" if roof and ms else "-",
            note,
        ]
        lines.append("| " + " | ".join(cells) + " |")

    for backend, entry in (report.get("plain") or {}).items():
        if not entry:
            continue
        for key, t in entry["steps"].items():
            context, bs = (int(x) for x in key.split("/"))
            note = f"eager {t['eager_ms']:.2f} ms"
            if "attention_share" in t:
                note += f"; attention {t['attention_ms']:.3f} ms = {t['attention_share']:.0%}"
            row("decode step (graph)", backend, bs, context, t["graph_ms"], note)
    for backend, entry in (report.get("spec") or {}).items():
        plain = ((report.get("plain") or {}).get(backend) or {}).get("steps", {})
        for bs, t in (entry or {}).items():
            base = plain.get(f"{args.spec_context}/{bs}", {}).get("graph_ms")
            ratio = f"; verify/plain {t['verify_ms'] / base:.2f}" if base else ""
            ratio += f"; draft/plain {t['draft_ms'] / base:.2f}" if base else ""
            note = f"verify {t['verify_ms']:.3f} ms, draft {t['draft_ms']:.3f} ms{ratio}"
            note += "; tokens/s = accept_len x bs / step"
            row(f"EAGLE-3 step k={args.k}", backend, bs, args.spec_context, t["step_ms"], note, 0)
    ours: dict[str, float] = {}  # the fastest backend's graph step, for the peers' ratios
    for entry in (report.get("plain") or {}).values():
        for key, t in (entry or {}).get("steps", {}).items():
            ours[key] = min(t["graph_ms"], ours.get(key, float("inf")))
    for key, t in (report.get("peers") or {}).items():
        if not t:
            continue
        kind, bs = key.split("/")
        bs, context = int(bs), min(args.contexts)
        mine = ours.get(f"{context}/{bs}")
        steps = (
            [("transformers generate", "hf", t["step_ms"])]
            if kind == "generate"
            else [("transformers StaticCache loop", "hf eager", t["eager_step_ms"])]
            + [("transformers StaticCache loop", "hf graph", t["graph_step_ms"])]
            * ("graph_step_ms" in t)
        )
        for what, backend, ms in steps:
            note = f"ours (best graph step) is {ms / mine:.1f}x its tokens/s" if mine else ""
            row(what, backend, bs, context, ms, note)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--model", default="llama8b", choices=sorted(SHAPES))
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--backends", default="triton,torch")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--spec-context", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32, help="peer decode steps")
    parser.add_argument("--iters", type=int, default=30, help="graph replays timed per point")
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="start no stage after this many seconds"
    )
    parser.add_argument("--skip", default="", help="comma-separated: plain,spec,peers")
    args = parser.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python"] + sys.argv),
        "model": args.model,
        "shape": SHAPES[args.model],
        "plain": {},
        "spec": {},
    }
    try:
        import transformers
        import triton

        report["triton"], report["transformers"] = triton.__version__, transformers.__version__
    except ImportError as exc:
        report["import_error"] = str(exc)
    stages = Stages(report, args.budget_s, args.json)
    report["copy_bandwidth_Bps"] = stages.run("copy bandwidth", copy_bandwidth)
    stages.save()
    target = write_config(SHAPES[args.model])
    models: dict = {}
    per_token: list = []
    backends = args.backends.split(",")
    if "plain" not in skip:
        for backend in backends:
            result = stages.run(
                f"plain {backend}", plain_stage, target, backend, args, models, per_token
            )
            report["weight_bytes"] = models.get("weight_bytes")
            report["kv_bytes_per_token"] = per_token[0] if per_token else None
            stages.record("plain", backend, result)
    if report.get("weight_bytes") and report["copy_bandwidth_Bps"]:
        report["roofline_weights_ms"] = report["weight_bytes"] / report["copy_bandwidth_Bps"] * 1e3
    # the first backend's speculative step, the peers, then the other backends' steps
    for backend in backends[:1] if "spec" not in skip else []:
        stages.record(
            "spec", backend, stages.run(f"spec {backend}", spec_stage, target, backend, args)
        )
    if "peers" not in skip:
        report["peers"] = stages.run("peers", peers_stage, target, args, stages)
        stages.save()
    for backend in backends[1:] if "spec" not in skip else []:
        stages.record(
            "spec", backend, stages.run(f"spec {backend}", spec_stage, target, backend, args)
        )
    stages.save()
    bw = report["copy_bandwidth_Bps"]
    print(
        f"\n{report['gpu']}  torch {report['torch']}  triton {report.get('triton')}  "
        f"transformers {report.get('transformers')}  {report['date']}  {args.model}  "
        f"copy bandwidth {bw / 1e12 if bw else float('nan'):.2f} TB/s  "
        f"weights-only roofline {report.get('roofline_weights_ms') or float('nan'):.3f} ms  "
        f"errors: {sorted(report['errors']) or 'none'}  ({stages.elapsed():.0f} s)"
    )
    print("\n".join(table(report, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
