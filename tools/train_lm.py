"""Stages 3 and 6: a Llama language model (the target, or the 2-layer draft LM) trained from
scratch on packed windows of the corpus, evaluated on the held-out stream and saved in HF
layout with its tokenizer and model card."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from common import TokenStream, autocast, log, loop_summary, param_count, save_stage, train_stage
from corpus import card_line
from modeling import LlamaLM, LlamaShape


@dataclass
class LMRun:
    """How one LM is trained."""

    name: str  # "target" or "draft_lm"
    shape: LlamaShape
    batch_size: int
    lr: float
    budget_s: float
    max_steps: int = 0
    warmup: int = 100
    seed: int = 0


@torch.no_grad()
def heldout_loss(model: LlamaLM, heldout: TokenStream, device, windows: int = 32) -> float:
    """Mean next-token cross-entropy over disjoint held-out windows of the model's context."""
    model.eval()
    total, count = 0.0, 0
    for window in heldout.windows(model.shape.context + 1, windows):
        with autocast(device):
            total += float(model.loss(window))
        count += 1
    model.train()
    return total / max(count, 1)


def train_lm(run: LMRun, train: TokenStream, heldout: TokenStream, device) -> tuple[LlamaLM, dict]:
    """Train from scratch until the budget; returns the model and its summary row."""
    torch.manual_seed(run.seed)
    model = LlamaLM(run.shape).to(device)
    s = run.shape
    log(run.name, f"{param_count(model) / 1e6:.2f}M params, batch {run.batch_size}x{s.context}")

    def step(_: int):
        batch = train.batch(run.batch_size, s.context + 1)
        with autocast(device):
            return model.loss(batch), {}

    result = train_stage(run.name, model, step, run, tokens_per_step=run.batch_size * s.context)
    start = time.perf_counter()
    loss = heldout_loss(model, heldout, device)
    log(run.name, f"held-out loss {loss:.4f} (ppl {math.exp(loss):.2f})")
    summary = {
        **loop_summary(result, start),
        "heldout_loss": round(loss, 4),
        "params": param_count(model),
        "batch": f"{run.batch_size} x {s.context} tokens",
        "lr": run.lr,
        "shape": asdict(s),
    }
    return model, summary


def save_lm(
    model: LlamaLM,
    summary: dict,
    out_dir: Path,
    tokenizer_dir: Path,
    corpus_card: dict,
    eos_id: int,
    title: str,
    about: str,
    device,
    max_shard_mb: float,
) -> None:
    """HF checkpoint (config.json, safetensors, tokenizer files) and its model card."""
    import shutil

    s = model.shape
    save_stage(
        out_dir,
        model.hf_tensors(),
        s.hf_config(eos_id),
        max_shard_mb,
        title=title,
        about=about,
        rows={
            "architecture": (
                f"LlamaForCausalLM, hidden {s.hidden}, {s.layers} layers, {s.heads} heads "
                f"({s.kv_heads} KV), intermediate {s.intermediate}, context {s.context}, "
                f"rope_theta {s.rope_theta:g}, untied, {summary['params'] / 1e6:.2f}M params"
            ),
            "corpus": card_line(corpus_card),
            "optimizer": f"AdamW (0.9, 0.95), wd 0.1, lr {summary['lr']:g}, warm-up then cosine",
            "batch": summary["batch"] + " (windows at random offsets, files joined by EOS)",
            "precision": "bf16 autocast, fp32 master weights; saved as bf16",
        },
        summary=summary,
        device=device,
    )
    if tokenizer_dir.resolve() != out_dir.resolve():
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(tokenizer_dir / name, out_dir / name)
    generation = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    (out_dir / "generation_config.json").write_text(_json(generation))


def _json(obj) -> str:
    import json

    return json.dumps(obj, indent=2) + "\n"
