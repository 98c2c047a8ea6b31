"""Tiny random Hugging Face checkpoints for tests, written with `transformers`.

Every builder seeds torch first, so the same call writes the same weights. Sizes: hidden 64,
4 query heads and 2 KV heads of dim 16, intermediate 128, vocab 256 (the llama with a
tokenizer uses the tokenizer's vocab size). `initializer_range=0.2` keeps logits from being
flat, so greedy decoding is not decided by rounding noise.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    dtype="float32",
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def save_tokenizer(out_dir: Path) -> Path:
    """Write the demo model's byte-level BPE tokenizer.json (vocab 512, eos `<|endoftext|>`)."""
    from speculant.launch.demo import build_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out_dir / "tokenizer.json"))
    return out_dir


def save_hf_model(
    out_dir: Path,
    arch: str,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    tokenizer_dir: Path | None = None,
    legacy_config: bool = False,
    **overrides,
) -> Path:
    """Save a random `arch` ("llama", "qwen2", "qwen3") model to `out_dir` as safetensors.

    `tokenizer_dir` copies its tokenizer.json in and sets vocab and eos to match it;
    `legacy_config` rewrites config.json in the transformers-4 style of published
    checkpoints (`rope_theta`, `rope_scaling`, `torch_dtype`).
    """
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    kwargs = {**TINY, **copy.deepcopy(overrides)}  # transformers writes into dicts it is given
    if tokenizer_dir is not None:
        from tokenizers import Tokenizer

        from speculant.launch.demo import EOS_TOKEN

        tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        eos = tokenizer.token_to_id(EOS_TOKEN)
        kwargs.update(vocab_size=tokenizer.get_vocab_size(), bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    if tokenizer_dir is not None:
        shutil.copy(tokenizer_dir / "tokenizer.json", out_dir / "tokenizer.json")
    if legacy_config:
        _rewrite_legacy_config(out_dir / "config.json")
    return out_dir


def _rewrite_legacy_config(path: Path) -> None:
    config = json.loads(path.read_text())
    rope = dict(config.pop("rope_parameters", None) or {})
    if "rope_theta" in rope:
        config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    path.write_text(json.dumps(config, indent=2) + "\n")


def build_llama(out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
    """Llama-3.1 style: llama3 RoPE scaling, legacy config keys, tokenizer.json when given."""
    return save_hf_model(
        out_dir, "llama", rope_scaling=LLAMA3_ROPE, tokenizer_dir=tokenizer_dir, legacy_config=True
    )


def build_qwen2(out_dir: Path) -> Path:
    """Qwen2: biases on q/k/v projections."""
    return save_hf_model(out_dir, "qwen2", seed=1)


def build_qwen3(out_dir: Path) -> Path:
    """Qwen3: per-head q/k RMSNorm, 3 layers."""
    return save_hf_model(out_dir, "qwen3", seed=2, num_hidden_layers=3)


def build_llama_tied(out_dir: Path) -> Path:
    """Llama whose lm_head shares the embedding (no lm_head.weight in the file)."""
    return save_hf_model(out_dir, "llama", seed=3, tie_word_embeddings=True)


def build_llama_sharded(out_dir: Path) -> Path:
    """Llama split over several safetensors shards with a model.safetensors.index.json."""
    return save_hf_model(out_dir, "llama", seed=4, max_shard_size="100KB")
