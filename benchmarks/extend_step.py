"""The realistic job's extend (mixed) step in isolation: where its ~190 ms go. The job
(benchmarks/workload.py, 1,000 requests) spends 9-13 s in 51 extend steps of ~6,500 prompt
tokens next to ~185 decode rows, where the GEMMs' FLOPs at 700 TFLOP/s take ~6.7 s.

8B shape, bf16 dummy weights, `triton` backend, the engine's default token budget: one step
of `--rows` decode rows at the job's contexts (attention_sweep.job_contexts) and a group of
prompts drawn as the job draws them (lognormal median 220, sigma 1.0, 16..3000) up to the
budget, timed through `ModelRunner.extend` (what `Engine._extend` runs) as CUDA events, with
the host's launch time (the call returning before the read-back), against the same prompts
alone, then its kernel profile (torch profiler) by kernel family.

    python benchmarks/extend_step.py --json OUT.json [--rows 185] [--iters 10]
        [--shape small --device cpu]   (a CPU check of the script)
        [--varlen 64:64:4:0,128:64:8:2,...]

`--varlen BM:BN:WARPS:STAGES,...`: the packed-prefill attention launch (kernels/
paged_attention.py VARLEN_BLOCK_M, VARLEN_LAUNCH; stages 0: Triton's default) per setting,
each first checked against the float64 reference on a packed batch, then the mixed and
prefill-only steps timed, two rounds in rotation (the first setting is the shipped one).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

FAMILIES = (  # kernel name pattern -> family, first match wins
    ("gemm", r"gemm|gemv|cutlass|sm90_xmma|nvjet|cublas|_dot_kernel"),
    ("attention", r"attention|attn|flash|_fwd_kernel|paged|merge"),
    ("norm", r"norm"),
    ("rope / kv write", r"rope|rotary|kv_write|store_kv|scatter"),
    ("activation", r"silu|act_and_mul|gelu"),
    ("sampling", r"argmax|softmax|topk|sort|sample|gumbel"),
)


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return fam
    return "other"


def prompt_lengths(budget: int, gen: torch.Generator, reserve: int) -> list[int]:
    """Prompt lengths as the job draws them, as many as fit `budget - reserve` tokens."""
    out, used = [], 0
    while True:
        n = int(
            (torch.randn(1, generator=gen) + torch.log(torch.tensor(220.0))).exp().clamp(16, 3000)
        )
        if used + n > budget - reserve:
            return out or [budget - reserve]
        out.append(n)
        used += n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rows", type=int, default=185)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--varlen", default="")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    from attention_sweep import job_contexts
    from decode import free, kernel_profile
    from graphs import SHAPES, time_ms, write_config
    from job_step import fill_rows

    from speculant.executor.model_runner import SeqInput
    from speculant.executor.sampling import GREEDY

    shape = SHAPES[args.shape]
    vocab = shape["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    from speculant import Engine

    engine = Engine(
        write_config(shape), device=args.device, dtype="bfloat16" if cuda else "float32",
        load_format="dummy", max_num_seqs=args.rows + 96, max_model_len=4608 if cuda else 2048,
        capture_sizes=[8], attention_backend="triton" if cuda else "torch",
    )  # fmt: skip
    budget = engine.max_num_batched_tokens
    contexts = job_contexts(args.rows, gen)
    rows = fill_rows(engine, contexts, vocab, gen)
    lengths = prompt_lengths(budget, gen, args.rows)
    prompt_rows = [engine.kv.allocate(n + 1) for n in lengths]
    chunks = [
        SeqInput(row, 0, torch.randint(3, vocab, (n,), generator=gen).tolist(), samples=True)
        for row, n in zip(prompt_rows, lengths, strict=True)
    ]
    decode = [SeqInput(row, c, [int(torch.randint(3, vocab, (1,)))], verify=True)
              for row, c in zip(rows, contexts, strict=True)]  # fmt: skip
    tokens = sum(lengths)
    report = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
        "budget": budget,
        "prompts": len(lengths),
        "prompt_tokens": tokens,
        "decode_rows": args.rows,
        "decode_contexts": {"mean": sum(contexts) / len(contexts), "max": max(contexts)},
    }
    # the linear layers' FLOPs of every token (lm_head only where a row samples)
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    dim = h // heads
    per_token = 2 * layers * (h * (heads + 2 * kv_heads) * dim + heads * dim * h + 3 * h * inter)
    lm = 2 * h * vocab * (len(lengths) + args.rows)
    flops = per_token * (tokens + args.rows) + lm
    attn = sum(4 * layers * heads * dim * n * (n + 1) / 2 for n in lengths)
    report["gemm_tflop"] = flops / 1e12
    report["prefill_attention_tflop"] = attn / 1e12

    def info(n):
        return engine._sampling_info([_Greedy()] * n)

    def run(seqs, sampling):
        rows_t = torch.tensor([s.row for s in seqs], device=args.device)
        starts_t = torch.tensor(
            [s.start for s in seqs], device=args.device, dtype=engine.kv.cache_lens.dtype
        )

        def call():
            engine.runner.extend(seqs, sampling, GREEDY)
            engine.kv.cache_lens[rows_t] = starts_t  # the cache lengths grew: back as they were

        return call

    for name, seqs in (("mixed", decode + chunks), ("prefill", chunks), ("decode", decode)):
        sampling = info(len(seqs))
        call = run(seqs, sampling)
        ms = time_ms(call, args.iters, cuda)
        sync()
        t0 = time.perf_counter()
        call()  # host time to launch: the call returns before the GPU is done only if the
        host_ms = (time.perf_counter() - t0) * 1e3  # forward is GPU-bound (no read-back inside)
        sync()
        report[f"{name}_ms"] = ms
        report[f"{name}_host_ms"] = host_ms
        print(f"  {name}: {ms:.2f} ms (host returns after {host_ms:.2f} ms)", flush=True)
    if args.varlen:
        report["varlen"] = varlen_sweep(args, run(decode + chunks, info(len(decode) + len(chunks))),
                                        run(chunks, info(len(chunks))), time_ms, cuda)  # fmt: skip
    report["gemm_floor_ms_at_700tflops"] = flops / 700e12 * 1e3
    report["mixed_tflops"] = (flops + attn) / (report["mixed_ms"] / 1e3) / 1e12
    if not cuda:
        Path(args.json).write_text(json.dumps(report, indent=1))
        return 0
    prof = kernel_profile(run(decode + chunks, info(len(decode) + len(chunks))), steps=3, top=40)
    by_family: dict[str, float] = {}
    for k in prof["top"]:
        by_family[family(k["kernel"])] = by_family.get(family(k["kernel"]), 0.0) + k["us_per_step"]
    report["profile"] = prof
    report["profile_by_family_us"] = by_family
    floor = report["gemm_floor_ms_at_700tflops"]
    print(f"  FLOPs {flops / 1e12:.1f} T gemm + {attn / 1e12:.2f} T attention "
          f"({report['mixed_tflops']:.0f} TFLOP/s); 700 TFLOP/s: {floor:.1f} ms")  # fmt: skip
    for fam, us in sorted(by_family.items(), key=lambda kv: -kv[1]):
        print(f"   {us / 1e3:8.2f} ms  {fam}")
    for k in prof["top"][:15]:
        print(f"   {k['us_per_step']:8.0f} us  {k['calls_per_step']:5.0f}x  {k['kernel'][:90]}")
    free(engine)
    Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def varlen_check(device: str) -> float:
    """Max abs error of packed-prefill attention (bf16) against the float64 reference."""
    from speculant.kernels import reference
    from speculant.kernels.paged_attention import paged_attention, varlen_tiles

    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, d, page, rows_n, per_row = 32, 8, 128, 16, 6, 80
    lens, starts = [700, 33, 1, 250, 1300, 90], [0, 64, 900, 17, 0, 400]
    k_pool = torch.randn((rows_n * per_row + 1) * page, kv_heads, d, generator=gen)
    v_pool = torch.randn(k_pool.shape, generator=gen)
    table = torch.zeros(rows_n + 1, per_row, dtype=torch.int32)
    table[:rows_n] = 1 + torch.randperm(rows_n * per_row, generator=gen).view(rows_n, -1)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
    q = torch.randn(sum(lens), heads, d, generator=gen)
    rows = torch.arange(rows_n)
    want = reference.paged_attention_varlen(
        q.double(), k_pool.double(), v_pool.double(), table, rows, pos, page, per_row * page, lens
    )  # fmt: skip
    dev = torch.device(device)
    bf = [t.to(dev, torch.bfloat16) for t in (q, k_pool, v_pool)]
    got = paged_attention(
        bf[0], bf[1], bf[2], table.to(dev), rows.to(dev), pos.to(dev), page, per_row * page, 0,
        varlen=varlen_tiles(lens, heads // kv_heads, dev),
    )  # fmt: skip
    return float((got.double().cpu() - want).abs().max())


def varlen_sweep(args, mixed, prefill, time_ms, cuda) -> dict:
    from speculant.kernels import paged_attention as pa

    shipped = pa.VARLEN_BLOCK_M, pa.VARLEN_LAUNCH
    settings = [tuple(int(v) for v in item.split(":")) for item in args.varlen.split(",")]
    out: dict = {}
    try:
        for round_ in range(2):
            for bm, bn, warps, stages in settings:
                pa.VARLEN_BLOCK_M, pa.VARLEN_LAUNCH = bm, (bn, warps, stages or None)
                tag = f"{bm}:{bn}:{warps}:{stages}"
                row = out.setdefault(tag, {"mixed_ms": [], "prefill_ms": []})
                if round_ == 0:
                    try:
                        row["max_abs_error"] = varlen_check(args.device)
                    except Exception as e:  # noqa: BLE001 (a launch out of resources)
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                if "error" in row:
                    continue
                row["mixed_ms"].append(time_ms(mixed, args.iters, cuda))
                row["prefill_ms"].append(time_ms(prefill, args.iters, cuda))
                print(f"  varlen {tag}: mixed {row['mixed_ms'][-1]:.2f} ms, prefill "
                      f"{row['prefill_ms'][-1]:.2f} ms, error {row['max_abs_error']:.2e}",
                      flush=True)  # fmt: skip
    finally:
        pa.VARLEN_BLOCK_M, pa.VARLEN_LAUNCH = shipped
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Greedy:
    seed = 0

    class params:  # noqa: N801
        temperature, top_k, top_p = 0.0, 0, 1.0


if __name__ == "__main__":
    sys.exit(main())
