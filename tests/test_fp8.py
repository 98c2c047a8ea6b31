"""FP8 targets as published (issue 24, CPU part): tiny random checkpoints written in the `fp8`
(block 128x128 `weight_scale_inv`; per-tensor `weight_scale` + static `input_scale`) and
compressed-tensors float-quantized (tensor / channel / block `weight_scale`, `ignore` lists)
layouts load and run the dequantising reference forward.

Tolerance: our float32 forward of the e4m3 weights against transformers' float64 forward of the
same weights dequantised in float64 (written as a plain checkpoint): relative Frobenius error of
the logits < 1e-4 (float32 rounding, as tests/test_models.py). With bfloat16 activations the
logits are within 1e-3 of the plain bfloat16 model of the dequantised weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers_ckpt import save_hf_model
from helpers_dflash import write_random_dflash
from helpers_eagle import write_random_eagle3
from safetensors.torch import load_file, save_file

from speculant import Engine, SamplingParams, SpeculantError
from speculant.comm.groups import ParallelContext
from speculant.config import ModelConfig
from speculant.launch.spawn import run_ranks
from speculant.models.loader import build_causal_lm

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
# hidden 256 and head_dim 128: q 512 rows, k/v 256, so TP=2 keeps whole 128x128 blocks;
# intermediate 320 leaves a partial last block (TP=1 only), 512 splits evenly over tp=2
SIZES = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=256
)
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-3}  # bf16: vs the plain bf16 model
ENGINE = dict(device="cpu", max_num_seqs=4, max_model_len=128, page_size=8)
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
COLLECTIVE_TIMEOUT_S = 60
LAUNCH_TIMEOUT_S = 150

CT_WEIGHTS = dict(type="float", num_bits=8, symmetric=True, dynamic=False)
DYNAMIC_TOKEN = dict(type="float", num_bits=8, symmetric=True, dynamic=True, strategy="token")
STATIC_TENSOR = dict(type="float", num_bits=8, symmetric=True, dynamic=False, strategy="tensor")


def compressed_tensors(weights: dict, inputs: dict | None, ignore: list[str]) -> dict:
    group = dict(targets=["Linear"], weights={**CT_WEIGHTS, **weights}, input_activations=inputs)
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


# name -> (quantization_config, weight strategy, scale tensor name, scale shape of a per-tensor
# scale, writes input_scale)
SCHEMES = {
    "fp8_block": (
        dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
             weight_block_size=[128, 128]),
        "block", "weight_scale_inv", None, False,
    ),
    "fp8_tensor": (
        dict(quant_method="fp8", activation_scheme="static", ignored_layers=["lm_head"]),
        "tensor", "weight_scale", (), True,
    ),
    "ct_channel": (
        compressed_tensors(
            dict(strategy="channel"), DYNAMIC_TOKEN, ["lm_head", r"re:.*layers\.1\.mlp\.down_proj$"]
        ),
        "channel", "weight_scale", None, False,
    ),
    "ct_tensor_static": (
        compressed_tensors(dict(strategy="tensor"), STATIC_TENSOR, ["lm_head"]),
        "tensor", "weight_scale", (1,), True,
    ),
    "ct_block": (
        compressed_tensors(
            dict(strategy="block", block_structure=[128, 128]),
            dict(DYNAMIC_TOKEN, strategy="group", group_size=128),
            ["lm_head"],
        ),
        "block", "weight_scale", None, False,
    ),
}  # fmt: skip


def quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale in the published shape, the weight dequantised in float64)."""
    out, inp = w.shape
    if strategy == "tensor":
        scale = w.abs().amax() / E4M3_MAX
        full = scale.expand(out, inp)
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        full = scale.expand(out, inp)
    else:
        rows, cols = -(-out // 128), -(-inp // 128)
        padded = torch.zeros(rows * 128, cols * 128)
        padded[:out, :inp] = w
        scale = padded.view(rows, 128, cols, 128).abs().amax(dim=(1, 3)) / E4M3_MAX
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inp]
    weight = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return weight, scale.float(), weight.double() * full.double()


def write_fp8_checkpoint(src: Path, out: Path, scheme: str, seed: int = 0) -> Path:
    """The float checkpoint `src` quantized per `scheme` into `out` (config.json with its
    quantization_config); its dequantised float64 weights go to `out`/reference as a plain
    checkpoint. Rows and columns are rescaled first so that block and channel scales differ."""
    qconfig, strategy, scale_name, scalar_shape, static_input = SCHEMES[scheme]
    gen = torch.Generator().manual_seed(seed)
    tensors, reference = {}, {}
    ignore = qconfig.get("ignore") or qconfig.get("ignored_layers") or []
    for name, w in load_file(src / "model.safetensors").items():
        module = name.removesuffix(".weight")
        skipped = any(
            re.match(e[3:], module) if e.startswith("re:") else module.endswith(e) for e in ignore
        )
        if not LINEAR.search(name) or skipped:
            tensors[name], reference[name] = w, w.double()
            continue
        w = w * (0.5 + 1.5 * torch.rand(w.shape[0], 1, generator=gen))
        w = w * (0.5 + 1.5 * torch.rand(1, w.shape[1], generator=gen))
        weight, scale, dequantised = quantize(w, strategy)
        tensors[name], reference[name] = weight, dequantised
        tensors[f"{module}.{scale_name}"] = scale.reshape(scalar_shape) if scalar_shape else scale
        if static_input:
            tensors[f"{module}.input_scale"] = (0.01 + torch.rand(1, generator=gen)).reshape(
                scalar_shape
            )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (out / "reference").mkdir()
    save_file({k: v.float() for k, v in reference.items()}, out / "reference/model.safetensors")
    (out / "reference/config.json").write_text(json.dumps(config))
    torch.save(reference, out / "reference/float64.pt")
    config["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory) -> dict[int, Path]:
    """Float llama checkpoints by intermediate size (320: a partial block; 512: TP=2)."""
    return {
        inter: save_hf_model(
            tmp_path_factory.mktemp(f"float{inter}"),
            "llama",
            seed=5,
            intermediate_size=inter,
            **SIZES,
        )
        for inter in (320, 512)
    }


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory, float_dirs) -> dict[tuple[str, int], Path]:
    return {
        (scheme, inter): write_fp8_checkpoint(
            src, tmp_path_factory.mktemp(f"{scheme}_{inter}"), scheme
        )
        for scheme in SCHEMES
        for inter, src in float_dirs.items()
    }


def our_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, through the paged prefill path."""
    row = engine.kv.allocate(len(ids) + 1)
    try:
        hidden, _, _ = engine.runner.forward_prefill([row], [ids], [0])
        return engine.model.compute_logits(hidden)
    finally:
        engine.kv.free(row)


def reference_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """transformers in float64 on the dequantised weights (exactly, from float64 tensors)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path / "reference", dtype=torch.float64, experts_implementation="eager"
    ).eval()  # eager experts: the grouped ones have no float64 kernel
    state = torch.load(path / "reference/float64.pt")
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


PROMPT = torch.randint(3, 256, (29,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_logits_match_float64_reference_of_dequantised_weights(fp8_dirs, scheme):
    path = fp8_dirs[(scheme, 320)]
    engine = Engine(str(path), **ENGINE)
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.fp8 is not None
    assert engine.model.lm_head.weight.dtype == torch.float32  # ignored: stored dtype
    ours, theirs = our_logits(engine, PROMPT), reference_logits(path, PROMPT)
    rel = ((ours.double() - theirs).norm() / theirs.norm()).item()
    assert rel < REL_TOL[torch.float32], f"{scheme}: relative error {rel:.2e}"


def test_ignore_list_keeps_stored_dtype(fp8_dirs):
    engine = Engine(str(fp8_dirs[("ct_channel", 320)]), **ENGINE)
    layers = engine.model.model.layers
    assert layers[1].mlp.down_proj.weight.dtype == torch.float32  # re: ignore entry
    assert layers[1].mlp.down_proj.fp8 is None
    assert layers[0].mlp.down_proj.weight.dtype == FP8


def test_bfloat16_activations(fp8_dirs):
    """Dequantised to bfloat16, the weights are the plain bfloat16 model's of the dequantised
    checkpoint: the same logits (and bfloat16's own distance to float64)."""
    path = fp8_dirs[("fp8_block", 320)]
    ours = our_logits(Engine(str(path), **ENGINE, dtype="bfloat16"), PROMPT)
    plain = our_logits(Engine(str(path / "reference"), **ENGINE, dtype="bfloat16"), PROMPT)
    theirs = reference_logits(path, PROMPT)
    assert ((ours - plain).norm() / plain.norm()).item() < REL_TOL[torch.bfloat16]
    rel, rel_plain = ((x.double() - theirs).norm() / theirs.norm() for x in (ours, plain))
    assert rel < 2 * rel_plain, f"relative error {rel:.2e}, plain bfloat16 {rel_plain:.2e}"


# ------------------------------------------------------------------------------------- TP=2


def fp8_generate_in_rank(tp: int, cases: list[tuple]) -> dict:
    """One rank: for each (name, target) an engine, the prompt's logits and greedy tokens."""
    pctx = ParallelContext.from_env(tp, 1, "cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
    seen = {}
    for name, target in cases:
        engine = Engine(str(target), pctx=pctx, **ENGINE)
        logits = our_logits(engine, PROMPT)
        source = pctx.rank == 0
        outs = engine.generate([PROMPT, PROMPT[:5]] if source else None, GREEDY if source else None)
        # a list, not a tensor: torch would pass a tensor's storage, gone once the rank exits
        seen[name] = dict(logits=logits.tolist(), tokens={o.index: o.token_ids for o in outs})
    pctx.close()
    return seen


@pytest.fixture(scope="module")
def kv1_dirs(tmp_path_factory) -> dict[str, Path]:
    """One KV head: at tp=2 it is replicated on both ranks, its scale rows with it."""
    src = save_hf_model(
        tmp_path_factory.mktemp("float_kv1"),
        "llama",
        seed=7,
        intermediate_size=512,
        **{**SIZES, "num_key_value_heads": 1},
    )
    return {
        scheme: write_fp8_checkpoint(src, tmp_path_factory.mktemp(f"{scheme}_kv1"), scheme)
        for scheme in ("fp8_block", "ct_channel")
    }


def test_tp2_equals_tp1(fp8_dirs, kv1_dirs):
    """Weights and their scales shard together: block scales along rows (q/k/v, gate/up) and
    columns (o, down), channel scales with their rows, per-part tensor scales whole. Logits
    within 1e-4 (float32 partial sums reduced in another order)."""
    cases = [(s, fp8_dirs[(s, 512)]) for s in ("fp8_block", "ct_channel", "ct_tensor_static")]
    cases += [(f"{s}_kv1", path) for s, path in kv1_dirs.items()]
    assert_tp2_equals_tp1(cases)


def assert_tp2_equals_tp1(cases: list[tuple[str, Path]]) -> None:
    """Each (name, checkpoint) run by two gloo ranks at tp=2: their logits within 1e-4 of one
    process's and rank 0's greedy tokens equal to its."""
    ranks = run_ranks(fp8_generate_in_rank, 2, (2, cases), timeout_s=LAUNCH_TIMEOUT_S)
    for name, target in cases:
        engine = Engine(str(target), **ENGINE)
        logits = our_logits(engine, PROMPT)
        tokens = {o.index: o.token_ids for o in engine.generate([PROMPT, PROMPT[:5]], GREEDY)}
        for rank in ranks:
            torch.testing.assert_close(
                torch.tensor(rank[name]["logits"]), logits, rtol=1e-4, atol=1e-4
            )
        assert ranks[0][name]["tokens"] == tokens, name


def test_block_split_by_tp_is_refused(fp8_dirs):
    cfg = ModelConfig.from_dir(fp8_dirs[("fp8_block", 320)])
    with pytest.raises(SpeculantError, match=r"tp=2 leaves 160 output rows per rank") as exc:
        build_causal_lm(cfg, 64, ParallelContext(tp_size=2, tp_rank=0))
    assert "\n" not in str(exc.value)


def test_fp8_targets_launch_their_kernels_with_their_own_pdl_modes(fp8_dirs, float_dirs):
    """A dense FP8 target's forward runs inside its ops' launch_modes with models/fp8.py's
    modes (the small kernels between FP8 projections launch their successor early); a float
    target's with none. Seen through the ops the forward is given (the protocol: what it enters
    around its kernels)."""
    from speculant.kernels.ops import TorchOps
    from speculant.models.fp8 import FP8_LAUNCH_MODES

    entered = []

    class RecordingOps(TorchOps):
        @staticmethod
        def launch_modes(modes):
            entered.append(modes)
            return TorchOps.launch_modes(modes)

    for path, want in ((fp8_dirs[("fp8_block", 320)], FP8_LAUNCH_MODES), (float_dirs[320], None)):
        engine = Engine(str(path), **ENGINE)
        assert engine.model.launch_modes == want, path
        engine.runner.attn.ops = RecordingOps()  # an instance attribute over the class's
        entered.clear()
        logits = our_logits(engine, PROMPT[:5])
        assert entered == [want] and torch.isfinite(logits).all(), (path, entered)


# ----------------------------------------------------------------------- Qwen3-MoE FP8 experts


@pytest.fixture(scope="module")
def fp8_moe_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE (3 layers, layer 1 dense) quantised block-wise in the published layout:
    per-expert `experts.{j}.{gate,up,down}_proj.weight` e4m3 + `weight_scale_inv` (partial
    128-blocks: hidden 64, expert intermediate 32), attention and dense MLP too; router stays
    float."""
    from test_moe import save_moe

    src = tmp_path_factory.mktemp("moe_float")
    save_moe(src, 0, False, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
    return write_fp8_checkpoint(src, tmp_path_factory.mktemp("moe_fp8"), "fp8_block")


def test_fp8_moe_experts_load_and_match_float64_reference(fp8_moe_dir):
    names = load_file(fp8_moe_dir / "model.safetensors")
    assert names["model.layers.0.mlp.experts.3.up_proj.weight"].dtype == FP8
    assert names["model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"].shape == (1, 1)
    engine = Engine(str(fp8_moe_dir), **ENGINE)
    experts = engine.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == FP8 and experts.fp8 is not None
    assert experts.gate_up_proj_weight_scale_inv.shape == (8, 2, 1)
    assert engine.model.model.layers[0].mlp.gate.weight.dtype == torch.float32
    ours, theirs = our_logits(engine, PROMPT), reference_logits(fp8_moe_dir, PROMPT)
    rel = ((ours.double() - theirs).norm() / theirs.norm()).item()
    assert rel < REL_TOL[torch.float32], f"relative error {rel:.2e}"


def test_fp8_moe_eagle3_greedy_equals_plain(fp8_moe_dir, tmp_path):
    write_random_eagle3(tmp_path, fp8_moe_dir, draft_vocab=200)
    prompts = [PROMPT, PROMPT[:3], PROMPT[7:20]]
    plain = Engine(str(fp8_moe_dir), **ENGINE).generate(prompts, GREEDY)
    spec = dict(algo="eagle3", draft=str(tmp_path), num_draft_tokens=3)
    outs = Engine(str(fp8_moe_dir), **ENGINE, **spec).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_fp8_moe_dummy_weights(fp8_moe_dir):
    engine = Engine(str(fp8_moe_dir), **ENGINE, load_format="dummy")
    experts = engine.model.model.layers[2].mlp.experts
    scale = experts.down_proj_weight_scale_inv
    assert experts.down_proj.dtype == FP8 and bool((scale > 0).all())
    gate_up, _ = experts.fp8.dequantize(experts, torch.float32)
    assert 0.3 < gate_up.std().item() * 64**0.5 < 3
    assert len(engine.generate([PROMPT[:4]], GREEDY)[0].token_ids) == GREEDY.max_new_tokens


# ------------------------------------------------------------------------- speculative decoding


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, fp8_dirs) -> dict[str, dict]:
    target = fp8_dirs[("fp8_block", 512)]
    eagle, dflash = tmp_path_factory.mktemp("eagle3"), tmp_path_factory.mktemp("dflash")
    write_random_eagle3(eagle, target, num_kv_heads=1, seed=3)
    write_random_dflash(dflash, target, num_layers=2, block_size=4, target_layer_ids=[1, 0])
    draft = save_hf_model(tmp_path_factory.mktemp("draft"), "llama", seed=6, vocab_size=256)
    return {
        "eagle3": dict(algo="eagle3", draft=str(eagle), num_draft_tokens=3),
        "dflash": dict(algo="dflash", draft=str(dflash), num_draft_tokens=3),
        "draft-model": dict(algo="draft-model", draft=str(draft), num_draft_tokens=2),
    }


@pytest.mark.parametrize("algo", ["eagle3", "dflash", "draft-model"])
def test_greedy_speculative_equals_plain_greedy(fp8_dirs, drafters, algo):
    target = str(fp8_dirs[("fp8_block", 512)])
    prompts = [PROMPT, PROMPT[:3], PROMPT[7:20]]
    plain = Engine(target, **ENGINE).generate(prompts, GREEDY)
    spec = Engine(target, **ENGINE, **drafters[algo]).generate(prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


# ------------------------------------------------------------------------------- dummy weights


@pytest.mark.parametrize("scheme", ["fp8_block", "ct_channel", "fp8_tensor"])
def test_dummy_load_format_builds_fp8_weights_and_scales(fp8_dirs, scheme):
    engine = Engine(str(fp8_dirs[(scheme, 320)]), **ENGINE, load_format="dummy")
    layer = engine.model.model.layers[0].mlp.gate_up_proj
    _, strategy, scale_name, _, static_input = SCHEMES[scheme]
    scale = getattr(layer, scale_name)
    assert layer.weight.dtype == FP8 and scale.dtype == torch.float32
    assert bool((scale > 0).all()) and layer.weight.float().abs().max() > 1
    assert hasattr(layer, "input_scale") == static_input
    weight = layer.fp8.dequantize(layer, torch.float32)
    assert 0.3 < weight.std().item() * 256**0.5 < 3  # like the dense dummy init's spread
    out = engine.generate([PROMPT[:4]], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_new_tokens


# ------------------------------------------------------------------------------------ refusals


def with_quant(qconfig: dict) -> dict:
    return dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=256,
        quantization_config=qconfig,
    )


INT8 = compressed_tensors(dict(type="int", strategy="channel"), None, [])
W4A16 = compressed_tensors(dict(type="int", num_bits=4, strategy="group", group_size=128), None, [])


@pytest.mark.parametrize(
    "qconfig, named",
    [
        (dict(quant_method="awq", bits=4), "quant_method='awq'"),
        (dict(quant_method="gptq", bits=4), "quant_method='gptq'"),
        (dict(quant_method="fp8", weight_block_size=[64, 64]), "weight_block_size=[64, 64]"),
        (dict(quant_method="fp8", fmt="e5m2"), "fmt='e5m2'"),
        (dict(INT8), "config_groups.group_0.weights.type='int'"),
        (dict(W4A16), "config_groups.group_0.weights.type='int'"),
        (
            compressed_tensors(dict(num_bits=4), None, []),
            "config_groups.group_0.weights.num_bits=4",
        ),
        (
            compressed_tensors(dict(strategy="group", group_size=128), None, []),
            "config_groups.group_0.weights.strategy='group'",
        ),
        (dict(INT8, format="int-quantized"), "format='int-quantized'"),
        (
            compressed_tensors(dict(strategy="block", block_structure=[64, 64]), None, []),
            "block_structure=[64, 64]",
        ),
    ],
)
def test_unsupported_schemes_are_refused_naming_the_key(qconfig, named):
    with pytest.raises(SpeculantError, match=re.escape(named)) as exc:
        ModelConfig.from_hf(with_quant(qconfig))
    assert "\n" not in str(exc.value) and "not supported" in str(exc.value)


@pytest.mark.parametrize("zero", [True, False])
def test_zero_points_of_a_symmetric_scheme_are_skipped(tmp_path, fp8_dirs, caplog, zero):
    """compressed-tensors exports may save `weight_zero_point` / `input_zero_point` for a
    symmetric scheme too: all zeros, the checkpoint loads as without them (the same logits, no
    "tensors not used" warning); non-zero ones are an asymmetric scheme, refused naming one."""
    src = fp8_dirs[("ct_tensor_static", 320)]
    tensors = load_file(src / "model.safetensors")
    points = {}
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        stem = name.removesuffix(".weight_scale")
        points[f"{stem}.weight_zero_point"] = torch.zeros_like(tensors[name], dtype=torch.int8)
        points[f"{stem}.input_zero_point"] = torch.zeros(1, dtype=torch.int8)
    first = sorted(points)[0]
    if not zero:
        points[first] = points[first] + 3
    save_file({**tensors, **points}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    if not zero:
        with pytest.raises(SpeculantError, match=re.escape(repr(first)) + ".*asymmetric"):
            Engine(str(tmp_path), **ENGINE)
        return
    with caplog.at_level("WARNING"):
        engine = Engine(str(tmp_path), **ENGINE)
    assert "not used" not in caplog.text, caplog.text
    ids = [3, 17, 5, 9]
    expected = our_logits(Engine(str(src), **ENGINE), ids)
    torch.testing.assert_close(our_logits(engine, ids), expected, rtol=0, atol=0)


def test_unquantized_tensor_in_an_fp8_layer_is_refused(tmp_path, fp8_dirs):
    """A float weight the config does not ignore would load without scales: an error."""
    src = fp8_dirs[("fp8_block", 320)]
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(SpeculantError, match=re.escape(name) + ".*ignore list"):
        Engine(str(tmp_path), **ENGINE)


def test_fp8_tensor_into_an_unquantized_model_is_refused(tmp_path, fp8_dirs):
    """An FP8 checkpoint whose config lost its quantization_config is not read as floats."""
    src = fp8_dirs[("fp8_block", 320)]
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpeculantError, match="float8_e4m3fn, but its module loads unquantized"):
        Engine(str(tmp_path), **ENGINE)


@pytest.mark.parametrize("kind", ["float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"])
@pytest.mark.parametrize("quantized", [True, False])
def test_other_fp8_kinds_are_refused(tmp_path, fp8_dirs, kind, quantized):
    """e5m2 and the fnuz forms are FP8 codes too: in an FP8 layer they are not e4m3, and in a
    float layer (a config without quantization_config, or a module its ignore list names) they
    would load as unscaled codes (a weight of 448 where the model's is below 1)."""
    src = fp8_dirs[("fp8_block", 320)]
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if not quantized:  # a float checkpoint but for the one tensor
        del config["quantization_config"]
        tensors = {key: value.float() for key, value in tensors.items() if "_scale" not in key}
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].float().to(getattr(torch, kind))
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    want = "not float8_e4m3fn: FP8 layers load e4m3" if quantized else "loads unquantized"
    with pytest.raises(SpeculantError, match=re.escape(f"{name!r}") + f".*{kind}.*{want}"):
        Engine(str(tmp_path), **ENGINE)


@pytest.mark.parametrize(
    "scheme, qconfig, named",
    [
        # block scales (weight_scale_inv) under a config without weight_block_size
        ("fp8_block", dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic"),
         "holds block scales ('model.layers.0.mlp.down_proj.weight_scale_inv', ...)"),
        ("fp8_block", SCHEMES["ct_block"][0], "with weight_block_size (e.g. [128, 128]); add it"),
        # per-tensor weight_scale under a block config
        ("ct_tensor_static", SCHEMES["fp8_block"][0], "remove weight_block_size"),
    ],
)  # fmt: skip
def test_scales_of_another_layout_than_the_config_names_are_named(
    tmp_path, fp8_dirs, scheme, qconfig, named
):
    """An FP8 checkpoint whose quantization_config describes another scale layout than its
    tensors hold (a config edited by hand): one line saying which scales it holds and what
    the config must say, not only that a scale is missing."""
    src = fp8_dirs[(scheme, 320)]
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qconfig
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpeculantError) as info:
        Engine(str(tmp_path), **ENGINE)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_scale_layout_hint_names_fused_expert_scales_too():
    """Fused experts' scales (`..._weight_scale`) get the hint dense layers' do."""
    from speculant.models.loader import _scale_layout_hint

    experts = "model.layers.0.mlp.experts."
    hint = _scale_layout_hint(experts + "gate_up_proj_weight_scale",
                              [experts + "0.gate_proj.weight_scale_inv"])  # fmt: skip
    assert hint is not None and "with weight_block_size (e.g. [128, 128]); add it" in hint
    hint = _scale_layout_hint(experts + "down_proj_weight_scale_inv",
                              [experts + "0.down_proj.weight_scale"])  # fmt: skip
    assert hint is not None and "remove weight_block_size" in hint
    assert _scale_layout_hint(experts + "down_proj_weight_scale", ["lm_head.weight"]) is None


def test_fp8_draft_model_is_refused(fp8_dirs, float_dirs):
    """Draft models are built unquantized: an FP8 one is an error, not floats without scales."""
    draft = dict(algo="draft-model", draft=str(fp8_dirs[("fp8_block", 320)]), num_draft_tokens=2)
    with pytest.raises(SpeculantError, match="model.layers.0.*float8_e4m3fn"):
        Engine(str(float_dirs[320]), **ENGINE, **draft)
