"""Random EAGLE-3 heads written exactly as published heads are (SpecForge / SGLang layout).

Names: `midlayer.*` (one layer) or `midlayer.{i}.*` / `layers.{i}.*` (several), `fc.weight`
[H, 3*H_target], `norm.weight`, `lm_head.weight` [draft_vocab, H], `embed_tokens.weight`, and,
when the draft vocabulary is given, `d2t` (int64 offsets: target = draft + d2t[draft]) and `t2d`
(bool over the target vocabulary). Weights are bfloat16 like the published files; config.json is
`LlamaForCausalLMEagle3` with `draft_vocab_size` and the aux layer ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from speculant.config import ModelConfig


def _target_config(target_dir_or_cfg: str | Path | ModelConfig) -> ModelConfig:
    if isinstance(target_dir_or_cfg, ModelConfig):
        return target_dir_or_cfg
    return ModelConfig.from_dir(target_dir_or_cfg)


def tiny_target_config(num_layers: int = 32, hidden: int = 64, vocab: int = 256) -> ModelConfig:
    """A target's config without a checkpoint (for config-only tests)."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=hidden // 4,
        intermediate_size=2 * hidden,
        vocab_size=vocab,
    )


def write_random_eagle3(
    out_dir: str | Path,
    target_dir_or_cfg: str | Path | ModelConfig,
    draft_vocab: int | None = None,
    num_layers: int = 1,
    aux_ids: list[int] | None = None,
    fmt: str = "safetensors",
    seed: int = 0,
    *,
    aux_ids_at: str = "eagle_config",
    layer_keys: str = "midlayer",
    num_heads: int = 4,
    num_kv_heads: int = 1,
    intermediate_size: int | None = None,
    drop_keys: Iterable[str] = (),
    config_overrides: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
    hidden: int | None = None,
) -> dict[str, torch.Tensor]:
    """Write config.json and the weights of a random head for the target; return the tensors.

    `draft_vocab=None` writes neither `draft_vocab_size` nor d2t / t2d (full vocabulary);
    `aux_ids` go under `eagle_config` (SpecForge, output-of-layer ids) or at the top level
    (`aux_ids_at="top"`, vLLM's input-of-layer ids); `layer_keys` picks `midlayer` or `layers`
    naming for several layers; `drop_keys` leaves tensors out (to test errors). `hidden` gives
    the head its own hidden size (default: the target's); then config.json also holds
    `target_hidden_size` and `embed_tokens.weight` is [vocab, hidden] (used, as in SGLang).
    `config_overrides` with `norm_before_fc` / `fc_norm` also writes their EAGLE-3.1 norms.
    """
    target = _target_config(target_dir_or_cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target_hidden, vocab = target.hidden_size, target.vocab_size
    own_hidden = hidden is not None
    hidden = hidden if own_hidden else target_hidden
    head_dim = hidden // num_heads
    inter = intermediate_size or 2 * hidden
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float | None = None) -> torch.Tensor:
        std = scale if scale is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm_weight() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)

    tensors: dict[str, torch.Tensor] = {"fc.weight": rand(hidden, 3 * target_hidden)}
    for i in range(num_layers):
        p = "midlayer." if num_layers == 1 and layer_keys == "midlayer" else f"{layer_keys}.{i}."
        width = 2 * hidden if i == 0 else hidden
        tensors[f"{p}self_attn.q_proj.weight"] = rand(num_heads * head_dim, width)
        tensors[f"{p}self_attn.k_proj.weight"] = rand(num_kv_heads * head_dim, width)
        tensors[f"{p}self_attn.v_proj.weight"] = rand(num_kv_heads * head_dim, width)
        tensors[f"{p}self_attn.o_proj.weight"] = rand(hidden, num_heads * head_dim)
        tensors[f"{p}mlp.gate_proj.weight"] = rand(inter, hidden)
        tensors[f"{p}mlp.up_proj.weight"] = rand(inter, hidden)
        tensors[f"{p}mlp.down_proj.weight"] = rand(hidden, inter)
        tensors[f"{p}input_layernorm.weight"] = norm_weight()
        if i == 0:
            tensors[f"{p}hidden_norm.weight"] = norm_weight()
        tensors[f"{p}post_attention_layernorm.weight"] = norm_weight()
    tensors["norm.weight"] = norm_weight()
    tensors["lm_head.weight"] = rand(draft_vocab or vocab, hidden, scale=0.5)
    # Saved by every head; used only when the head's hidden differs from the target's.
    tensors["embed_tokens.weight"] = rand(vocab, hidden, scale=1.0)
    if draft_vocab is not None:
        if draft_vocab == vocab:
            target_ids = torch.arange(vocab)
        else:
            target_ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        tensors["d2t"] = target_ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[target_ids] = True
        tensors["t2d"] = t2d
    overrides = config_overrides or {}
    if overrides.get("norm_before_fc"):  # EAGLE-3.1: one norm over the aux concatenation
        norm = 1.0 + 0.1 * torch.randn(3 * target_hidden, generator=gen)
        tensors["input_norm.weight"] = norm.to(dtype)
    if overrides.get("fc_norm"):  # EAGLE-3.1: one norm per aux state
        for j in range(3):
            norm = 1.0 + 0.1 * torch.randn(target_hidden, generator=gen)
            tensors[f"fc_norm.{j}.weight"] = norm.to(dtype)
    for key in drop_keys:
        del tensors[key]

    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": target.rope_theta,
        "rope_scaling": target.rope_scaling,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if own_hidden:
        config["target_hidden_size"] = target_hidden
    if draft_vocab is not None:
        config["draft_vocab_size"] = draft_vocab
    if aux_ids is not None and aux_ids_at == "top":
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    elif aux_ids is not None:
        ids = list(aux_ids)
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": ids,
            "use_aux_hidden_state": True,
        }
    config.update(config_overrides or {})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    elif fmt == "bin":
        torch.save(tensors, out_dir / "pytorch_model.bin")
    else:
        raise ValueError(f"fmt must be 'safetensors' or 'bin', not {fmt!r}")
    return tensors


def write_speculators_eagle3(
    out_dir: str | Path,
    head_dir: str | Path,
    target_dir: str | Path,
    aux_ids: list[int] | None = None,
    speculative_tokens: int = 3,
    layer_type: str = "llama",
    **fields,
) -> dict:
    """Rewrite the LlamaForCausalLMEagle3 head in `head_dir` as the speculators package's
    Eagle3Converter writes it (checked against the real converter in tests/test_formats.py):
    `layers.0.*` for `midlayer.*`, the Llama layer config under `transformer_layer_config`
    (vocab_size = the target's), `speculators_config` with one greedy proposal method of
    `speculative_tokens`, top-level `eagle_aux_hidden_state_layer_ids` (input-of-layer ids) and
    the EAGLE-3.1 flags; `fields` override top-level fields. Every tensor is kept (a head
    trained by speculators ships its EAGLE-3.1 norms; the converter's legacy model drops them).
    `layer_type="qwen3"` writes Qwen3 layers (speculators trains those too) with random q/k
    norms added. Returns the config."""
    from safetensors.torch import load_file, save_file

    src = json.loads((Path(head_dir) / "config.json").read_text())
    target = json.loads((Path(target_dir) / "config.json").read_text())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        k.replace("midlayer.", "layers.0."): t
        for k, t in load_file(str(Path(head_dir) / "model.safetensors")).items()
    }
    layer_keys = (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
        "rms_norm_eps", "rope_theta", "rope_scaling", "attention_bias",
    )  # fmt: skip
    layer = {k: src[k] for k in layer_keys if k in src}
    layer.update(model_type=layer_type, vocab_size=target["vocab_size"], tie_word_embeddings=False)
    if layer_type == "qwen3":
        gen = torch.Generator().manual_seed(11)
        for i in range(src["num_hidden_layers"]):
            for x in "qk":
                norm = 1.0 + 0.2 * torch.randn(src["head_dim"], generator=gen)
                tensors[f"layers.{i}.self_attn.{x}_norm.weight"] = norm.to(torch.bfloat16)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": speculative_tokens}
            ],
            "verifier": {"architectures": target["architectures"], "name_or_path": "target"},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": src.get("draft_vocab_size", target["vocab_size"]),
        "target_hidden_size": src.get("target_hidden_size"),
        "eagle_aux_hidden_state_layer_ids": aux_ids,
        "norm_before_residual": bool(src.get("norm_before_residual", False)),
        "norm_before_fc": bool(src.get("norm_before_fc", False)),
        "fc_norm": bool(src.get("fc_norm", False)),
        "norm_output": bool(src.get("norm_output", False)),
        "embed_requires_grad": False,
        **fields,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return config
