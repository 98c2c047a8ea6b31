"""Tokens per verify step of `--sampled-verify match` against `rejection` on the bundled models
(CPU, float32): each bundled drafter, temperature 0.6 and 1.0, the first `--prompts` bundled
held-out prompts, seeded. The ratio match / rejection is what README's `--sampled-verify` row
quotes.

python benchmarks/match_accept.py [--prompts 24] [--max-new-tokens 48] [--out FILE.json]
    [--drafters eagle3,dflash,draft_lm]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import run_info  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", default=None)
    parser.add_argument("--drafters", default="eagle3,dflash,draft_lm")
    args = parser.parse_args(argv)
    algos = {"eagle3": "eagle3", "dflash": "dflash", "draft_lm": "draft-model"}
    unknown = [name for name in args.drafters.split(",") if name not in algos]
    if unknown:
        parser.error(f"--drafters: unknown {', '.join(unknown)} (known: {', '.join(algos)})")

    import speculant
    from speculant import Engine, SamplingParams
    from speculant.launch.accept_rate import acceptance, bundled_prompts

    prompts = [json.loads(line)["prompt"] for line in bundled_prompts().open()][: args.prompts]
    rows = []
    for name in args.drafters.split(","):
        algo = algos[name]
        for temperature in (0.6, 1.0):
            lengths = {}
            for mode in ("rejection", "match"):
                engine = Engine(speculant.bundled("target"), device="cpu", dtype="float32",
                                algo=algo, draft=str(speculant.bundled(name)), seed=0,
                                sampled_verify=mode, max_num_seqs=8)  # fmt: skip
                params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                        temperature=temperature)  # fmt: skip
                outputs = engine.generate(prompts, params, use_tqdm=False)
                lengths[mode] = acceptance(outputs)[0]
            row = {"drafter": name, "temperature": temperature, **lengths,
                   "match_over_rejection": lengths["match"] / lengths["rejection"]}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**run_info("cpu", argv), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
