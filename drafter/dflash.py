"""DFLASH: a block-diffusion drafter that proposes a whole block of tokens in one forward pass,
conditioned on the target's hidden states (z-lab/dflash `DFlashDraftModel` checkpoints).

Conventions, from the published `dflash/model.py`: the context features of position p are
`hidden_norm(fc(cat(target layer outputs at p for id in target_layer_ids)))` (HF
`hidden_states[id + 1]`, i.e. the OUTPUT of decoder layer id, which is our aux id `id + 1`: the
residual entering layer id + 1; for the last layer HF hands the final-norm output, and so do
we). Every draft layer projects them with its own k/v projections
(KV injection; k gets the layer's k_norm and RoPE at the context position) and caches them; the
block [newest token, mask x (B-1)] at the next B positions is embedded with the target's
embedding table, its queries attend to the cached context before the block and to the whole
block non-causally; the final norm and the target's lm_head give drafts for block positions
1..B-1. Missing `target_layer_ids` default to the published spread: [L // 2] for one draft
layer, else round(1 + i * (L - 4) / (n - 1)) for the n draft layers, L the target's layers.

Config fields the reference reads, each honoured or refused: `block_size`, `mask_token_id`,
`target_layer_ids`, `input_embedding_scale` (scales the raw embeddings), `output_multiplier` and
`final_logit_softcapping` (logits * m, then tanh(l / c) * c) from `dflash_config` or the top level;
`is_causal` from the top level only, as the reference reads it (a causal block, every layer);
`dflash_config.causal`, which vLLM (`_dflash_layer_causal`) reads when the top level has no
`is_causal`, with the same meaning (the z-lab reference ignores it; `causal_head`, which neither
reference defines, is refused unless false);
`layer_types` with `sliding_window` (which counts only with `use_sliding_window`, as transformers'
Qwen3Config reads it): a sliding layer's block is causal unless `is_causal` (or
`dflash_config.causal`) says otherwise. We run
one block mask for all layers (a mix of causal and non-causal layers is refused) and no window (a
window is refused unless it covers every position the engine reaches, where it changes nothing).

The speculators format (vLLM's `DFlashConverter` output, `speculators_model_type: dflash`; see
drafter/checkpoint.py): layer shapes in `transformer_layer_config`, `block_size` and
`mask_token_id` at the top level, `aux_hidden_state_layer_ids` = z-lab id + 1 (the input of that
layer), `sliding_window_non_causal` (default False: windowed sliding layers are causal; full
layers and unwindowed ones never are).
A reduced draft vocabulary (own lm_head and d2t), `sample_from_anchor` and aux id L (the final
hidden state, taken before the final norm by vLLM and after it by z-lab) are refused. In either
format a `vocab_size` (speculators: also `draft_vocab_size`) other than the target's is refused:
the drafter drafts with the target's embeddings and lm_head, so its ids would be another
tokenizer's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from speculant.comm.groups import ParallelContext
from speculant.config import (
    ModelConfig,
    config_architectures,
    config_bool,
    config_dict,
    config_float,
    config_int,
    layer_types_and_window,
    read_hf_config,
)
from speculant.drafter.base import Drafter, DraftInputs, Proposal
from speculant.drafter.checkpoint import (
    check_tp_split,
    format_of,
    read_head_weights,
    require_tensors,
    speculators_block_size,
    speculators_fields,
)
from speculant.drafter.eagle import ReplicatedLinear
from speculant.errors import SpeculantError
from speculant.executor.attention import BlockContextAttention
from speculant.executor.forward_batch import SamplingInfo
from speculant.executor.kv_cache import PagedKVCache
from speculant.executor.piecewise_drafter import (
    DFlashContextPiece,
    propose_extend,
)
from speculant.models.layers import QKVParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear
from speculant.models.llama import MLP
from speculant.models.loader import (
    check_load_format,
    default_device_and_dtype,
    init_dummy_weights,
    load_weights,
)

DEFAULT_BLOCK_SIZE = 16  # the published default when a config names none


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default: the middle layer for one draft layer, else evenly spread over
    layers 1 .. L-3 (Python's round, as published)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    """A published DFLASH drafter, checked against the target it drafts for."""

    layer: ModelConfig  # the draft layers' shapes, rope and eps (Qwen3 style, q/k norms)
    num_layers: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # decoder layers whose OUTPUT is a context feature
    causal_block: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    logit_softcap: float = 0.0
    sliding_window: int | None = None  # of its sliding layers; load_dflash checks it never binds
    source: str = "config.json"

    @classmethod
    def from_dir(cls, path: str | Path, target: ModelConfig, dflash2: bool = False) -> DFlashConfig:
        hf = read_hf_config(path)
        source = str(Path(path) / "config.json")
        fmt = format_of(hf, source)
        if fmt.speculators:
            hf = _speculators_dflash(hf, fmt.algo, target, source)
        archs = config_architectures(hf, source)
        if archs and not any("dflash" in arch.lower() for arch in archs):
            raise SpeculantError(
                f"{source} describes {archs[0]!r}, not a DFLASH drafter (DFlashDraftModel); "
                "pass the drafter's folder"
            )
        if not dflash2 and any("dflash2" in arch.lower() for arch in archs):
            raise SpeculantError(
                f"{source} is a DFlash2 drafter (candidate selector, convolutions); only "
                "DFlashDraftModel checkpoints are supported"
            )
        extra = config_dict(hf, "dflash_config", source)
        merged = {**hf, **extra}  # dflash_config's fields win over the top level's

        def value(name, default=None):
            found = merged.get(name)
            return default if found is None else found

        layer = ModelConfig.from_hf({**hf, "architectures": ["Qwen3ForCausalLM"]}, source)
        if layer.hidden_size != target.hidden_size:
            raise SpeculantError(
                f"DFLASH hidden_size {layer.hidden_size} in {source} != the target's "
                f"{target.hidden_size}; the drafter shares the target's embeddings and lm_head, "
                "so it is for another target"
            )
        if layer.vocab_size != target.vocab_size:  # the reference drafts with the target's lm_head
            name = "DFlash2" if dflash2 else "DFLASH"
            field = "transformer_layer_config.vocab_size" if fmt.speculators else "vocab_size"
            codebooks = (
                ", and its selector's codebooks are indexed by target ids" if dflash2 else ""
            )
            raise SpeculantError(
                f"{name} {field}={layer.vocab_size} in {source} != the target's "
                f"{target.vocab_size}; the drafter shares the target's embeddings and lm_head"
                f"{codebooks}, so it is for another target: pass the drafter made for this target"
            )
        mask_id = value("mask_token_id")
        if (
            not isinstance(mask_id, int)
            or isinstance(mask_id, bool)
            or not (0 <= mask_id < target.vocab_size)
        ):
            raise SpeculantError(
                f"dflash_config.mask_token_id={mask_id} in {source} must be a token id below the "
                f"target vocabulary {target.vocab_size}; add the mask token to the config"
            )
        block = config_int(merged, "block_size", source, DEFAULT_BLOCK_SIZE, minimum=2)
        ids = value("target_layer_ids")
        L = target.num_layers
        if ids is None:
            num_target = config_int(merged, "num_target_layers", source, L)
            ids = default_target_layer_ids(num_target, layer.num_layers)
            key = f"the default target_layer_ids {ids}"
        else:
            key = f"dflash_config.target_layer_ids={ids}"
        if not isinstance(ids, list) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in ids
        ):
            raise SpeculantError(f"{key} in {source} must be a list of target layer indices")
        if not ids or any(not 0 <= i < L for i in ids):
            raise SpeculantError(
                f"{key} in {source} is out of range for a target with {L} layers (0..{L - 1}); "
                "the drafter is for another target"
            )
        if len(set(ids)) != len(ids):
            raise SpeculantError(f"{key} in {source} repeats a layer; list distinct layers")
        causal, window = _block_attention(hf, extra, layer.num_layers, fmt.speculators, source)
        return cls(
            layer=layer,
            num_layers=layer.num_layers,
            block_size=block,
            mask_token_id=int(mask_id),
            target_layer_ids=tuple(ids),
            causal_block=causal,
            input_embedding_scale=config_float(merged, "input_embedding_scale", source, 1.0),
            output_multiplier=config_float(merged, "output_multiplier", source, 1.0),
            logit_softcap=config_float(
                merged, "final_logit_softcapping", source, 0.0, minimum=-math.inf
            ),
            sliding_window=window,
            source=source,
        )


def _block_attention(
    hf: dict, extra: dict, num_layers: int, speculators: bool, source: str
) -> tuple[bool, int | None]:
    """(causal, sliding window) of the block, one for every layer as the drafter runs. Window and
    default layer types follow transformers' Qwen3Config, which both references read the config
    with: `sliding_window` counts only with `use_sliding_window`, and without `layer_types` the
    layers from `max_window_layers` on slide."""
    types, window = layer_types_and_window(hf, num_layers)
    if len(types) != num_layers:
        raise SpeculantError(
            f"layer_types {types} in {source} names {len(types)} layers, but "
            f"num_hidden_layers is {num_layers}; fix config.json"
        )
    unknown = [t for t in types if t not in ("full_attention", "sliding_attention")]
    if unknown:
        raise SpeculantError(
            f"layer_types value {unknown[0]!r} in {source} is not supported; supported: "
            "full_attention, sliding_attention"
        )
    sliding = [t == "sliding_attention" for t in types]
    if "is_causal" in extra:
        raise SpeculantError(
            f"dflash_config.is_causal in {source}: the reference reads is_causal only at the top "
            "level of config.json; move it there"
        )
    if extra.get("causal_head") not in (None, False):
        raise SpeculantError(
            f"dflash_config.causal_head={extra['causal_head']!r} in {source} is not supported: "
            "neither reference defines what it computes"
        )
    override = extra.get("causal")  # vLLM's dflash_config.causal: every layer's block
    if override is not None and not isinstance(override, bool):
        raise SpeculantError(
            f"dflash_config.causal={override!r} in {source} must be true or false; fix config.json"
        )
    if speculators:  # its anchor-block mask: causal only on windowed sliding layers
        if "is_causal" in hf:
            raise SpeculantError(
                f"is_causal in the transformer_layer_config of {source} is not supported: the "
                "speculators format sets the block's causality by sliding_window_non_causal"
            )
        non_causal = config_bool(hf, "sliding_window_non_causal", source)
        causal_window = window is not None and not non_causal
        causal = [s and causal_window for s in sliding]
    else:  # vLLM's order: is_causal, else dflash_config.causal (every layer), else sliding
        is_causal = config_bool(hf, "is_causal", source, None)
        if is_causal is None:
            is_causal = override
        causal = [s if is_causal is None else bool(is_causal) for s in sliding]
    if len(set(causal)) > 1:
        raise SpeculantError(
            f"layer_types {types} in {source} make the sliding layers' block causal and the "
            "full layers' not; one block mask for all layers is supported, not a mix"
        )
    if not any(sliding):
        return causal[0], None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise SpeculantError(
            f"sliding_window={window!r} in {source} must be a positive integer for its "
            "sliding_attention layers; fix config.json"
        )
    return causal[0], window


def _speculators_dflash(hf: dict, algo: str, target: ModelConfig, source: str) -> dict:
    """The flat config of a speculators DFLASH drafter, its layer ids in the z-lab convention."""
    if algo != "dflash":
        raise SpeculantError(
            f"{source} is a speculators {algo} drafter, not a DFLASH drafter; pass --algo {algo} "
            "(or leave --algo out)"
        )
    flat = speculators_fields(hf, source)
    if config_bool(flat, "sample_from_anchor", source):
        raise SpeculantError(
            f"sample_from_anchor=true in {source} is not supported: DFLASH drafts the block "
            "positions after the newest token only"
        )
    for name, ours in (
        ("draft_vocab_size", target.vocab_size),
        ("target_hidden_size", target.hidden_size),
    ):
        if flat.get(name) is not None and config_int(flat, name, source) != ours:
            raise SpeculantError(
                f"{name}={flat[name]} in {source} != the target's {ours}: that needs the "
                "drafter's own lm_head or embeddings, which DFLASH does not support"
            )
    aux, L = flat.get("aux_hidden_state_layer_ids"), target.num_layers
    if not aux:
        raise SpeculantError(
            f"{source} lacks aux_hidden_state_layer_ids; re-convert it with the speculators "
            "package (DFlashConverter)"
        )
    if not isinstance(aux, list) or any(isinstance(a, bool) or not isinstance(a, int) for a in aux):
        raise SpeculantError(
            f"aux_hidden_state_layer_ids={aux!r} in {source} must be a list of target layer "
            "indices; fix config.json"
        )
    if any(not 1 <= a < L for a in aux) or len(set(aux)) != len(aux):
        raise SpeculantError(
            f"aux_hidden_state_layer_ids={aux} in {source} must be distinct target layers in "
            f"1..{L - 1} (the input of layer a, z-lab's id a - 1) for a target with {L} layers"
        )
    dflash = {
        "target_layer_ids": [a - 1 for a in aux],
        "block_size": speculators_block_size(hf, source),
        "mask_token_id": flat.get("mask_token_id"),
    }
    return {**flat, "dflash_config": dflash}


def block_size_of(path: str | Path) -> int:
    """The block size a drafter folder declares (before the target is known), with the default
    of its format: a speculators drafter's 8 (as `_speculators_dflash` builds it), else 16."""
    hf = read_hf_config(path)
    source = str(Path(path) / "config.json")
    if hf.get("speculators_model_type") is not None:
        return speculators_block_size(hf, source)
    merged = {**hf, **config_dict(hf, "dflash_config", source)}
    return config_int(merged, "block_size", source, DEFAULT_BLOCK_SIZE, minimum=2)


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from the context features and the block, both
    through this layer's projections (k_norm and RoPE on both)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, pctx: ParallelContext):
        super().__init__()
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, pctx
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, pctx
        )  # Qwen3 attention: `attention_bias` gives o_proj a bias too
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, context, rope_context, x, rope_block, attn: BlockContextAttention):
        n_context, d = context.shape[0], self.head_dim
        # One projection over context and block rows; the context rows' q is not used.
        q, k, v = self.qkv_proj.split(self.qkv_proj(torch.cat([context, x])))
        k = self.k_norm(k.view(-1, self.num_kv_heads, d))
        v = v.view(-1, self.num_kv_heads, d)
        k_context = RotaryEmbedding.apply(k[:n_context], rope_context)
        k_block = RotaryEmbedding.apply(k[n_context:], rope_block)
        q = RotaryEmbedding.apply(
            self.q_norm(q[n_context:].view(-1, self.num_heads, d)), rope_block
        )
        out = attn.forward(self.layer_id, q, k_block, v[n_context:], k_context, v[:n_context])
        return self.o_proj(out.reshape(-1, self.num_heads * d))

    def context_key_values(self, context, rope_context) -> tuple[torch.Tensor, torch.Tensor]:
        """The context rows' keys (normed, rotated) and values, as `forward` writes them."""
        _, k, v = self.qkv_proj.split(self.qkv_proj(context))
        k = RotaryEmbedding.apply(self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)),
                                  rope_context)  # fmt: skip
        return k, v.reshape(-1, self.num_kv_heads, self.head_dim)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, pctx: ParallelContext):
        super().__init__()
        self.self_attn = DFlashAttention(cfg, layer_id, pctx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, pctx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, context, rope_context, h, rope_block, attn) -> torch.Tensor:
        h = h + self.self_attn(context, rope_context, self.input_layernorm(h), rope_block, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """The drafter's own weights (embeddings and lm_head are the target's)."""

    def __init__(self, cfg: DFlashConfig, max_positions: int, pctx: ParallelContext):
        super().__init__()
        lc = cfg.layer
        self.config = cfg
        self.rotary = RotaryEmbedding(lc.head_dim, max_positions, lc.rope_theta, lc.rope_scaling)
        self.fc = ReplicatedLinear(
            len(cfg.target_layer_ids) * lc.hidden_size, lc.hidden_size, False
        )
        self.hidden_norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.layers = nn.ModuleList([self.make_layer(lc, i, pctx) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.num_kv_heads = self.layers[0].self_attn.num_kv_heads  # per TP rank
        self.head_dim = lc.head_dim

    def make_layer(self, cfg: ModelConfig, layer_id: int, pctx: ParallelContext) -> nn.Module:
        return DFlashLayer(cfg, layer_id, pctx)  # DFlash2 adds its convolutions

    def forward(
        self,
        features: torch.Tensor,
        context_positions: torch.Tensor,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        attn: BlockContextAttention,
    ) -> torch.Tensor:
        """features [N_context, n * H] (target layer outputs in target_layer_ids order), block
        embeddings [bs * B, H] -> final-norm block hidden states [bs * B, H]."""
        context = self.hidden_norm(self.fc(features))
        rope_context = self.rotary.lookup(context_positions, block_embeds.dtype)
        rope_block = self.rotary.lookup(block_positions, block_embeds.dtype)
        h = block_embeds
        for layer in self.layers:
            h = layer(context, rope_context, h, rope_block, attn)
        return self.norm(h)

    def write_context(self, features, positions, k_pools, v_pools, slots) -> None:
        """Every layer's context K/V of `features` at `positions` (their slots), as the block
        forward writes them, without the block (a step that drafts nothing)."""
        context = self.hidden_norm(self.fc(features))
        rope = self.rotary.lookup(positions, context.dtype)
        for layer, k_pool, v_pool in zip(self.layers, k_pools, v_pools, strict=True):
            k, v = layer.self_attn.context_key_values(context, rope)
            k_pool.index_copy_(0, slots, k.to(k_pool.dtype))
            v_pool.index_copy_(0, slots, v.to(v_pool.dtype))


def published_keys(cfg: DFlashConfig) -> list[str]:
    keys = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        keys += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
        keys += [f"{p}self_attn.{x}_norm.weight" for x in "qk"]
        keys += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        keys += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
    return keys


def load_dflash(
    path: str | Path,
    target_cfg: ModelConfig,
    device: str | torch.device,
    dtype: torch.dtype,
    pctx: ParallelContext,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
) -> DFlashModel:
    """Build the drafter of folder `path` for `target_cfg` and load its published weights
    (`load_format="dummy"`: random weights, no weight files needed)."""
    cfg = DFlashConfig.from_dir(path, target_cfg)
    return build_block_drafter(
        DFlashModel, cfg, published_keys(cfg), "a DFLASH drafter", path, device, dtype, pctx,
        max_positions, load_format, seed,
    )  # fmt: skip


def build_block_drafter(
    model_class, cfg, keys, what, path, device, dtype, pctx, max_positions, load_format, seed,
    rename=None,
):  # fmt: skip
    """A DFLASH-family model of `cfg` (DFLASH, DFlash2) with its weights: random ones for
    `load_format="dummy"`, else the folder's, `rename`d, all of `keys` required."""
    check_load_format(load_format)
    if cfg.sliding_window is not None and cfg.sliding_window < max_positions:
        raise SpeculantError(
            f"sliding_window={cfg.sliding_window} in {cfg.source} is shorter than the "
            f"{max_positions} positions a request may reach (--max-model-len + 2 x (k + 1)), and "
            "windowed attention is not supported; lower --max-model-len"
        )
    head = what.removeprefix("a ").removeprefix("an ")  # "DFLASH drafter", "DFlash2 drafter"
    check_tp_split(cfg.layer, pctx.tp_size, head, path, cfg.source)
    with default_device_and_dtype(device, dtype):
        model = model_class(cfg, max_positions, pctx)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        return model.eval()
    weights, source = read_head_weights(path)
    if rename is not None:
        weights = rename(weights)
    require_tensors(weights, keys, source, "drafter", what)
    load_weights(model, iter(weights.items()), source, refuse_dropped=head)
    return model.eval()


class DFlashDrafter(Drafter):
    """Writes the context K/V of every input position of the batch (rejected positions are
    rewritten later and hidden meanwhile: the block only sees positions before it), then drafts
    k = B - 1 tokens from one forward over the block [newest token, mask x k]."""

    block_attention = True

    def __init__(
        self,
        model: DFlashModel,
        target,
        kv: PagedKVCache,
        dtype: torch.dtype,
        num_draft_tokens: int,
        attention_backend: str = "torch",
    ):
        cfg = model.config
        if not 1 <= num_draft_tokens <= cfg.block_size - 1:
            raise SpeculantError(
                f"num_draft_tokens={num_draft_tokens} does not fit the DFLASH block of "
                f"{cfg.block_size} (at most {cfg.block_size - 1}); lower --num-draft-tokens"
            )
        super().__init__(
            kv,
            model.config.num_layers,
            model.num_kv_heads,
            model.head_dim,
            dtype,
            num_draft_tokens,
            attention_backend,
        )
        self.model, self.target = model, target
        # Layer outputs are our aux ids id + 1, handed in layer order (fc wants the config's
        # order); the last layer's output is the final-norm hidden, as in HF's hidden_states.
        last = target.config.num_layers - 1
        self.aux_layer_ids = tuple(sorted(i + 1 for i in cfg.target_layer_ids if i != last))
        self.feature_sources = [
            None if i == last else self.aux_layer_ids.index(i + 1) for i in cfg.target_layer_ids
        ]
        self.mask = torch.full(
            (1, num_draft_tokens), cfg.mask_token_id, device=kv.cache_lens.device
        )
        self.catch_up_width = len(cfg.target_layer_ids) * target.config.hidden_size
        self.offsets = torch.arange(num_draft_tokens + 1, device=kv.cache_lens.device)

    def feature_parts(self, inputs: DraftInputs) -> list[torch.Tensor]:
        """The target layer outputs [N, H] of every input position, in config order."""
        return [inputs.hidden if i is None else inputs.aux[i] for i in self.feature_sources]

    def features(self, inputs: DraftInputs) -> torch.Tensor:
        """[N, n * H]: `feature_parts` side by side."""
        return torch.cat(self.feature_parts(inputs), dim=-1)

    def extend_piece(self) -> DFlashContextPiece:
        return DFlashContextPiece(self)

    def catch_up_entry(self, inputs: DraftInputs) -> tuple[None, list]:
        return None, self.feature_parts(inputs)  # the context K/V need no token

    def catch_up(self, rows, ids, features, positions, slots) -> None:
        features = features.reshape(slots.shape[0], -1)
        self.model.write_context(features, positions.reshape(-1), self.k_pools, self.v_pools,
                                 slots)  # fmt: skip

    def propose(
        self, inputs: DraftInputs, sampling: SamplingInfo, variant: str, num_drafts: int
    ) -> Proposal:
        batch, bs, cfg = inputs.batch, inputs.batch.bs, self.model.config
        if batch.is_varlen:
            # EXTEND: the context K/V of all N positions (a function of N only, graphed by
            # token bucket), then the block from each sequence's last position only
            return propose_extend(self, inputs, sampling, variant, num_drafts)
        features = self.features(inputs)
        if num_drafts == 0:  # the context K/V of the batch's positions, no block forward
            self.model.write_context(features, batch.positions, self.k_pools, self.v_pools,
                                     batch.out_cache_loc)  # fmt: skip
            return self.no_drafts(batch)
        newest = inputs.next_tokens.reshape(-1)[inputs.last_flat].clamp(min=0)
        block_start = batch.positions[inputs.last_flat] + 1
        block_ids = torch.cat([newest[:, None], self.mask.expand(bs, -1)], dim=1)
        block_positions = block_start[:, None] + self.offsets
        self.attn.prepare(
            batch, block_start, self.k + 1, cfg.causal_block, shared_slots=inputs.target_slots
        )
        embeds = self.target.embed(block_ids.reshape(-1))
        if cfg.input_embedding_scale != 1.0:
            embeds = embeds * cfg.input_embedding_scale
        hidden = self.model(
            features,
            batch.positions,
            embeds,
            block_positions.reshape(-1),
            self.attn,
        )
        hidden = hidden.view(bs, self.k + 1, -1)[:, 1:]
        logits = self.target.compute_logits(hidden)
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.logit_softcap > 0:
            logits = torch.tanh(logits / cfg.logit_softcap) * cfg.logit_softcap
        return self.draft(hidden, logits, newest, block_positions, sampling, variant)

    def draft(self, hidden, logits, newest, block_positions, sampling, variant) -> Proposal:
        """The k drafts from the block's final hidden states [bs, k, H] and logits [bs, k, V] at
        block positions 1..k (DFlash2 selects them with its candidate selector)."""
        drafts, probs = [], []
        for i in range(self.k):  # draft i is the token at block_start + 1 + i
            token, q = self.pick(logits[:, i], sampling, block_positions[:, i + 1], variant)
            drafts.append(token)
            probs.append(q)
        return self.proposal(drafts, probs)
