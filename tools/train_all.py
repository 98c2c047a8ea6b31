"""Build the corpus and tokenizer and train the bundled models, in one process, on one GPU.

    timeout 580 python tools/train_all.py --out $OUT/assets --data-out $OUT/data

writes assets/{target,eagle3,dflash,draft_lm} (HF layout, bf16, model cards), the held-out
prompt sets into --data-out and train_summary.json into --out. Every training stage stops at its
wall-clock budget (--target-seconds etc.). `--smoke` runs every stage for a few steps with tiny
shapes on the CPU (a test of the pipeline, not a model). See tools/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling stage modules

import corpus as corpus_mod  # noqa: E402
import torch  # noqa: E402
from common import TokenStream, gpu_name, log  # noqa: E402
from modeling import LlamaShape, load_lm  # noqa: E402
from tokenizer import save_tokenizer, special_ids, train_tokenizer  # noqa: E402
from train_dflash import DFlashRun, build_target_layer_ids, save_dflash, train_dflash  # noqa: E402
from train_eagle3 import Eagle3Run, default_aux_ids, save_eagle3, train_eagle3  # noqa: E402
from train_lm import LMRun, save_lm, train_lm  # noqa: E402

STAGES = ("target", "eagle3", "dflash", "draft_lm")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="assets directory to write")
    p.add_argument("--data-out", required=True, type=Path, help="where the prompt sets go")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, a few steps, on the CPU")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument(
        "--stages",
        default=",".join(STAGES),
        help="comma list of stages to train; a skipped target is loaded from --out",
    )
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("corpus and tokenizer")
    g.add_argument("--max-files", type=int, default=0, help="subset of files (0: all)")
    g.add_argument("--max-corpus-mb", type=float, default=0, help="cap on source MB (0: none)")
    g.add_argument("--max-file-kb", type=float, default=200, help="skip larger files")
    g.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    g.add_argument("--vocab-size", type=int, default=4096)
    g.add_argument("--tokenizer-mb", type=float, default=24, help="train text for the BPE")
    g.add_argument("--prompts", type=int, default=64)
    g.add_argument("--small-prompts", type=int, default=8)
    g.add_argument("--prompt-tokens", type=int, default=200)
    g = p.add_argument_group("budgets (wall-clock seconds of each training loop)")
    g.add_argument("--target-seconds", type=float, default=170)
    g.add_argument("--eagle3-seconds", type=float, default=130)
    g.add_argument("--dflash-seconds", type=float, default=90)
    g.add_argument("--draft-lm-seconds", type=float, default=30)
    g.add_argument("--max-steps", type=int, default=0, help="cap on steps per stage (0: none)")
    g = p.add_argument_group("shapes and batches")
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--intermediate", type=int, default=768)
    g.add_argument("--context", type=int, default=1024)
    g.add_argument("--draft-lm-layers", type=int, default=2)
    g.add_argument("--lm-batch", type=int, default=64, help="windows per target/draft-LM step")
    g.add_argument("--eagle3-batch", type=int, default=32, help="windows per EAGLE-3 step")
    g.add_argument("--eagle3-length", type=int, default=512, help="EAGLE-3 window length")
    g.add_argument("--drafter-batch", type=int, default=16, help="windows per DFLASH step")
    g.add_argument("--target-lr", type=float, default=2e-3)
    g.add_argument("--drafter-lr", type=float, default=2e-3)
    g.add_argument("--draft-vocab", type=int, default=1024)
    g.add_argument("--ttt-steps", type=int, default=7)
    g.add_argument("--dflash-layers", type=int, default=2)
    g.add_argument("--dflash-block", type=int, default=8)
    g.add_argument("--dflash-anchors", type=int, default=128, help="anchors per sequence")
    g.add_argument(
        "--dflash-layer-ids",
        default="1,3,5",
        help="target layer outputs the DFLASH context reads ('default': z-lab's)",
    )
    g.add_argument("--max-shard-mb", type=float, default=15)
    p.add_argument(
        "--bundle",
        type=Path,
        default=None,
        help="also write --out and --data-out as one tar in 15 MB parts here\n"
        "(restore: cat DIR/bundle.tar.part-* | tar xf -)",
    )
    args = p.parse_args(argv)
    if args.smoke:
        smoke = dict(
            max_files=args.max_files or 200,
            vocab_size=512,
            tokenizer_mb=2,
            hidden=64,
            intermediate=128,
            context=128,
            lm_batch=4,
            drafter_batch=2,
            eagle3_batch=2,
            eagle3_length=96,
            dflash_anchors=8,
            prompt_tokens=40,
            max_steps=args.max_steps or 3,
            workers=min(args.workers, 2),
            draft_vocab=128,
            device=args.device or "cpu",
        )
        for key, value in smoke.items():
            setattr(args, key, value)
    args.stages = [s for s in args.stages.split(",") if s]
    unknown = set(args.stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stage(s) {sorted(unknown)}; choose from {', '.join(STAGES)}")
    return args


def build_data(args, summary: dict):
    """Stages 1-2: file list, tokenizer (trained unless reused), token streams, prompt sets."""
    t0 = time.perf_counter()
    files = corpus_mod.list_files(int(args.max_file_kb * 1000))
    files = corpus_mod.select_files(files, args.max_files, args.max_corpus_mb)
    log("corpus", f"{len(files)} files, {sum(f.size for f in files) / 1e6:.1f} MB of source")
    target_dir = args.out / "target"
    from tokenizers import Tokenizer

    if "target" not in args.stages and (target_dir / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
        log("tokenizer", f"reused {target_dir / 'tokenizer.json'}")
    else:
        sample, total = [], 0
        for f in sorted(files, key=lambda f: corpus_mod.name_hash(f.name + "/bpe")):
            if total >= args.tokenizer_mb * 1e6:
                break
            text = None if corpus_mod.is_heldout(f.name) else corpus_mod.read_text(f.path)
            if text:
                sample.append(text)
                total += len(text)
        t1 = time.perf_counter()
        tokenizer = train_tokenizer(sample, args.vocab_size)
        log(
            "tokenizer",
            f"BPE {tokenizer.get_vocab_size()} tokens from {total / 1e6:.1f} MB "
            f"in {time.perf_counter() - t1:.1f}s",
        )
        save_tokenizer(tokenizer, target_dir, args.context)
    eos_id, mask_id = special_ids(tokenizer)
    t2 = time.perf_counter()
    corpus = corpus_mod.build_corpus(
        files, str(target_dir / "tokenizer.json"), eos_id, args.workers
    )
    card = corpus.card()
    log(
        "corpus",
        f"tokenized in {time.perf_counter() - t2:.1f}s ({args.workers} workers): "
        f"{card['train_tokens']:,} train / {card['heldout_tokens']:,} held-out tokens, "
        f"{card['train_files']} + {card['heldout_files']} files, {corpus.unreadable} unreadable, "
        f"list sha256 {card['file_list_sha256'][:16]}",
    )
    sizes = corpus_mod.write_prompt_sets(
        corpus, tokenizer, args.data_out, args.prompts, args.small_prompts, args.prompt_tokens
    )
    log("corpus", f"prompt sets {sizes} in {args.data_out}")
    summary["corpus"] = {**card, "unreadable_files": corpus.unreadable, "prompt_sets": sizes}
    summary["tokenizer"] = {
        "vocab_size": tokenizer.get_vocab_size(),
        "eos_id": eos_id,
        "mask_id": mask_id,
        "train_mb": args.tokenizer_mb,
    }
    summary["stages"]["data"] = {"wall_seconds": round(time.perf_counter() - t0, 1)}
    return tokenizer, corpus, eos_id, mask_id


def main(argv=None) -> int:
    args = parse_args(argv)
    # bf16 activations into fp32-weight RMSNorm under autocast: a slower kernel, not an error
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {
        "command": " ".join(sys.argv),
        "device": gpu_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "stages": {},
    }
    log("setup", f"device {summary['device']}, torch {torch.__version__}, stages {args.stages}")
    tokenizer, corpus, eos_id, mask_id = build_data(args, summary)
    card = summary["corpus"]
    train = TokenStream(corpus.train, device, seed=args.seed)
    heldout = TokenStream(corpus.heldout, device, seed=args.seed + 1)
    V = tokenizer.get_vocab_size()
    target_shape = LlamaShape(
        V, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.context
    )

    def stage_done(name: str, t0: float, row: dict) -> None:
        row["wall_seconds"] = round(time.perf_counter() - t0, 1)
        summary["stages"][name] = row
        (args.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()

    t0 = time.perf_counter()
    if "target" in args.stages:
        run = LMRun(
            "target",
            target_shape,
            args.lm_batch,
            args.target_lr,
            args.target_seconds,
            args.max_steps,
            seed=args.seed,
        )
        target, row = train_lm(run, train, heldout, device)
        save_lm(
            target,
            row,
            args.out / "target",
            args.out / "target",
            card,
            eos_id,
            "Bundled target: a small Python-code Llama",
            "A Llama trained from scratch on Python source files (standard library and "
            "site-packages); the target of the bundled EAGLE-3, DFLASH and draft-LM drafters.",
            device,
            args.max_shard_mb,
        )
        stage_done("target", t0, row)
    else:
        target = load_lm(args.out / "target", target_shape, device)
        log("target", f"loaded {args.out / 'target'}")
    target.eval().requires_grad_(False)

    if "eagle3" in args.stages:
        t0 = time.perf_counter()
        aux_ids = default_aux_ids(target_shape.layers)
        run = Eagle3Run(
            args.draft_vocab,
            args.ttt_steps,
            args.eagle3_batch,
            args.eagle3_length,
            args.drafter_lr,
            args.eagle3_seconds,
            args.max_steps,
            seed=args.seed + 1,
        )
        head, d2t, t2d, row = train_eagle3(
            run, target, train, heldout, corpus.train, aux_ids, device
        )
        save_eagle3(
            head,
            d2t,
            t2d,
            target,
            row,
            args.out / "eagle3",
            card,
            aux_ids,
            eos_id,
            device,
            args.max_shard_mb,
        )
        del head
        stage_done("eagle3", t0, row)

    if "dflash" in args.stages:
        t0 = time.perf_counter()
        if args.dflash_layer_ids == "default":
            layer_ids = build_target_layer_ids(target_shape.layers, args.dflash_layers)
        else:
            layer_ids = [int(i) for i in args.dflash_layer_ids.split(",")]
        run = DFlashRun(
            args.dflash_layers,
            args.dflash_block,
            args.dflash_anchors,
            args.drafter_batch,
            args.context,
            args.drafter_lr,
            args.dflash_seconds,
            max_steps=args.max_steps,
            seed=args.seed + 2,
        )
        model, row = train_dflash(run, target, train, heldout, layer_ids, mask_id, device)
        save_dflash(
            model, target, row, args.out / "dflash", card, run, mask_id, device, args.max_shard_mb
        )
        del model
        stage_done("dflash", t0, row)

    if "draft_lm" in args.stages:
        t0 = time.perf_counter()
        shape = LlamaShape(**{**vars(target_shape), "layers": args.draft_lm_layers})
        run = LMRun(
            "draft_lm",
            shape,
            args.lm_batch,
            args.target_lr,
            args.draft_lm_seconds,
            args.max_steps,
            seed=args.seed + 3,
        )
        draft_lm, row = train_lm(run, train, heldout, device)
        save_lm(
            draft_lm,
            row,
            args.out / "draft_lm",
            args.out / "target",
            card,
            eos_id,
            "Bundled draft LM: a 2-layer Python-code Llama",
            "A small Llama of the target's tokenizer, trained on the same corpus, for the "
            "draft-model algorithm (`--algo draft-model`).",
            device,
            args.max_shard_mb,
        )
        stage_done("draft_lm", t0, row)

    summary["asset_mb"] = {
        d.name: round(sum(f.stat().st_size for f in d.iterdir()) / 1e6, 2)
        for d in sorted(args.out.iterdir())
        if d.is_dir()
    }
    summary["wall_seconds"] = round(time.perf_counter() - start, 1)
    (args.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary)
    if args.bundle:
        write_bundle(args.bundle, [args.out, args.data_out])
    return 0


def write_bundle(folder: Path, paths: list[Path], part_mb: int = 15) -> None:
    """A tar of `paths` (named by their last component) split into `part_mb` MB parts, so a
    machine that returns few, small files can hand back the whole run."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in paths:
            tar.add(path, arcname=path.name)
    data, size = buffer.getvalue(), part_mb * 1_000_000
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(data), size):
        (folder / f"bundle.tar.part-{i // size:02d}").write_bytes(data[i : i + size])
    log("bundle", f"{len(data) / 1e6:.1f} MB in {-(-len(data) // size)} parts in {folder}")


def print_table(summary: dict) -> None:
    rows = [("stage", "wall s", "steps", "tokens", "train loss", "held-out loss", "other")]
    for name, row in summary["stages"].items():
        other = ""
        if "heldout_acc_per_step" in row:
            other = "acc/step " + ",".join(f"{a:.2f}" for a in row["heldout_acc_per_step"])
        elif "heldout_tau" in row:
            other = f"tau {row['heldout_tau']:.2f}"
        rows.append(
            (
                name,
                str(row.get("wall_seconds", "")),
                str(row.get("steps", "")),
                f"{row.get('tokens_seen', row.get('block_tokens_seen', '')):,}"
                if "steps" in row
                else "",
                str(row.get("final_train_loss", "")),
                str(row.get("heldout_loss", "")),
                other,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    sizes = ", ".join(f"{k} {v} MB" for k, v in summary["asset_mb"].items())
    total = sum(summary["asset_mb"].values())
    print(f"\nassets: {sizes} (total {total:.1f} MB{'; OVER 40 MB' if total > 40 else ''})")
    print(
        f"corpus: {summary['corpus']['files']} files, list sha256 "
        f"{summary['corpus']['file_list_sha256']}; wall {summary['wall_seconds']}s on "
        f"{summary['device']}"
    )


if __name__ == "__main__":
    sys.exit(main())
