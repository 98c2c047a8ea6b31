"""DFlash2 drafters (z-lab/dflash `DFlash2DraftModel`) for tests: written by the reference package's
own class (`write_reference_dflash2`: random init, `save_pretrained`), or without that package
in the same layout (`write_random_dflash2`: helpers_dflash's DFLASH drafter plus the selector and
the convolutions; tests/test_dflash2.py checks the two layouts agree).

Layout: the DFLASH one (see helpers_dflash.py) with `architectures: ["DFlash2DraftModel"]`,
`selector_rank`, `selector_top_k`, `conv_kernel_size`, `conv_group_size` in `dflash_config`, and
per layer `layers.{i}.{attention_conv,mlp_conv}.base_kernel` [2, K, H] and
`.kernel_projection.weight` [2 K H / g, H]; `candidate_selector.{predecessor,successor}_codebook
.weight` [V, r] and `candidate_selector.hidden_projection.weight` [r, H].

Weights: the convolutions start near the identity (base tap 0 of each kernel ~1, the rest and the
dynamic taps small), so a DFlash2 drafter made from a trained DFLASH drafter drafts nearly what
that one drafts, and accepts often enough for verify steps to differ."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from helpers_dflash import write_random_dflash
from safetensors.torch import load_file, save_file

from speculant.config import ModelConfig

SIZES = {"selector_rank": 8, "selector_top_k": 8, "conv_kernel_size": 3, "conv_group_size": 16}


def _extra_tensors(H: int, vocab: int, num_layers: int, sizes: dict, gen) -> dict:
    K, g, r = sizes["conv_kernel_size"], sizes["conv_group_size"], sizes["selector_rank"]
    out = {}
    for i in range(num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = 0.1 * torch.randn(2, K, H, generator=gen)
            base[:, :1] += 1.0
            out[f"layers.{i}.{conv}.base_kernel"] = base
            proj = 0.05 * torch.randn(2 * K * (H // g), H, generator=gen) * H**-0.5
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = proj
    for name in ("predecessor_codebook", "successor_codebook"):
        out[f"candidate_selector.{name}.weight"] = torch.randn(vocab, r, generator=gen)
    out["candidate_selector.hidden_projection.weight"] = torch.randn(r, H, generator=gen) * H**-0.5
    return out


def write_random_dflash2(
    out_dir: str | Path,
    target_dir: str | Path,
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids: list[int] | None = (0, 1),
    seed: int = 0,
    sizes: dict | None = None,
    config_overrides: dict | None = None,
    drop_keys: tuple[str, ...] = (),
    bare_codebooks: bool = False,
    from_dflash: str | Path | None = None,
) -> dict[str, torch.Tensor]:
    """A random DFlash2 drafter in the reference's layout, without the `dflash` package. `sizes`
    override SIZES in dflash_config (a None value leaves the field out); `bare_codebooks` stores
    the codebooks without `.weight`, as published checkpoints do; `from_dflash`: a trained DFLASH
    drafter's folder whose config and weights it starts from (small codebooks, so the selector
    mostly keeps that drafter's argmax and drafts are often accepted)."""
    sizes = {**SIZES, **(sizes or {})}
    ids = list(target_layer_ids) if target_layer_ids is not None else None
    out_dir = Path(out_dir)
    if from_dflash is None:
        tensors = write_random_dflash(out_dir, target_dir, num_layers, block_size, ids, seed=seed)
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(from_dflash) / "config.json", out_dir / "config.json")
        tensors = load_file(Path(from_dflash) / "model.safetensors")
        num_layers = json.loads((out_dir / "config.json").read_text())["num_hidden_layers"]
    target = ModelConfig.from_dir(target_dir)
    gen = torch.Generator().manual_seed(seed + 1000)
    full = {k: SIZES[k] if v is None else v for k, v in sizes.items()}
    extra = _extra_tensors(target.hidden_size, target.vocab_size, num_layers, full, gen)
    if from_dflash is not None:
        for name in ("predecessor_codebook", "successor_codebook"):
            extra[f"candidate_selector.{name}.weight"] *= 0.3
    tensors.update({k: v.to(torch.bfloat16) for k, v in extra.items()})
    for key in drop_keys:
        del tensors[key]
    if bare_codebooks:
        for name in ("predecessor_codebook", "successor_codebook"):
            key = f"candidate_selector.{name}"
            tensors[key] = tensors.pop(f"{key}.weight")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"].update({k: v for k, v in sizes.items() if v is not None})
    config.update(config_overrides or {})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tensors


def write_reference_dflash2(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids: list[int] = (0, 1),
    mask_token_id: int | None = None,
    seed: int = 0,
    sizes: dict | None = None,
    from_dflash: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """The reference package's `DFlash2DraftModel`, random weights (or a trained DFLASH drafter's
    in `from_dflash`, its config too, with the selector and convolutions added), written with its
    `save_pretrained`."""
    from dflash.model import DFlash2DraftModel
    from transformers import AutoConfig, Qwen3Config

    target = ModelConfig.from_dir(target_dir)
    sizes = {**SIZES, **(sizes or {})}
    if from_dflash is not None:
        config = AutoConfig.from_pretrained(from_dflash)
        config.dflash_config = {**config.dflash_config, **sizes}
    else:
        H = target.hidden_size
        config = Qwen3Config(
            hidden_size=H,
            intermediate_size=2 * H,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=H // 4,
            vocab_size=target.vocab_size,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            num_target_layers=target.num_layers,
            block_size=block_size,
            dflash_config={
                "mask_token_id": target.vocab_size - 1 if mask_token_id is None else mask_token_id,
                "target_layer_ids": list(target_layer_ids),
                **sizes,
            },
        )
    config.architectures = ["DFlash2DraftModel"]
    model = DFlash2DraftModel(config).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    extra = _extra_tensors(
        config.hidden_size, config.vocab_size, config.num_hidden_layers, sizes, gen
    )
    trained = {}
    if from_dflash is not None:
        trained = {
            k.removeprefix("model."): v
            for k, v in load_file(Path(from_dflash) / "model.safetensors").items()
        }
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in extra:
                value = extra[name]
            elif name in trained:
                value = trained[name]
            elif "norm" in name:
                value = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
            else:
                value = torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5
            param.copy_(value.to(param.dtype))
    model.save_pretrained(out_dir)
    return Path(out_dir)
