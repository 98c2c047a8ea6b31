"""filtered_probs with top-p 0.95 (and top-k 50 + top-p) as the engine runs it in its decode
graphs: captured in one CUDA graph per batch size and path, the sort-free kernel
(kernels/rank_filter.py) against torch's sort by chunks of rows, replayed and CUDA-event timed
(median of --iters), bf16 logits at a 152k vocabulary, T 0.8. (sampler_race.py times eager
calls: there the kernel's 35 launches cost host time a graph does not pay.)

python benchmarks/rank_graph.py [--out DIR] [--sizes 1,64,256] [--iters 50] [--noskip] [--profile]
[--kernel-rows N]"""

from __future__ import annotations

import argparse
import json
import sys

from _common import cuda_median_ms, write_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--vocab", type=int, default=152_064)
    parser.add_argument("--sizes", default="1,64,256")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also each kernel's time in a call of the kernel path (torch.profiler)",
    )
    parser.add_argument(
        "--kernel-rows",
        type=int,
        default=None,
        help="the kernel from this many rows (sampling.RANK_KERNEL_ROWS)",
    )
    parser.add_argument(
        "--noskip",
        action="store_true",
        help="also time the kernel binning every block (rank_filter.SKIP_EMPTY off)",
    )
    args = parser.parse_args(argv)

    import torch

    from speculant.executor import sampling

    def graphed(*inputs):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                sampling.filtered_probs(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = sampling.filtered_probs(*inputs)
        return graph, out

    def timed(graph):
        return cuda_median_ms(graph.replay, iters=args.iters)

    def kernel_times(inputs, calls=5):
        """Each kernel's GPU time per call (eager calls under torch.profiler: a graph's kernels
        run the same), us, by name, largest first."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                sampling.filtered_probs(*inputs)
            torch.cuda.synchronize()
        times = {}
        for event in prof.key_averages():
            if event.device_time_total > 0:
                times[event.key[:60]] = round(event.device_time_total / calls, 1)
        return dict(sorted(times.items(), key=lambda kv: -kv[1]))

    from speculant.kernels import rank_filter

    kernel = sampling._rank_kernel
    if args.kernel_rows is not None:
        sampling.RANK_KERNEL_ROWS = args.kernel_rows
    paths = ["kernel", "sort"]
    if args.noskip and hasattr(rank_filter, "SKIP_EMPTY"):
        paths.insert(1, "kernel_noskip")  # every block binned (SKIP_EMPTY off)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for bs in (int(x) for x in args.sizes.split(",")):
        logits = (torch.randn(bs, args.vocab, device="cuda", generator=gen) * 3).bfloat16()
        temp = torch.full((bs,), 0.8, device="cuda")
        top_p = torch.full((bs,), 0.95, device="cuda")
        row = {"bs": bs, "vocab": args.vocab}
        for name, k in (("top_p", 0), ("top_k50_top_p", 50)):
            top_k = torch.full((bs,), k, device="cuda", dtype=torch.long)
            for path in paths:
                sampling._rank_kernel = kernel if path != "sort" else (lambda device: None)
                if hasattr(rank_filter, "SKIP_EMPTY"):
                    rank_filter.SKIP_EMPTY = path != "kernel_noskip"
                graph, out = graphed(logits, temp, top_k, top_p)
                row[f"{name}_{path}_ms"] = timed(graph)
                row[f"{name}_{path}_kept"] = int((out > 0).sum())
                if args.profile and path == "kernel":
                    inputs = (logits, temp, top_k, top_p)
                    row[f"{name}_{path}_kernels_us"] = kernel_times(inputs)
                sampling._rank_kernel = kernel
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_rows(args.out, "rank_graph.json", rows, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
