"""A tiny random-weight Llama checkpoint (HF layout) so the CLI runs with nothing downloaded.

Its weights are random, so what it generates is gibberish; it exists to exercise the
whole path (config, safetensors, tokenizer, engine) on any machine.
"""

from __future__ import annotations

import bisect
import colorsys
import fnmatch
import heapq
import inspect
import json
import os
import shutil
import tempfile
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_VOCAB_SIZE = 512
# Small, stable stdlib modules: enough Python source to learn ~250 BPE merges.
_CORPUS_MODULES = (heapq, bisect, textwrap, fnmatch, colorsys)
_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE tokenizer on stdlib source; the same input gives the same merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([inspect.getsource(m) for m in _CORPUS_MODULES], trainer)
    return tokenizer


def demo_config(vocab_size: int, eos_token_id: int) -> dict:
    """HF LlamaForCausalLM config of the demo model (2 layers, hidden 64, GQA 4:2)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
    }


def demo_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under HF Llama key names, reproducible from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]

    def randn(*shape: int) -> torch.Tensor:
        # std 0.1 keeps the logits of a 64-wide model from being flat.
        return torch.randn(*shape, generator=gen) * 0.1

    weights = {"model.embed_tokens.weight": randn(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = randn(q_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = randn(kv_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = randn(kv_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = randn(hidden, q_dim)
        weights[p + "mlp.gate_proj.weight"] = randn(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = randn(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = randn(hidden, inter)
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = randn(vocab, hidden)
    return weights


def default_demo_dir() -> Path:
    """`$XDG_CACHE_HOME/speculant/demo-model`, or `~/.cache/speculant/demo-model`."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "speculant" / "demo-model"


def write_demo_model(out_dir: str | os.PathLike) -> Path:
    """Write config.json, model.safetensors and tokenizer.json into `out_dir` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = demo_config(tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS_TOKEN))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(demo_weights(config), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_demo_model(out_dir: str | os.PathLike | None = None) -> Path:
    """Return the demo checkpoint directory, building it first if it is not complete.

    Builds in a temporary sibling directory and renames it into place, so a run that is
    interrupted, or two runs at once, never leave a half-written checkpoint behind.
    """
    out = Path(out_dir) if out_dir is not None else default_demo_dir()
    if all((out / name).is_file() for name in _FILES):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        write_demo_model(staging)
        for path in (staging, *staging.iterdir()):  # mkdtemp and save_file make them private
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():  # incomplete leftover from an older run
            shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    except OSError:
        if not all((out / name).is_file() for name in _FILES):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
