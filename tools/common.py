"""What every training stage shares: logging, token batches, the wall-clock-budgeted training
loop (AdamW, warm-up then cosine over the budget) and the summary row it starts, bf16
safetensors in HF layout (sharded with an index above a size limit) and the model cards."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

START = time.perf_counter()


def log(stage: str, message: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {stage:<9} {message}", flush=True)


def autocast(device: torch.device):
    """bf16 autocast on CUDA; plain fp32 on the CPU (smoke runs)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class TokenStream:
    """A token stream on the device; batches are windows at random offsets."""

    def __init__(self, tokens: np.ndarray, device: torch.device, seed: int):
        self.tokens = torch.from_numpy(tokens.astype(np.int32)).to(device)
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.device = device

    def __len__(self) -> int:
        return self.tokens.numel()

    def batch(self, batch_size: int, length: int) -> torch.Tensor:
        """[batch_size, length] int64 windows."""
        high = max(1, len(self) - length)
        starts = torch.randint(0, high, (batch_size, 1), device=self.device, generator=self.gen)
        index = (starts + torch.arange(length, device=self.device)).clamp(max=len(self) - 1)
        return self.tokens[index].long()

    def windows(self, length: int, count: int) -> list[torch.Tensor]:
        """Up to `count` disjoint [1, length] windows spread evenly over the stream."""
        n = len(self) // length
        picks = np.linspace(0, n - 1, num=min(count, n)).astype(int) if n else []
        return [self.tokens[i * length : (i + 1) * length].long()[None] for i in picks]


@dataclass
class LoopResult:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    final_loss: float = float("nan")
    metrics: dict[str, float] = field(default_factory=dict)


def train_loop(
    stage: str,
    params: list[torch.nn.Parameter],
    step_fn: Callable[[int], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    *,
    lr: float,
    budget_s: float,
    max_steps: int,
    tokens_per_step: int,
    warmup: int = 50,
    weight_decay: float = 0.1,
    min_lr_ratio: float = 0.1,
    log_every_s: float = 15.0,
    sync_every: int = 5,
) -> LoopResult:
    """Run `step_fn(step) -> (loss, metrics)` under AdamW until `budget_s` seconds or
    `max_steps` (0: no step limit) pass. The cosine decay follows the larger of the elapsed
    time fraction and the step fraction, so the schedule ends when the budget does."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    fused = params[0].device.type == "cuda"
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=fused,
    )
    result, pending, recent = LoopResult(), [], []
    start = last_log = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        progress = max(elapsed / budget_s, result.steps / max_steps if max_steps else 0.0)
        if progress >= 1.0 or (max_steps and result.steps >= max_steps):
            break
        scale = min(1.0, (result.steps + 1) / warmup)
        scale *= min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        loss, metrics = step_fn(result.steps)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pending.append(torch.stack([loss.detach().float(), *[m.float() for m in metrics.values()]]))
        result.steps += 1
        result.tokens += tokens_per_step
        if len(pending) >= sync_every:  # one host sync every few steps
            recent.extend(torch.stack(pending).cpu().tolist())
            pending, recent = [], recent[-50:]
            if time.perf_counter() - last_log >= log_every_s:
                last_log = time.perf_counter()
                log(stage, _progress_line(result, recent, list(metrics), lr * scale, start))
    if pending:
        recent = (recent + torch.stack(pending).cpu().tolist())[-50:]
    result.seconds = time.perf_counter() - start
    if recent:
        means = np.mean(np.array(recent[-20:]), axis=0).tolist()
        result.final_loss = means[0]
        result.metrics = dict(zip(list(metrics), means[1:], strict=True))
    log(stage, "done: " + _progress_line(result, recent, list(result.metrics), 0.0, start))
    return result


class StageRun(Protocol):
    """The schedule fields every stage's run settings carry (LMRun, Eagle3Run, DFlashRun)."""

    lr: float
    budget_s: float
    max_steps: int
    warmup: int


def train_stage(
    stage: str,
    module: torch.nn.Module,
    step_fn: Callable[[int], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    run: StageRun,
    tokens_per_step: int,
    weight_decay: float = 0.1,
) -> LoopResult:
    """train_loop over all of `module`'s parameters on `run`'s learning rate, budget, step cap
    and warm-up."""
    return train_loop(
        stage,
        list(module.parameters()),
        step_fn,
        lr=run.lr,
        budget_s=run.budget_s,
        max_steps=run.max_steps,
        tokens_per_step=tokens_per_step,
        warmup=run.warmup,
        weight_decay=weight_decay,
    )


def loop_summary(result: LoopResult, eval_start: float, tokens_key: str = "tokens_seen") -> dict:
    """The first fields of a stage's summary row; `eval_start` is when its held-out eval began."""
    return {
        "steps": result.steps,
        tokens_key: result.tokens,
        "train_seconds": round(result.seconds, 1),
        "eval_seconds": round(time.perf_counter() - eval_start, 1),
        "final_train_loss": round(result.final_loss, 4),
    }


def _progress_line(result: LoopResult, recent: list, names: list[str], lr: float, start) -> str:
    means = np.mean(np.array(recent[-20:]), axis=0).tolist() if recent else [float("nan")]
    seconds = time.perf_counter() - start
    extra = " ".join(f"{n}={v:.3f}" for n, v in zip(names, means[1:], strict=False))
    return (
        f"step {result.steps} loss {means[0]:.4f} {extra} lr {lr:.2e} "
        f"{result.tokens / max(seconds, 1e-9) / 1e3:.0f}k tok/s {seconds:.0f}s"
    )


def save_hf(
    out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict, max_shard_mb: float
) -> list[str]:
    """config.json and bf16 safetensors (float tensors cast, others kept): model.safetensors,
    or model-0000i-of-0000n.safetensors plus model.safetensors.index.json above the limit."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    cast = {
        k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach())
        .cpu()
        .contiguous()
        for k, v in tensors.items()
    }
    shards, current, size = [], {}, 0
    for name, tensor in cast.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_mb * 1e6:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / filename), metadata=meta)
        names.append(filename)
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in cast.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def write_card(out_dir: str | Path, title: str, summary: str, rows: dict, notes: str = "") -> None:
    """README.md: what the model is, a table of how it was trained, and an empty
    'Measured acceptance' section for the numbers measured with the runtime later."""
    table = "\n".join(f"| {k} | {v} |" for k, v in rows.items())
    text = (
        f"# {title}\n\n{summary}\n\n## Training\n\n| what | value |\n| --- | --- |\n{table}\n"
        + (f"\n{notes.strip()}\n" if notes else "")
        + "\n## Measured acceptance\n\n_To be filled from `speculant accept-rate` runs._\n"
    )
    (Path(out_dir) / "README.md").write_text(text)


def save_stage(
    out_dir: Path,
    tensors: dict[str, torch.Tensor],
    config: dict,
    max_shard_mb: float,
    *,
    title: str,
    about: str,
    rows: dict,
    summary: dict,
    device: torch.device,
    heldout_rows: dict | None = None,
    tokens_key: str = "tokens_seen",
) -> None:
    """save_hf, then the model card: the stage's own `rows` (layout, corpus, objective, batch),
    then what every stage reports from its `summary` row (steps, tokens, losses, the stage's
    `heldout_rows`, training seconds), the device and the weight files."""
    files = save_hf(out_dir, tensors, config, max_shard_mb)
    training = {
        "steps": summary["steps"],
        tokens_key.replace("_", " "): f"{summary[tokens_key]:,}",
        "final train loss": summary["final_train_loss"],
        "held-out loss": summary["heldout_loss"],
        **(heldout_rows or {}),
        "training seconds": summary["train_seconds"],
        "device": gpu_name(device),
        "files": ", ".join(files),
    }
    write_card(out_dir, title, about, {**rows, **training})


def param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
