"""The realistic job's decode step in isolation (issue [batch-jobs] figure): the 8B-shape graph
decode step (bf16, dummy weights, `triton` backend) at bs 192 with every row at its own context
drawn as in a decode step of benchmarks/workload.py's job (attention_sweep.job_contexts), against
the same batch with every row at the mean context; then the kernel profile of the mixed step
(torch profiler; under PDL a kernel's time includes its wait, so the figures overlap).

    python benchmarks/job_step.py --json OUT.json [--bs 192] [--row-layout plan,longest_first,batch]

`--row-layout`: the step per decode-attention layout (executor/triton_attention.py
`row_layout`: a RowPlan, rows longest first, batch order), graphs recaptured for each, in
order, then again (two rounds); the profile is the first setting's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def fill_rows(engine, contexts: list[int], vocab: int, gen) -> list[int]:
    """One request row per context, its tokens in the cache, its next step's inputs filled."""
    rows = [engine.kv.allocate(c + 64) for c in contexts]
    for row, c in zip(rows, contexts, strict=True):
        if engine.kv.pages_needed(row, c + 64):
            raise RuntimeError(f"the KV pool holds too few pages for {len(rows)} rows")
    for i in range(0, len(rows), 8):
        chunk = rows[i : i + 8]
        prompts = [
            torch.randint(3, vocab, (c,), generator=gen).tolist() for c in contexts[i : i + 8]
        ]
        engine.runner.forward_prefill(chunk, prompts, [0] * len(chunk))
    bs = len(rows)
    ids = torch.randint(3, vocab, (bs, engine.tokens_per_req), generator=gen).tolist()
    engine.runner.buffers.fill(
        rows, ids, [0.0] * bs, [0] * bs, [1.0] * bs, [0] * bs, bs, engine.kv.sentinel_row
    )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--bs", type=int, default=192)
    parser.add_argument("--row-layout", default="plan,longest_first,batch")
    args = parser.parse_args()
    from attention_sweep import job_contexts
    from decode import build_engine, free, kernel_profile
    from fp8_gpu import targets
    from graphs import SHAPES, time_ms

    from speculant.executor.triton_attention import TritonPagedAttention

    vocab = SHAPES["llama8b"]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    contexts = job_contexts(args.bs, gen)
    mean = round(sum(contexts) / len(contexts))
    report = {
        "gpu": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
        "contexts": {"mean": mean, "max": max(contexts)},
    }
    engine = build_engine(targets()["bf16"], "triton", 3584, [args.bs], piecewise=False)
    shipped = TritonPagedAttention.row_layout
    settings = args.row_layout.split(",")
    try:
        for round_ in range(2 if len(settings) > 1 else 1):
            for setting in settings:
                TritonPagedAttention.row_layout = setting
                engine.clear_graphs()
                engine.capture_graphs()
                graph = engine.graphs.graph("greedy", args.bs)
                tag = f"/{setting}/r{round_}"
                for name, ctxs in (("job", contexts), ("uniform", [mean] * args.bs)):
                    rows = fill_rows(engine, ctxs, vocab, gen)
                    key = f"graph_ms/{name}{tag}"
                    report[key] = time_ms(graph.replay, 30)
                    print(f"  bs {args.bs} {name} {setting}: {report[key]:.3f} ms")
                    if name == "job" and "profile_job" not in report:
                        report["profile_job"] = kernel_profile(graph.replay, top=20)
                    for row in rows:
                        engine.kv.free(row)
    finally:
        TritonPagedAttention.row_layout = shipped
        free(engine)
    Path(args.json).write_text(json.dumps(report, indent=1))
    for k in report.get("profile_job", {}).get("top", [])[:12]:
        print(f"   {k['us_per_step']:8.0f} us  {k['calls_per_step']:5.0f}x  {k['kernel'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
