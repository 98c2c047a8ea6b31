"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 attention (q/k norms) with sparse MoE blocks in the
layers `ModelConfig.moe_layer_ids` names and the dense MLP elsewhere (mlp_only_layers,
decoder_sparse_step).

A sparse block routes each token to its top-k experts (softmax over the router logits in float32,
top-k, renormalised when norm_topk_prob), sends it to the EP rank holding each expert through the
model's `MoeDispatcher`, runs the local experts and combines their weighted outputs. Experts are
split over all ranks (expert e on rank e // (num_experts / world_size)); attention, norms, router
and dense MLPs follow the dense DP x TP layout of models/llama.py, which this file reuses.

Checkpoints: the HF-hub layout (`mlp.gate.weight` [E, H], `mlp.experts.{j}.{gate,up,down}_proj.
weight`) and transformers-5's fused layout (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]) both load (see loader.EXPERT_PARAM)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from speculant.comm.groups import ParallelContext
from speculant.comm.moe_dispatch import (
    AllToAllDispatcher,
    ExpertTokens,
    LocalDispatcher,
    MoeDispatcher,
    is_capturing,
)
from speculant.config import ModelConfig, MoeConfig
from speculant.errors import SpeculantError
from speculant.models.layers import _copy_checked, _param, _plain_loader
from speculant.models.llama import CausalLM

log = logging.getLogger("speculant")
MOE_BACKENDS = ("auto", "local", "all2all", "deepep")
DENSE_EXPERT_ROWS = 2048  # eager: padded buffers up to this many rows run as two batched matmuls


class Router(nn.Module):
    """`mlp.gate`: replicated [E, H] logits -> top-k expert ids and weights (as transformers:
    logits in the model dtype, softmax in float32, weights rounded to the model dtype)."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, renormalise: bool):
        super().__init__()
        self.top_k, self.renormalise = top_k, renormalise
        self.weight = _param(num_experts, hidden)
        self.weight.weight_loader = _plain_loader

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype).float()


class Experts(nn.Module):
    """This rank's experts, fused like transformers-5: gate_up_proj [E_local, 2I, H] (gate rows
    first) and down_proj [E_local, H, I]."""

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, first: int, num_local: int
    ):
        super().__init__()
        self.num_experts, self.first, self.num_local = num_experts, first, num_local
        self.intermediate = intermediate
        self.gate_up_proj = _param(num_local, 2 * intermediate, hidden)
        self.down_proj = _param(num_local, hidden, intermediate)
        local = range(first, first + num_local)
        self.gate_up_proj.shard_ids = tuple((e, part) for e in local for part in (0, 1))
        self.down_proj.shard_ids = tuple((e, None) for e in local)
        self.gate_up_proj.weight_loader = self.down_proj.weight_loader = self._load

    fp8 = None  # an fp8.Fp8Experts once fp8.quantize_linears gives the experts e4m3 weights

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) in `dtype`: FP8 experts dequantised (models/fp8.py)."""
        if self.fp8 is not None:
            return self.fp8.dequantize(self, dtype)
        return self.gate_up_proj, self.down_proj

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard=None) -> None:
        """shard None: a fused [E, ...] tensor; (expert, part): one expert's gate (0), up (1) or
        down (None) matrix, ignored when the expert lives on another rank."""
        if shard is None:
            full = (self.num_experts, *param.shape[1:])
            if tuple(loaded.shape) != full:
                raise ValueError(f"expected shape {full}, got {tuple(loaded.shape)}")
            _copy_checked(param.data, loaded.narrow(0, self.first, self.num_local))
            return
        expert, part = shard
        if not self.first <= expert < self.first + self.num_local:
            return
        dst = param.data[expert - self.first]
        if part is not None:
            dst = dst.narrow(0, part * self.intermediate, self.intermediate)
        _copy_checked(dst, loaded)

    def forward(self, tokens: ExpertTokens, dense: bool | None = None) -> torch.Tensor:
        """SwiGLU of every local expert over its rows -> [E_local, C, H]. `dense` computes every
        row, padding included, in two batched matmuls of fixed shape (the default while capturing
        a graph, and for small buffers); otherwise only the valid rows, in two grouped matmuls
        over the rows packed by expert. Neither reads the counts on the host (no sync); where
        the grouped matmul would (a CUDA tensor it has no kernel for), the dense path runs."""
        x = tokens.hidden
        if dense is None:
            dense = is_capturing() or x.shape[0] * x.shape[1] <= DENSE_EXPERT_ROWS
        gate_up_proj, down_proj = self.weights(x.dtype)
        if dense or not x.numel() or not self._grouped_without_sync(x):
            gate, up = torch.bmm(x, gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
            return torch.bmm(F.silu(gate) * up, down_proj.transpose(1, 2))
        return self._grouped(tokens, gate_up_proj, down_proj)

    def _grouped_without_sync(self, x: torch.Tensor) -> bool:
        """torch._grouped_mm reads its offsets on the device only in its CUDA kernels (bfloat16,
        sm90/sm100; elsewhere it copies them to the host); on the CPU there is no device to wait
        for. Its operands need rows of a multiple of 16 bytes."""
        if not hasattr(torch, "_grouped_mm"):
            return False
        widths = (x.shape[-1], self.intermediate)
        if any(w * x.element_size() % 16 for w in widths):
            return False
        if x.device.type == "cpu":
            return True
        return (
            x.device.type == "cuda"
            and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] in (9, 10)
        )

    def _grouped(
        self, tokens: ExpertTokens, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
    ) -> torch.Tensor:
        """Packs the valid rows expert after expert (row s of the pack is row s - start[e] of the
        expert e whose segment holds s, found on the device), runs both projections as grouped
        matmuls over the segments and scatters the results back. The pack holds
        `tokens.max_rows` rows (a host-known bound) plus one spare; rows past the last segment
        are not computed and land in a dropped row, so padding rows stay unset (combine never
        reads them)."""
        x, counts = tokens.hidden, tokens.counts
        num_local, capacity, width = x.shape
        rows = num_local * capacity
        packed = min(rows, rows if tokens.max_rows is None else tokens.max_rows) + 1
        ends = torch.cumsum(counts, 0, dtype=torch.int32)  # segment e ends at row ends[e]
        slot = torch.arange(packed, dtype=torch.int32, device=x.device)
        expert = torch.searchsorted(ends, slot, right=True)  # num_local past the last segment
        real = expert < num_local
        expert = expert.clamp_max(num_local - 1)
        source = expert * capacity + (slot - ends[expert] + counts[expert])
        source = torch.where(real, source, rows)  # row `rows`: a dropped one, in and out
        flat = x.reshape(rows, width)
        picked = flat.index_select(0, source.clamp_max(rows - 1))
        gate, up = torch._grouped_mm(picked, gate_up_proj.transpose(1, 2), offs=ends).chunk(
            2, dim=-1
        )
        down = torch._grouped_mm(F.silu(gate) * up, down_proj.transpose(1, 2), offs=ends)
        out = x.new_empty(rows + 1, width)
        out.index_copy_(0, source, down)
        return out[:rows].view(num_local, capacity, width)


class SparseMoeBlock(nn.Module):
    """`mlp` of a sparse layer: router, this rank's experts, and the shared dispatcher."""

    def __init__(self, cfg: ModelConfig, dispatcher: MoeDispatcher):
        super().__init__()
        self.gate = Router(
            cfg.num_experts, cfg.hidden_size, cfg.num_experts_per_tok, cfg.norm_topk_prob
        )
        self.experts = Experts(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            dispatcher.first_expert,
            dispatcher.num_local_experts,
        )
        self.dispatcher = dispatcher  # not a module: one object shared by every sparse layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)
        d, outs = self.dispatcher, []
        for c in range(d.num_chunks):  # the same count on every EP rank (begin_forward)
            part = slice(c * d.chunk_tokens, (c + 1) * d.chunk_tokens)
            tokens, handle = d.dispatch(x[part], topk_ids[part], topk_weights[part])
            outs.append(d.combine(self.experts(tokens), handle))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class Qwen3MoeForCausalLM(CausalLM):
    """CausalLM whose sparse layers use SparseMoeBlock; every forward first lets the dispatcher
    plan its dispatches (the same number on every EP rank)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        pctx: ParallelContext,
        dispatcher: MoeDispatcher,
    ):
        sparse = set(cfg.moe_layer_ids)
        super().__init__(
            cfg,
            max_positions,
            pctx,
            make_mlp=lambda i: SparseMoeBlock(cfg, dispatcher) if i in sparse else None,
        )
        self.dispatcher = dispatcher

    def replay_hooks(self) -> list:
        return self.dispatcher.replay_hooks()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn,
        tokens_per_rank: list[int] | None = None,
    ):
        """As CausalLM.forward; the dispatches are planned from `tokens_per_rank` (every rank's
        token count in this forward; None: the dispatcher asks the other ranks)."""
        self.dispatcher.begin_forward(input_ids.shape[0], tokens_per_rank)
        return super().forward(input_ids, positions, attn)


def make_dispatcher(
    cfg: ModelConfig,
    pctx: ParallelContext,
    moe: MoeConfig,
    decode_tokens: int,
    device: torch.device | str,
) -> MoeDispatcher:
    """The dispatcher `moe.backend` names, over all ranks. `decode_tokens` (max_bs * (k + 1)) is
    the default per-rank token limit and the least one may be."""
    if moe.backend not in MOE_BACKENDS:
        raise SpeculantError(
            f"MoE backend {moe.backend!r} is not supported; use one of {', '.join(MOE_BACKENDS)}"
        )
    ep_size, ep_rank = pctx.ep_size, pctx.rank
    limit = moe.max_tokens_per_rank or decode_tokens
    if limit < decode_tokens:
        raise SpeculantError(
            f"moe max_tokens_per_rank={limit} is below one decode step's {decode_tokens} tokens "
            "per rank (max_num_seqs // dp * (k + 1)); raise --moe-max-tokens-per-rank to at "
            f"least {decode_tokens}"
        )
    backend = moe.backend
    if backend == "auto":
        backend = "local" if ep_size == 1 else _auto_backend(cfg, device)
    if backend == "local":
        if ep_size > 1:
            raise SpeculantError(
                f"--moe-backend local keeps every expert on one rank but there are {ep_size} "
                "ranks; use all2all or deepep"
            )
        return LocalDispatcher(cfg.num_experts, limit)
    if ep_size == 1 and (backend == "all2all" or str(device).startswith("cuda")):
        # no process group joins one rank: its first dispatch would fail in torch
        raise SpeculantError(
            f"--moe-backend {backend} moves tokens between ranks but this job has one; use "
            "local (or auto) on one rank, or start several with --tp/--dp"
        )
    if backend == "all2all":
        # pctx.ep_group: every rank, on the device backend (None outside a job: the default group)
        return AllToAllDispatcher(
            cfg.num_experts, ep_size, ep_rank, limit, group=pctx.ep_group, cpu_group=pctx.cpu_group
        )
    from speculant.comm.deepep import DeepEPBuffer, DeepEPDispatcher

    if not str(device).startswith("cuda"):
        raise SpeculantError("--moe-backend deepep needs CUDA; use all2all on the CPU")
    ep = DeepEPBuffer.create(pctx.ep_group, cfg.hidden_size, cfg.num_experts, limit, decode_tokens)
    return DeepEPDispatcher(ep, ep_size, ep_rank, cpu_group=pctx.cpu_group)


def _auto_backend(cfg: ModelConfig, device: torch.device | str) -> str:
    from speculant.comm.deepep import SUPPORTED_HIDDEN_SIZES, deep_ep_installed

    if not str(device).startswith("cuda"):
        return "all2all"
    if deep_ep_installed() and cfg.hidden_size in SUPPORTED_HIDDEN_SIZES:
        return "deepep"
    log.info("MoE tokens move by NCCL all-to-all (DeepEP not installed or hidden size unsupported)")
    return "all2all"
