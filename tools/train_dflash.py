"""Stage 5: a DFLASH block drafter trained against the frozen target, as published (z-lab/dflash
`dflash/model.py`, Qwen3-style layers with q/k norms; no embedding or LM head of its own).

Context features = hidden_norm(fc(cat(outputs of target layers `target_layer_ids`))), i.e.
the residual entering layers id+1. Training picks random anchors a >= 1; each anchor's block is
[token a, MASK x (B-1)] at positions a..a+B-1, embedded with the target's embed_tokens. In every
layer the block's queries (q_norm(q_proj(input_layernorm(h)))) attend, non-causally, to the
context K/V of positions < a (k_norm(k_proj(ctx)), v_proj(ctx)) and to the whole block's own K/V;
RoPE at the real positions. norm -> the target's lm_head gives block positions 1..B-1, trained
by cross-entropy to the target's distribution for those tokens, weighted exp(-(i-1)/gamma).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from common import TokenStream, autocast, log, loop_summary, param_count, save_stage, train_stage
from corpus import card_line
from modeling import MLP, LlamaLM, apply_rope, init_drafter, repeat_kv
from torch import nn


@dataclass
class DFlashRun:
    layers: int
    block: int
    anchors: int  # anchors per sequence
    batch_size: int
    length: int
    lr: float
    budget_s: float
    gamma: float = 4.0
    max_steps: int = 0
    warmup: int = 50
    seed: int = 2


def build_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """z-lab's default spread (ids count layer outputs): the middle layer for one id, else
    round(1 + i * (L - 4) / (n - 1))."""
    if num_ids == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_ids - 1)) for i in range(num_ids)]


class DFlashAttention(nn.Module):
    def __init__(self, H: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(H, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(H, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(H, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, H, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=eps)

    def _heads(self, x, n):
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)

    def forward(self, x, ctx, rope_blk, rope_ctx, mask):
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.heads)), *rope_blk)
        k_blk = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.kv_heads)), *rope_blk)
        k_ctx = apply_rope(self.k_norm(self._heads(self.k_proj(ctx), self.kv_heads)), *rope_ctx)
        v = torch.cat(
            [
                self._heads(self.v_proj(ctx), self.kv_heads),
                self._heads(self.v_proj(x), self.kv_heads),
            ],
            dim=2,
        )
        groups = self.heads // self.kv_heads
        k = repeat_kv(torch.cat([k_ctx, k_blk], dim=2), groups)
        a = F.scaled_dot_product_attention(q, k, repeat_kv(v, groups), attn_mask=mask)
        return self.o_proj(a.transpose(1, 2).flatten(2))


class DFlashLayer(nn.Module):
    def __init__(self, H, heads, kv_heads, head_dim, intermediate, eps):
        super().__init__()
        self.self_attn = DFlashAttention(H, heads, kv_heads, head_dim, eps)
        self.mlp = MLP(H, intermediate)
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)

    def forward(self, h, ctx, rope_blk, rope_ctx, mask):
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope_blk, rope_ctx, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """Parameter names are the published ones (fc, hidden_norm, norm, layers.i.*)."""

    def __init__(self, target: LlamaLM, layers: int, layer_ids: list[int]):
        super().__init__()
        s = target.shape
        self.shape, self.layer_ids = s, list(layer_ids)
        args = (s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.eps)
        self.layers = nn.ModuleList(DFlashLayer(*args) for _ in range(layers))
        self.norm = nn.RMSNorm(s.hidden, eps=s.eps)
        self.fc = nn.Linear(len(layer_ids) * s.hidden, s.hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(s.hidden, eps=s.eps)
        init_drafter(self, target)

    def forward(self, block_emb, ctx_states, rope_blk, rope_ctx, mask):
        ctx = self.hidden_norm(self.fc(torch.cat(ctx_states, dim=-1)))
        h = block_emb
        for layer in self.layers:
            h = layer(h, ctx, rope_blk, rope_ctx, mask)
        return self.norm(h)


def sample_anchors(batch: int, length: int, block: int, count: int, gen, device) -> torch.Tensor:
    """[batch, count] distinct sorted anchors in [1, length - block]."""
    span = length - block
    count = min(count, span)
    scores = torch.rand(batch, span, device=device, generator=gen)
    return (scores.topk(count, dim=1).indices + 1).sort(dim=1).values


def dflash_loss(model: DFlashDrafter, target: LlamaLM, ids, anchors, mask_id, block, gamma):
    """ids [B, T], anchors [B, N]. Returns (loss, metrics: per-position top-1 agreement with the
    target and `tau`, the mean accepted length 1 + sum of leading agreements)."""
    B, T = ids.shape
    N = anchors.shape[1]
    device = ids.device
    with torch.no_grad():
        hidden, aux = target(ids, capture=tuple(i + 1 for i in model.layer_ids))
        offsets = torch.arange(block, device=device)
        pos = (anchors[:, :, None] + offsets).reshape(B, N * block)  # block positions
        tokens = torch.full_like(pos, mask_id)
        tokens.view(B, N, block)[:, :, 0] = ids.gather(1, anchors)
        block_emb = target.model.embed_tokens(tokens)
        # labels: block position i (token a+i) is predicted by the target at a+i-1
        label_pos = (anchors[:, :, None] + offsets[1:] - 1).reshape(B, -1)
        t_hidden = hidden.gather(1, label_pos[..., None].expand(-1, -1, hidden.shape[-1]))
        t_logits = target.lm_head(t_hidden).float()
        t_probs, t_top = torch.softmax(t_logits, -1), t_logits.argmax(-1)
        key_pos = torch.arange(T, device=device)
        ctx_visible = (key_pos < anchors[:, :, None]).repeat_interleave(block, dim=1)
        same_block = torch.eye(N, dtype=torch.bool, device=device).repeat_interleave(block, 0)
        blk_visible = same_block.repeat_interleave(block, 1).expand(B, -1, -1)
        mask = torch.cat([ctx_visible, blk_visible], dim=-1)[:, None]  # [B, 1, NB, T + NB]
    cos, sin = target.rope(device)
    rope_blk = (cos[pos][:, None], sin[pos][:, None])
    rope_ctx = (cos[:T], sin[:T])
    out = model(block_emb, aux, rope_blk, rope_ctx, mask)
    out = out.view(B, N, block, -1)[:, :, 1:].reshape(B, N * (block - 1), -1)
    logits = target.lm_head(out).float()
    ce = -(t_probs * F.log_softmax(logits, -1)).sum(-1).view(B, N, block - 1)
    weights = torch.exp(-torch.arange(block - 1, device=device) / gamma)
    loss = (ce * weights).sum(-1).mean() / weights.sum()
    with torch.no_grad():
        hit = (logits.argmax(-1) == t_top).view(B, N, block - 1).float()
        metrics = {f"acc{i + 1}": hit[..., i].mean() for i in range(block - 1)}
        metrics["tau"] = 1 + hit.cumprod(-1).sum(-1).mean()
    return loss, metrics


def train_dflash(
    run: DFlashRun,
    target: LlamaLM,
    train: TokenStream,
    heldout: TokenStream,
    layer_ids: list[int],
    mask_id: int,
    device,
):
    torch.manual_seed(run.seed)
    target.eval().requires_grad_(False)
    model = DFlashDrafter(target, run.layers, layer_ids).to(device)
    gen = torch.Generator(device=device).manual_seed(run.seed)
    log(
        "dflash",
        f"{param_count(model) / 1e6:.2f}M params, {run.layers} layers, block {run.block}, "
        f"context from target layer outputs {layer_ids}, {run.anchors} anchors/sequence",
    )

    def step(_: int):
        ids = train.batch(run.batch_size, run.length)
        anchors = sample_anchors(run.batch_size, run.length, run.block, run.anchors, gen, device)
        with autocast(device):
            return dflash_loss(model, target, ids, anchors, mask_id, run.block, run.gamma)

    tokens_per_step = run.batch_size * run.anchors * run.block
    result = train_stage("dflash", model, step, run, tokens_per_step, weight_decay=0.0)
    start = time.perf_counter()
    held = evaluate(model, target, heldout, mask_id, run, device)
    log("dflash", "held-out loss {loss:.4f} tau {tau:.3f} acc per position {accs}".format(**held))
    summary = {
        **loop_summary(result, start, tokens_key="block_tokens_seen"),
        "train_tau": round(result.metrics.get("tau", float("nan")), 4),
        "heldout_loss": round(held["loss"], 4),
        "heldout_tau": round(held["tau"], 4),
        "heldout_acc_per_position": held["accs"],
        "params": param_count(model),
        "target_layer_ids": layer_ids,
        "batch": f"{run.batch_size} x {run.length} tokens, {run.anchors} anchors each",
        "lr": run.lr,
        "gamma": run.gamma,
    }
    return model, summary


@torch.no_grad()
def evaluate(model, target, heldout, mask_id, run, device, windows=8):
    gen = torch.Generator(device=device).manual_seed(1234)
    losses, taus, accs = [], [], []
    for window in heldout.windows(run.length, windows):
        anchors = sample_anchors(1, run.length, run.block, run.anchors, gen, device)
        with autocast(device):
            loss, metrics = dflash_loss(
                model, target, window, anchors, mask_id, run.block, run.gamma
            )
        losses.append(float(loss))
        taus.append(float(metrics.pop("tau")))
        accs.append([float(v) for v in metrics.values()])
    nan = float("nan")
    return {
        "loss": float(np.mean(losses)) if losses else nan,
        "tau": float(np.mean(taus)) if taus else nan,
        "accs": np.mean(np.array(accs), axis=0).round(4).tolist() if accs else [],
    }


def save_dflash(
    model: DFlashDrafter,
    target: LlamaLM,
    summary,
    out_dir: Path,
    corpus_card: dict,
    run: DFlashRun,
    mask_id: int,
    device,
    max_shard_mb: float,
) -> None:
    s = target.shape
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": s.hidden,
        "num_hidden_layers": run.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "intermediate_size": s.intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": s.eps,
        "rope_theta": s.rope_theta,
        "vocab_size": s.vocab_size,
        "max_position_embeddings": s.context,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * run.layers,
        "block_size": run.block,
        "num_target_layers": s.layers,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": model.layer_ids},
        "torch_dtype": "bfloat16",
    }
    save_stage(
        out_dir,
        dict(model.state_dict()),
        config,
        max_shard_mb,
        title="DFLASH drafter for the bundled target",
        about="A DFLASH block drafter (`DFlashDraftModel`, z-lab/dflash layout) for the bundled "
        "Python-code Llama in `../target`; it has no embedding or LM head of its own and uses "
        "the target's.",
        rows={
            "layout": f"{run.layers} Qwen3-style layers (q/k norms), block {run.block}, "
            f"fc [{s.hidden}, {len(model.layer_ids) * s.hidden}], mask token id {mask_id}, "
            f"{summary['params'] / 1e6:.2f}M params",
            "context features": f"outputs of target layers {model.layer_ids} (the residual "
            f"entering layers {[i + 1 for i in model.layer_ids]})",
            "corpus": card_line(corpus_card),
            "objective": f"random anchors, block [anchor, MASK x {run.block - 1}] attending "
            f"non-causally to itself and to context before the anchor; CE to the target's "
            f"distribution, weights exp(-(i-1)/{run.gamma:g})",
            "batch": summary["batch"],
        },
        summary=summary,
        device=device,
        heldout_rows={
            "held-out top-1 agreement per block position": summary["heldout_acc_per_position"],
            "held-out accepted length (teacher-forced estimate)": summary["heldout_tau"],
        },
        tokens_key="block_tokens_seen",
    )
