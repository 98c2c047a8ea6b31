"""DFlash2: a DFLASH drafter (drafter/dflash.py) with grouped dynamic causal convolutions around
every layer's attention and MLP, and a candidate selector that drafts the block as a chain over
each position's top-k tokens (z-lab/dflash `DFlash2DraftModel` checkpoints).

Conventions, from the published `dflash/model.py`:

- Convolutions (`attention_conv`, `mlp_conv` per layer; `conv_kernel_size` K, `conv_group_size`
  g): `prepare(x)` projects the normed block rows x to dynamic taps
  `kernel_projection(x)` -> [2, K, H / g]; it returns conv(x, base_kernel[0], taps[0]) and keeps
  taps[1] for `finish(y) = conv(y, base_kernel[1], taps[1])` on the sublayer's output. The conv
  is causal over the block only: out[t] = sum_{o < K} (base[o] + taps[t, o, group]) * in[t - o],
  rows before the block's first are zero. The context rows (target features) are never
  convolved, so nothing carries from one step to the next: each step's block [newest, mask x k]
  is convolved afresh, and the paged context K/V stay as DFLASH keeps them.
- Candidate selector (`selector_rank` r, `selector_top_k` K): the top-K tokens of each block
  position's logits are its candidates; position i scores candidate c by
  `logit(c) + <predecessor_codebook[prev] * hidden_projection(h_i), successor_codebook[c]>`,
  prev the token chosen at position i - 1 (the newest token for the first draft). Greedy takes
  the best score; sampling draws from q = softmax(scores / T) over the K candidates (the request's
  temperature; no top-k / top-p on q, as the reference). q, scattered to the target vocabulary,
  is the Proposal's probs, so verify's rejection sampling is exact.
- Fields `selector_rank`, `selector_top_k`, `conv_kernel_size`, `conv_group_size` are read from
  `dflash_config` first, then the top level (the reference's `_draft_value`); all four are
  required. Tensors `candidate_selector.{predecessor,successor}_codebook` load with or without a
  `.weight` suffix (the reference's `from_pretrained` maps the bare published names;
  `save_pretrained` writes `.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from speculant.comm.groups import ParallelContext
from speculant.config import ModelConfig, config_dict, config_int, read_hf_config
from speculant.drafter.base import Proposal
from speculant.drafter.dflash import (
    DFlashConfig,
    DFlashDrafter,
    DFlashLayer,
    DFlashModel,
    build_block_drafter,
    published_keys,
)
from speculant.drafter.eagle import ReplicatedLinear, _copy_whole
from speculant.errors import SpeculantError
from speculant.executor.sampling import GREEDY, SCALED, filtered_probs, race

CODEBOOKS = ("predecessor_codebook", "successor_codebook")


@dataclass
class DFlash2Config(DFlashConfig):
    """A DFLASH config plus the selector's and the convolutions' sizes."""

    selector_rank: int = 0
    selector_top_k: int = 0
    conv_kernel_size: int = 0
    conv_group_size: int = 0

    @classmethod
    def from_dir(cls, path: str | Path, target: ModelConfig) -> DFlash2Config:
        base = DFlashConfig.from_dir(path, target, dflash2=True)
        hf = read_hf_config(path)
        source = base.source
        merged = {**hf, **config_dict(hf, "dflash_config", source)}  # as _draft_value reads
        # vocab_size == the target's: DFlashConfig checks it (the codebooks are indexed by it)
        sizes = {name: config_int(merged, name, source) for name in (
            "selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size"
        )}  # fmt: skip
        if sizes["selector_top_k"] > target.vocab_size:
            raise SpeculantError(
                f"selector_top_k={sizes['selector_top_k']} in {source} exceeds the target "
                f"vocabulary {target.vocab_size}; fix config.json"
            )
        group, H = sizes["conv_group_size"], base.layer.hidden_size
        if H % group:
            raise SpeculantError(
                f"conv_group_size={group} in {source} does not divide hidden_size {H}; "
                "fix config.json"
            )
        return cls(**{f.name: getattr(base, f.name) for f in fields(base)}, **sizes)


def grouped_dynamic_conv(
    x: torch.Tensor, taps: torch.Tensor, base: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Causal over the block: x [bs, T, H], taps [bs, T, K, G] (G = H / group_size), base
    [K, H]; out[t] = sum_o (base[o] + taps[t, o, group]) * x[t - o], x before the block zero."""
    bs, T, H = x.shape
    groups = H // group_size
    blocks = x.view(bs, T, groups, group_size)
    out = torch.zeros_like(blocks)
    for offset in range(min(base.shape[0], T)):  # taps past the block's start see only zeros
        values = blocks if offset == 0 else F.pad(blocks[:, :-offset], (0, 0, 0, 0, offset, 0))
        out = out + base[offset].view(1, 1, groups, group_size).to(x.dtype) * values
        out = torch.addcmul(out, taps[:, :, offset, :, None], values)
    return out.view_as(x)


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(
            torch.empty(2, kernel_size, hidden_size), requires_grad=False
        )
        self.base_kernel.weight_loader = _copy_whole
        self.kernel_projection = ReplicatedLinear(hidden_size, 2 * kernel_size * self.groups, False)

    def prepare(self, x: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [bs * T, H] (blocks of T rows) -> (conv with base_kernel[0], the finish taps)."""
        x = x.view(-1, T, x.shape[-1])
        taps = self.kernel_projection(x).view(*x.shape[:2], 2, self.kernel_size, self.groups)
        out = grouped_dynamic_conv(x, taps[:, :, 0], self.base_kernel[0], self.group_size)
        return out.flatten(0, 1), taps[:, :, 1]

    def finish(self, y: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        y = y.view(*taps.shape[:2], y.shape[-1])
        return grouped_dynamic_conv(y, taps, self.base_kernel[1], self.group_size).flatten(0, 1)


class DFlash2Layer(DFlashLayer):
    def __init__(self, cfg: DFlash2Config, layer_id: int, pctx: ParallelContext):
        lc = cfg.layer
        super().__init__(lc, layer_id, pctx)
        args = (lc.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.attention_conv = GroupedDynamicCausalConv(*args)
        self.mlp_conv = GroupedDynamicCausalConv(*args)
        self.block_tokens = 0  # rows per block (k + 1), set by DFlash2Drafter

    def forward(self, context, rope_context, h, rope_block, attn) -> torch.Tensor:
        T = self.block_tokens
        x, taps = self.attention_conv.prepare(self.input_layernorm(h), T)
        h = h + self.attention_conv.finish(
            self.self_attn(context, rope_context, x, rope_block, attn), taps
        )
        x, taps = self.mlp_conv.prepare(self.post_attention_layernorm(h), T)
        return h + self.mlp_conv.finish(self.mlp(x), taps)


class Codebook(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, rank), requires_grad=False)
        self.weight.weight_loader = _copy_whole


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        vocab, rank = cfg.layer.vocab_size, cfg.selector_rank
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = Codebook(vocab, rank)
        self.successor_codebook = Codebook(vocab, rank)
        self.hidden_projection = ReplicatedLinear(cfg.layer.hidden_size, rank, False)


class DFlash2Model(DFlashModel):
    def __init__(self, cfg: DFlash2Config, max_positions: int, pctx: ParallelContext):
        super().__init__(cfg, max_positions, pctx)
        self.candidate_selector = CandidateSelector(cfg)

    def make_layer(self, cfg: ModelConfig, layer_id: int, pctx: ParallelContext) -> nn.Module:
        return DFlash2Layer(self.config, layer_id, pctx)


def dflash2_keys(cfg: DFlash2Config) -> list[str]:
    keys = published_keys(cfg)
    for i in range(cfg.num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            keys += [
                f"layers.{i}.{conv}.base_kernel",
                f"layers.{i}.{conv}.kernel_projection.weight",
            ]
    keys += [f"candidate_selector.{name}.weight" for name in CODEBOOKS]
    return keys + ["candidate_selector.hidden_projection.weight"]


def _with_weight_suffix(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The published bare codebook names as the module's `.weight` names."""
    bare = {f"candidate_selector.{name}" for name in CODEBOOKS}
    return {f"{k}.weight" if k in bare else k: t for k, t in weights.items()}


def load_dflash2(
    path: str | Path,
    target_cfg: ModelConfig,
    device: str | torch.device,
    dtype: torch.dtype,
    pctx: ParallelContext,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
) -> DFlash2Model:
    """Build the DFlash2 drafter of folder `path` for `target_cfg` and load its weights
    (`load_format="dummy"`: random weights, only config.json needed)."""
    cfg = DFlash2Config.from_dir(path, target_cfg)
    return build_block_drafter(
        DFlash2Model, cfg, dflash2_keys(cfg), "a DFlash2 drafter", path, device, dtype, pctx,
        max_positions, load_format, seed, rename=_with_weight_suffix,
    )  # fmt: skip


class DFlash2Drafter(DFlashDrafter):
    """DFLASH's block forward (its convolutions inside the layers), then the candidate selector's
    chain over the k block positions: argmax for greedy rows, else sampled from q over each
    position's top-k candidates with the draft random stream at the drafted token's position.
    Static shapes throughout (the chain is unrolled over k), so it captures in the step graph."""

    def __init__(self, model: DFlash2Model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        for layer in model.layers:
            layer.block_tokens = self.k + 1

    def draft(self, hidden, logits, newest, block_positions, sampling, variant) -> Proposal:
        selector = self.model.candidate_selector
        unary, candidates = logits.float().topk(selector.top_k, dim=-1)  # [bs, k, K]
        projected = selector.hidden_projection(hidden).float()  # [bs, k, r]
        successors = F.embedding(candidates, selector.successor_codebook.weight).float()
        predecessors = selector.predecessor_codebook.weight
        previous = newest
        drafts, probs = [], []
        for i in range(self.k):  # draft i is the token at block_start + 1 + i
            pair = F.embedding(previous, predecessors).float() * projected[:, i]
            scores = unary[:, i] + torch.einsum("br,bkr->bk", pair, successors[:, i])
            index = scores.argmax(-1)
            if variant != GREEDY:
                # temperature only over the candidates: SCALED ranks nothing (top-k / top-p off)
                q = filtered_probs(scores, sampling.temperature, sampling.top_k, sampling.top_p,
                                   None, SCALED)  # fmt: skip
                drawn = race(q, sampling.seed, block_positions[:, i + 1], self.draft_stream,
                             candidates[:, i])  # fmt: skip
                index = torch.where(sampling.is_greedy, index, drawn)
                if not self.match_samples:  # verify by match needs no q
                    probs.append(torch.zeros_like(logits[:, i]).scatter_(-1, candidates[:, i], q))
            previous = candidates[:, i].gather(-1, index[:, None])[:, 0]
            drafts.append(previous)
        return self.proposal(drafts, probs or [None])
