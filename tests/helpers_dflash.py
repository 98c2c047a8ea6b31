"""Random DFLASH drafters written as the published ones are (z-lab/dflash `DFlashDraftModel`), and
an independent dense reference of the published forward pass for checking our drafter.

Layout: config.json (Qwen3 fields, `architectures: ["DFlashDraftModel"]`, `block_size`,
`num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}`) and bf16
model.safetensors with `fc.weight` [H, n * H], `hidden_norm.weight`, `norm.weight` and
`layers.{i}.` Qwen3 layers (q/k norms); no embeddings and no lm_head (the target's are shared).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from speculant.config import ModelConfig


def write_random_dflash(
    out_dir: str | Path,
    target_dir: str | Path,
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    rope_theta: float = 10000.0,
    drop_keys: Iterable[str] = (),
    config_overrides: dict | None = None,
    ids_at: str = "dflash_config",
    dflash_fields: dict | None = None,
) -> dict[str, torch.Tensor]:
    """Write a random drafter for the target in `target_dir`; return its tensors (bf16).
    `target_layer_ids=None` leaves them out of the config (the published default applies);
    `dflash_fields` adds fields to `dflash_config` (or the top level, with `ids_at`)."""
    target = ModelConfig.from_dir(target_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    H, vocab = target.hidden_size, target.vocab_size
    head_dim, inter = H // num_heads, 2 * H
    n_features = len(target_layer_ids) if target_layer_ids is not None else num_layers
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)

    def norm(n: int = H) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)

    tensors = {"fc.weight": rand(H, n_features * H), "hidden_norm.weight": norm()}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors[f"{p}self_attn.q_proj.weight"] = rand(num_heads * head_dim, H)
        tensors[f"{p}self_attn.k_proj.weight"] = rand(num_kv_heads * head_dim, H)
        tensors[f"{p}self_attn.v_proj.weight"] = rand(num_kv_heads * head_dim, H)
        tensors[f"{p}self_attn.o_proj.weight"] = rand(H, num_heads * head_dim)
        tensors[f"{p}self_attn.q_norm.weight"] = norm(head_dim)
        tensors[f"{p}self_attn.k_norm.weight"] = norm(head_dim)
        tensors[f"{p}mlp.gate_proj.weight"] = rand(inter, H)
        tensors[f"{p}mlp.up_proj.weight"] = rand(inter, H)
        tensors[f"{p}mlp.down_proj.weight"] = rand(H, inter)
        tensors[f"{p}input_layernorm.weight"] = norm()
        tensors[f"{p}post_attention_layernorm.weight"] = norm()
    tensors["norm.weight"] = norm()
    for key in drop_keys:
        del tensors[key]
    extra = {"mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id}
    if target_layer_ids is not None:
        extra["target_layer_ids"] = list(target_layer_ids)
    extra.update(dflash_fields or {})
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "intermediate_size": inter,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "max_position_embeddings": 4096,
        "vocab_size": vocab,
        "attention_bias": False,
        "block_size": block_size,
        "num_target_layers": target.num_layers,
        "torch_dtype": "bfloat16",
    }
    if ids_at == "dflash_config":
        config["dflash_config"] = extra
    else:  # some exports keep the fields at the top level
        config.update(extra)
    config.update(config_overrides or {})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def write_speculators_dflash(
    out_dir: str | Path, drafter_dir: str | Path, target_dir: str | Path, **fields
) -> dict:
    """Rewrite the z-lab drafter in `drafter_dir` as the speculators package's DFlashConverter
    writes it (checked against the real converter in tests/test_formats.py): the Qwen3 layer
    config under `transformer_layer_config`, `block_size` / `mask_token_id` at the top level,
    `aux_hidden_state_layer_ids` = z-lab id + 1, one greedy proposal method of block_size - 1
    tokens; the same tensors. `fields` override top-level fields. Returns the config."""
    src = json.loads((Path(drafter_dir) / "config.json").read_text())
    target = json.loads((Path(target_dir) / "config.json").read_text())
    extra = src.get("dflash_config", {})
    block = src.get("block_size") or extra.get("block_size")
    skip = {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers"}
    layer = {k: v for k, v in src.items() if k not in skip}
    config = {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block - 1}],
            "verifier": {"architectures": target["architectures"], "name_or_path": "target"},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": layer["vocab_size"],
        "block_size": block,
        "aux_hidden_state_layer_ids": [
            i + 1 for i in extra["target_layer_ids"] if i + 1 != target["num_hidden_layers"]
        ],
        "mask_token_id": extra.get("mask_token_id"),
        "target_hidden_size": None,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        **fields,
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(Path(drafter_dir) / "model.safetensors", out_dir / "model.safetensors")
    return config


# ------------------------------------------------------------------ dense reference (float64)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [heads, n, d] rotated at positions [n] (rotate-half convention)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def reference_drafts(
    tensors: dict[str, torch.Tensor],
    config: dict,
    target_hidden_states: list[torch.Tensor],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    tokens: list[int],
    k: int,
) -> list[int]:
    """The published forward for one sequence: context = every position before the newest
    token `tokens[-1]` (HF `hidden_states` of the target over tokens[:-1], [n, H] each), block
    [newest, mask x k] at the next positions, non-causal; returns the k argmax drafts."""
    w = {name: t.double() for name, t in tensors.items()}
    extra = config.get("dflash_config", {})
    ids, mask_id = extra["target_layer_ids"], extra["mask_token_id"]
    heads, kv_heads, d = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    n = len(tokens) - 1
    features = torch.cat([target_hidden_states[i + 1].double() for i in ids], -1)
    context = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    block = torch.tensor([tokens[-1]] + [mask_id] * k)
    h = embed.double()[block]
    ctx_pos, blk_pos = torch.arange(n), torch.arange(n, n + k + 1)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        x = _rms(h, w[f"{p}input_layernorm.weight"], eps)
        q = (x @ w[f"{p}self_attn.q_proj.weight"].T).view(-1, heads, d).transpose(0, 1)
        q = _rope(_rms(q, w[f"{p}self_attn.q_norm.weight"], eps), blk_pos, theta)
        both = torch.cat([context, x])
        keys = (both @ w[f"{p}self_attn.k_proj.weight"].T).view(-1, kv_heads, d).transpose(0, 1)
        keys = _rms(keys, w[f"{p}self_attn.k_norm.weight"], eps)
        keys = _rope(keys, torch.cat([ctx_pos, blk_pos]), theta)
        values = (both @ w[f"{p}self_attn.v_proj.weight"].T).view(-1, kv_heads, d).transpose(0, 1)
        keys = keys.repeat_interleave(heads // kv_heads, 0)
        values = values.repeat_interleave(heads // kv_heads, 0)
        out = F.scaled_dot_product_attention(q, keys, values)  # non-causal: no mask
        h = h + out.transpose(0, 1).reshape(-1, heads * d) @ w[f"{p}self_attn.o_proj.weight"].T
        x = _rms(h, w[f"{p}post_attention_layernorm.weight"], eps)
        gate, up = x @ w[f"{p}mlp.gate_proj.weight"].T, x @ w[f"{p}mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ w[f"{p}mlp.down_proj.weight"].T
    logits = _rms(h, w["norm.weight"], eps) @ lm_head.double().T
    return logits[1:].argmax(-1).tolist()
