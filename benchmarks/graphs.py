"""Graph replay vs eager decode on one GPU: token equality (bs 1, 3, 17, 64) and step times
(bs 1, 16, 64 at context 512) for a small Llama and a Llama-3.1-8B-shape dummy model in bf16,
plus the 8B step as a fraction of the HBM roofline (weight bytes / measured copy bandwidth).

    python benchmarks/graphs.py [--json OUT.json] [--models small,llama8b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from speculant import Engine, SamplingParams

SHAPES = {
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=2048,
    ),
    "qwen3_8b": dict(
        architectures=["Qwen3ForCausalLM"],
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
    ),
    "llama8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


def write_config(shape: dict) -> str:
    path = Path(tempfile.mkdtemp())
    config = {
        "architectures": ["LlamaForCausalLM"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "eos_token_id": 2,
        **shape,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of 20."""
    src = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def time_ms(fn, iters: int, cuda: bool = True) -> float:
    """Median ms of `fn` over `iters` calls after 3 warm-up calls: CUDA events, or the wall
    clock with `cuda=False` (CPU checks)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def check_equal(engine: Engine, vocab: int, sizes=(1, 3, 17, 64)) -> dict:
    gen = torch.Generator().manual_seed(0)
    result = {}
    for bs in sizes:
        prompts = [
            torch.randint(3, vocab, (int(n),), generator=gen).tolist()
            for n in torch.randint(4, 64, (bs,), generator=gen)
        ]
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        engine.graphs.use_graphs = engine.graphs.pad = True
        graph_tokens = [o.token_ids for o in engine.generate(prompts, params)]
        engine.graphs.use_graphs = engine.graphs.pad = False
        eager_tokens = [o.token_ids for o in engine.generate(prompts, params)]
        eager_again = [o.token_ids for o in engine.generate(prompts, params)]
        engine.graphs.use_graphs = engine.graphs.pad = True
        result[bs] = graph_tokens == eager_tokens
        if not result[bs]:  # tell rounding-order differences from bugs
            first = next(
                i
                for i, (g, e) in enumerate(zip(graph_tokens, eager_tokens, strict=False))
                if g != e
            )
            at = next(
                j
                for j, (g, e) in enumerate(
                    zip(graph_tokens[first], eager_tokens[first], strict=False)
                )
                if g != e
            )
            result[f"{bs}_detail"] = {
                "eager_deterministic": eager_tokens == eager_again,
                "requests_differing": sum(
                    g != e for g, e in zip(graph_tokens, eager_tokens, strict=False)
                ),
                "first_request": first,
                "first_token_index": at,
            }
    return result


def live_rows(engine: Engine, bs: int, vocab: int, context: int, gen) -> list[int]:
    """bs requests with `context` random tokens in the cache, their next step's inputs (random
    tokens, greedy) in the input buffers. Free the returned rows afterwards."""
    rows = [engine.kv.allocate(context + 400) for _ in range(bs)]
    if any(engine.kv.pages_needed(row, context + 400) for row in rows):
        for row in rows:
            engine.kv.free(row)
        raise RuntimeError(f"the KV pool holds too few pages for {bs} rows of {context + 400}")
    for i in range(0, bs, 8):
        chunk = rows[i : i + 8]
        prompts = [torch.randint(3, vocab, (context,), generator=gen).tolist() for _ in chunk]
        engine.runner.forward_prefill(chunk, prompts, [0] * len(chunk))
    ids = torch.randint(3, vocab, (bs, engine.tokens_per_req), generator=gen).tolist()
    engine.runner.buffers.fill(
        rows, ids, [0.0] * bs, [0] * bs, [1.0] * bs, [0] * bs, bs, engine.kv.sentinel_row
    )
    return rows


def step_times(engine: Engine, vocab: int, context: int) -> dict:
    """Median decode step time (ms), graph and eager, with bs live requests at `context`."""
    out = {}
    gen = torch.Generator().manual_seed(1)
    for bs in (1, 16, 64):
        rows = live_rows(engine, bs, vocab, context, gen)
        graph = engine.graphs.graph("greedy", bs)
        out[bs] = {
            "graph_ms": time_ms(graph.replay, 50),
            "eager_ms": time_ms(lambda b=bs: engine.runner.decode_step(b, "greedy"), 10),
        }
        for row in rows:
            engine.kv.free(row)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--models", default="small,llama8b")
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "copy_bandwidth_TBps": bandwidth / 1e12,
        "command": " ".join(["python"] + sys.argv),
        "models": {},
    }
    for name in args.models.split(","):
        shape = SHAPES[name]
        t0 = time.perf_counter()
        engine = Engine(
            write_config(shape),
            device="cuda",
            dtype="bfloat16",
            load_format="dummy",
            max_num_seqs=64,
            max_model_len=args.context + 512,
            capture_sizes=[1, 2, 4, 8, 16, 24, 32, 48, 64],
        )
        build_s = time.perf_counter() - t0
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        entry = {
            "build_and_capture_s": build_s,
            "weight_GB": weight_bytes / 1e9,
            "graph_memory_GiB": engine.graphs.graph_memory_bytes / 2**30,
            "roofline_ms": weight_bytes / bandwidth * 1e3,
            "graph_equals_eager": check_equal(engine, shape["vocab_size"]),
            "steps": step_times(engine, shape["vocab_size"], args.context),
        }
        report["models"][name] = entry
        del engine
        torch.cuda.empty_cache()
    print(
        f"\n{report['gpu']}  torch {report['torch']}  copy bandwidth "
        f"{report['copy_bandwidth_TBps']:.2f} TB/s  {report['date']}"
    )
    print("| model | bs | graph ms | eager ms | eager/graph | roofline ms | graph % of roofline |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, entry in report["models"].items():
        for bs, t in entry["steps"].items():
            print(
                f"| {name} | {bs} | {t['graph_ms']:.3f} | {t['eager_ms']:.2f} | "
                f"{t['eager_ms'] / t['graph_ms']:.1f}x | {entry['roofline_ms']:.3f} | "
                f"{entry['roofline_ms'] / t['graph_ms']:.0%} |"
            )
        print(
            f"{name}: graph == eager {entry['graph_equals_eager']}; build+capture "
            f"{entry['build_and_capture_s']:.1f} s; "
            f"graph memory {entry['graph_memory_GiB']:.2f} GiB"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    ok = all(
        v is True or isinstance(v, dict)
        for e in report["models"].values()
        for v in e["graph_equals_eager"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
