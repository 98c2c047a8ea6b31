"""Checkpoint loading: Hugging Face safetensors (single file or sharded with an index; every
tensor in exactly one file, the one the index names: `check_tensor_homes`), TP sharding through
each parameter's `weight_loader`, and `dummy` random weights built straight in the target dtype
and device."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from speculant.comm.groups import ParallelContext
from speculant.config import ModelConfig, MoeConfig, read_json_object
from speculant.errors import SpeculantError
from speculant.models.fp8 import FP8, FP8_LAUNCH_MODES, quantize_linears
from speculant.models.layers import RotaryEmbedding
from speculant.models.llama import CausalLM
from speculant.models.qwen3_moe import Qwen3MoeForCausalLM, make_dispatcher

# HF name fragment -> (our fragment, shard id) for merged projections.
STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
# Per-expert HF tensors (`mlp.experts.7.up_proj.weight`) -> the fused expert parameter and the
# shard (expert, part); transformers-5 style fused tensors (`mlp.experts.gate_up_proj`) load whole.
EXPERT_PARAM = re.compile(
    r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight(?:_scale_inv|_scale)?|input_scale)$"
)  # FP8 experts (models/fp8.py) add `weight_scale_inv` -> `gate_up_proj_weight_scale_inv`
EXPERT_FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
IGNORED = re.compile(r"rotary_emb\.inv_freq|\.attn\.bias$|\.masked_bias$")
# FP8 attention / KV cache scales (compressed-tensors kv_cache_scheme: self_attn.k_scale and
# v_scale; AutoFP8: k_proj.output_scale; ModelOpt: k_proj.k_scale; legacy kv_scale): we keep the
# KV cache in the model dtype, so they are skipped with one warning (not "unused tensors").
KV_SCALE = re.compile(
    r"\.self_attn\.(?:attn\.)?(?:[qkv]|kv|prob)_scale$"
    r"|\.self_attn\.[qkv]_proj\.(?:output|[qkv])_scale$"
)

# compressed-tensors zero points (`weight_zero_point`, `input_zero_point`), which some exports
# save for symmetric schemes too: all zeros, they change nothing and are skipped quietly; any
# other value is an asymmetric scheme, which is refused
ZERO_POINT = re.compile(r"\.(?:weight|input|output)_zero_point$")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_NAMES_SHOWN = 8  # unused tensors named in the warning; the rest are counted

log = logging.getLogger("speculant")


def resolve_dtype(name: str | torch.dtype, checkpoint_dtype: str, device: str) -> torch.dtype:
    """`auto` keeps the checkpoint's dtype on GPU and uses float32 on CPU; a torch dtype of
    DTYPES is taken as its name (as vLLM's `LLM(dtype=torch.bfloat16)`)."""
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    if name == "auto":
        if device == "cpu":
            return torch.float32
        return DTYPES.get(checkpoint_dtype, torch.bfloat16)
    if name not in DTYPES:
        raise SpeculantError(f"dtype {name!r} is not supported; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def check_load_format(load_format: str) -> None:
    """`auto` reads the checkpoint's weights and `dummy` makes random ones; nothing else exists."""
    if load_format not in ("auto", "dummy"):
        raise SpeculantError(f"load format {load_format!r} is not supported; use auto or dummy")


@contextlib.contextmanager
def default_device_and_dtype(device: str | torch.device, dtype: torch.dtype):
    """Build modules with parameters allocated directly in `dtype` on `device`."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


INDEX_FILE = "model.safetensors.index.json"


def _weight_map(path: Path) -> dict[str, str] | None:
    """The index's tensor name -> shard file name (None without an index)."""
    index = path / INDEX_FILE
    if not index.is_file():
        return None
    weight_map = read_json_object(index, "a safetensors index is one {...} object").get(
        "weight_map"
    )
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) for name in weight_map.values()
    ):
        raise SpeculantError(
            f"{str(index)!r} is not a valid safetensors index (no 'weight_map' object of "
            "tensor name -> file name); re-export the checkpoint"
        )
    return weight_map


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of checkpoint folder `path`: the shards its index names (other
    *.safetensors beside them, e.g. a consolidated copy, are not read), else every
    *.safetensors in it."""
    path = Path(path)
    weight_map = _weight_map(path)
    if weight_map is not None:
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise SpeculantError(
                f"shard {missing[0]!r} named in {INDEX_FILE} is missing; copy "
                "all shards of the checkpoint"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files and (bins := sorted(path.glob("pytorch_model*.bin"))):
        raise SpeculantError(
            f"{str(path)!r} holds {bins[0].name} but no *.safetensors: targets are read from "
            "safetensors only; convert the checkpoint (transformers: from_pretrained, then "
            "save_pretrained) or download its safetensors files"
        )
    if not files:
        raise SpeculantError(
            f"no *.safetensors in {str(path)!r}; download the weights or pass "
            "--load-format dummy for random weights"
        )
    return files


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint's weight files (`safetensors_files`), each name once,
    after a check of the files' headers (`check_tensor_homes`) before any tensor is read."""
    files = safetensors_files(path)
    weight_map = _weight_map(Path(path))
    homes = None if weight_map is None else {k: Path(path) / v for k, v in weight_map.items()}
    check_tensor_homes({file: _tensor_names(file) for file in files}, homes)
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise _unreadable(file, exc) from exc


def _tensor_names(file: Path) -> list[str]:
    """The tensor names in a safetensors file's header (no tensor is read)."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise _unreadable(file, exc) from exc


def _unreadable(file: Path, exc: Exception) -> SpeculantError:
    return SpeculantError(
        f"cannot read {str(file)!r} ({exc}); the file is corrupt or truncated, download it again"
    )


def check_tensor_homes(headers: dict[Path, list[str]], homes: dict[str, Path] | None) -> None:
    """Each tensor name in exactly one file (`headers`: file -> its tensor names): a name in two
    files is refused, naming both, as which copy won used to depend on the files' sort order.
    With an index (`homes`: name -> the shard its weight_map names) the index decides: a tensor
    must sit in that shard, and one in another shard is refused (index and shards disagree); a
    name the index does not list loads from the one shard holding it, as transformers reads
    whole shards."""
    homes = homes or {}
    held_by: dict[str, Path] = {}
    for file, names in headers.items():
        for name in names:
            home = homes.get(name)
            mapped = "" if home is None else f" ({INDEX_FILE} maps it to {str(home)!r})"
            if name in held_by:
                raise SpeculantError(
                    f"tensor {name!r} is in both {str(held_by[name])!r} and {str(file)!r}"
                    f"{mapped}; a checkpoint holds each tensor once: remove the stray copy (or "
                    "re-export the checkpoint)"
                )
            held_by[name] = file
    for name, file in held_by.items():
        home = homes.get(name, file)
        if home != file:
            raise SpeculantError(
                f"tensor {name!r} is in {str(file)!r} but {INDEX_FILE} maps it to "
                f"{str(home)!r}; the index does not match its shards: re-export the checkpoint "
                "(or fix the index's weight_map)"
            )


def load_weights(
    model: nn.Module,
    weights: Iterator[tuple[str, torch.Tensor]],
    source: str,
    rename: Callable[[str], str] = lambda name: name,
    refuse_dropped: str | None = None,
) -> None:
    """Copy checkpoint tensors into `model`, merging q/k/v and gate/up, checking that every
    parameter was loaded exactly once, that shapes match and that float weights come from float
    tensors; tensors the model does not use are named in one warning. With `refuse_dropped` (a
    drafter: "EAGLE-3 head", ...) an unused weight or bias under one of the model's own modules
    (a bias its config does not switch on, a layer past num_hidden_layers) is refused instead:
    dropping it would draft with other weights than the drafter was trained with. A tied
    parameter (the lm_head of tie_word_embeddings) loads from its own name
    (model.embed_tokens.weight): a checkpoint's copy under the other name (lm_head.weight) is
    used only when that is missing, whatever the order of the files, as vLLM does."""
    params = dict(model.named_parameters(remove_duplicate=False))
    owner = {id(param): name for name, param in model.named_parameters()}  # a tied one's 1st name
    loaded: set[tuple[int, object]] = set()
    unused: list[str] = []
    kv_scales: list[str] = []
    tied: list[tuple[str, str, torch.Tensor, object]] = []  # tensors under a tied alias name

    def copy(hf_name: str, param: torch.Tensor, tensor: torch.Tensor, shard: object) -> None:
        check_fp8_tensor(param, tensor, hf_name, source)
        if param.is_floating_point() and not tensor.is_floating_point():
            raise SpeculantError(
                f"tensor {hf_name!r} in {file_holding(source, hf_name)} is {tensor.dtype}, not a "
                "float weight; the checkpoint is corrupt or not for this model"
            )
        try:
            param.weight_loader(param, tensor.to(param.dtype), shard)
        except ValueError as exc:
            raise SpeculantError(
                f"tensor {hf_name!r} in {source} has the wrong shape: {exc}; the "
                "checkpoint does not match its config.json"
            ) from exc
        loaded.add((id(param), shard))

    for hf_name, tensor in weights:
        if IGNORED.search(hf_name):
            continue
        if KV_SCALE.search(hf_name):
            kv_scales.append(hf_name)
            continue
        if ZERO_POINT.search(hf_name):
            if tensor.numel() and bool(tensor.ne(0).any()):
                raise SpeculantError(
                    f"tensor {hf_name!r} in {file_holding(source, hf_name)} holds non-zero zero "
                    "points: an asymmetric quantization scheme, which is not supported (FP8 "
                    "layers are symmetric)"
                )
            continue
        name, shard = rename(hf_name), None
        expert = EXPERT_PARAM.search(name)
        if expert:
            fused, part = EXPERT_FUSED.get(expert[2], ("down_proj", None))
            suffix = "" if expert[3] == "weight" else f"_{expert[3]}"
            name = f"{name[: expert.start()]}.experts.{fused}{suffix}"
            shard = (int(expert[1]), part)
        else:
            for hf_part, our_part, shard_id in STACKED_PARAMS:
                if hf_part in name:
                    name, shard = name.replace(hf_part, our_part), shard_id
                    break
        if name not in params:
            if refuse_dropped is not None:
                _refuse_dropped(model, name, hf_name, source, refuse_dropped)
            unused.append(hf_name)
            continue
        param = params[name]
        if owner.get(id(param), name) != name:  # tied: wait for the owner's own tensor
            tied.append((hf_name, name, tensor, shard))
            continue
        copy(hf_name, param, tensor, shard)
    shadowed = []  # tied copies the owner's tensor made redundant
    for hf_name, name, tensor, shard in tied:
        param = params[name]
        if (id(param), shard) in loaded or (id(param), None) in loaded:
            shadowed.append(f"{hf_name} (shares {owner[id(param)]})")
        else:
            copy(hf_name, param, tensor, shard)
    for name, param in model.named_parameters():
        for shard in getattr(param, "shard_ids", (None,)):
            # a whole tensor (shard None) fills every part, e.g. fused experts
            if (id(param), shard) not in loaded and (id(param), None) not in loaded:
                part = name if shard is None else f"{name} (part {shard})"
                if hint := _scale_layout_hint(name, unused):
                    raise SpeculantError(f"{source} lacks the tensor for {part!r}: {hint}")
                if held := _unread_beside(name, unused, rename):
                    raise SpeculantError(
                        f"{source} lacks the tensor for {part!r}; it holds {held}, which this "
                        "model does not read: a layout of these weights it does not support, "
                        "or a checkpoint for another architecture"
                    )
                raise SpeculantError(
                    f"{source} lacks the tensor for {part!r}; the checkpoint is "
                    "incomplete or for another architecture"
                )
    if not dist.is_initialized() or dist.get_rank() == 0:  # one line per job
        if kv_scales:
            log.warning(
                "%s: %d FP8 KV cache scale tensor(s) ignored (%s, ...): the KV cache stays in the "
                "model dtype (quantization_config kv_cache_scheme is not applied)",
                source,
                len(kv_scales),
                kv_scales[0],
            )
        if unused:
            log.warning("%s", unused_tensors_line(unused, source))
        if shadowed:
            log.warning(
                "%s: %s ignored: tied weights (tie_word_embeddings) load from the tensor they "
                "share, which the checkpoint also holds",
                source,
                ", ".join(shadowed),
            )


def _unread_beside(
    missing: str, unused: list[str], rename: Callable[[str], str] = lambda name: name
) -> str:
    """The unused tensors under the module of parameter `missing` (e.g. experts stacked per
    projection beside the fused `experts.gate_up_proj` it lacks), named for its error ("" when
    none): the warning naming unused tensors comes after the error, so would never show."""
    module = missing.rsplit(".", 1)[0] + "."
    beside = [repr(n) for n in unused if rename(n).startswith(module)]
    shown = ", ".join(beside[:MAX_NAMES_SHOWN])
    more = f" and {len(beside) - MAX_NAMES_SHOWN} more" if len(beside) > MAX_NAMES_SHOWN else ""
    return shown + more


def _scale_layout_hint(missing: str, unused: list[str]) -> str | None:
    """Why an FP8 scale is missing when the checkpoint holds the other layout's scales (the
    tensors it did not use): block scales (`weight_scale_inv`, quant_method fp8 with
    weight_block_size) read as per-tensor or compressed-tensors `weight_scale`, or the
    reverse; None otherwise."""
    # (fused experts' scales are named `..._weight_scale`, a dense layer's `....weight_scale`)
    block = [n for n in unused if n.endswith("weight_scale_inv")]
    flat = [n for n in unused if n.endswith("weight_scale")]
    if missing.endswith("weight_scale") and block:
        return (
            f"it holds block scales ({block[0]!r}, ...), which config.json's quantization_config "
            'reads only as quant_method "fp8" with weight_block_size (e.g. [128, 128]); add it'
        )
    if missing.endswith("weight_scale_inv") and flat:
        return (
            f"it holds {flat[0]!r}, ... (per-tensor, per-channel or compressed-tensors scales), "
            "and config.json's quantization_config gives weight_block_size, which reads "
            "weight_scale_inv block scales; remove weight_block_size (quant_method fp8) or "
            "describe the scales' scheme (compressed-tensors)"
        )
    return None


def check_fp8_tensor(param: torch.Tensor, tensor: torch.Tensor, hf_name: str, source: str) -> None:
    """An e4m3 parameter takes only e4m3 tensors and a float parameter no FP8 one of any kind
    (e4m3, e5m2, the fnuz forms): either would load without its scales and compute garbage."""
    tensor_fp8 = "float8" in str(tensor.dtype)
    if param.dtype == FP8 and tensor.dtype == FP8 or param.dtype != FP8 and not tensor_fp8:
        return
    if param.dtype == FP8 and not tensor.is_floating_point():
        raise SpeculantError(
            f"tensor {hf_name!r} in {file_holding(source, hf_name)} is {tensor.dtype}, not "
            "float8_e4m3fn: FP8 layers load e4m3 weights only (integer-quantized checkpoints are "
            "not supported); the checkpoint does not match its quantization_config"
        )
    if param.dtype == FP8 and tensor_fp8:
        raise SpeculantError(
            f"tensor {hf_name!r} in {file_holding(source, hf_name)} is {tensor.dtype}, not "
            "float8_e4m3fn: FP8 layers load e4m3 weights only (e5m2 and the fnuz forms are not "
            "supported); use an e4m3 checkpoint"
        )
    if param.dtype == FP8:
        raise SpeculantError(
            f"tensor {hf_name!r} in {source} is {tensor.dtype}, but quantization_config in "
            "config.json makes it FP8; add its module to the config's ignore list"
        )
    raise SpeculantError(
        f"tensor {hf_name!r} in {file_holding(source, hf_name)} is {tensor.dtype}, but its "
        "module loads unquantized: FP8 loads in a target's decoder linear layers when "
        "config.json has its quantization_config (not in embeddings, lm_head, routers, drafters "
        "or modules its ignore list names); use bf16 weights"
    )


def _refuse_dropped(model: nn.Module, name: str, hf_name: str, source: str, what: str) -> None:
    """Raise for tensor `hf_name` (our `name`) that `model` has no parameter for, when it is a
    weight or bias under one of the model's top-level modules (see `load_weights`)."""
    modules = {child for child, _ in model.named_children()}
    if name.split(".")[0] in modules and name.endswith((".weight", ".bias")):
        raise SpeculantError(
            f"{file_holding(source, hf_name)} holds {hf_name!r}, but the {what} built from its "
            "config.json has no such parameter (a bias, norm or layer the config does not switch "
            "on); running without it would draft wrong tokens: fix config.json (attention_bias, "
            "bias, num_hidden_layers, ...) or remove the tensor"
        )


def unused_tensors_line(names: list[str], source: str) -> str:
    """One line naming the tensors a checkpoint holds that nothing loads (at most
    MAX_NAMES_SHOWN of them, then a count)."""
    shown = ", ".join(names[:MAX_NAMES_SHOWN])
    more = f" and {len(names) - MAX_NAMES_SHOWN} more" if len(names) > MAX_NAMES_SHOWN else ""
    return (
        f"{source}: {len(names)} tensor(s) not used by the model, ignored: {shown}{more}; "
        "check that the checkpoint is for this architecture"
    )


def file_holding(source: str | Path, name: str) -> str:
    """The weight file of checkpoint folder `source` that holds tensor `name` (for errors; the
    folder itself when no safetensors header names it, e.g. pytorch_model.bin)."""
    path = Path(source)
    if path.is_file():
        return str(path)
    files: list[Path] = []
    with contextlib.suppress(SpeculantError):  # none: a pytorch_model.bin head
        files = safetensors_files(path)  # the index's shards only, as the loader reads them
    for file in files:
        with contextlib.suppress(Exception), safe_open(str(file), framework="pt") as f:
            if name in f.keys() or f"model.{name}" in f.keys():  # heads drop `model.`
                return str(file)
    bins = sorted(path.glob("pytorch_model*.bin"))
    return str(bins[0]) if len(bins) == 1 else str(path)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights in place, in the parameters' own dtype and device (no fp32 copy); FP8
    layers get random e4m3 weights and scales (fp8.Fp8Linear.init_dummy)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed % 2**64)  # any integer seed
    for name, param in model.named_parameters():
        if param.dtype == FP8 or hasattr(param, "fp8_scale"):
            continue
        if "norm" in name:
            param.fill_(1.0)
        else:
            fan_in = param.shape[-1] if param.dim() > 1 else 1
            param.normal_(0.0, fan_in**-0.5 if param.dim() > 1 else 0.02, generator=gen)
    for module in model.modules():
        if getattr(module, "fp8", None) is not None:
            module.fp8.init_dummy(module, gen)


def build_fp8_causal_lm(
    cfg: ModelConfig, max_positions: int, pctx: ParallelContext, make: Callable | None = None
) -> CausalLM:
    """A CausalLM (or `make()`'s model: Qwen3-MoE) whose linear layers and experts hold FP8
    weights and scales, built on the meta device first so that no float copy of those weights
    is ever allocated; the rotary tables are then rebuilt and every other parameter allocated on
    the ambient device."""
    device = torch.get_default_device()
    with torch.device("meta"):
        model = make() if make is not None else CausalLM(cfg, max_positions, pctx)
        converted = quantize_linears(model, cfg.quantization)
    if make is None and converted:  # dense: measured (mixture-of-experts targets were not)
        model.launch_modes = dict(FP8_LAUNCH_MODES)
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
            real.__dict__.update(param.__dict__)  # weight_loader, shard_ids, fp8_scale
            setattr(module, name, real)
        for name, child in list(module.named_children()):
            if isinstance(child, RotaryEmbedding):
                rope = (cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
                setattr(module, name, RotaryEmbedding(*rope))
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a new buffer in the model needs rebuilding here
        raise RuntimeError(f"FP8 model build left {left} on the meta device")
    return model


def build_causal_lm(
    cfg: ModelConfig,
    max_positions: int,
    pctx: ParallelContext,
    moe: MoeConfig | None = None,
    decode_tokens: int = 1,
) -> CausalLM:
    """The target model for `cfg.architecture` on the ambient device and dtype (see
    default_device_and_dtype): a dense CausalLM, or Qwen3MoeForCausalLM with its experts split
    over all ranks and the dispatcher `moe` names (`decode_tokens`: max_bs * (k + 1)). A
    `quantization_config` gives its linear layers FP8 weights and scales (models/fp8.py)."""
    if not cfg.is_moe:
        if moe is not None and (moe.backend != "auto" or moe.max_tokens_per_rank is not None):
            raise SpeculantError(
                f"--moe-backend/--moe-max-tokens-per-rank apply to mixture-of-experts targets; "
                f"{cfg.architecture} is dense, drop them"
            )
        if cfg.quantization is not None:
            return build_fp8_causal_lm(cfg, max_positions, pctx)
        return CausalLM(cfg, max_positions, pctx)
    device = torch.get_default_device()
    dispatcher = make_dispatcher(cfg, pctx, moe or MoeConfig(), decode_tokens, device)
    if cfg.quantization is not None:
        make = lambda: Qwen3MoeForCausalLM(cfg, max_positions, pctx, dispatcher)  # noqa: E731
        return build_fp8_causal_lm(cfg, max_positions, pctx, make)
    return Qwen3MoeForCausalLM(cfg, max_positions, pctx, dispatcher)
