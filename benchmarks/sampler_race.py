"""The sampler's cost per step on the GPU: the exponential race (executor/sampling.py `race`,
on CUDA the Triton kernel kernels/race.py; and its torch reference) against the inverse-CDF
draw it replaced (reimplemented here), each after the same filtered_probs (temperature, top-p
0.95), and filtered_probs for temperature-only rows in the FULL variant against SCALED
(unranked; checked equal), and FULL's top-p (and top-k 50 + top-p) cut by the radix-select kernel
(kernels/rank_filter.py, shipped on CUDA) against torch's sort, by chunks of rows
(`sampling.SORT_ELEMENTS`) and in one sort of every row (with the rows whose kept tokens equal
the sort's), at a 152k vocabulary for plain steps (T = 1) and verify steps (T = 4), bs 1 / 64 /
256. Also checks the race kernel's draws equal the torch reference's on every row timed. Eager,
CUDA-event timed, median of `--iters`.

python benchmarks/sampler_race.py [--out DIR] [--vocab 152064] [--iters 50]"""

from __future__ import annotations

import argparse
import json
import sys

from _common import cuda_median_ms, write_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for sampler_race.json")
    parser.add_argument("--vocab", type=int, default=152_064)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--sizes", default="1x1,64x1,1x4,64x4,256x1")
    args = parser.parse_args(argv)

    import torch

    from speculant.executor import sampling
    from speculant.kernels import rank_filter

    assert torch.cuda.is_available(), "needs a GPU"
    dev = "cuda"

    def inverse_cdf(probs, seed, pos):
        cdf = probs.cumsum(-1)
        u = sampling.uniform(seed, pos, sampling.STREAM_SAMPLE)
        index = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1), right=True)
        return index.squeeze(-1).clamp_(max=probs.shape[-1] - 1)

    def torch_race(probs, seed, pos):
        ids = torch.arange(probs.shape[-1], device=probs.device)
        return sampling.argmax(probs / sampling.exponentials(seed, pos, 1, ids))

    def kernel_race(probs, seed, pos):
        return sampling.race(probs, seed, pos, sampling.STREAM_SAMPLE)

    def sorted_cut(*a, chunk=sampling.SORT_ELEMENTS):  # top-k / top-p by torch's sort
        kept, shipped = sampling.SORT_ELEMENTS, sampling._rank_kernel
        sampling.SORT_ELEMENTS, sampling._rank_kernel = chunk, lambda device: None
        try:
            return sampling.filtered_probs(*a)
        finally:
            sampling.SORT_ELEMENTS, sampling._rank_kernel = kept, shipped

    def one_sort(*a):  # every row ranked in one sort (before 2026-12-07: its memory)
        return sorted_cut(*a, chunk=1 << 62)

    def timed(fn, *a) -> float:
        return cuda_median_ms(fn, *a, iters=args.iters)

    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for size in args.sizes.split(","):
        bs, T = (int(x) for x in size.split("x"))
        logits = torch.randn(bs, T, args.vocab, device=dev, generator=gen) * 3
        temp = torch.full((bs, 1), 0.8, device=dev)
        top_k = torch.zeros((bs, 1), dtype=torch.long, device=dev)
        top_p = torch.full((bs, 1), 0.95, device=dev)
        seed = torch.arange(bs, device=dev)[:, None] * 7919 + 1
        pos = torch.arange(T, device=dev)[None, :] + 100
        filtered = (logits, temp, top_k, top_p)
        probs = sampling.filtered_probs(*filtered)
        same = torch.equal(kernel_race(probs, seed, pos), torch_race(probs, seed, pos))
        # temperature only (no top-k / top-p): what such a batch paid before the SCALED
        # variant (FULL ranks the vocabulary whatever the rows ask) and pays now
        plain = (logits, temp, top_k, torch.ones_like(top_p), None)
        scaled_same = torch.equal(
            sampling.filtered_probs(*plain, sampling.SCALED),
            sampling.filtered_probs(*plain, sampling.FULL),
        )
        # top-k and top-p together (top-k 50): both cuts of the kernel
        both = (logits, temp, torch.full_like(top_k, 50), top_p)
        kernel_cut, sort_cut = sampling.filtered_probs(*filtered), sorted_cut(*filtered)
        flat_logits = logits.view(bs * T, -1)
        flat_probs = torch.softmax(flat_logits / 0.8, -1)
        flat_p = top_p.expand(bs, T).reshape(-1)
        flat_k = top_k.expand(bs, T).reshape(-1)

        def cut(bits, probs, logits, k, p):  # the kernel alone, on a copy (its own column)
            rank_filter.rank_filter_(probs.clone(), logits, k, p, bits)

        kernel_args = (flat_probs, flat_logits, flat_k, flat_p)

        row = {
            "bs": bs, "T": T, "vocab": args.vocab,
            "rank_kernel_4bit_ms": timed(cut, 4, *kernel_args),
            "rank_kernel_2bit_ms": timed(cut, 2, *kernel_args),
            "copy_ms": timed(flat_probs.clone),
            "filtered_probs_ms": timed(sampling.filtered_probs, *filtered),
            "filtered_probs_sorted_ms": timed(sorted_cut, *filtered),
            "filtered_probs_one_sort_ms": timed(one_sort, *filtered),
            "rows_kept_as_sorted": int(((kernel_cut > 0) == (sort_cut > 0)).all(-1).sum()),
            "rows": bs * T,
            "top_k50_top_p_ms": timed(sampling.filtered_probs, *both),
            "top_k50_top_p_sorted_ms": timed(sorted_cut, *both),
            "temperature_only_full_ms": timed(sampling.filtered_probs, *plain, sampling.FULL),
            "temperature_only_scaled_ms": timed(sampling.filtered_probs, *plain, sampling.SCALED),
            "scaled_equals_full": scaled_same,
            "inverse_cdf_ms": timed(inverse_cdf, probs, seed, pos),
            "race_torch_ms": timed(torch_race, probs, seed, pos),
            "race_kernel_ms": timed(kernel_race, probs, seed, pos),
            "kernel_equals_torch": same,
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_rows(args.out, "sampler_race.json", rows, argv)
    return 0 if all(r["kernel_equals_torch"] and r["scaled_equals_full"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
