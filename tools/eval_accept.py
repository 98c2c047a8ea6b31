"""Greedy acceptance of the trained drafters on held-out prompts, for checking a training run.

    python tools/eval_accept.py --assets assets --prompts data/heldout_prompts_small.jsonl

Runs speculant's Engine plainly and with each drafter (EAGLE-3 at several k, the draft LM,
DFLASH when the runtime has it), checks that greedy speculative output equals plain greedy
output, and prints the acceptance length (tokens emitted per verify step) and per-position
acceptance. `dflash-ref` is a full-recompute DFLASH loop built from the training modules
(tools/train_dflash.py): a runtime-independent check of what training achieved.
The release harness is `speculant accept-rate`; this script is the trainer's quick look.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import autocast  # noqa: E402
from modeling import LlamaShape, load_lm  # noqa: E402


def engine_run(assets: Path, prompts, max_new: int, device: str, algo=None, draft=None, k=0):
    from speculant import Engine, SamplingParams

    context = json.loads((assets / "target" / "config.json").read_text())["max_position_embeddings"]
    options = dict(device=device, max_num_seqs=max(len(prompts), 1), max_model_len=context)
    if algo:
        options.update(algo=algo, draft=str(assets / draft), num_draft_tokens=k)
    options["enforce_eager"] = True  # a quality check, not a speed benchmark: skip capture
    engine = Engine(str(assets / "target"), **options)
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    seconds = time.perf_counter() - start
    del engine
    return outs, seconds


def summarize(outs) -> dict:
    steps = sum(o.stats["num_verify_steps"] for o in outs)
    emitted = sum(o.stats["accept_len"] * o.stats["num_verify_steps"] for o in outs)
    k = len(outs[0].stats["per_position_acceptance"])
    per_pos = [
        sum(o.stats["per_position_acceptance"][i] * o.stats["num_verify_steps"] for o in outs)
        / max(steps, 1)
        for i in range(k)
    ]
    return {"acceptance_length": emitted / max(steps, 1), "per_position": per_pos}


@torch.no_grad()
def dflash_reference(assets: Path, prompt_ids: list[list[int]], max_new: int, device) -> dict:
    """Greedy DFLASH with full recomputation, from the training-time modules."""
    device = torch.device(device)
    from train_dflash import DFlashDrafter

    tcfg = json.loads((assets / "target" / "config.json").read_text())
    dcfg = json.loads((assets / "dflash" / "config.json").read_text())
    shape = LlamaShape(
        tcfg["vocab_size"],
        tcfg["hidden_size"],
        tcfg["num_hidden_layers"],
        tcfg["num_attention_heads"],
        tcfg["num_key_value_heads"],
        tcfg["intermediate_size"],
        tcfg["max_position_embeddings"],
        tcfg["rope_theta"],
        tcfg["rms_norm_eps"],
    )
    target = load_lm(assets / "target", shape, device).eval()
    ids_cfg = dcfg["dflash_config"]
    drafter = DFlashDrafter(target, dcfg["num_hidden_layers"], ids_cfg["target_layer_ids"])
    from safetensors.torch import load_file

    state = load_file(str(assets / "dflash" / "model.safetensors"))
    drafter.load_state_dict({k: v.float() for k, v in state.items()})
    drafter.to(device).eval()
    B, mask_id = dcfg["block_size"], ids_cfg["mask_token_id"]
    capture = tuple(i + 1 for i in ids_cfg["target_layer_ids"])
    cos, sin = target.rope(device)
    steps = emitted = 0
    accepted = [0] * (B - 1)
    for prompt in prompt_ids:
        seq = torch.tensor([prompt], device=device)
        with autocast(device):
            hidden, _ = target(seq)
        seq = torch.cat([seq, target.lm_head(hidden[:, -1:]).argmax(-1)], dim=1)
        produced = 1
        while produced < max_new:
            s = seq.shape[1] - 1  # the newest token's position: the block's anchor
            with autocast(device):
                _, aux = target(seq[:, :s], capture=capture)
                block = torch.full((1, B), mask_id, device=device)
                block[0, 0] = seq[0, s]
                pos = torch.arange(s, s + B, device=device)
                mask = torch.ones(1, 1, B, s + B, dtype=torch.bool, device=device)
                out = drafter(
                    target.model.embed_tokens(block),
                    aux,
                    (cos[pos][None, None], sin[pos][None, None]),
                    (cos[:s], sin[:s]),
                    mask,
                )
                drafts = target.lm_head(out[:, 1:]).argmax(-1)
                hidden, _ = target(torch.cat([seq, drafts], dim=1))
                verify = target.lm_head(hidden[:, s:]).argmax(-1)  # [1, B]
            match = (drafts[0] == verify[0, :-1]).int().cumprod(0)
            n = int(match.sum())
            for i in range(n):
                accepted[i] += 1
            seq = torch.cat([seq, drafts[:, :n], verify[:, n : n + 1]], dim=1)
            steps, emitted, produced = steps + 1, emitted + n + 1, produced + n + 1
    return {
        "acceptance_length": emitted / max(steps, 1),
        "per_position": [a / max(steps, 1) for a in accepted],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--assets", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--eagle3-k", default="2,4,6")
    p.add_argument("--draft-lm-k", type=int, default=4)
    p.add_argument("--dflash-k", type=int, default=7)
    p.add_argument("--algos", default="eagle3,draft-model,dflash,dflash-ref")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    lines = args.prompts.read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][: args.num_prompts]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.assets / "target" / "tokenizer.json"))
    prompt_ids = [tokenizer.encode(t).ids for t in prompts]
    algos = args.algos.split(",")
    plain, seconds = engine_run(args.assets, prompt_ids, args.max_new_tokens, args.device)
    reference = [o.token_ids for o in plain]
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy, {args.device}")
    print(f"{'algo':<12} {'k':>2} {'accept_len':>10} {'lossless':>8} {'s':>6}  per-position")
    rows = []

    def add(algo, k, acc, per_pos, same, seconds):
        rows.append((algo, k, acc, per_pos, same, seconds))
        pp = " ".join(f"{x:.2f}" for x in per_pos)
        print(f"{algo:<12} {k:>2} {acc:>10.3f} {str(same):>8} {seconds:>6.1f}  {pp}", flush=True)

    add("plain", 0, 1.0, [], True, seconds)
    runs = [("eagle3", "eagle3", int(k)) for k in args.eagle3_k.split(",") if "eagle3" in algos]
    if "draft-model" in algos:
        runs.append(("draft-model", "draft_lm", args.draft_lm_k))
    if "dflash" in algos:
        runs.append(("dflash", "dflash", args.dflash_k))
    for algo, folder, k in runs:
        try:
            outs, seconds = engine_run(
                args.assets, prompt_ids, args.max_new_tokens, args.device, algo, folder, k
            )
        except Exception as exc:  # e.g. a runtime without this algorithm
            print(f"{algo} k={k}: not run ({exc})")
            continue
        stats = summarize(outs)
        same = [o.token_ids for o in outs] == reference
        add(algo, k, stats["acceptance_length"], stats["per_position"], same, seconds)
    if "dflash-ref" in algos:
        start = time.perf_counter()
        stats = dflash_reference(args.assets, prompt_ids, args.max_new_tokens, args.device)
        k = len(stats["per_position"])
        seconds = time.perf_counter() - start
        add("dflash-ref", k, stats["acceptance_length"], stats["per_position"], None, seconds)
    if args.json:
        keys = ("algo", "k", "acceptance_length", "per_position", "lossless", "seconds")
        args.json.write_text(json.dumps([dict(zip(keys, r, strict=True)) for r in rows], indent=2))
    return 0 if all(r[4] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
