"""A step's log-probability statistics on the GPU: torch's logsumexp + topk (kernels/reference.py
`top_logprobs`, what every step ran before) against the one-read Triton kernels
(kernels/logprobs.py), on float32 logits of bf16 values [rows, vocab] as the 8B model's lm_head
gives them. Each is timed as fp8_sweep.py times a kernel (`time_us`: 20 calls captured in a
CUDA graph, the median of 10 replays, us per call); the outputs are compared (values within
float32 rounding, equal ids where no value ties).

    python benchmarks/logprobs_kernel.py --json OUT.json [--rows 1,8,64,256,1024]
        [--vocab 128256,151936] [--top 5,20]
        [--variants 1024:4,4096:8,...]

`--variants`: kernel variants timed side by side, BLOCK:WARPS (kernels/logprobs.py's BLOCK,
WARPS); the module's own setting when not given. (Wave 23 also timed a part's chunk count as a
compile-time constant, code since removed: results/wave23.md.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import run_info  # noqa: E402
from fp8_sweep import time_us  # noqa: E402

from speculant.kernels import logprobs, reference  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rows", default="1,8,64,256,1024")
    parser.add_argument("--vocab", default="128256,151936")
    parser.add_argument("--top", default="5,20")
    parser.add_argument("--variants", default=None)
    args = parser.parse_args()
    own = f"{logprobs.BLOCK}:{logprobs.WARPS}"
    variants = (args.variants or own).split(",")
    torch.manual_seed(0)
    results = []
    print(f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"| vocab | top | rows | torch us | {' | '.join(variants)} | outputs |")
    print("| --- " * (5 + len(variants)) + "|")
    for vocab in map(int, args.vocab.split(",")):
        for top in map(int, args.top.split(",")):
            for rows in map(int, args.rows.split(",")):
                x = (torch.randn(rows, vocab, device="cuda") * 3).bfloat16().float()
                ref_norm, ref_values, ref_ids = reference.top_logprobs(x, top)
                near = x.topk(top + 1).values  # a tie at the edge of the top too
                ties = (near[:, 1:] == near[:, :-1]).any(1)
                a = time_us(lambda x, top=top: reference.top_logprobs(x, top), [x], True)
                row = dict(vocab=vocab, top=top, rows=rows, torch_us=round(a, 1), variants={})
                cells, equal = [], True
                for variant in variants:
                    block, warps = variant.split(":")
                    logprobs.BLOCK, logprobs.WARPS = int(block), int(warps)
                    norm, values, ids = logprobs.top_logprobs(x, top)
                    equal &= bool(
                        torch.allclose(norm, ref_norm, rtol=1e-6, atol=1e-5)
                        and torch.allclose(values, ref_values, rtol=1e-6, atol=1e-5)
                        and torch.equal(x.gather(1, ids) - norm[:, None], values)
                        and torch.equal(ids[~ties], ref_ids[~ties])
                    )
                    b = time_us(lambda x, top=top: logprobs.top_logprobs(x, top), [x], True)
                    row["variants"][variant] = round(b, 1)
                    cells.append(f"{b:.1f} ({a / b:.1f}x)")
                row["equal"] = equal
                results.append(row)
                print(f"| {vocab} | {top} | {rows} | {a:.1f} | {' | '.join(cells)} | "
                      f"{'equal' if equal else 'DIFFER'} |", flush=True)  # fmt: skip
    with open(args.json, "w") as f:
        json.dump({**run_info("cuda"), "device": torch.cuda.get_device_name(), "results": results},
                  f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
