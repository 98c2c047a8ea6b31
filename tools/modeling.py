"""A training-time Llama whose parameter names are the Hugging Face ones
(`model.embed_tokens.weight`, `model.layers.i.self_attn.q_proj.weight`, ..., `lm_head.weight`),
so its state dict is the checkpoint. Numerics follow speculant's runtime (models/layers.py):
neox RoPE (rotate_half) with inv_freq = theta^(-2i/d), RMSNorm, SiLU-gated MLP, GQA.
Sequences are [batch, time]; attention is causal SDPA (flash on the GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaShape:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def hf_config(self, eos_id: int) -> dict:
        """config.json of a LlamaForCausalLM of this shape (read by models/loader.py and by
        transformers)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.context,
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "initializer_range": 0.02,
            "bos_token_id": eos_id,
            "eos_token_id": eos_id,
            "pad_token_id": eos_id,
            "use_cache": True,
            "torch_dtype": "bfloat16",
        }


def rope_tables(head_dim: int, max_positions: int, theta: float, device) -> tuple:
    """float32 (cos, sin) [max_positions, head_dim], both halves sharing frequencies."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d]; cos/sin broadcastable to [B, 1, T, d] (row per position)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kv_heads, T, d] -> [B, kv_heads * groups, T, d] (head i uses KV head i // groups)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """q/k/v/o projections; `in_features` is 2H for the EAGLE-3 midlayer."""

    def __init__(self, in_features: int, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def qkv(self, x: torch.Tensor, cos, sin):
        """Rotated q [B, h, T, d] and k, v [B, kv, T, d] of x [B, T, in]."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))

    def forward(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        groups = self.heads // self.kv_heads
        a = F.scaled_dot_product_attention(
            q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True
        )
        return self.out(a)


class DecoderLayer(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.self_attn = Attention(s.hidden, s.hidden, s.heads, s.kv_heads, s.head_dim)
        self.mlp = MLP(s.hidden, s.intermediate)
        self.input_layernorm = nn.RMSNorm(s.hidden, eps=s.eps)
        self.post_attention_layernorm = nn.RMSNorm(s.hidden, eps=s.eps)

    def forward(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden, eps=s.eps)


class LlamaLM(nn.Module):
    """`forward(ids, capture)` returns the final-norm hidden [B, T, H] and the residual stream
    entering each layer in `capture` (id L = the last layer's output, before the final norm),
    the runtime's `aux_layer_ids` convention (models/llama.py CausalLM)."""

    def __init__(self, s: LlamaShape):
        super().__init__()
        self.shape = s
        self.model = LlamaModel(s)
        self.lm_head = nn.Linear(s.hidden, s.vocab_size, bias=False)
        self.rope_len = s.context + 64  # drafters run a few positions past the window
        self._rope: dict = {}
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        std, depth = 0.02, (2 * self.shape.layers) ** -0.5
        for name, p in self.named_parameters():
            if p.dim() < 2:
                p.fill_(1.0)
            else:
                p.normal_(
                    0.0,
                    std * (depth if name.endswith(("o_proj.weight", "down_proj.weight")) else 1),
                )

    def rope(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._rope:
            s = self.shape
            self._rope[key] = rope_tables(s.head_dim, self.rope_len, s.rope_theta, device)
        return self._rope[key]

    def forward(self, ids: torch.Tensor, capture: tuple[int, ...] = ()):
        cos, sin = self.rope(ids.device)
        T = ids.shape[1]
        cos, sin = cos[:T], sin[:T]
        x = self.model.embed_tokens(ids)
        aux = []
        for i, layer in enumerate(self.model.layers):
            if i in capture:
                aux.append(x)
            x = layer(x, cos, sin)
        if len(self.model.layers) in capture:
            aux.append(x)
        return self.model.norm(x), aux

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of ids [B, T+1]."""
        hidden, _ = self(ids[:, :-1])
        logits = self.lm_head(hidden)
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())


@torch.no_grad()
def init_drafter(drafter: nn.Module, target: LlamaLM) -> None:
    """A drafter's start: norm weights 1, matrices N(0, 0.02), and the target's final-norm
    weight in `drafter.norm` (a warm start on the target's output head)."""
    for p in drafter.parameters():
        p.fill_(1.0) if p.dim() < 2 else p.normal_(0.0, 0.02)
    drafter.norm.weight.copy_(target.model.norm.weight)


def load_lm(path, shape: LlamaShape, device) -> LlamaLM:
    """A saved checkpoint (model.safetensors or shards) back into a float32 LlamaLM."""
    from pathlib import Path

    from safetensors.torch import load_file

    state = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(file)))
    model = LlamaLM(shape)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.to(device)
