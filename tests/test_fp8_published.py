"""FP8 checkpoints in the layouts published families use (issue 24 audit): tiny random models
written tensor for tensor as Qwen3-*-FP8 / Qwen3-30B-A3B-FP8 (fp8 block `weight_scale_inv`,
float32 or bfloat16 scales, bf16 router), DeepSeek-style block scales on shapes that are not
multiples of 128, RedHatAI / neuralmagic compressed-tensors (float- and naive-quantized, tensor /
channel / block `weight_scale`, static `input_scale`, W8A16, kv_cache_scheme with
`self_attn.k_scale` / `v_scale`, channel- and tensor-scaled MoE experts with a `re:` router
ignore) and old AutoFP8 per-tensor scales (q/k/v and gate/up with different scales, in dense
layers and in each expert). Everything not quantized is bf16 as
published, and the weights are split over two safetensors shards with an index (scales not
always beside their weights).

Tolerance: our float32 forward against transformers' float64 forward of the dequantised weights
(tests/test_fp8.py's reference): relative Frobenius error of the logits < 1e-4. Greedy tokens
equal those of our engine on the plain float32 checkpoint of the dequantised weights (the
product of an e4m3 value and a float32 / bf16 scale is exact in float32, so both forwards see
the same weights). TP=2 against TP=1 (MoE experts split over both ranks: EP=2): logits within
1e-4, greedy tokens equal.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers_ckpt import save_hf_model
from safetensors.torch import load_file, save_file
from test_fp8 import (
    ENGINE,
    GREEDY,
    PROMPT,
    REL_TOL,
    assert_tp2_equals_tp1,
    compressed_tensors,
    our_logits,
    reference_logits,
    with_quant,
)

from speculant import Engine, SpeculantError
from speculant.config import ModelConfig

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
# each merged part gets its own range, so q/k/v and gate/up scales differ by far
PART_GAIN = {"q": 1.0, "k": 6.0, "v": 0.2, "o": 1.0, "gate": 0.3, "up": 4.0, "down": 1.0}

QWEN_BLOCK = dict(
    quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128]
)
AUTOFP8 = dict(quant_method="fp8", activation_scheme="static", ignored_layers=["lm_head"])
CHANNEL = dict(strategy="channel")
BLOCK = dict(strategy="block", block_structure=[128, 128])
DYNAMIC_TOKEN = dict(type="float", num_bits=8, symmetric=True, dynamic=True, strategy="token")
STATIC_TENSOR = dict(type="float", num_bits=8, symmetric=True, dynamic=False, strategy="tensor")
KV_SCHEME = dict(type="float", num_bits=8, symmetric=True, dynamic=False, strategy="tensor")
MOE_IGNORE = ["lm_head", "re:.*mlp.gate$"]
# AutoFP8 lists the concrete modules it skipped: lm_head and each sparse layer's router
AUTOFP8_MOE_IGNORE = ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in (0, 2)]
# an export that keeps one sparse layer's experts unquantized, naming each expert's projections
LAYER2_EXPERTS = [
    f"model.layers.2.mlp.experts.{e}.{p}"
    for e in range(8)
    for p in ("gate_proj", "up_proj", "down_proj")
]
QWEN_MOE_NOT_CONVERTED = ["lm_head", "model.embed_tokens"] + [
    f"model.layers.{i}.{module}"
    for i in range(3)
    for module in ("input_layernorm", "post_attention_layernorm", "mlp.gate")
]


def ct(weights: dict, inputs: dict | None, ignore=("lm_head",), group=None, **top) -> dict:
    """A compressed-tensors quantization_config as llm-compressor writes it (`group`: more keys
    of config_groups.group_0, e.g. the per-group `format` newer exports write, null or not)."""
    config = {**compressed_tensors(weights, inputs, list(ignore)), **top}
    config["config_groups"]["group_0"].update(group or {})
    return config


@dataclass(frozen=True)
class Layout:
    qconfig: dict
    strategy: str  # tensor | channel | block
    scale_name: str = "weight_scale"
    scale_dtype: torch.dtype = torch.float32
    scalar_shape: tuple = ()  # shape of a per-tensor weight_scale / input_scale
    input_scale: bool = False
    kv_scales: tuple = ()  # per-layer attention tensors: (name suffix, shape)
    ignore: tuple = ("lm_head",)  # what the writer leaves unquantized (HF module names / re:)
    model: str = "qwen3"  # which float checkpoint (see float_dirs)
    config_key: str = "quantization_config"


LAYOUTS = {
    # Qwen/Qwen3-*-FP8: block 128x128 weight_scale_inv, modules_to_not_convert null or a list
    "qwen3_fp8_f32_scales": Layout(
        dict(QWEN_BLOCK, modules_to_not_convert=None), "block", "weight_scale_inv"
    ),
    "qwen3_fp8_bf16_scales": Layout(
        dict(QWEN_BLOCK, modules_to_not_convert=["lm_head"]),
        "block",
        "weight_scale_inv",
        torch.bfloat16,
    ),
    # Qwen/Qwen3-30B-A3B-FP8: per-expert weights + weight_scale_inv, bf16 router without scale
    # (modules_to_not_convert naming routers, norms and embeddings as newer Qwen FP8 exports do)
    "qwen3_moe_fp8": Layout(
        dict(QWEN_BLOCK, modules_to_not_convert=QWEN_MOE_NOT_CONVERTED),
        "block",
        "weight_scale_inv",
        torch.bfloat16,
        model="qwen3_moe",
    ),
    # DeepSeek-style block scales on odd shapes: q 320 rows, k/v 64, intermediate 704, hidden 320
    "llama_block_odd_shapes": Layout(dict(QWEN_BLOCK), "block", "weight_scale_inv", model="odd"),
    "ct_block_odd_shapes": Layout(
        ct(BLOCK, dict(DYNAMIC_TOKEN, strategy="group", group_size=128)),
        "block",
        scale_dtype=torch.bfloat16,
        model="odd",
    ),
    # RedHatAI *-FP8-dynamic: channel scales [out, 1] (bf16), dynamic per-token activations
    "ct_channel_dynamic": Layout(
        ct(CHANNEL, DYNAMIC_TOKEN, group=dict(format=None)), "channel", scale_dtype=torch.bfloat16
    ),
    # RedHatAI *-FP8-block: block weight_scale [ceil(out/128), ceil(in/128)], dynamic groups of 128
    "ct_block": Layout(
        ct(
            BLOCK,
            dict(DYNAMIC_TOKEN, strategy="group", group_size=128),
            group=dict(format="float-quantized"),
        ),
        "block",
        scale_dtype=torch.bfloat16,
        model="llama",
    ),
    # W8A16: weight-only FP8
    "ct_channel_w8a16": Layout(ct(CHANNEL, None), "channel", model="llama"),
    # RedHatAI *-FP8 (static): tensor weight_scale [1], input_scale [1]
    "ct_tensor_static": Layout(
        ct(dict(strategy="tensor"), STATIC_TENSOR),
        "tensor",
        scalar_shape=(1,),
        input_scale=True,
        model="llama",
    ),
    # neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8 (older llm-compressor export)
    "ct_naive_frozen": Layout(
        ct(
            dict(strategy="tensor"),
            STATIC_TENSOR,
            format="naive-quantized",
            quantization_status="frozen",
        ),
        "tensor",
        input_scale=True,
        model="llama",
    ),
    # early compressed-tensors exports: the same config under `compression_config`
    "ct_compression_config_key": Layout(
        ct(CHANNEL, DYNAMIC_TOKEN),
        "channel",
        model="llama",
        config_key="compression_config",
    ),
    # RedHatAI *-FP8-KV: a kv_cache_scheme and self_attn.k_scale / v_scale in the files
    "ct_kv_cache_scheme": Layout(
        ct(dict(strategy="tensor"), STATIC_TENSOR, kv_cache_scheme=KV_SCHEME),
        "tensor",
        scalar_shape=(1,),
        input_scale=True,
        kv_scales=(("self_attn.k_scale", ()), ("self_attn.v_scale", ())),
        model="llama",
    ),
    # RedHatAI/Qwen3-30B-A3B-FP8-dynamic: channel experts, routers ignored by a regex
    "ct_moe_channel": Layout(
        ct(CHANNEL, DYNAMIC_TOKEN, ignore=MOE_IGNORE),
        "channel",
        scale_dtype=torch.bfloat16,
        ignore=tuple(MOE_IGNORE),
        model="qwen3_moe",
    ),
    # channel experts with static per-tensor input scales (each expert's own)
    "ct_moe_channel_static": Layout(
        ct(CHANNEL, STATIC_TENSOR, ignore=MOE_IGNORE),
        "channel",
        input_scale=True,
        ignore=tuple(MOE_IGNORE),
        model="qwen3_moe",
    ),
    # RedHatAI / neuralmagic static *-FP8 MoE: per-tensor weight_scale [1] and input_scale [1]
    # per expert projection (gate and up of one expert with different scales), routers ignored
    "ct_moe_tensor_static": Layout(
        ct(dict(strategy="tensor"), STATIC_TENSOR, ignore=MOE_IGNORE),
        "tensor",
        scalar_shape=(1,),
        input_scale=True,
        ignore=tuple(MOE_IGNORE),
        model="qwen3_moe",
    ),
    # AutoFP8 static MoE: per-tensor weight_scale [] and input_scale [] per expert projection
    "autofp8_moe_static": Layout(
        dict(AUTOFP8, ignored_layers=AUTOFP8_MOE_IGNORE),
        "tensor",
        input_scale=True,
        ignore=tuple(AUTOFP8_MOE_IGNORE),
        model="qwen3_moe",
    ),
    # the same with layer 2's experts kept bf16, each of their projections named
    "autofp8_moe_layer_kept": Layout(
        dict(AUTOFP8, ignored_layers=AUTOFP8_MOE_IGNORE + LAYER2_EXPERTS),
        "tensor",
        input_scale=True,
        ignore=tuple(AUTOFP8_MOE_IGNORE + LAYER2_EXPERTS),
        model="qwen3_moe",
    ),
    # old neuralmagic AutoFP8: per-tensor weight_scale and input_scale of shape []
    "autofp8_static": Layout(dict(AUTOFP8), "tensor", input_scale=True, model="llama"),
    # AutoFP8 with its kv cache scales on k_proj / v_proj (`output_scale`)
    "autofp8_kv": Layout(
        dict(AUTOFP8, kv_cache_scheme="static"),
        "tensor",
        input_scale=True,
        kv_scales=(("self_attn.k_proj.output_scale", ()), ("self_attn.v_proj.output_scale", ())),
        model="llama",
    ),
}


def is_ignored(module: str, ignore: tuple) -> bool:
    return any(
        re.match(e[3:], module) if e.startswith("re:") else e in (module, module.split(".")[-1])
        for e in ignore
    )


def quantize(w: torch.Tensor, strategy: str, scale_dtype: torch.dtype):
    """(e4m3 weight, scale as stored, the weight dequantised in float64): the scale is rounded
    to its stored dtype before the weight is divided by it."""
    out, inp = w.shape
    if strategy == "tensor":
        scale = w.abs().amax() / E4M3_MAX
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    else:
        rows, cols = -(-out // 128), -(-inp // 128)
        padded = torch.zeros(rows * 128, cols * 128)
        padded[:out, :inp] = w
        scale = padded.view(rows, 128, cols, 128).abs().amax(dim=(1, 3)) / E4M3_MAX
    scale = scale.to(scale_dtype)
    wide = scale.double()
    if strategy == "block":
        full = wide.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inp]
    else:
        full = wide.expand(out, inp)
    weight = (w.double() / full).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return weight, scale, weight.double() * full


def save_sharded(tensors: dict[str, torch.Tensor], out: Path) -> None:
    """Two shards and an index, tensors dealt alternately (a scale may sit in the other shard
    than its weight, as in published multi-file checkpoints)."""
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n].contiguous() for n in part}, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))


def write_published(src: Path, out: Path, layout: Layout, seed: int = 0) -> Path:
    """The float checkpoint `src` in `layout`; the float64 dequantised weights (and the float
    ones that stay bf16) go to `out`/reference for tests/test_fp8.reference_logits."""
    gen = torch.Generator().manual_seed(seed)
    tensors, reference = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if not LINEAR.search(name) or is_ignored(module, layout.ignore):
            stored = w.to(torch.bfloat16)  # published: everything unquantized is bf16
            tensors[name], reference[name] = stored, stored.double()
            continue
        w = w * PART_GAIN[LINEAR.search(name)[1]]
        w = w * (0.5 + 1.5 * torch.rand(w.shape[0], 1, generator=gen))
        w = w * (0.5 + 1.5 * torch.rand(1, w.shape[1], generator=gen))
        weight, scale, dequantised = quantize(w, layout.strategy, layout.scale_dtype)
        tensors[name], reference[name] = weight, dequantised
        if layout.strategy == "tensor":
            scale = scale.reshape(layout.scalar_shape)
        tensors[f"{module}.{layout.scale_name}"] = scale
        if layout.input_scale:
            value = 0.01 + torch.rand(1, generator=gen)
            tensors[f"{module}.input_scale"] = value.reshape(layout.scalar_shape)
    config = json.loads((src / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        for suffix, shape in layout.kv_scales:
            value = 0.01 + torch.rand(1, generator=gen)
            tensors[f"model.layers.{layer}.{suffix}"] = value.reshape(shape)
    out.mkdir(parents=True, exist_ok=True)
    save_sharded(tensors, out)
    (out / "reference").mkdir()
    save_file({k: v.float() for k, v in reference.items()}, out / "reference/model.safetensors")
    (out / "reference/config.json").write_text(json.dumps(config))
    torch.save(reference, out / "reference/float64.pt")
    config[layout.config_key] = layout.qconfig
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return out


# head_dim 128 and 2 KV heads: q 512 rows, k/v 256, o 512 columns, so TP=2 keeps whole blocks
WIDE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128)


def save_float(kind: str, out: Path) -> Path:
    if kind == "qwen3":  # tied embeddings as the small Qwen3 FP8 models
        return save_hf_model(
            out, "qwen3", seed=11, intermediate_size=512, tie_word_embeddings=True, **WIDE
        )
    if kind == "llama":
        return save_hf_model(out, "llama", seed=12, intermediate_size=512, **WIDE)
    if kind == "odd":  # nothing a multiple of 128 but k/v: 64 rows, hidden 320, 1 KV head
        return save_hf_model(
            out,
            "llama",
            seed=13,
            hidden_size=320,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=64,
            intermediate_size=704,
        )
    from test_moe import save_moe  # 3 layers, layer 1 dense; expert intermediate 64: 1/2 block

    save_moe(
        out, 14, False, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True,
        intermediate_size=512, moe_intermediate_size=64, **WIDE,
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory) -> dict[str, Path]:
    kinds = {layout.model for layout in LAYOUTS.values()}
    return {kind: save_float(kind, tmp_path_factory.mktemp(f"float_{kind}")) for kind in kinds}


@pytest.fixture(scope="module")
def published(tmp_path_factory, float_dirs) -> dict[str, Path]:
    return {
        name: write_published(float_dirs[layout.model], tmp_path_factory.mktemp(name), layout)
        for name, layout in LAYOUTS.items()
    }


def greedy(path: Path, **kwargs) -> list[list[int]]:
    outs = Engine(str(path), **ENGINE, **kwargs).generate([PROMPT, PROMPT[:5]], GREEDY)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_published_layout_matches_float64_reference(published, name):
    path, layout = published[name], LAYOUTS[name]
    engine = Engine(str(path), **ENGINE)
    layer = engine.model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.fp8.quant.strategy == layout.strategy
    if layout.model == "qwen3_moe":
        experts = layer.mlp.experts
        assert experts.gate_up_proj.dtype == FP8 and experts.fp8 is not None
        assert layer.mlp.gate.weight.dtype == torch.float32  # the bf16 router, unquantized
    if name == "autofp8_moe_layer_kept":  # layer 2's experts named one by one: stored dtype
        kept = engine.model.model.layers[2].mlp.experts
        assert kept.fp8 is None and kept.gate_up_proj.dtype == torch.float32
    ours, theirs = our_logits(engine, PROMPT), reference_logits(path, PROMPT)
    rel = ((ours.double() - theirs).norm() / theirs.norm()).item()
    assert rel < REL_TOL[torch.float32], f"{name}: relative error {rel:.2e}"
    outs = engine.generate([PROMPT, PROMPT[:5]], GREEDY)
    assert [o.token_ids for o in outs] == greedy(path / "reference")


def test_scales_keep_each_merged_part(published):
    """AutoFP8 per-tensor scales: q, k and v (gate and up) keep their own after the merge."""
    path = published["autofp8_static"]
    engine = Engine(str(path), **ENGINE)
    tensors = {}
    for file in path.glob("*.safetensors"):
        tensors.update(load_file(file))
    attn, mlp = engine.model.model.layers[1].self_attn, engine.model.model.layers[1].mlp
    want = [tensors[f"model.layers.1.self_attn.{p}_proj.weight_scale"] for p in "qkv"]
    assert torch.equal(attn.qkv_proj.weight_scale, torch.stack(want))
    assert len({float(s) for s in want}) == 3
    want = [tensors[f"model.layers.1.mlp.{p}_proj.weight_scale"] for p in ("gate", "up")]
    assert torch.equal(mlp.gate_up_proj.weight_scale, torch.stack(want))


TENSOR_EXPERTS = ["ct_moe_tensor_static", "autofp8_moe_static"]


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in path.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("name", TENSOR_EXPERTS)
def test_tensor_experts_keep_each_part_scale(published, name):
    """Per-tensor expert scales: gate and up of each expert keep their own (fused into
    gate_up_proj, each half dequantised with its part's scale), down its own."""
    path = published[name]
    engine = Engine(str(path), **ENGINE)
    experts = engine.model.model.layers[2].mlp.experts
    tensors = checkpoint_tensors(path)
    prefix = "model.layers.2.mlp.experts"
    assert experts.gate_up_proj_weight_scale.shape == (8, 2)
    assert experts.down_proj_weight_scale.shape == (8, 1)
    for kind in ("weight_scale", "input_scale"):
        gate_up, down = (getattr(experts, f"{p}_{kind}") for p in ("gate_up_proj", "down_proj"))
        for j in range(8):
            want = [tensors[f"{prefix}.{j}.{p}_proj.{kind}"].reshape(()) for p in ("gate", "up")]
            assert torch.equal(gate_up[j], torch.stack(want)), (kind, j)
            assert torch.equal(down[j], tensors[f"{prefix}.{j}.down_proj.{kind}"].reshape(1))
    gate, up = experts.gate_up_proj_weight_scale.unbind(1)
    assert bool((gate != up).all())  # PART_GAIN: gate's range is far from up's
    reference = torch.load(path / "reference/float64.pt")
    gate_up, down = experts.fp8.dequantize(experts, torch.float64)
    for j in range(8):
        want = [reference[f"{prefix}.{j}.{p}_proj.weight"] for p in ("gate", "up")]
        assert torch.equal(gate_up[j], torch.cat(want)), j
        assert torch.equal(down[j], reference[f"{prefix}.{j}.down_proj.weight"]), j


def test_kv_cache_scales_are_ignored_with_one_warning(published, caplog):
    """An FP8 KV cache is not implemented: the checkpoint runs with the KV cache in the model
    dtype, said in one warning line, and its k/v scales are not reported as unknown tensors."""
    for name in ("ct_kv_cache_scheme", "autofp8_kv"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="speculant"):
            Engine(str(published[name]), **ENGINE)
        lines = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert "model dtype" in lines[0]
        assert not any("not used by the model" in r.getMessage() for r in caplog.records)


def test_channel_experts_dummy_weights(published):
    engine = Engine(str(published["ct_moe_channel_static"]), **ENGINE, load_format="dummy")
    experts = engine.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_weight_scale.shape == (8, 128, 1)
    assert bool((experts.down_proj_weight_scale > 0).all())
    gate_up, _ = experts.fp8.dequantize(experts, torch.float32)
    assert 0.3 < gate_up.std().item() * 256**0.5 < 3  # like the dense dummy init's spread
    assert len(engine.generate([PROMPT[:4]], GREEDY)[0].token_ids) == GREEDY.max_new_tokens


@pytest.mark.parametrize("name", TENSOR_EXPERTS)
def test_tensor_experts_dummy_weights(published, name):
    engine = Engine(str(published[name]), **ENGINE, load_format="dummy")
    experts = engine.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_weight_scale.shape == (8, 2)
    assert experts.down_proj_weight_scale.shape == (8, 1)
    assert bool((experts.down_proj_weight_scale > 0).all())
    gate_up, _ = experts.fp8.dequantize(experts, torch.float32)
    assert 0.3 < gate_up.std().item() * 256**0.5 < 3  # like the dense dummy init's spread
    assert len(engine.generate([PROMPT[:4]], GREEDY)[0].token_ids) == GREEDY.max_new_tokens


# ------------------------------------------------------------------------------------- TP=2


TP2_CASES = [
    "qwen3_fp8_bf16_scales",
    "qwen3_moe_fp8",
    "ct_channel_dynamic",
    "ct_block",
    "ct_naive_frozen",
    "ct_kv_cache_scheme",
    "ct_moe_channel",
    "ct_moe_channel_static",
    "ct_moe_tensor_static",
    "autofp8_moe_static",
    "autofp8_static",
]


def test_tp2_equals_tp1(published):
    assert_tp2_equals_tp1([(name, published[name]) for name in TP2_CASES])


# ------------------------------------------------------------------------------------ refusals


INT8_CT = ct(dict(type="int", strategy="channel"), None, format="int-quantized")


@pytest.mark.parametrize(
    "qconfig, named",
    [
        (dict(INT8_CT), "format='int-quantized'"),
        (dict(INT8_CT, format="float-quantized"), "config_groups.group_0.weights.type='int'"),
        (ct(dict(CHANNEL, num_bits=4), None), "config_groups.group_0.weights.num_bits=4"),
        (
            ct(dict(strategy="group", group_size=128), None),
            "config_groups.group_0.weights.strategy='group'",
        ),
        (ct(dict(CHANNEL, symmetric=False), None), "config_groups.group_0.weights.symmetric=False"),
        (
            ct(CHANNEL, dict(DYNAMIC_TOKEN, symmetric=False)),
            "config_groups.group_0.input_activations.symmetric=False",
        ),
        (
            ct(CHANNEL, dict(DYNAMIC_TOKEN, type="int")),
            "config_groups.group_0.input_activations.type='int'",
        ),
        (ct(CHANNEL, None, format="pack-quantized"), "format='pack-quantized'"),
        (
            ct(dict(type="int", num_bits=8, strategy="channel"), None, format="naive-quantized"),
            "config_groups.group_0.weights.type='int'",
        ),
        (ct(CHANNEL, None, kv_cache_scheme="fp8"), "kv_cache_scheme='fp8'"),
        (
            ct(CHANNEL, None, sparsity_config=dict(format="sparse-24-bitmask")),
            "sparsity_config.format='sparse-24-bitmask'",
        ),
        (ct(CHANNEL, None, transform_config=dict(config_groups={})), "transform_config="),
        (
            ct(CHANNEL, None, group=dict(format="int-quantized")),
            "config_groups.group_0.format='int-quantized'",
        ),
        (dict(quant_method="fp8", activation_scheme="dynamic", fmt="e5m2"), "fmt='e5m2'"),
        (dict(QWEN_BLOCK, weight_block_size=[1, 128]), "weight_block_size=[1, 128]"),
        (dict(quant_method="bitsandbytes", load_in_8bit=True), "quant_method='bitsandbytes'"),
    ],
)
def test_unsupported_schemes_are_refused_naming_the_key(qconfig, named):
    with pytest.raises(SpeculantError, match=re.escape(named)) as exc:
        ModelConfig.from_hf(with_quant(qconfig))
    assert "\n" not in str(exc.value) and "not supported" in str(exc.value)


def test_naive_quantized_int8_tensors_are_refused(published, tmp_path):
    """naive-quantized with float weights in config.json but int8 tensors in the files: one
    clear error naming the tensor, not a shape or dtype crash."""
    src = published["ct_naive_frozen"]
    tensors = {}
    for file in src.glob("*.safetensors"):
        tensors.update(load_file(file))
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].float().round().clamp(-127, 127).to(torch.int8)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(SpeculantError, match=re.escape(name) + ".*int8.*float8_e4m3fn") as exc:
        Engine(str(tmp_path), **ENGINE)
    assert "\n" not in str(exc.value)


def test_experts_ignored_only_in_part_are_refused(published, tmp_path):
    """An ignore list naming some of a layer's expert projections but not all: the layer's
    experts are one fused FP8 tensor, so one clear error naming both, not a load crash."""
    src = published["autofp8_moe_layer_kept"]
    for file in src.glob("*.safetensors*"):
        (tmp_path / file.name).symlink_to(file)
    config = json.loads((src / "config.json").read_text())
    partial = "model.layers.0.mlp.experts.3.down_proj"
    config["quantization_config"]["ignored_layers"] = AUTOFP8_MOE_IGNORE + [partial]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpeculantError, match=re.escape(partial) + ".* but not ") as exc:
        Engine(str(tmp_path), **ENGINE)
    assert "\n" not in str(exc.value)
