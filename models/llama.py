"""Llama, Qwen2 and Qwen3 decoders (one file: they differ by qkv bias and q/k norms).

The forward pass is token-major: `input_ids` and `positions` are flat [N]; attention reads and
writes the paged KV cache through the step's attention backend, which already holds the step's
metadata (slots, block tables, masks)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from speculant.comm.groups import ParallelContext
from speculant.config import ModelConfig
from speculant.kernels.ops import TORCH_OPS, TorchOps
from speculant.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, pctx: ParallelContext):
        super().__init__()
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, pctx
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, pctx
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, rope, x: torch.Tensor, attn) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = self.qkv_proj.split(qkv)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if attn.ops.fuses_rope:
            return self._forward_rope_in_backend(rope, q, k, v, attn)
        if self.q_norm is not None:
            q = RotaryEmbedding.apply(self.q_norm(q.view(-1, self.num_heads, self.head_dim)), rope)
            k = RotaryEmbedding.apply(
                self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim)), rope
            )
        else:  # q and k are adjacent in qkv: rotate both in one pass
            heads = self.num_heads + self.num_kv_heads
            qk = RotaryEmbedding.apply(
                qkv[:, : heads * self.head_dim].view(-1, heads, self.head_dim), rope
            )
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = attn.forward(self.layer_id, q, k, v)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))

    def key_values(self, rope, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's rotated keys and values of x [N, kv_heads, d] each, without attending
        (a drafter catching its KV up on positions it does not draft from)."""
        _, k, v = self.qkv_proj.split(self.qkv_proj(x))
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return RotaryEmbedding.apply(k, rope), v.reshape(-1, self.num_kv_heads, self.head_dim)

    def _forward_rope_in_backend(self, rope, q, k, v, attn) -> torch.Tensor:
        """The backend rotates q and k as it writes the KV cache (one fused kernel)."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q, attn.ops), self.k_norm(k, attn.ops)
        out = attn.forward(self.layer_id, q, k, v, rope)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, pctx: ParallelContext):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], False, pctx)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, pctx)

    def forward(self, x: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, pctx: ParallelContext, mlp: nn.Module | None = None
    ):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, pctx)
        self.mlp = mlp if mlp is not None else MLP(cfg.hidden_size, cfg.intermediate_size, pctx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope, x: torch.Tensor, attn) -> torch.Tensor:
        h, residual = self.forward_split(rope, x, None, attn)
        return residual + h

    def forward_split(
        self, rope, h: torch.Tensor, residual: torch.Tensor | None, attn, entering=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on a residual stream held as h + residual (residual None: h alone), so
        each residual add is fused into the next norm; returns the output the same way.
        `entering`: a list to append the residual stream entering the layer to (the sum the
        fused norm writes anyway: an auxiliary state costs no kernel)."""
        ops = attn.ops
        if residual is None:
            residual, normed = h, self.input_layernorm(h, ops)
        else:
            normed, residual = self.input_layernorm.add_forward(h, residual, ops)
        if entering is not None:
            entering.append(residual)
        h = self.self_attn(rope, normed, attn)
        normed, residual = self.post_attention_layernorm.add_forward(h, residual, ops)
        mlp_out = self.mlp(normed, ops) if isinstance(self.mlp, MLP) else self.mlp(normed)
        return mlp_out, residual


class DecoderModel(nn.Module):
    """`make_mlp(layer_id)` builds a layer's feed-forward block (None: the dense MLP); MoE
    targets pass their expert blocks this way."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        pctx: ParallelContext,
        make_mlp: Callable[[int], nn.Module | None] = lambda layer_id: None,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, pctx)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, pctx, make_mlp(i)) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """A dense decoder with its LM head. `aux_layer_ids` asks for the residual stream entering
    those layers (what EAGLE-3 and DFLASH drafters condition on); layer id L means the output
    of the last layer before the final norm."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        pctx: ParallelContext,
        make_mlp: Callable[[int], nn.Module | None] = lambda layer_id: None,
    ):
        super().__init__()
        self.config = cfg
        self.pctx = pctx
        self.model = DecoderModel(cfg, max_positions, pctx, make_mlp)
        self.lm_head = (
            self.model.embed_tokens
            if cfg.tie_word_embeddings
            else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, pctx)
        )
        self.aux_layer_ids: tuple[int, ...] = ()
        # {kernel kind: PDL mode} for the kernels this forward launches (attn.ops.launch_modes):
        # set by models/fp8.py for FP8 projections, None keeps the shipped modes
        self.launch_modes: dict[str, int] | None = None

    def replay_hooks(self) -> list:
        """Code to run around CUDA-graph capture and replay (executor/cuda_graph.ReplayHook);
        the DeepEP-backed MoE target returns its adapter."""
        return []

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn,
        tokens_per_rank: list[int] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final-norm hidden states [N, H] and the requested auxiliary states
        (`tokens_per_rank`, every rank's tokens in this forward, plans a MoE target's
        dispatches; a dense model has none to plan)."""
        with attn.ops.launch_modes(self.launch_modes):
            return self._forward(input_ids, positions, attn)

    def _forward(self, input_ids, positions, attn) -> tuple[torch.Tensor, list[torch.Tensor]]:
        h = self.embed(input_ids)
        rope = self.model.rotary.lookup(positions, h.dtype)
        aux, residual = [], None  # the residual stream is h + residual (see forward_split)
        for i, layer in enumerate(self.model.layers):
            entering = aux if i in self.aux_layer_ids else None
            h, residual = layer.forward_split(rope, h, residual, attn, entering)
        if len(self.model.layers) in self.aux_layer_ids:
            h, residual = residual + h, None
            aux.append(h)
        if residual is None:
            return self.model.norm(h, attn.ops), aux
        return self.model.norm.add_forward(h, residual, attn.ops)[0], aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits in float32 (gathered over TP)."""
        return ParallelLMHead.logits(self.lm_head, hidden).float()
