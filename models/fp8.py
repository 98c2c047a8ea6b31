"""FP8 linear weights as published (config.QuantConfig): the e4m3 weight and its scales on a
tensor-parallel linear layer of models/layers.py, how the scales shard with the weight, and the
torch reference forward (dequantise to the activation dtype, then F.linear); on the Triton
backend the forward runs kernels/fp8.py's kernels instead. Qwen3-MoE experts (Fp8Experts) load
the published per-expert block-, channel- or tensor-scaled layouts and dequantise in their
forward."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from speculant.config import FP8_BLOCK, QuantConfig
from speculant.errors import SpeculantError
from speculant.models.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

FP8 = torch.float8_e4m3fn
# PDL modes (kernels/runtime.py launch_modes) for the small kernels between a dense model's FP8
# projections: each lets its successor launch before its own wait, so that the next FP8 GEMV
# loads its weight rows into registers while the kernel before finishes. The 8B graph decode
# step on one H100: 3.46-3.52 vs 3.58-3.60 ms at bs 1 (EAGLE-3 k=3: 5.71 vs 5.78), bs 64
# unchanged; bf16 projections are slower with it (5.80-5.86 vs 5.72 ms), so only FP8 models set
# it (results/wave24.md).
FP8_LAUNCH_MODES = {"norm": 2, "act": 2, "merge": 2, "attention": 2}
BLOCK = FP8_BLOCK[0]  # rows and columns of one scale block (128 x 128)
# our merged projection -> the HF modules it is loaded from (see loader.STACKED_PARAMS)
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
DUMMY_RANGE = 64.0  # dummy FP8 weights are N(0, 64^2) in e4m3; their scales bring them back


def _blocks(size: int) -> int:
    return -(-size // BLOCK)


def _scale_param(*shape: int, device: torch.device, kind: str) -> nn.Parameter:
    param = nn.Parameter(torch.ones(*shape, dtype=torch.float32, device=device), False)
    param.fp8_scale = kind  # scales stay float32 whatever the model dtype
    return param


class Fp8Linear:
    """The FP8 state of one TP linear layer (`layer.fp8`): the layer's `weight` holds this
    rank's e4m3 shard and `weight_scale(_inv)` / `input_scale` its scales, laid out per merged
    part: block scales as ceil(rows/128) x ceil(cols/128) per part, channel scales [rows, 1],
    tensor and input scales one per part."""

    def __init__(self, quant: QuantConfig, layer: nn.Module, name: str):
        self.quant, self.name = quant, name
        self.tp, self.rank = layer.pctx.tp_size, layer.pctx.tp_rank
        self.row_parallel = isinstance(layer, RowParallelLinear)
        out_rows, in_cols = layer.weight.shape
        self.part_sizes = [out_rows] if self.row_parallel else list(layer.shard_sizes)
        self.in_features = in_cols
        self.kv_replicas = getattr(layer, "kv_replicas", 1)
        self.head_dim = getattr(layer, "head_dim", 0)
        self.part_index = {"q": 0, "k": 1, "v": 2} if isinstance(layer, QKVParallelLinear) else None
        if quant.strategy == "block":
            self._check_blocks()

    def _check_blocks(self) -> None:
        if self.tp == 1:
            return
        if self.row_parallel:
            split = [("input columns", self.in_features)]
        else:
            split = [("output rows", size) for size in self.part_sizes]
        if self.kv_replicas > 1:
            split.append(("rows per replicated KV head", self.head_dim))
        for what, size in split:
            if size % BLOCK:
                raise SpeculantError(
                    f"{self.name}: tp={self.tp} leaves {size} {what} per rank, which splits a "
                    f"{BLOCK}x{BLOCK} FP8 scale block; use a tp size that keeps whole blocks"
                )

    def convert(self, layer: nn.Module) -> None:
        """Swap the layer's float weight for an e4m3 one of the same shape and add its scales."""
        old = layer.weight
        weight = nn.Parameter(torch.empty(old.shape, dtype=FP8, device=old.device), False)
        weight.weight_loader = old.weight_loader
        shard_ids = getattr(old, "shard_ids", (None,))
        weight.shard_ids = shard_ids
        layer.weight, device, parts = weight, old.device, len(self.part_sizes)
        strategy = self.quant.strategy
        if strategy == "block":
            rows = sum(_blocks(size) for size in self.part_sizes)
            scale = _scale_param(rows, _blocks(self.in_features), device=device, kind="block")
            scale.weight_loader = self._load_block_scale
        elif strategy == "channel":
            scale = _scale_param(sum(self.part_sizes), 1, device=device, kind="channel")
            # column layers shard these rows like the weight's; row layers keep every row
            scale.weight_loader = self._load_whole if self.row_parallel else old.weight_loader
        else:
            scale = _scale_param(parts, device=device, kind="tensor")
            scale.weight_loader = self._load_part_scalar
        scale.shard_ids = shard_ids
        layer.register_parameter(self.quant.scale_name, scale)
        if self.quant.static_input:
            input_scale = _scale_param(parts, device=device, kind="tensor")
            input_scale.weight_loader, input_scale.shard_ids = self._load_part_scalar, shard_ids
            layer.register_parameter("input_scale", input_scale)
        layer.fp8 = self

    def _index(self, shard) -> int:
        if self.part_index is not None:
            return self.part_index[shard]
        return 0 if shard is None else shard

    @staticmethod
    def _load_whole(param: torch.Tensor, loaded: torch.Tensor, shard=None) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
        param.data.copy_(loaded)

    def _load_part_scalar(self, param: torch.Tensor, loaded: torch.Tensor, shard=None) -> None:
        if loaded.numel() != 1:
            raise ValueError(f"expected one per-tensor scale, got shape {tuple(loaded.shape)}")
        param.data[self._index(shard)] = loaded.reshape(())

    def _load_block_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard=None) -> None:
        index = self._index(shard)
        size, cols = self.part_sizes[index], _blocks(self.in_features)
        if index > 0 and self.kv_replicas > 1:  # replicated KV heads bring their scale rows
            per_head = self.head_dim // BLOCK
            loaded = loaded.view(-1, per_head, loaded.shape[-1])
            loaded = loaded.repeat_interleave(self.kv_replicas, dim=0).flatten(0, 1)
        if self.row_parallel:
            full = (_blocks(size), _blocks(self.in_features * self.tp))
            part = loaded.narrow(1, self.rank * cols, cols) if self.tp > 1 else loaded
        else:
            full = (_blocks(size * self.tp), cols)
            rows = _blocks(size)
            part = loaded.narrow(0, self.rank * rows, rows) if self.tp > 1 else loaded
        if tuple(loaded.shape) != full:
            raise ValueError(f"expected block scales of shape {full}, got {tuple(loaded.shape)}")
        offset = sum(_blocks(s) for s in self.part_sizes[:index])
        param.data.narrow(0, offset, part.shape[0]).copy_(part)

    def scale(self, layer: nn.Module) -> torch.Tensor:
        """The scale of every weight element, broadcastable to the weight (float32)."""
        scale = getattr(layer, self.quant.scale_name)
        if self.quant.strategy == "channel":
            return scale
        if self.quant.strategy == "tensor":  # python sizes: no host-to-device copy in a graph
            parts = [scale[i : i + 1].expand(size) for i, size in enumerate(self.part_sizes)]
            return torch.cat(parts).unsqueeze(1)
        parts = scale.split([_blocks(size) for size in self.part_sizes])
        rows = [
            part.repeat_interleave(BLOCK, dim=0)[:size]
            for part, size in zip(parts, self.part_sizes, strict=True)
        ]
        return torch.cat(rows).repeat_interleave(BLOCK, dim=1)[:, : self.in_features]

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight as `dtype`: e4m3 times its scale, multiplied in float32 (float64
        when asked for float64)."""
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        return (layer.weight.to(wide) * self.scale(layer).to(wide)).to(dtype)

    def linear(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None):
        """x W^T (+ bias): the Triton FP8 kernels (kernels/fp8.py) where the layer's `gemv` is
        set (the Triton backend, enable_gemv) and they run on x, else the reference forward:
        dequantised weight, activations as they come (a static `input_scale` is not applied:
        the kernels quantise activations dynamically, where they do at all)."""
        if layer.gemv is not None:
            from speculant.kernels import fp8 as kernels  # imports triton

            args = self.kernel_scale(layer)
            if args is not None and kernels.supports(x, layer.weight):
                return kernels.linear(x, layer.weight, *args, bias)
        return F.linear(x, self.dequantize(layer, x.dtype), bias)

    def kernel_scale(self, layer: nn.Module) -> tuple[torch.Tensor, str] | None:
        """(scale, mode) as kernels/fp8.py takes them: the block scales when every merged part
        has whole 128-row blocks (then the parts' blocks stack into one matrix's layout), else
        None (the reference); per-channel and per-tensor scales as one float32 per row (the
        tensor form cached, rebuilt when the scale parameter changes)."""
        scale = getattr(layer, self.quant.scale_name)
        if self.quant.strategy == "block":
            whole = len(self.part_sizes) == 1 or all(s % BLOCK == 0 for s in self.part_sizes)
            return (scale, "block") if whole else None
        if self.quant.strategy == "channel":
            return scale.view(-1), "row"
        key = (scale.data_ptr(), scale._version)
        cached = getattr(self, "_row_scale", None)
        if cached is None or cached[0] != key:
            cached = self._row_scale = (key, self.scale(layer).reshape(-1).contiguous())
        return cached[1], "row"

    @torch.no_grad()
    def init_dummy(self, layer: nn.Module, gen: torch.Generator) -> None:
        """Random e4m3 weights and scales whose product has the dense dummy init's spread."""
        weight = layer.weight
        values = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        values.normal_(0.0, DUMMY_RANGE, generator=gen).clamp_(-448.0, 448.0)
        weight.copy_(values.to(FP8))
        scale = getattr(layer, self.quant.scale_name)
        scale.uniform_(0.5, 1.5, generator=gen).mul_(self.in_features**-0.5 / DUMMY_RANGE)
        if self.quant.static_input:
            layer.input_scale.fill_(1.0)


def hf_module_names(name: str) -> tuple[str, ...]:
    """The checkpoint modules our module `name` is loaded from (q/k/v for qkv_proj, ...)."""
    prefix, _, leaf = name.rpartition(".")
    return tuple(f"{prefix}.{part}" for part in MERGED[leaf]) if leaf in MERGED else (name,)


def is_ignored(hf_name: str, ignore: tuple[str, ...]) -> bool:
    """compressed-tensors / fp8 `ignore` entries: "re:" regexes matched from the start, or
    module names matched as whole dotted components ("lm_head", "layers.0.mlp.down_proj")."""
    parts = hf_name.split(".")
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], hf_name):
                return True
            continue
        want = entry.split(".")
        if any(parts[i : i + len(want)] == want for i in range(len(parts) - len(want) + 1)):
            return True
    return False


class Fp8Experts:
    """The FP8 state of a Qwen3-MoE `Experts` module (`experts.fp8`): e4m3 gate_up_proj
    [E_local, 2I, H] and down_proj [E_local, H, I] and their scales, loaded from the published
    per-expert `experts.{j}.{gate,up,down}_proj.weight` + `weight_scale_inv` (fp8 block 128x128,
    Qwen3-*-FP8), per channel `weight_scale` (compressed-tensors, e.g. RedHatAI *-FP8-dynamic)
    or per tensor `weight_scale` (compressed-tensors static *-FP8, AutoFP8): gate_up_proj_<scale>
    [E_local, 2 ceil(I/128), ceil(H/128)] (gate's blocks first) and down_proj_<scale>
    [E_local, ceil(H/128), ceil(I/128)] for blocks, [E_local, 2I, 1] and [E_local, H, 1] per
    channel, [E_local, 2] (gate's, up's: each part keeps its own) and [E_local, 1] per tensor.
    Static `input_scale`s load into gate_up_proj_input_scale [E_local, 2] and
    down_proj_input_scale [E_local, 1], unused like the dense layers'. The forward dequantises
    the local experts to the activation dtype and runs the float expert paths."""

    PROJS = ("gate_up_proj", "down_proj")

    def __init__(self, quant: QuantConfig, experts: nn.Module, name: str):
        self.quant, self.name = quant, name
        self.scale_names = tuple(f"{p}_{quant.scale_name}" for p in self.PROJS)

    def _scale_shape(self, proj: str, inter: int, shape: torch.Size) -> tuple[int, ...]:
        local, rows, cols = shape
        if self.quant.strategy == "tensor":  # one per part (gate, up), like the input scales
            return (local, 2 if proj == "gate_up_proj" else 1)
        if self.quant.strategy == "channel":
            return (local, rows, 1)
        row_blocks = 2 * _blocks(inter) if proj == "gate_up_proj" else _blocks(rows)
        return (local, row_blocks, _blocks(cols))

    def convert(self, experts: nn.Module) -> None:
        inter = experts.intermediate
        for proj, scale_name in zip(self.PROJS, self.scale_names, strict=True):
            old = getattr(experts, proj)
            weight = nn.Parameter(torch.empty(old.shape, dtype=FP8, device=old.device), False)
            weight.weight_loader, weight.shard_ids = old.weight_loader, old.shard_ids
            setattr(experts, proj, weight)
            shape = self._scale_shape(proj, inter, old.shape)
            scale = _scale_param(*shape, device=old.device, kind=self.quant.strategy)
            scale.weight_loader, scale.shard_ids = self._load_scale(experts), old.shard_ids
            experts.register_parameter(scale_name, scale)
            if self.quant.static_input:
                parts = 2 if proj == "gate_up_proj" else 1
                inputs = _scale_param(old.shape[0], parts, device=old.device, kind="tensor")
                inputs.weight_loader, inputs.shard_ids = self._load_scale(experts), old.shard_ids
                experts.register_parameter(f"{proj}_input_scale", inputs)
        experts.fp8 = self

    @staticmethod
    def _load_scale(experts: nn.Module):
        def load(param: torch.Tensor, loaded: torch.Tensor, shard=None) -> None:
            if shard is None:  # a fused [E, ...] tensor
                full = (experts.num_experts, *param.shape[1:])
                if tuple(loaded.shape) != full:
                    raise ValueError(f"expected shape {full}, got {tuple(loaded.shape)}")
                param.data.copy_(loaded.narrow(0, experts.first, experts.num_local))
                return
            expert, part = shard
            if not experts.first <= expert < experts.first + experts.num_local:
                return
            dst = param.data[expert - experts.first]
            if part is not None:
                rows = dst.shape[0] // 2
                dst = dst.narrow(0, part * rows, rows)
            if dst.numel() == 1 and loaded.numel() == 1:  # a per-tensor scale: [] or [1]
                loaded = loaded.reshape(dst.shape)
            if dst.shape != loaded.shape:
                raise ValueError(f"expected shape {tuple(dst.shape)}, got {tuple(loaded.shape)}")
            dst.copy_(loaded)

        return load

    def scale(self, experts: nn.Module, proj: str) -> torch.Tensor:
        """The scale of every element of `proj`, broadcastable to its [E_local, rows, cols]."""
        scale = getattr(experts, f"{proj}_{self.quant.scale_name}")
        inter, (rows, cols) = experts.intermediate, getattr(experts, proj).shape[1:]
        if self.quant.strategy == "channel":
            return scale
        if self.quant.strategy == "tensor":  # [E_local, parts] -> one per row, part by part
            return scale.repeat_interleave(rows // scale.shape[1], dim=1).unsqueeze(2)
        if proj == "gate_up_proj":  # each part's blocks start at its first row
            parts = scale.chunk(2, dim=1)
            full = torch.cat([p.repeat_interleave(BLOCK, 1)[:, :inter] for p in parts], 1)
        else:
            full = scale.repeat_interleave(BLOCK, 1)[:, :rows]
        return full.repeat_interleave(BLOCK, 2)[:, :, :cols]

    def dequantize(self, experts: nn.Module, dtype: torch.dtype):
        """(gate_up_proj, down_proj) as `dtype`, multiplied in float32 (float64 if asked)."""
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        out = []
        for proj in self.PROJS:
            weight, scale = getattr(experts, proj), self.scale(experts, proj)
            out.append((weight.to(wide) * scale.to(wide)).to(dtype))
        return out[0], out[1]

    @torch.no_grad()
    def init_dummy(self, experts: nn.Module, gen: torch.Generator) -> None:
        """Random e4m3 weights and scales with the dense dummy init's spread."""
        for proj, scale_name in zip(self.PROJS, self.scale_names, strict=True):
            weight = getattr(experts, proj)
            values = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
            values.normal_(0.0, DUMMY_RANGE, generator=gen).clamp_(-448.0, 448.0)
            weight.copy_(values.to(FP8))
            scale = getattr(experts, scale_name)
            scale.uniform_(0.5, 1.5, generator=gen).mul_(weight.shape[-1] ** -0.5 / DUMMY_RANGE)
            if self.quant.static_input:
                getattr(experts, f"{proj}_input_scale").fill_(1.0)


def _experts_ignored(name: str, num_experts: int, ignore: tuple[str, ...]) -> bool:
    """Whether a layer's experts stay in their stored dtype: the experts module itself ignored,
    or every expert's gate, up and down projection named. Only some of them ignored cannot be
    one fused FP8 tensor: an error naming the first FP8 one and the first ignored one."""
    if is_ignored(name, ignore):
        return True
    names = [
        f"{name}.{e}.{p}" for e in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj")
    ]
    ignored = [is_ignored(n, ignore) for n in names]
    if all(ignored):
        return True
    if any(ignored):
        kept = names[ignored.index(False)]
        skipped = names[ignored.index(True)]
        raise SpeculantError(
            f"quantization_config ignores {skipped} but not {kept}: a layer's experts load as "
            f"one FP8 tensor ({name}); ignore all of its experts' projections or none"
        )
    return False


def quantize_linears(model: nn.Module, quant: QuantConfig) -> int:
    """Give every linear layer of `model` that `quant` does not ignore its FP8 weight and
    scales (the loader then fills them); returns how many layers were converted. A merged
    projection whose parts are ignored only in part cannot be one FP8 matrix: an error."""
    converted = 0
    for name, module in list(model.named_modules()):
        if hasattr(module, "gate_up_proj") and hasattr(module, "intermediate"):  # MoE experts
            if not _experts_ignored(name, module.num_experts, quant.ignore):
                Fp8Experts(quant, module, name).convert(module)
                converted += 1
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        ignored = [is_ignored(hf_name, quant.ignore) for hf_name in hf_module_names(name)]
        if all(ignored):
            continue
        if any(ignored):
            raise SpeculantError(
                f"quantization_config ignores only some of {', '.join(hf_module_names(name))}, "
                f"which load as one matrix ({name}); ignore all of them or none"
            )
        Fp8Linear(quant, module, name).convert(module)
        converted += 1
    return converted
