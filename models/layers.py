"""Building blocks shared by targets and drafters: RMSNorm, RoPE, and tensor-parallel linear and
embedding layers. Every parameter carries a `weight_loader(param, tensor, shard)` that copies its
slice of a full checkpoint tensor, so the loader never needs to know about TP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from speculant.comm.groups import ParallelContext
from speculant.kernels.ops import TORCH_OPS, TorchOps


def project(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ layer.weight^T (+ bias): an FP8 layer's dequantised reference (models/fp8.py), else
    the layer's `gemv` kernel when enable_gemv set one (it takes single rows and hands every
    other shape to F.linear), else F.linear."""
    fp8 = getattr(layer, "fp8", None)  # drafter layers outside this file have no FP8 form
    if fp8 is not None:
        return fp8.linear(layer, x, bias)
    if layer.gemv is not None:
        return layer.gemv(x, layer.weight, bias)
    return F.linear(x, layer.weight, bias)


def enable_gemv(model: nn.Module) -> None:
    """Route the single-row projections of every linear layer in `model` through the Triton
    matrix-vector kernel (kernels/gemv.py); the Triton attention backend's engines do this.
    Imported here, not at module level: importing it imports triton."""
    from speculant.kernels.gemv import linear

    for module in model.modules():
        if hasattr(module, "gemv"):
            module.gemv = linear


def _param(*shape: int) -> nn.Parameter:
    # Allocated on the ambient device and dtype (see loader.build_model); never an fp32 copy.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


def _plain_loader(param: torch.Tensor, loaded: torch.Tensor, shard=None) -> None:
    _copy_checked(param.data, loaded)


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in float32 and cast back like the HF models. `ops` (the
    attention backend's) picks the torch reference or the fused kernel."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)
        self.weight.weight_loader = _plain_loader

    def forward(self, x: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, ops: TorchOps = TORCH_OPS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add fused into the norm."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(pos_freqs: torch.Tensor, head_dim: int, theta: float, scaling: dict):
    """YaRN (as transformers' _compute_yarn_parameters, rounding included): frequencies blended
    between interpolated (/ factor) and extrapolated ones over a ramp of dimensions, and the
    attention factor that scales cos and sin. `pos_freqs`: theta ** (2i / head_dim)."""
    factor = scaling["factor"]
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    old_len = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half), with the frequency scalings of published
    configs (config._rope_settings): llama3, linear, yarn (whose attention factor scales the
    cos/sin tables), and dynamic, which is the default RoPE within max_position_embeddings.
    `lookup` runs once per forward; `apply` is then a roll and two multiply-adds per tensor."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        pos_freqs = theta**exponent
        inv_freq = 1.0 / pos_freqs
        attention_factor = 1.0
        kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(pos_freqs, head_dim, theta, scaling)
        elif kind not in (None, "default", "dynamic"):
            raise ValueError(f"rope scaling type {kind!r} is not supported")
        t = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
        freqs = torch.outer(t, inv_freq)
        # rotate_half(x) * sin == roll(x, d/2) * [-sin, sin] because both halves share frequencies
        sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
        cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1)
        if attention_factor != 1.0:  # in float32 before the cast to the model dtype, as HF
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos", cos.to(torch.get_default_device()), persistent=False)
        self.register_buffer("sin", sin.to(torch.get_default_device()), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype):
        """(cos, sin) rows for `positions`, shaped [N, 1, d] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(
            dtype
        )

    @staticmethod
    def apply(x: torch.Tensor, rope) -> torch.Tensor:
        """x [N, heads, d]. Rounds like the HF models: two products, then their sum."""
        cos, sin = rope
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows over the TP group; outputs stay sharded.
    `output_sizes` lists the full sizes of merged sub-matrices (gate and up, say)."""

    gemv = None  # set by enable_gemv
    fp8 = None  # an fp8.Fp8Linear once fp8.quantize_linears gives the layer an e4m3 weight

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, pctx: ParallelContext
    ):
        super().__init__()
        tp = pctx.tp_size
        for size in output_sizes:
            if size % tp:
                raise ValueError(f"output size {size} is not divisible by tp={tp}")
        self.pctx = pctx
        self.shard_sizes = [s // tp for s in output_sizes]
        shard_ids = self.shard_ids(len(output_sizes))
        self.weight = _param(sum(self.shard_sizes), in_features)
        self.weight.weight_loader, self.weight.shard_ids = self._load, shard_ids
        self.bias = _param(sum(self.shard_sizes)) if bias else None
        if bias:
            self.bias.weight_loader, self.bias.shard_ids = self._load, shard_ids

    @staticmethod
    def shard_ids(count: int) -> tuple:
        """The shard ids the loader must fill for a parameter made of `count` sub-matrices."""
        return tuple(range(count)) if count > 1 else (None,)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        index = 0 if shard is None else shard
        size = self.shard_sizes[index]
        offset = sum(self.shard_sizes[:index])
        full = (size * self.pctx.tp_size, *param.shape[1:])
        if tuple(loaded.shape) != full:
            raise ValueError(f"expected shape {full}, got {tuple(loaded.shape)}")
        part = loaded.narrow(0, self.pctx.tp_rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self, x, self.bias)


def _heads_split(num_heads: int, num_kv_heads: int, tp: int) -> bool:
    """Whether the heads and the (replicated) KV heads divide over tp ranks."""
    return num_heads % tp == 0 and (num_kv_heads * max(1, tp // num_kv_heads)) % tp == 0


def heads_tp_problem(
    num_heads: int, num_kv_heads: int, tp: int, intermediate_size: int | None = None
) -> str | None:
    """Why a model of these attention heads (and dense MLP width) cannot run at tensor-parallel
    size tp, naming the sizes that can; None if it can. The launcher asks before it starts a
    rank; the layers ask again as they are built."""
    def fits(t: int) -> bool:
        return _heads_split(num_heads, num_kv_heads, t) and (
            intermediate_size is None or intermediate_size % t == 0
        )

    if tp >= 1 and fits(tp):
        return None
    sizes = ", ".join(str(t) for t in range(1, num_heads + 1) if fits(t))
    if tp >= 1 and _heads_split(num_heads, num_kv_heads, tp):
        what = f"the MLP's intermediate_size {intermediate_size} is not divisible by"
    elif tp >= 1 and num_heads % tp == 0:
        what = f"{num_kv_heads} KV heads cannot be split over"
    else:
        what = f"{num_heads} attention heads are not divisible by"
    return f"{what} tp={tp}; use --tp {sizes}"


class QKVParallelLinear(ColumnParallelLinear):
    """Merged q, k and v projections; KV heads are replicated when tp exceeds their number."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        pctx: ParallelContext,
    ):
        tp = pctx.tp_size
        if problem := heads_tp_problem(num_heads, num_kv_heads, tp):
            raise ValueError(problem)
        self.kv_replicas = max(1, tp // num_kv_heads)
        self.num_heads = num_heads // tp
        self.num_kv_heads = num_kv_heads * self.kv_replicas // tp
        self.head_dim = head_dim
        kv_full = self.num_kv_heads * tp * head_dim
        super().__init__(hidden, [num_heads * head_dim, kv_full, kv_full], bias, pctx)

    @staticmethod
    def shard_ids(count: int) -> tuple:
        return ("q", "k", "v")

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard=None) -> None:
        index = {"q": 0, "k": 1, "v": 2}[shard]
        if index > 0 and self.kv_replicas > 1:  # whole heads (weight rows, bias entries)
            loaded = (
                loaded.view(-1, self.head_dim, *loaded.shape[1:])
                .repeat_interleave(self.kv_replicas, dim=0)
                .flatten(0, 1)
            )
        super()._load(param, loaded, index)

    def split(self, qkv: torch.Tensor):
        q_size, kv_size = self.shard_sizes[0], self.shard_sizes[1]
        return qkv.split([q_size, kv_size, kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; partial sums are all-reduced over TP."""

    gemv = None  # set by enable_gemv
    fp8 = None  # an fp8.Fp8Linear once fp8.quantize_linears gives the layer an e4m3 weight

    def __init__(self, in_features: int, out_features: int, bias: bool, pctx: ParallelContext):
        super().__init__()
        if in_features % pctx.tp_size:
            raise ValueError(f"input size {in_features} is not divisible by tp={pctx.tp_size}")
        self.pctx = pctx
        self.in_shard = in_features // pctx.tp_size
        self.weight = _param(out_features, self.in_shard)
        self.weight.weight_loader = self._load
        self.bias = _param(out_features) if bias else None
        if bias:
            self.bias.weight_loader = _plain_loader

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard=None) -> None:
        full = (param.shape[0], self.in_shard * self.pctx.tp_size)
        if tuple(loaded.shape) != full:
            raise ValueError(f"expected shape {full}, got {tuple(loaded.shape)}")
        _copy_checked(
            param.data, loaded.narrow(1, self.pctx.tp_rank * self.in_shard, self.in_shard)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pctx.all_reduce_tp(project(self, x))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary ranges over TP (padded to a multiple of tp)."""

    def __init__(self, vocab_size: int, hidden: int, pctx: ParallelContext):
        super().__init__()
        self.pctx = pctx
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // pctx.tp_size)
        self.start = pctx.tp_rank * self.shard
        self.weight = _param(self.shard, hidden)
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard=None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"expected {self.vocab_size} vocabulary rows, got {loaded.shape[0]}")
        rows = loaded[self.start : self.start + self.shard]
        param.data.zero_()
        _copy_checked(param.data[: rows.shape[0]], rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.pctx.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard)
        out = F.embedding(local.clamp(0, self.shard - 1), self.weight) * inside.unsqueeze(-1)
        return self.pctx.all_reduce_tp(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection split by vocabulary; logits are gathered to the full vocabulary."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = F.linear(hidden, self.weight)
        return self.pctx.all_gather_tp(out, dim=-1)[..., : self.vocab_size]
