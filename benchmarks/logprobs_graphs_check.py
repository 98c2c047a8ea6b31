"""Do decode steps replay CUDA graphs when log-probabilities are computed? One engine with and
one without `max_logprobs` (8B shape, dummy bf16), one batch each: the captured graph sizes and
how many decode steps ran eagerly (the runner's decode_step called outside capture).

    python benchmarks/logprobs_graphs_check.py [--rows 192] [--logprobs 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from graphs import SHAPES, write_config  # noqa: E402

from speculant import Engine, SamplingParams  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=192)
parser.add_argument("--logprobs", type=int, default=5)
args = parser.parse_args()
target = write_config(SHAPES["llama8b"])
prompts = [np.random.default_rng(i).integers(3, 128000, 512).tolist() for i in range(args.rows)]
for n in (None, args.logprobs):
    extra = {} if n is None else {"max_logprobs": n}
    engine = Engine(target, device="cuda", dtype="bfloat16", load_format="dummy",
                    max_num_seqs=args.rows, kv_cache_memory_fraction=0.4, **extra)  # fmt: skip
    eager, inner = [], engine.runner.decode_step
    engine.runner.decode_step = lambda bs, *a, _e=eager, _i=inner, **k: (
        _e.append(bs) or _i(bs, *a, **k)
    )
    params = SamplingParams(max_new_tokens=64, ignore_eos=True, logprobs=n)
    engine.generate(prompts, params)
    sizes = sorted({bs for _, bs, _ in engine.graphs.graphs})
    print(
        f"max_logprobs={n}: graph sizes {sizes[:3]}..{sizes[-3:]} ({len(sizes)}), "
        f"eager decode steps {len(eager)} (sizes {sorted(set(eager))[:8]}), "
        f"stats {engine.stats()}",
        flush=True,
    )
    del engine
