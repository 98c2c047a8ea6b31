"""Configuration dataclasses: the model (from HF config.json), the cache, graphs, speculation and
parallelism. Everything an `Engine` is built from lives here."""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from speculant.errors import SpeculantError

# --page-size at most this many tokens (CLI and Engine): a page is the KV cache's unit of
# allocation, so one larger than a context wastes memory (a 1e8-token page is 100 GB), and a pool
# of such pages holds no whole page at all.
MAX_PAGE_SIZE = 1024
# --dist-timeout at most ~11.6 days: torch's store and process-group timeouts are C ints of
# milliseconds, which overflow beyond ~2.1e6 s (a hang, an abort, an OverflowError).
MAX_DIST_TIMEOUT_S = 1_000_000
# --num-draft-tokens (and a drafter config's default k) at most this many: the verify row is k + 1
# tokens, and capture sizes, buffers and the acceptance statistics are sized for it.
MAX_DRAFT_TOKENS = 16
# --catch-up-depth at most this many plain steps between drafter catch-ups (its buffers hold as
# many recorded steps a row)
MAX_CATCH_UP_DEPTH = 256

log = logging.getLogger("speculant")

DENSE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# max_position_embeddings where config.json has none: each transformers config class's default
# (yarn's original length and dynamic NTK's threshold depend on it)
DEFAULT_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048, "MistralForCausalLM": 131072, "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768, "Qwen3MoeForCausalLM": 32768,
}  # fmt: skip
QWEN3_DEFAULT_HEAD_DIM = 128  # transformers' Qwen3Config, when config.json has no head_dim
# transformers reads `attention_bias` (q/k/v and o_proj biases) for these; Qwen2 has q/k/v biases
# and none on o_proj whatever the config says, Mistral none at all
ATTENTION_BIAS_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
ACTIVATIONS = ("silu", "swish")  # the MLPs compute SiLU(gate) * up (transformers: ACT2FN)
# model_type -> architecture, as transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES maps it: what a
# config without `architectures` is loaded as (AutoModelForCausalLM goes by model_type alone)
MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def read_json_object(file: Path, what: str) -> dict:
    """A JSON file that must hold one object (config.json, an index), with clear errors."""
    try:
        value = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise SpeculantError(
            f"{str(file)!r} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
            f"{exc.start}); re-export the checkpoint"
        ) from None
    except json.JSONDecodeError as exc:
        raise SpeculantError(
            f"{str(file)!r} is not valid JSON ({exc}); re-export the checkpoint"
        ) from None
    except OSError as exc:
        raise SpeculantError(f"cannot read {str(file)!r} ({exc.strerror})") from None
    if not isinstance(value, dict):
        raise SpeculantError(
            f"{str(file)!r} holds a JSON {_json_kind(value)}, not an object; {what}"
        )
    return value


def _json_kind(value: object) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


SAFETENSORS_FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def safetensors_headers(path: str | Path) -> Iterator[dict[str, dict]]:
    """The tensor entries ({name: {"dtype", "shape", ...}}, `__metadata__` left out) of each
    *.safetensors file in checkpoint folder `path`, files in name order, read from their headers
    (no weights loaded); a file whose header cannot be read is skipped (the loader reports a
    broken file by its name)."""
    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with file.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
        except (OSError, ValueError, struct.error):
            continue
        if isinstance(header, dict):
            yield {n: e for n, e in header.items() if n != "__metadata__" and isinstance(e, dict)}


def weights_dtype(path: Path) -> str | None:
    """The dtype of the first float32 / bfloat16 / float16 tensor by name in the *.safetensors
    headers of checkpoint folder `path` (what transformers' dtype "auto" takes where config.json
    names none: safe_open's keys are sorted; a header lists float32 tensors before bfloat16
    ones); None when no header has one."""
    for header in safetensors_headers(path):
        for _, entry in sorted(header.items()):
            dtype = SAFETENSORS_FLOAT_DTYPES.get(entry.get("dtype"))
            if dtype is not None:
                return dtype
    return None


def read_hf_config(path: str | Path) -> dict:
    """Read `config.json` of a Hugging Face checkpoint directory, with clear errors."""
    path = Path(path)
    if path.is_file():
        raise SpeculantError(
            f"checkpoint {str(path)!r} is a file; pass the folder holding it (config.json and "
            "*.safetensors)"
        )
    if not path.is_dir():
        raise SpeculantError(
            f"checkpoint directory {str(path)!r} does not exist; pass a folder "
            "holding config.json and *.safetensors"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SpeculantError(
            f"{str(config_file)!r} is missing; {str(path)!r} is not a Hugging Face "
            "checkpoint (it needs config.json and *.safetensors)"
        )
    return read_json_object(config_file, "a checkpoint's config.json is one {...} object")


_REQUIRED = object()


def _field(hf: dict, key: str, source: str, default: object) -> object:
    """hf[key], or `default` when it is missing or null; an error naming it without a default."""
    value = hf.get(key)
    if value is not None:
        return value
    if default is _REQUIRED:
        raise SpeculantError(
            f"{source} lacks the field {key!r}; re-export the checkpoint with transformers"
        )
    return default


def config_int(hf: dict, key: str, source: str, default=_REQUIRED, minimum: int = 1) -> int:
    """hf[key] as an int >= `minimum` (4096.0 passes; true, "8" and 2.5 do not). A missing key
    takes `default`; without one it is an error naming the field."""
    value = _field(hf, key, source, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpeculantError(
            f"{key}={value!r} in {source} must be an integer >= {minimum}; fix config.json"
        )
    return value


def config_float(hf: dict, key: str, source: str, default=_REQUIRED, minimum: float = 0.0) -> float:
    """hf[key] as a finite float > `minimum` (JSON's NaN and Infinity are refused)."""
    value = _field(hf, key, source, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= minimum
    ):
        raise SpeculantError(
            f"{key}={value!r} in {source} must be a finite number > {minimum:g}; fix config.json"
        )
    return float(value)


def config_bool(hf: dict, key: str, source: str, default: bool | None = False) -> bool | None:
    """hf[key] as a JSON boolean (`default` when missing or null): "false" or 0 would otherwise
    read as Python truthiness, a string "false" switching the flag on."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SpeculantError(f"{key}={value!r} in {source} must be true or false; fix config.json")
    return value


def config_architectures(hf: dict, source: str) -> list[str]:
    """`architectures` as a list of class names ([] when missing, null or empty). The one reader
    of the field, for targets and drafters alike: anything but a list of strings is refused, a
    bare string too (vLLM and the engine pick the class from the list, and would read a string
    letter by letter), so every loader sees the same names."""
    value = hf.get("architectures")
    if value is None:
        return []
    if isinstance(value, str):
        raise SpeculantError(
            f"architectures={value!r} in {source} must be a list of class names; write "
            f"[{json.dumps(value)}] in config.json"
        )
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise SpeculantError(
            f"architectures={value!r} in {source} must be a list of class names, e.g. "
            '["LlamaForCausalLM"]; fix config.json'
        )
    return value


def target_architecture(hf: dict, source: str) -> str:
    """The architecture a target (or draft LM) config names: the first of `architectures`, else,
    as transformers' AutoModelForCausalLM loads a config without them, the class its
    `model_type` maps to (MODEL_TYPE_ARCHITECTURES). Either one unsupported is refused."""
    supported = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
    archs = config_architectures(hf, source)
    if archs:
        if archs[0] not in supported:
            raise SpeculantError(
                f"architecture {archs[0]!r} in {source} is not supported; supported: "
                f"{', '.join(supported)}"
            )
        return archs[0]
    model_type = hf.get("model_type")
    if model_type is None:
        raise SpeculantError(
            f"{source} has neither architectures nor model_type; add the model's class, e.g. "
            '"architectures": ["LlamaForCausalLM"], to config.json'
        )
    if not isinstance(model_type, str) or model_type not in MODEL_TYPE_ARCHITECTURES:
        raise SpeculantError(
            f"{source} has no architectures and model_type={model_type!r} is not supported; "
            f"supported model types: {', '.join(MODEL_TYPE_ARCHITECTURES)} (or set "
            f"architectures to one of {', '.join(supported)})"
        )
    return MODEL_TYPE_ARCHITECTURES[model_type]


def config_dict(hf: dict, key: str, source: str) -> dict:
    """hf[key] as a dict ({} when missing or null)."""
    value = hf.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpeculantError(f"{key}={value!r} in {source} must be a JSON object; fix config.json")
    return value


ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn")


def max_positions_of(hf: dict, source: str) -> int:
    """config.json's max_position_embeddings, or its architecture's transformers default."""
    arch = target_architecture(hf, source)
    return config_int(hf, "max_position_embeddings", source, DEFAULT_MAX_POSITIONS.get(arch, 4096))


def _rope_settings(hf: dict, source: str) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either the transformers-4 or transformers-5 layout. The
    scaling dict comes back with its `rope_type` set (older configs say `type`) and, for yarn, its
    `factor` (transformers' default: max_position_embeddings / original_max_position_embeddings).
    `dynamic` (NTK) rescales only positions past max_position_embeddings, which the context never
    reaches (engine: max_model_len <= max_position_embeddings): it runs as the default RoPE.
    llama3 and yarn take a top-level `original_max_position_embeddings` over the scaling dict's,
    as transformers' standardize_rope_params does (Phi-3 style configs keep it there), and
    max_position_embeddings (or the architecture's default) where neither gives one."""
    params = config_dict(hf, "rope_parameters", source)
    scaling = config_dict(hf, "rope_scaling", source) or None
    # transformers' priority: rope_scaling (which replaces rope_parameters), then the top level
    rope = {k: v for k, v in (scaling or params).items() if v is not None}
    theta = config_float({**hf, **rope}, "rope_theta", source, 10000.0)
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    if scaling is None:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise SpeculantError(
            f"rope scaling type {kind!r} in {source} is not supported; supported: "
            f"{', '.join(ROPE_TYPES)}"
        )
    where = f"rope scaling of {source}"
    scaling = {**scaling, "rope_type": kind}
    if kind in ("llama3", "yarn") and hf.get("original_max_position_embeddings") is not None:
        # transformers overwrites the scaling's own value with the top-level one
        scaling["original_max_position_embeddings"] = config_int(
            hf, "original_max_position_embeddings", source
        )
    if kind in ("llama3", "yarn"):  # without an original length: max_position_embeddings
        positions = max_positions_of(hf, source)
        original = config_int(scaling, "original_max_position_embeddings", where, positions)
        scaling["original_max_position_embeddings"] = original
    if kind == "yarn":
        if scaling.get("factor") is None:
            scaling["factor"] = positions / original
        for key in ("factor", "attention_factor", "beta_fast", "beta_slow"):
            if scaling.get(key) is not None:
                config_float(scaling, key, where)
        for key in ("mscale", "mscale_all_dim"):
            if scaling.get(key) is not None:
                config_float(scaling, key, where, minimum=-math.inf)
        return theta, scaling
    config_float(scaling, "factor", where, _REQUIRED)
    if kind == "llama3":
        config_int(scaling, "original_max_position_embeddings", where)
        low = config_float(scaling, "low_freq_factor", where, 1.0)
        if config_float(scaling, "high_freq_factor", where, 4.0) == low:
            raise SpeculantError(
                f"low_freq_factor == high_freq_factor == {low} in {where}; they must differ"
            )
    return theta, scaling


def _moe_settings(hf: dict, num_layers: int, source: str) -> dict:
    """Qwen3-MoE fields with transformers' defaults; `moe_layer_ids` are the layers whose MLP is
    sparse (not in mlp_only_layers, and every decoder_sparse_step-th layer)."""
    experts_key = "num_experts" if "num_experts" in hf else "num_local_experts"
    num_experts = config_int(hf, experts_key, source, 128, minimum=0)
    step = config_int(hf, "decoder_sparse_step", source, 1)
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in dense
    ):
        raise SpeculantError(
            f"mlp_only_layers={dense!r} in {source} must be a list of layer indices"
        )
    sparse = [i for i in range(num_layers) if i not in set(dense) and (i + 1) % step == 0]
    per_token = config_int(hf, "num_experts_per_tok", source, 8)
    if num_experts and per_token > num_experts:
        raise SpeculantError(
            f"num_experts_per_tok={per_token} in {source} exceeds num_experts={num_experts}; "
            "fix config.json"
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=per_token,
        moe_intermediate_size=config_int(hf, "moe_intermediate_size", source, 768),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layer_ids=tuple(sparse) if num_experts > 0 else (),
    )


def layer_types_and_window(
    hf: dict, num_layers: int, qwen3: bool = True
) -> tuple[list, int | None]:
    """(layer_types, sliding window) as transformers' config classes read them. Qwen2/3Config
    count `sliding_window` only with `use_sliding_window` and, without `layer_types`, make the
    layers from `max_window_layers` on slide; other configs (`qwen3=False`) take both as written.
    (The drafters read their layers' windows with it too.)"""
    if not qwen3:
        types = hf.get("layer_types") or ["full_attention"] * num_layers
        return list(types), hf.get("sliding_window")
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
    first = hf.get("max_window_layers", 28) if window is not None else num_layers
    if not isinstance(first, int):  # null: no layer from an index on
        first = num_layers
    default = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return list(hf.get("layer_types") or default), window


def _sliding_window(hf: dict, arch: str, num_layers: int, source: str) -> int | None:
    """The attention window of a target's sliding layers (None: no layer slides), as
    transformers reads it: Mistral slides every layer by `sliding_window` (4096 when the key is
    absent); Qwen2 / Qwen3 as `layer_types_and_window` says; Qwen3-MoE every layer with
    `use_sliding_window`; Llama never."""
    if arch == "MistralForCausalLM":
        window = hf.get("sliding_window", 4096)
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        types, window = layer_types_and_window(hf, num_layers)
        if arch != "Qwen3MoeForCausalLM" and "sliding_attention" not in types:
            window = None
    else:
        window = None
    if window is None:
        return None
    return config_int({"sliding_window": window}, "sliding_window", source)


def _eos_token_ids(hf: dict, source: str) -> tuple[int, ...]:
    """eos_token_id as a tuple: one id, a list of ids, or none."""
    eos = hf.get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise SpeculantError(
            f"eos_token_id={eos!r} in {source} must be a token id or a list of them; "
            f"fix {Path(source).name}"
        )
    return tuple(ids)


QUANT_METHODS = ("fp8", "compressed-tensors")
FP8_BLOCK = (128, 128)  # the one block shape published FP8 checkpoints use (and kernels assume)


@dataclass(frozen=True)
class QuantConfig:
    """FP8 linear weights as published, from config.json's `quantization_config` (or the
    `compression_config` of older compressed-tensors exports): `fp8` (block 128x128 with
    `weight_scale_inv`, or per-tensor `weight_scale`) and compressed-tensors `float-quantized` /
    `naive-quantized` (e4m3 weights; tensor / channel / block `weight_scale`). Modules matching
    `ignore` keep their stored dtype; activations stay unquantized on the reference path. A
    `kv_cache_scheme` is accepted but not applied: the KV cache stays in the model dtype and the
    loader skips its k/v scales with a warning (models/loader.KV_SCALE)."""

    method: str  # fp8 | compressed-tensors
    strategy: str  # tensor | channel | block
    scale_name: str  # weight_scale_inv (fp8 block) | weight_scale
    static_input: bool = False  # the checkpoint holds a per-tensor `input_scale` per layer
    ignore: tuple[str, ...] = ()  # HF module names, or "re:" patterns, stored unquantized


def _unsupported(key: str, value: object, source: str, supported: str) -> SpeculantError:
    return SpeculantError(
        f"quantization_config {key}={value!r} in {source} is not supported; supported: {supported}"
    )


def _ignore_list(value: object, key: str, source: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise _unsupported(key, value, source, "a list of module names")
    return tuple(value)


def _fp8_method(q: dict, source: str) -> QuantConfig:
    if q.get("fmt", "e4m3") != "e4m3":
        raise _unsupported("fmt", q["fmt"], source, "e4m3")
    activations = q.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise _unsupported("activation_scheme", activations, source, "dynamic, static")
    ignore = _ignore_list(q.get("ignored_layers"), "ignored_layers", source)
    ignore += _ignore_list(q.get("modules_to_not_convert"), "modules_to_not_convert", source)
    block = q.get("weight_block_size")
    if block is None:
        return QuantConfig("fp8", "tensor", "weight_scale", activations == "static", ignore)
    if block != list(FP8_BLOCK):
        raise _unsupported("weight_block_size", block, source, "[128, 128]")
    if activations == "static":
        raise _unsupported("activation_scheme", activations, source, "dynamic (block scales)")
    return QuantConfig("fp8", "block", "weight_scale_inv", False, ignore)


# compressed-tensors formats whose FP8 weights are stored as e4m3 tensors beside their scales
# (naive-quantized: older llm-compressor exports; the loader refuses any tensor not e4m3)
CT_FORMATS = ("float-quantized", "naive-quantized")


def _compressed_tensors(q: dict, source: str) -> QuantConfig:
    if q.get("format") not in CT_FORMATS:
        raise _unsupported("format", q.get("format"), source, ", ".join(CT_FORMATS))
    kv_cache = q.get("kv_cache_scheme")
    if kv_cache is not None and not isinstance(kv_cache, dict):
        raise _unsupported(
            "kv_cache_scheme", kv_cache, source, "null or a scheme object (not applied)"
        )
    sparsity = q.get("sparsity_config") or {}  # sparse-compressed weights are not e4m3 matrices
    if not isinstance(sparsity, dict):
        raise _unsupported("sparsity_config", sparsity, source, "null or a dense one")
    if sparsity.get("format", "dense") != "dense":
        raise _unsupported("sparsity_config.format", sparsity["format"], source, "dense")
    if q.get("transform_config"):  # rotated weights need their online transforms
        raise _unsupported("transform_config", q["transform_config"], source, "null")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _unsupported("config_groups", groups, source, "one or more scheme groups")
    schemes = set()
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise _unsupported(where, group, source, "a scheme object")
        targets = group.get("targets")
        if not isinstance(targets, list) or "Linear" not in targets:
            raise _unsupported(f"{where}.targets", targets, source, '["Linear"]')
        if (group.get("format") or q["format"]) not in CT_FORMATS:  # null: the top-level one
            raise _unsupported(f"{where}.format", group["format"], source, ", ".join(CT_FORMATS))
        if group.get("output_activations") is not None:
            raise _unsupported(
                f"{where}.output_activations", group["output_activations"], source, "null"
            )
        schemes.add(_ct_scheme(group.get("weights"), group.get("input_activations"), where, source))
    if len(schemes) > 1:
        raise _unsupported("config_groups", sorted(groups), source, "groups of one FP8 scheme")
    strategy, static_input = schemes.pop()
    ignore = _ignore_list(q.get("ignore"), "ignore", source)
    return QuantConfig("compressed-tensors", strategy, "weight_scale", static_input, ignore)


def _ct_scheme(weights: object, inputs: object, where: str, source: str) -> tuple[str, bool]:
    """(weight strategy, static input scale) of one compressed-tensors scheme group."""
    if not isinstance(weights, dict):
        raise _unsupported(f"{where}.weights", weights, source, "an FP8 weight scheme")
    for key, want in (("type", "float"), ("num_bits", 8), ("symmetric", True), ("dynamic", False)):
        if weights.get(key, want) != want:
            raise _unsupported(f"{where}.weights.{key}", weights.get(key), source, repr(want))
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise _unsupported(f"{where}.weights.strategy", strategy, source, "tensor, channel, block")
    if strategy == "block" and weights.get("block_structure") != list(FP8_BLOCK):
        raise _unsupported(
            f"{where}.weights.block_structure", weights.get("block_structure"), source, "[128, 128]"
        )
    if inputs is None:  # weight-only FP8
        return strategy, False
    if not isinstance(inputs, dict):
        raise _unsupported(f"{where}.input_activations", inputs, source, "an FP8 scheme or null")
    for key, want in (("type", "float"), ("num_bits", 8), ("symmetric", True)):
        if inputs.get(key, want) != want:
            raise _unsupported(
                f"{where}.input_activations.{key}", inputs.get(key), source, repr(want)
            )
    if inputs.get("dynamic", False):
        return strategy, False
    if inputs.get("strategy") != "tensor" or strategy == "block":
        raise _unsupported(
            f"{where}.input_activations.strategy",
            inputs.get("strategy"),
            source,
            "dynamic activations, or static per-tensor ones with tensor/channel weights",
        )
    return strategy, True


def parse_quantization(hf: dict, source: str) -> QuantConfig | None:
    """config.json's `quantization_config` (None without one; older compressed-tensors exports
    call it `compression_config`); a scheme we cannot run is a one-line error naming the key and
    value."""
    q = config_dict(hf, "quantization_config", source) or config_dict(
        hf, "compression_config", source
    )
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8_method(q, source)
    if method == "compressed-tensors":
        return _compressed_tensors(q, source)
    raise _unsupported("quant_method", method, source, ", ".join(QUANT_METHODS))


@dataclass
class ModelConfig:
    """The architecture of a decoder (Llama / Qwen2 / Qwen3, and Qwen3-MoE's expert fields) as
    read from config.json (the class from `architectures`, else from `model_type`:
    `target_architecture`)."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    num_experts: int = 0  # MoE only: routed experts per sparse layer
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    moe_layer_ids: tuple[int, ...] = ()  # layers with a sparse MoE block instead of the MLP
    quantization: QuantConfig | None = None  # FP8 linear weights (see QuantConfig)
    o_proj_bias: bool = False  # attention_bias of Llama / Qwen3 / Qwen3-MoE: o_proj has one too
    # the window of sliding-window layers (Mistral, Qwen2/3 use_sliding_window); windowed
    # attention is not implemented, so max_position_embeddings is capped at it (exact below it)
    sliding_window: int | None = None
    hf: dict = field(default_factory=dict, repr=False)

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layer_ids)

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> ModelConfig:
        arch = target_architecture(hf, source)
        if hf.get("mlp_bias"):
            raise SpeculantError(f"mlp_bias=true in {source} is not supported")
        act = hf.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise SpeculantError(
                f"hidden_act={act!r} in {source} is not supported; supported: "
                f"{', '.join(ACTIVATIONS)}"
            )
        hidden = config_int(hf, "hidden_size", source)
        heads = config_int(hf, "num_attention_heads", source)
        kv_heads = config_int(hf, "num_key_value_heads", source, heads)
        if heads % kv_heads:
            raise SpeculantError(
                f"num_attention_heads={heads} in {source} is not a multiple of "
                f"num_key_value_heads={kv_heads}; fix config.json"
            )
        # transformers' Qwen3Config (which the DFLASH and Qwen3 EAGLE-3 references read drafters
        # with) defaults head_dim to 128; the other config classes to hidden // heads
        default_head_dim = QWEN3_DEFAULT_HEAD_DIM if arch == "Qwen3ForCausalLM" else hidden // heads
        if hf.get("head_dim") is None and default_head_dim == 0:
            raise SpeculantError(
                f"hidden_size={hidden} in {source} is smaller than num_attention_heads={heads} "
                "and no head_dim is given; fix config.json"
            )
        head_dim = config_int(hf, "head_dim", source, default_head_dim)
        if head_dim % 2:
            raise SpeculantError(
                f"head_dim={head_dim} in {source} is odd; rotary embeddings need an even size"
            )
        theta, scaling = _rope_settings(hf, source)
        num_layers = config_int(hf, "num_hidden_layers", source)
        moe = _moe_settings(hf, num_layers, source) if arch in MOE_ARCHITECTURES else {}
        attention_bias = arch in ATTENTION_BIAS_ARCHITECTURES and bool(hf.get("attention_bias"))
        window = _sliding_window(hf, arch, num_layers, source)
        max_positions = max_positions_of(hf, source)
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=config_int(hf, "intermediate_size", source),
            vocab_size=config_int(hf, "vocab_size", source),
            rms_norm_eps=config_float(hf, "rms_norm_eps", source, 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=min(max_positions, window or max_positions),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_token_ids(hf, source),
            # `dtype` wins over a stale `torch_dtype` beside it, as transformers reads both
            torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
            **moe,
            quantization=parse_quantization(hf, source),
            o_proj_bias=attention_bias,
            sliding_window=window,
            hf=hf,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """config.json of checkpoint folder `path`; the end-of-sequence ids of its
        generation_config.json (Llama-3 and Qwen instruct models list several there: what
        transformers' generate and vLLM stop on) join config.json's."""
        source = str(Path(path) / "config.json")
        cfg = cls.from_hf(read_hf_config(path), source=source)
        if not (cfg.hf.get("dtype") or cfg.hf.get("torch_dtype")):  # --dtype auto: as transformers
            cfg.torch_dtype = weights_dtype(Path(path)) or cfg.torch_dtype
        generation = Path(path) / "generation_config.json"
        if generation.is_file():
            gen = read_json_object(generation, "a generation_config.json is one {...} object")
            extra = _eos_token_ids(gen, str(generation))
            cfg.eos_token_ids += tuple(i for i in extra if i not in cfg.eos_token_ids)
        window = cfg.sliding_window
        if window is not None and window < max_positions_of(cfg.hf, source):
            log.warning(
                "%s: sliding_window=%d: windowed attention is not supported, so the context is "
                "limited to %d positions (max_position_embeddings), where it is exact",
                source,
                cfg.sliding_window,
                cfg.max_position_embeddings,
            )
        return cfg


def check_rows_for_dp(max_num_seqs: int | None, dp: int) -> None:
    """max_num_seqs counts the request rows of all DP ranks: at least one a rank."""
    if max_num_seqs is not None and max_num_seqs < dp:
        raise SpeculantError(
            f"max_num_seqs={max_num_seqs} is less than dp={dp}; raise --max-num-seqs (it counts "
            "requests over all DP ranks)"
        )


@dataclass
class CacheConfig:
    """Paged KV cache sizing. `num_pages=None` sizes the pool for max_num_seqs full-length
    requests, capped at `kv_cache_memory_fraction` of free GPU memory or of available host memory
    on the CPU; an explicit `num_pages` beyond that cap is refused."""

    page_size: int = 16
    max_num_seqs: int | None = None  # None: 512 on a GPU, 64 on the CPU (over all DP ranks)
    max_num_batched_tokens: int | None = None  # tokens per forward; None: 8192 GPU, 2048 CPU
    max_model_len: int | None = None
    num_pages: int | None = None
    kv_cache_memory_fraction: float = 0.85
    # keep whole prefilled KV pages and reuse them for contexts that start the same
    # (executor/prefix_cache.py)
    enable_prefix_caching: bool = False


@dataclass
class GraphConfig:
    """CUDA graph capture policy (see docs/ARCHITECTURE.md, "Graphs")."""

    capture_sizes: list[int] | None = None
    max_capture_size: int | None = None
    disable_padding: bool = False
    enforce_eager: bool = False
    eager_padding: bool = False
    # extend (prefill / mixed) forwards by padded token count (executor/piecewise.py); with
    # `piecewise` on (or sizes given), None is the default list, [] none
    piecewise: bool = True
    piecewise_sizes: list[int] | None = None
    piecewise_capture: str = "eager"  # eager: every size at start; lazy: on a size's first use


@dataclass
class SpecConfig:
    """Speculative decoding: which drafter and how many draft tokens per step. None (unset) is
    the drafter's default with an algo; 0 is plain decoding (no drafter is loaded)."""

    algo: str | None = None
    draft: str | None = None
    num_draft_tokens: int | None = None
    speculation: str = "fixed"  # fixed: k drafts every step; auto: 0 or k per step (speculation.py)
    # auto: plain steps record the drafter's inputs and catch it up every this many steps
    # (executor/catch_up.py); 0 catches up in every plain step
    catch_up_depth: int = 8
    # sampled rows: "rejection" accepts a draft with probability min(1, p/q) (resampling from
    # the residual); "match" accepts it when it equals the token plain sampling draws at its
    # position, so seeded output is the plain run's whatever was drafted (executor/verify.py)
    sampled_verify: str = "rejection"


@dataclass
class ParallelConfig:
    """Data-parallel groups of tensor-parallel ranks."""

    tp: int = 1
    dp: int = 1


@dataclass
class MoeConfig:
    """Expert parallelism for MoE targets: how tokens reach the rank holding their expert
    (`auto`: local on one rank, else DeepEP on CUDA when installed, else all2all) and the most
    tokens one rank dispatches at once (None: one decode step, max_num_seqs // dp * (k + 1))."""

    backend: str = "auto"  # auto | local | all2all | deepep
    max_tokens_per_rank: int | None = None


@dataclass
class EngineConfig:
    """Everything an Engine needs."""

    target: str
    device: str = "cpu"
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    # auto (triton on CUDA when it imports, else torch) | triton | torch
    attention_backend: str = "auto"
    # one rank: launch the next decode step before reading back the current one (when the
    # batch cannot change in between); token-equal to synchronous steps on the CPU and an H200
    overlap: bool = True
    # the most alternatives a request may ask log-probabilities for (SamplingParams.logprobs);
    # None: no step computes any (the graphs are captured without them)
    max_logprobs: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
