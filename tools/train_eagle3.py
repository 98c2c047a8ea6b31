"""Stage 4: an EAGLE-3 head trained against the frozen target with training-time test (TTT).

Conventions are the runtime's (drafter/eagle.py, drafter/eagle_drafter.py). The head's row at
position p reads the target's residual entering layers `aux_ids` at p (fc of their concatenation)
and the embedding of token p+1, and predicts token p+2. Draft step i >= 1 of row p feeds back the
head's own pre-norm output, embeds token p+i+1, sits at RoPE position p+i and attends to the
step-0 keys of rows <= p and to its own earlier steps' keys (positions p+1..p+i): the runtime's
draft chain, which writes step i's KV at position P+i. Step i's loss is the cross-entropy to the
target's next-token distribution at p+i+1 restricted to the draft vocabulary (renormalized),
on rows whose target top-1 is in the draft vocabulary, weighted 0.8^i.
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
from modeling import MLP, Attention, LlamaLM, init_drafter, repeat_kv, rope_tables
from torch import nn


@dataclass
class Eagle3Run:
    draft_vocab: int
    ttt_steps: int
    batch_size: int
    length: int
    lr: float
    budget_s: float
    max_steps: int = 0
    step_decay: float = 0.8
    warmup: int = 50
    seed: int = 1


def default_aux_ids(num_layers: int) -> list[int]:
    """Inputs of layers [2, L//2, L-3] (SGLang's default), or an even spread for toy depths."""
    ids = sorted({min(max(i, 1), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)})
    if len(ids) != 3:
        ids = [max(1, num_layers // 4), max(2, num_layers // 2), num_layers - 1]
    return ids


def draft_vocabulary(train_tokens: np.ndarray, vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent target tokens, sorted by id."""
    counts = np.bincount(train_tokens, minlength=vocab)
    top = np.argsort(-counts, kind="stable")[:size]
    return torch.from_numpy(np.sort(top)).long()


class Midlayer(nn.Module):
    def __init__(self, s, heads, kv_heads):
        super().__init__()
        H = s.hidden
        self.self_attn = Attention(2 * H, H, heads, kv_heads, H // heads)
        self.mlp = MLP(H, s.intermediate)
        self.input_layernorm = nn.RMSNorm(H, eps=s.eps)
        self.hidden_norm = nn.RMSNorm(H, eps=s.eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=s.eps)


class Eagle3Head(nn.Module):
    """Parameter names are the published ones (fc, midlayer.*, norm, lm_head)."""

    def __init__(self, target: LlamaLM, draft_ids: torch.Tensor):
        super().__init__()
        s = target.shape
        self.shape = s
        self.fc = nn.Linear(3 * s.hidden, s.hidden, bias=False)
        self.midlayer = Midlayer(s, s.heads, s.kv_heads)
        self.norm = nn.RMSNorm(s.hidden, eps=s.eps)
        self.lm_head = nn.Linear(s.hidden, len(draft_ids), bias=False)
        init_drafter(self, target)
        with torch.no_grad():  # warm start: the target's own output head over the draft vocabulary
            self.lm_head.weight.copy_(
                target.lm_head.weight[draft_ids.to(target.lm_head.weight.device)]
            )

    def step(self, emb, hidden, cos, sin, keys, values, mask):
        """One draft step over all rows: returns the new pre-norm hidden; appends its K/V."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        q, k, v = attn.qkv(x, cos, sin)
        keys.append(k)
        values.append(v)
        groups = attn.heads // attn.kv_heads
        K, V = repeat_kv(torch.cat(keys, 2), groups), repeat_kv(torch.cat(values, 2), groups)
        if mask is None:
            a = F.scaled_dot_product_attention(q, K, V, is_causal=True)
        else:
            a = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
        h = hidden + attn.out(a)
        return h + layer.mlp(layer.post_attention_layernorm(h))


def ttt_mask(T: int, step: int, device) -> torch.Tensor:
    """[T, T * (step + 1)]: row p sees step-0 keys of rows <= p and its own keys of steps 1..i."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def ttt_loss(head, target, ids, draft_ids, t2d, aux_ids, steps, decay, masks):
    """ids [B, T + steps]. Returns (weighted loss, {acc_i: top-1 agreement with the target})."""
    T = ids.shape[1] - steps
    with torch.no_grad():
        hidden, aux = target(ids[:, :T], capture=tuple(aux_ids))
        tlogits = target.lm_head(hidden).float()
        t_top = tlogits.argmax(-1)  # [B, T]
        in_vocab = t2d[t_top]
        t_probs = torch.softmax(tlogits[..., draft_ids], dim=-1)
        del tlogits
        embeds = target.model.embed_tokens(ids)
    cos, sin = rope_tables(head.shape.head_dim, T + steps, head.shape.rope_theta, ids.device)
    h = head.fc(torch.cat(aux, dim=-1))
    keys, values, total, metrics = [], [], 0.0, {}
    for i in range(steps):
        emb = embeds[:, i + 1 : i + 1 + T]
        h = head.step(emb, h, cos[i : i + T], sin[i : i + T], keys, values, masks[i])
        n = T - 1 - i  # rows whose label (target at p+i+1) lies inside the window
        logits = head.lm_head(head.norm(h[:, :n])).float()
        valid = in_vocab[:, i + 1 : i + 1 + n]
        ce = -(t_probs[:, i + 1 : i + 1 + n] * F.log_softmax(logits, -1)).sum(-1)
        total = total + decay**i * (ce * valid).sum() / valid.sum().clamp(min=1)
        with torch.no_grad():
            hit = draft_ids[logits.argmax(-1)] == t_top[:, i + 1 : i + 1 + n]
            metrics[f"acc{i}"] = hit.float().mean()
    return total, metrics


def train_eagle3(
    run: Eagle3Run,
    target: LlamaLM,
    train: TokenStream,
    heldout: TokenStream,
    train_tokens: np.ndarray,
    aux_ids: list[int],
    device,
):
    """Train a head for the frozen `target`; returns (head, d2t, t2d, summary)."""
    torch.manual_seed(run.seed)
    V = target.shape.vocab_size
    draft_ids = draft_vocabulary(train_tokens, V, run.draft_vocab).to(device)
    t2d = torch.zeros(V, dtype=torch.bool, device=device)
    t2d[draft_ids] = True
    target.eval().requires_grad_(False)
    head = Eagle3Head(target, draft_ids).to(device)
    coverage = float(
        t2d.cpu()[torch.from_numpy(train_tokens[:1_000_000].astype(np.int64))].float().mean()
    )
    log(
        "eagle3",
        f"{param_count(head) / 1e6:.2f}M params, aux layer inputs {aux_ids}, draft vocab "
        f"{run.draft_vocab} covers {coverage:.1%} of train tokens, TTT {run.ttt_steps} steps",
    )
    T = run.length
    masks = [None] + [ttt_mask(T, i, device) for i in range(1, run.ttt_steps)]

    def step(_: int):
        batch = train.batch(run.batch_size, T + run.ttt_steps)
        with autocast(device):
            return ttt_loss(
                head, target, batch, draft_ids, t2d, aux_ids, run.ttt_steps, run.step_decay, masks
            )

    result = train_stage("eagle3", head, step, run, run.batch_size * T, weight_decay=0.0)
    start = time.perf_counter()
    held = evaluate(head, target, heldout, draft_ids, t2d, aux_ids, run, masks, device)
    log("eagle3", "held-out loss {loss:.4f} acc per step {accs}".format(**held))
    summary = {
        **loop_summary(result, start),
        "train_acc_per_step": [round(v, 4) for v in result.metrics.values()],
        "heldout_loss": round(held["loss"], 4),
        "heldout_acc_per_step": held["accs"],
        "draft_vocab_coverage": round(coverage, 4),
        "params": param_count(head),
        "aux_layer_inputs": aux_ids,
        "batch": f"{run.batch_size} x {T} tokens",
        "lr": run.lr,
    }
    d2t = draft_ids.cpu() - torch.arange(run.draft_vocab)
    return head, d2t, t2d.cpu(), summary


@torch.no_grad()
def evaluate(head, target, heldout, draft_ids, t2d, aux_ids, run, masks, device, windows=8):
    T = run.length
    losses, accs = [], []
    for window in heldout.windows(T + run.ttt_steps, windows):
        with autocast(device):
            loss, metrics = ttt_loss(
                head, target, window, draft_ids, t2d, aux_ids, run.ttt_steps, run.step_decay, masks
            )
        losses.append(float(loss))
        accs.append([float(v) for v in metrics.values()])
    mean_accs = np.mean(np.array(accs), axis=0).round(4).tolist() if accs else []
    return {"loss": float(np.mean(losses)) if losses else float("nan"), "accs": mean_accs}


def save_eagle3(
    head,
    d2t,
    t2d,
    target: LlamaLM,
    summary,
    out_dir: Path,
    corpus_card: dict,
    aux_ids: list[int],
    eos_id: int,
    device,
    max_shard_mb: float,
) -> None:
    s = target.shape
    tensors = {k: v for k, v in head.state_dict().items()}
    tensors["embed_tokens.weight"] = target.model.embed_tokens.weight  # published heads ship it
    tensors["d2t"], tensors["t2d"] = d2t.long(), t2d.bool()
    output_ids = [i - 1 for i in aux_ids]  # eagle_config counts layer outputs (SpecForge)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": s.eps,
        "rope_theta": s.rope_theta,
        "max_position_embeddings": s.context,
        "vocab_size": s.vocab_size,
        "draft_vocab_size": int(d2t.numel()),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": output_ids,
            "use_aux_hidden_state": True,
        },
    }
    save_stage(
        out_dir,
        tensors,
        config,
        max_shard_mb,
        title="EAGLE-3 head for the bundled target",
        about="An EAGLE-3 draft head (`LlamaForCausalLMEagle3`, SpecForge / SGLang layout) for "
        "the bundled Python-code Llama in `../target`, trained against the frozen target.",
        rows={
            "layout": f"1 midlayer (q/k/v on 2H = {2 * s.hidden}), "
            f"fc [{s.hidden}, {3 * s.hidden}], draft vocab {d2t.numel()} (d2t offsets, t2d "
            f"mask), {summary['params'] / 1e6:.2f}M params",
            "aux states": f"residual entering target layers {aux_ids} "
            f"(eagle_config ids {output_ids} count layer outputs)",
            "corpus": card_line(corpus_card),
            "objective": "training-time test: {} unrolled steps, own hidden fed back, step "
            "weights 0.8^i, CE to the target's distribution over the draft vocab".format(
                len(summary["train_acc_per_step"])
            ),
            "draft vocab coverage of train tokens": f"{summary['draft_vocab_coverage']:.1%}",
            "batch": summary["batch"],
        },
        summary=summary,
        device=device,
        heldout_rows={"held-out top-1 agreement per step": summary["heldout_acc_per_step"]},
    )
