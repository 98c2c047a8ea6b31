"""The EAGLE-3 draft head as published (`LlamaForCausalLMEagle3` checkpoints) and its loader.

Conventions, from SGLang `python/sglang/srt/models/llama_eagle3.py` and `models/llama.py`, vLLM
`vllm/model_executor/models/llama_eagle3.py` and SpecForge
`specforge/modeling/draft/llama3_eagle.py` (which wrote most published heads): `fc` [H, 3*H_target]
projects the concatenated aux states, and is skipped when the hidden is already H wide (the head's
own fed-back output; SGLang tests the width against the embeddings). Layer 0 (`midlayer.*`) keeps
the projected hidden as residual (not the embeddings), attends over cat([input_layernorm(embeds),
hidden_norm(hidden)]) (2H wide) and ends with the usual post-attention norm and MLP; layers i > 0
(`midlayer.{i}.*` as NVIDIA ModelOpt exports them, or vLLM's `layers.{i}.*`) are plain Llama layers
on H, as in vLLM (SGLang loads one layer). The pre-final-norm output is fed back to the next draft
step; logits come from lm_head(norm(out)) over the draft vocabulary. `d2t` holds int64 offsets
(target = draft + d2t[draft], SGLang's hot_token_id); `t2d` is rebuilt from d2t (SGLang and vLLM
skip it). A head as wide as its target ignores `embed_tokens.weight` (embeddings come from the
target); one whose hidden differs (`target_hidden_size` != `hidden_size`, SGLang's
`llama_eagle3`) embeds with its own `embed_tokens` [vocab, H] and `fc` maps 3*H_target -> H.
The architecture names the decoder layers, as vLLM and SGLang pick the model class by it: Llama
layers, or Qwen3 ones (per-head q/k RMSNorm before RoPE) for vLLM's `Eagle3Qwen3ForCausalLM`
(models/qwen3_eagle3.py) and SpecForge's `Qwen3ForCausalLMEagle3`; a top-level model_type qwen3
decides only where no architecture is given (`LlamaForCausalLMEagle3` with model_type qwen3 is
built with Llama layers by both). q/k norm tensors in a head built without them are refused.
Aux layers: `aux_layer_ids` names the target layers whose INPUT residual is taken, as SGLang's
`layers_to_capture` (default [2, L//2, L-3]); `eagle_config.eagle_aux_hidden_state_layer_ids`
counts layer outputs, so SGLang's `set_eagle3_layers_to_capture` adds 1 and so do we; a top-level
`eagle_aux_hidden_state_layer_ids` (vLLM / speculators, ignored by SGLang) already means the input
of layer i and is taken as is.

The speculators format (vLLM's `Eagle3Converter` output, `speculators_model_type: eagle3`; see
drafter/checkpoint.py) holds the same head: layer shapes in `transformer_layer_config` (Llama
layers, or Qwen3 ones with q/k norms for model_type qwen3, as vLLM's `update_eagle3` maps),
`layers.0.*` for `midlayer.*`, aux ids at the top level (input of layer i), and the head embeds
with its own `embed_tokens` when the file has one, as vLLM does (we share the target's table when
the two are equal). EAGLE-3.1 flags, read as vLLM reads them and
defaulting to the speculators schema's False (vLLM alone defaults an absent
`norm_before_residual` to True):
`norm_before_residual` (layer 0's residual is hidden_norm(hidden)), `norm_before_fc` (one RMSNorm
`input_norm` over the concatenated aux states before fc; also read from `eagle_config`),
`fc_norm` (an RMSNorm `fc_norm.{j}` per aux state; exclusive with norm_before_fc) and
`norm_output` (the post-norm hidden is fed back, and lm_head reads it without a second norm).
In either format, sliding layers (`layer_types` + `sliding_window`, read as transformers' config
class of the model_type reads them) are refused unless the window covers every position, and the
attention heads and MLP must split over --tp.
"""

from __future__ import annotations

import re
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
    config_int,
    layer_types_and_window,
    read_hf_config,
)
from speculant.drafter.checkpoint import (
    check_tp_split,
    format_of,
    read_head_weights,
    require_tensors,
    speculators_fields,
)
from speculant.errors import SpeculantError
from speculant.models.layers import (
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    project,
)
from speculant.models.llama import MLP, Attention, DecoderLayer
from speculant.models.loader import (
    check_load_format,
    default_device_and_dtype,
    file_holding,
    init_dummy_weights,
    load_weights,
)

AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
# Top-level EAGLE-3 architectures with Qwen3 decoder layers (q/k norms): vLLM's registered
# Eagle3Qwen3ForCausalLM and SpecForge's Qwen3ForCausalLMEagle3. Others (LlamaForCausalLMEagle3,
# Eagle3LlamaForCausalLM, vLLM's Eagle3Qwen3vlForCausalLM ...) are Llama layers in vLLM.
QWEN3_EAGLE3_ARCHITECTURES = ("Eagle3Qwen3ForCausalLM", "Qwen3ForCausalLMEagle3")
_QK_NORM_KEY = re.compile(r"^(?:midlayer|layers)(?:\.\d+)?\.self_attn\.[qk]_norm\.")
_LAYER_KEY = re.compile(r"^(midlayer|layers)(?:\.(\d+))?\.(.+)$")


@dataclass
class Eagle3Config:
    """A published EAGLE-3 head, checked against the target it drafts for."""

    layer: ModelConfig  # the head's decoder-layer shapes, rope and eps (Llama style)
    num_layers: int
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose input residual is concatenated
    fc_bias: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # EAGLE-3.1: RMSNorm `input_norm` over the aux concatenation
    fc_norm: bool = False  # EAGLE-3.1: RMSNorm `fc_norm.{j}` on each aux state
    norm_output: bool = False  # EAGLE-3.1: feed back the post-norm hidden
    speculators: bool = False  # read from the speculators format
    sliding_window: int | None = None  # of its sliding layers; load_eagle3 checks it never binds
    head_embeddings: bool = False  # embeds with its own table at the target's width (vLLM)
    source: str = "config.json"
    layers_named_by: str = ""  # the config field that picked the layers (for errors)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def own_embeddings(self) -> bool:
        """A head narrower or wider than its target embeds tokens itself (`embed_tokens`), and so
        does a speculators head that ships its table."""
        return self.layer.hidden_size != self.target_hidden_size or self.head_embeddings

    @classmethod
    def from_dir(cls, path: str | Path, target: ModelConfig) -> Eagle3Config:
        hf = read_hf_config(path)
        source = str(Path(path) / "config.json")
        fmt = format_of(hf, source)
        if fmt.speculators:
            hf = _speculators_eagle3(hf, fmt.algo, source)
        archs = config_architectures(hf, source)
        if archs and not any("eagle3" in arch.lower() for arch in archs):
            raise SpeculantError(
                f"{source} describes {archs[0]!r}, not an EAGLE-3 head "
                "(LlamaForCausalLMEagle3); pass the draft head's folder"
            )
        # tie_word_embeddings is not read: heads always carry their own trained lm_head (over
        # the draft vocabulary); SpecForge's configs copy the flag from a tied target (its
        # qwen3-4b-eagle3.json) and vLLM ignores it too (a head without lm_head is refused)
        if config_bool(hf, "attention_bias", source):
            raise SpeculantError(
                f"attention_bias=true in {source} is not supported for EAGLE-3 heads"
            )
        qwen3, named_by = _qwen3_layers(hf, fmt.speculators, source)
        arch = "Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"
        layer = ModelConfig.from_hf(
            {**hf, "architectures": [arch], "tie_word_embeddings": False}, source
        )
        window = _sliding_window(hf, layer.num_layers, source)
        if not hf.get("target_hidden_size") and layer.hidden_size != target.hidden_size:
            raise SpeculantError(
                f"EAGLE-3 hidden_size {layer.hidden_size} in {source} != the "
                f"target's {target.hidden_size} and no target_hidden_size is given; "
                "the head is for another target"
            )
        target_hidden = config_int(hf, "target_hidden_size", source, layer.hidden_size)
        if target_hidden != target.hidden_size:
            raise SpeculantError(
                f"target_hidden_size {target_hidden} in {source} != target hidden "
                f"size {target.hidden_size}; the head is for another target"
            )
        draft_vocab = config_int(hf, "draft_vocab_size", source, layer.vocab_size)
        if draft_vocab > target.vocab_size or (
            draft_vocab == layer.vocab_size and layer.vocab_size != target.vocab_size
        ):
            raise SpeculantError(
                f"EAGLE-3 vocabulary {draft_vocab} in {source} does not fit the "
                f"target vocabulary {target.vocab_size}; the head is for another "
                "target"
            )
        return cls(
            layer=layer,
            num_layers=layer.num_layers,
            draft_vocab_size=draft_vocab,
            target_vocab_size=target.vocab_size,
            target_hidden_size=target_hidden,
            aux_layer_ids=_aux_layer_ids(hf, target.num_layers, source),
            fc_bias=config_bool(hf, "bias", source),
            **_norm_flags(hf, source),
            speculators=fmt.speculators,
            sliding_window=window,
            source=source,
            layers_named_by=named_by,
        )


def _qwen3_layers(hf: dict, speculators: bool, source: str) -> tuple[bool, str]:
    """Whether the head's decoder layers are Qwen3's (q/k norms), as vLLM and SGLang pick the
    model class, and the field that says so: a speculators head's layer model_type (vLLM's
    update_eagle3); else the architecture (vLLM's registry), and model_type only without one."""
    model_type = hf.get("model_type")
    if speculators:
        return model_type == "qwen3", f"transformer_layer_config.model_type={model_type!r}"
    eagle3 = [a for a in config_architectures(hf, source) if "eagle3" in a.lower()]
    if eagle3:
        return eagle3[0] in QWEN3_EAGLE3_ARCHITECTURES, f"architectures={eagle3[:1]}"
    return model_type == "qwen3", f"model_type={model_type!r} (no architectures)"


def _sliding_window(hf: dict, num_layers: int, source: str) -> int | None:
    """The window of the head's sliding layers (vLLM and its training masks apply it), None
    when it has none; load_eagle3 refuses one that would bind. The config is read as
    transformers' class of its model_type reads it (Qwen2/3: `sliding_window` only with
    `use_sliding_window`), and layer i slides where `layer_types[i]` says so, as in vLLM."""
    qwen = hf.get("model_type") in ("qwen2", "qwen3")
    types, window = layer_types_and_window(hf, num_layers, qwen)
    types = types[:num_layers]
    unknown = [t for t in types if t not in ("full_attention", "sliding_attention")]
    if unknown:
        raise SpeculantError(
            f"layer_types value {unknown[0]!r} in {source} is not supported; supported: "
            "full_attention, sliding_attention"
        )
    if "sliding_attention" not in types or window is None:
        return None
    if not isinstance(window, int) or window < 1:
        raise SpeculantError(f"sliding_window={window!r} in {source} must be a positive integer")
    return window


def _speculators_eagle3(hf: dict, algo: str, source: str) -> dict:
    """The flat config of a speculators EAGLE-3 head (Llama or Qwen3 layers, as vLLM maps)."""
    if algo != "eagle3":
        raise SpeculantError(
            f"{source} is a speculators {algo} drafter, not an EAGLE-3 head; pass --algo {algo} "
            "(or leave --algo out)"
        )
    flat = speculators_fields(hf, source)
    layer_type = flat.get("model_type", "llama")
    if layer_type not in ("llama", "qwen3"):
        raise SpeculantError(
            f"transformer_layer_config.model_type={layer_type!r} in {source} is not supported "
            "for EAGLE-3 heads; supported: llama, qwen3 decoder layers"
        )
    return {**flat, "architectures": ["LlamaForCausalLMEagle3"]}


def _norm_flags(hf: dict, source: str) -> dict[str, bool]:
    """norm_before_residual and the EAGLE-3.1 flags, False when absent (the speculators schema);
    norm_before_fc may sit in eagle_config, as vLLM reads it. Each must be a JSON boolean: a
    string "false" would read as true."""
    nested = config_dict(hf, "eagle_config", source)
    before_fc = config_bool(hf, "norm_before_fc", source)
    flags = {
        "norm_before_residual": config_bool(hf, "norm_before_residual", source),
        "norm_before_fc": config_bool(
            nested, "norm_before_fc", f"eagle_config of {source}", before_fc
        ),
        "fc_norm": config_bool(hf, "fc_norm", source),
        "norm_output": config_bool(hf, "norm_output", source),
    }
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise SpeculantError(
            f"norm_before_fc and fc_norm are both true in {source}; they exclude each other "
            "(one norm over the aux concatenation, or one per aux state): fix config.json"
        )
    return flags


def _aux_layer_ids(hf: dict, num_target_layers: int, source: str) -> tuple[int, ...]:
    """Aux layer ids in our convention (input of layer i; i = L is the last layer's output), in
    layer order: the target captures them in that order, whatever order the config lists."""
    L = num_target_layers
    eagle_config = config_dict(hf, "eagle_config", source)
    if not config_bool(eagle_config, "use_aux_hidden_state", f"eagle_config of {source}", True):
        # vLLM and SGLang then feed the target's last hidden state without fc (gpt-oss-style
        # heads); drafting from the aux concatenation instead would silently draft wrong
        raise SpeculantError(
            f"eagle_config.use_aux_hidden_state=false in {source} is not supported: the head "
            "drafts from the target's last hidden state without fc, and only heads fed the "
            "3 aux layers' states are"
        )
    nested = eagle_config.get(AUX_IDS_KEY)
    for where, listed in (("eagle_config.", nested), ("", hf.get(AUX_IDS_KEY))):
        if listed and not (
            isinstance(listed, list)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in listed)
        ):
            raise SpeculantError(
                f"{where}{AUX_IDS_KEY}={listed!r} in {source} must be a list of layer indices"
            )
    fix = f"eagle_config.{AUX_IDS_KEY}"
    if nested:  # SpecForge / SGLang: output of layer i, i.e. the input of layer i + 1
        ids, key = [i + 1 for i in nested], f"eagle_config.{AUX_IDS_KEY}={nested}"
    elif hf.get(AUX_IDS_KEY):  # vLLM / speculators: already the input of layer i
        ids, key = list(hf[AUX_IDS_KEY]), f"{AUX_IDS_KEY}={hf[AUX_IDS_KEY]}"
        fix = AUX_IDS_KEY
    else:  # SGLang's default, clamped so toy targets with few layers still work
        ids = [min(max(i, 0), L) for i in (2, L // 2, L - 3)]
        key = f"the default aux layers [2, L//2, L-3] = {ids}"
    if len(set(ids)) != 3:
        raise SpeculantError(
            f"{key} in {source} must name 3 distinct target layers (EAGLE-3 "
            f"concatenates exactly 3); fix {fix} in config.json"
        )
    if any(not 0 <= i <= L for i in ids):
        raise SpeculantError(
            f"{key} in {source} is out of range for a target with {L} layers; "
            "the head is for another target"
        )
    return tuple(sorted(ids))


class ReplicatedLinear(nn.Module):
    """A linear layer every TP rank holds whole (`fc`: its input is the full aux concatenation)."""

    gemv = None  # set by enable_gemv

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = _copy_whole
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        if bias:
            self.bias.weight_loader = _copy_whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self, x, self.bias)


def _copy_whole(param: torch.Tensor, loaded: torch.Tensor, shard=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class Eagle3Midlayer(nn.Module):
    """Layer 0: attention over cat([input_layernorm(embeds), hidden_norm(hidden)]), residual on
    the (projected) hidden."""

    def __init__(self, cfg: Eagle3Config, pctx: ParallelContext):
        super().__init__()
        lc = cfg.layer
        self.norm_before_residual = cfg.norm_before_residual
        self.self_attn = Attention(lc, 0, pctx)
        # The published head widens q/k/v to 2H (SGLang overrides qkv_proj the same way).
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * lc.hidden_size, lc.head_dim, lc.num_heads, lc.num_kv_heads, lc.qkv_bias, pctx
        )
        self.mlp = MLP(lc.hidden_size, lc.intermediate_size, pctx)
        self.input_layernorm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.hidden_norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)

    def forward(self, rope, embeds: torch.Tensor, hidden: torch.Tensor, attn) -> torch.Tensor:
        ops = attn.ops  # the backend's element-wise ops (fused kernels with triton)
        normed = self.hidden_norm(hidden, ops)
        residual = normed if self.norm_before_residual else hidden  # vLLM's norm_before_residual
        x = torch.cat([self.input_layernorm(embeds, ops), normed], dim=-1)
        normed, h = self.post_attention_layernorm.add_forward(
            self.self_attn(rope, x, attn), residual, ops
        )
        return h + self.mlp(normed, ops)


class Eagle3Head(nn.Module):
    """The draft head. `forward` returns the pre-norm hidden to feed back; `logits` the draft
    vocabulary's float32 logits. Its attention layers are 0..num_layers-1 of its own KV pool."""

    def __init__(
        self, cfg: Eagle3Config, target_cfg: ModelConfig, max_positions: int, pctx: ParallelContext
    ):
        super().__init__()
        lc = cfg.layer
        self.config = cfg
        self.pctx = pctx
        self.rotary = RotaryEmbedding(lc.head_dim, max_positions, lc.rope_theta, lc.rope_scaling)
        self.fc = ReplicatedLinear(3 * cfg.target_hidden_size, lc.hidden_size, cfg.fc_bias)
        eps, aux_width = lc.rms_norm_eps, cfg.target_hidden_size
        self.input_norm = RMSNorm(3 * aux_width, eps) if cfg.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList([RMSNorm(aux_width, eps) for _ in range(3)]) if cfg.fc_norm else None
        )
        # SGLang's llama_eagle3: a head whose hidden differs from the target's has its own table.
        self.embed_tokens = (
            VocabParallelEmbedding(target_cfg.vocab_size, lc.hidden_size, pctx)
            if cfg.own_embeddings
            else None
        )
        self.layers = nn.ModuleList(
            [Eagle3Midlayer(cfg, pctx)]
            + [DecoderLayer(lc, i, pctx) for i in range(1, cfg.num_layers)]
        )
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, lc.hidden_size, pctx)
        self.num_layers = cfg.num_layers
        self.num_kv_heads = self.layers[0].self_attn.num_kv_heads  # per TP rank
        self.head_dim = lc.head_dim
        self.target_vocab_size = target_cfg.vocab_size
        draft = cfg.draft_vocab_size
        self.register_buffer("d2t", torch.zeros(draft, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(target_cfg.vocab_size) < draft)
        self.register_buffer("draft_to_target", torch.arange(draft), persistent=False)
        self.identity_vocab = draft == target_cfg.vocab_size

    def set_vocab_map(self, d2t: torch.Tensor) -> None:
        """Install draft->target offsets (already checked by the loader)."""
        ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
        self.d2t.copy_(d2t)
        self.draft_to_target.copy_(ids)
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True
        self.identity_vocab = (d2t.numel() == self.target_vocab_size) and not bool(d2t.any())

    def embed(self, tokens: torch.Tensor, target) -> torch.Tensor:
        """[N, H] embeddings of target-vocabulary `tokens`: the head's own table when it has
        one (hidden != target hidden), else the target's."""
        if self.embed_tokens is not None:
            return self.embed_tokens(tokens)
        return target.embed(tokens)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attn
    ) -> torch.Tensor:
        """embeds [N, H] from `embed`; hidden [N, 3*H_target] (aux) or [N, H] (fed back).
        Returns the hidden to feed back: pre-norm, or post-norm with norm_output."""
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(self._normed_aux(hidden, attn.ops))
        rope = self.rotary.lookup(positions, embeds.dtype)
        h = self.layers[0](rope, embeds, hidden, attn)
        for layer in self.layers[1:]:
            h = layer(rope, h, attn)
        return self.norm(h, attn.ops) if self.config.norm_output else h

    def write_kv(
        self, embeds: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, pools, slots, ops
    ) -> None:
        """A one-layer head's K/V at `positions` (slots) from embeds and aux states, without the
        attention, MLP and logits a draft needs: what a step that does not draft must still
        write so that a later one can (a query at p reads keys <= p)."""
        layer = self.layers[0]
        normed = layer.hidden_norm(self.fc(self._normed_aux(aux, ops)), ops)
        x = torch.cat([layer.input_layernorm(embeds, ops), normed], dim=-1)
        k, v = layer.self_attn.key_values(self.rotary.lookup(positions, embeds.dtype), x)
        (k_pool,), (v_pool,) = pools
        k_pool.index_copy_(0, slots, k.to(k_pool.dtype))
        v_pool.index_copy_(0, slots, v.to(v_pool.dtype))

    def _normed_aux(self, aux: torch.Tensor, ops) -> torch.Tensor:
        """The EAGLE-3.1 norms before fc: one over the concatenation, or one per aux state."""
        if self.input_norm is not None:
            return self.input_norm(aux, ops)
        if self.fc_norm is not None:
            parts = aux.chunk(len(self.fc_norm), dim=-1)
            normed = [n(p.contiguous(), ops) for n, p in zip(self.fc_norm, parts, strict=True)]
            return torch.cat(normed, dim=-1)
        return aux

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """[N, draft_vocab] float32 logits of the output of `forward` (normed here unless
        norm_output already did)."""
        normed = hidden_out if self.config.norm_output else self.norm(hidden_out)
        return self.lm_head.logits(normed).float()

    def share_target_embeddings(self, target_embed: nn.Module) -> None:
        """Drop the head's own table when it equals the target's (speculators heads ship a copy
        of it), so the head embeds with the target's and holds no second vocab x H table."""
        own = self.embed_tokens
        if own is not None and own.weight.shape == target_embed.weight.shape:
            if torch.equal(own.weight, target_embed.weight):
                self.embed_tokens = None

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids to target ids: i + d2t[i]."""
        return draft_ids if self.identity_vocab else self.draft_to_target[draft_ids]

    def draft_probs_to_target(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., draft_vocab] -> [..., target_vocab], zero outside the draft vocabulary."""
        if self.identity_vocab:
            return probs
        out = probs.new_zeros(*probs.shape[:-1], self.target_vocab_size)
        return out.index_copy_(-1, self.draft_to_target, probs)


def published_keys(cfg: Eagle3Config, layer_prefix: str = "midlayer.") -> list[str]:
    """The tensor names a published head of this config holds (without d2t / t2d).
    `layer_prefix` is `midlayer.` (one layer), `midlayer.{i}.` or `layers.{i}.`."""
    keys = ["fc.weight", "norm.weight", "lm_head.weight"] + (["fc.bias"] if cfg.fc_bias else [])
    keys += ["embed_tokens.weight"] if cfg.own_embeddings else []
    keys += ["input_norm.weight"] if cfg.norm_before_fc else []
    keys += [f"fc_norm.{j}.weight" for j in range(3)] if cfg.fc_norm else []
    for i in range(cfg.num_layers):
        p = layer_prefix.format(i=i)
        keys += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
        keys += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        keys += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
        keys += [f"{p}hidden_norm.weight"] if i == 0 else []
        keys += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"] if cfg.layer.qkv_bias else []
        keys += [f"{p}self_attn.{x}_norm.weight" for x in "qk"] if cfg.layer.qk_norm else []
    return keys


def our_name(key: str) -> str:
    """Published tensor name -> our parameter name (`midlayer[.i].` -> `layers.i.`)."""
    match = _LAYER_KEY.match(key)
    if match is None:
        return key
    _, index, rest = match.groups()
    return f"layers.{index or 0}.{rest}"


def _layer_prefix(keys, num_layers: int) -> str:
    """Which of the published layer namings a checkpoint uses."""
    if any(re.match(r"midlayer\.\d+\.", k) for k in keys):
        return "midlayer.{i}."
    if any(re.match(r"layers\.\d+\.", k) for k in keys):
        return "layers.{i}."
    return "midlayer." if num_layers == 1 else "midlayer.{i}."


def _checked_d2t(weights: dict, cfg: Eagle3Config, source: str) -> torch.Tensor:
    """The draft -> target offsets `d2t` [draft_vocab] int64, checked: integers, mapping into
    the target vocabulary one to one, and agreeing with `t2d` when the head has one."""
    draft, target = cfg.draft_vocab_size, cfg.target_vocab_size
    if "d2t" not in weights:
        if draft != target:
            raise SpeculantError(
                f"{source} has draft_vocab_size {draft} < target vocabulary "
                f"{target} but no 'd2t' tensor to map draft ids to target ids"
            )
        return torch.zeros(draft, dtype=torch.int64)
    raw = weights["d2t"]
    if raw.is_floating_point() or raw.is_complex() or raw.dtype == torch.bool:
        raise SpeculantError(
            f"'d2t' in {file_holding(source, 'd2t')} is {raw.dtype}; it must hold integer "
            "offsets (int64); the head is corrupt"
        )
    d2t = raw.to(torch.int64)
    if d2t.shape != (draft,):
        raise SpeculantError(
            f"'d2t' in {source} has shape {tuple(d2t.shape)}, expected "
            f"({draft},) for draft_vocab_size {draft}"
        )
    ids = torch.arange(draft) + d2t
    if bool((ids < 0).any() or (ids >= target).any()) or ids.unique().numel() != draft:
        raise SpeculantError(
            f"'d2t' in {source} maps draft ids outside the target vocabulary "
            f"{target} or onto the same id; the head is for another target"
        )
    if "t2d" in weights:
        _check_t2d(weights["t2d"], ids, target, file_holding(source, "t2d"))
    return d2t


def _check_t2d(t2d: torch.Tensor, ids: torch.Tensor, target: int, file: str) -> None:
    """`t2d` [target_vocab] marks the target ids in the draft vocabulary: it is rebuilt from
    d2t, but one that disagrees means the head was written wrong (or for another target)."""
    if t2d.is_floating_point() or t2d.is_complex():
        raise SpeculantError(f"'t2d' in {file} is {t2d.dtype}; it must be bool (or 0/1 integers)")
    if t2d.shape != (target,):
        raise SpeculantError(
            f"'t2d' in {file} has shape {tuple(t2d.shape)}, expected ({target},) for the "
            f"target vocabulary {target}; the head is for another target"
        )
    expected = torch.zeros(target, dtype=torch.bool)
    expected[ids] = True
    if not torch.equal(t2d != 0, expected) or bool(((t2d != 0) & (t2d != 1)).any()):
        raise SpeculantError(
            f"'t2d' in {file} marks {int((t2d != 0).sum())} target ids, not the {ids.numel()} "
            "that 'd2t' maps to; the head is corrupt"
        )


def _refuse_unused_norms(weights: dict, cfg: Eagle3Config, source: str) -> None:
    """Norm tensors the head is not built with would be dropped: refuse instead. EAGLE-3.1 norms
    the config does not switch on, and q/k norms (Qwen3 layers) in a head of Llama layers."""
    for key, flag, on in (
        ("input_norm.", "norm_before_fc", cfg.norm_before_fc),
        ("fc_norm.", "fc_norm", cfg.fc_norm),
    ):
        stray = next((k for k in weights if k.startswith(key)), None)
        if stray is not None and not on:
            raise SpeculantError(
                f"{source} holds {stray!r} but {flag} is not true in its config.json; "
                f"set {flag}: true (the head was trained with it)"
            )
    qk_norms = sorted(k for k in weights if _QK_NORM_KEY.match(k))
    if qk_norms and not cfg.layer.qk_norm:
        fix = (
            'transformer_layer_config.model_type "qwen3"'
            if cfg.speculators
            else f'architectures ["{QWEN3_EAGLE3_ARCHITECTURES[0]}"]'
        )
        raise SpeculantError(
            f"{source} holds q/k norm tensors {', '.join(map(repr, qk_norms))} but "
            f"{cfg.layers_named_by} in {cfg.source} builds Llama layers without them; a head "
            f"with Qwen3 layers says so with {fix} in its config.json"
        )


def dummy_d2t(draft_vocab: int, target_vocab: int, seed: int = 0) -> torch.Tensor:
    """Offsets for random weights: identity for equal vocabularies, else a random sorted subset."""
    if draft_vocab == target_vocab:
        return torch.zeros(draft_vocab, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed % 2**64)  # any integer seed
    ids = torch.randperm(target_vocab, generator=gen)[:draft_vocab].sort().values
    return ids - torch.arange(draft_vocab)


def load_eagle3(
    path: str | Path,
    target_cfg: ModelConfig,
    device: str | torch.device,
    dtype: torch.dtype,
    pctx: ParallelContext,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
) -> Eagle3Head:
    """Build the head of folder `path` for `target_cfg` and load its published weights
    (`load_format="dummy"`: random weights, no weight files needed)."""
    check_load_format(load_format)
    cfg = Eagle3Config.from_dir(path, target_cfg)
    check_tp_split(cfg.layer, pctx.tp_size, "EAGLE-3 head", path, cfg.source)
    if cfg.sliding_window is not None and cfg.sliding_window < max_positions:
        raise SpeculantError(
            f"sliding_window={cfg.sliding_window} in {cfg.source} is shorter than the "
            f"{max_positions} positions a request may reach (--max-model-len + 2 x (k + 1)), and "
            "windowed attention is not supported; lower --max-model-len"
        )
    weights, source = ({}, str(path)) if load_format == "dummy" else read_head_weights(path)
    # vLLM embeds a speculators head with the table it ships (build_drafter shares equal ones)
    cfg.head_embeddings = cfg.speculators and "embed_tokens.weight" in weights
    with default_device_and_dtype(device, dtype):
        head = Eagle3Head(cfg, target_cfg, max_positions, pctx)
    if load_format == "dummy":
        init_dummy_weights(head, seed)
        head.set_vocab_map(dummy_d2t(cfg.draft_vocab_size, cfg.target_vocab_size, seed).to(device))
        return head.eval()
    keys = published_keys(cfg, _layer_prefix(weights, cfg.num_layers))
    require_tensors(weights, keys, source, "head", "an EAGLE-3 head")
    _refuse_unused_norms(weights, cfg, source)
    d2t = _checked_d2t(weights, cfg, source)
    # the vocabulary maps are buffers; a head as wide as its target embeds with the target's table
    skip = {"d2t", "t2d"} | (set() if cfg.own_embeddings else {"embed_tokens.weight"})
    tensors = ((k, t) for k, t in weights.items() if k not in skip)
    load_weights(head, tensors, source, rename=our_name, refuse_dropped="EAGLE-3 head")
    head.set_vocab_map(d2t.to(device))
    return head.eval()
