"""Checkpoint variants in published Hugging Face layouts that the shared fixtures do not cover,
against transformers (CPU, float32): attention_bias (o_proj has a bias too), linear / dynamic /
yarn RoPE scaling, sliding windows (Mistral, Qwen2 use_sliding_window), end-of-sequence ids
listed in generation_config.json (and the tokenizer's eos_token), a non-SiLU hidden_act, and a
tied checkpoint that also holds lm_head.weight. Biases and norm weights are random
(transformers initialises them to 0 and 1, which would hide a bias or norm that is never
loaded)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import helpers_ckpt
import pytest
import torch
from safetensors.torch import load_file, save_file

from speculant import Engine, SamplingParams, SpeculantError
from speculant.config import ModelConfig

PROMPT_LENGTHS = (5, 17, 2, 40)
NEW_TOKENS = 24


def save_variant(out_dir: Path, arch: str, seed: int, legacy: bool = True, **overrides) -> Path:
    """A random transformers model of `arch` (helpers_ckpt.TINY sizes) with random biases and
    norm weights, saved as safetensors; `legacy` writes config.json as published checkpoints do
    (transformers 4: rope_scaling, rope_theta, torch_dtype)."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**helpers_ckpt.TINY, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif "norm" in name:
                param.copy_(1 + torch.randn(param.shape, generator=gen) * 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    if legacy:
        helpers_ckpt._rewrite_legacy_config(out_dir / "config.json")
    return out_dir


def hf_greedy(path: Path, prompts: list[list[int]], n: int, eos: object = None) -> list[list[int]]:
    """transformers' greedy generate; `eos="config"` stops where its generation_config says."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kwargs = {} if eos == "config" else {"eos_token_id": None}
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def prompts_of(lengths=PROMPT_LENGTHS, vocab: int = 256, seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def our_greedy(path: Path, prompts, n: int = NEW_TOKENS, ignore_eos: bool = True, **options):
    options = {"max_model_len": 256, "page_size": 8, "max_num_seqs": 4, **options}
    engine = Engine(str(path), device="cpu", dtype="float32", **options)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=ignore_eos))
    return [out.token_ids for out in outs]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    """A one-layer Llama of the same vocabulary, for --algo draft-model."""
    return save_variant(tmp_path_factory.mktemp("draft"), "llama", 99, num_hidden_layers=1)


ATTENTION_BIAS = {
    # Llama with attention_bias (q/k/v and o_proj biases, as transformers' LlamaAttention)
    "llama": dict(attention_bias=True),
    # Qwen3 reads attention_bias the same way
    "qwen3": dict(attention_bias=True),
}


@pytest.mark.parametrize("arch", sorted(ATTENTION_BIAS))
def test_attention_bias_includes_o_proj(tmp_path, arch, draft_dir):
    """attention_bias=true gives o_proj a bias too; it used to be left out (one warning line
    naming the unused o_proj.bias tensors) and greedy output differed from the first token."""
    path = save_variant(tmp_path, arch, 3, **ATTENTION_BIAS[arch])
    assert ModelConfig.from_dir(path).o_proj_bias
    prompts = prompts_of()
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    assert our_greedy(path, prompts, attention_backend="torch") == expected
    spec = our_greedy(path, prompts, algo="draft-model", draft=str(draft_dir), num_draft_tokens=3)
    assert spec == expected


SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)


def test_qwen2_and_mistral_attention_biases():
    """Qwen2: q/k/v biases and none on o_proj whatever attention_bias says; Mistral: none (as
    transformers builds them)."""
    qwen2 = ModelConfig.from_hf(
        {**SIZES, "architectures": ["Qwen2ForCausalLM"], "attention_bias": True}
    )
    assert qwen2.qkv_bias and not qwen2.o_proj_bias
    mistral = ModelConfig.from_hf(
        {**SIZES, "architectures": ["MistralForCausalLM"], "attention_bias": True}
    )
    assert not mistral.qkv_bias and not mistral.o_proj_bias


ROPE_VARIANTS = {
    # Llama-2 long-context fine-tunes (LongChat, Vicuna-16k): positions / factor
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    # transformers-4 key `type` (older configs)
    "linear_type": ("llama", {"type": "linear", "factor": 2.0}),
    # dynamic NTK: the default RoPE until max_position_embeddings (which the context never passes)
    "dynamic": ("llama", {"type": "dynamic", "factor": 4.0}),
    # Qwen2.5 / Qwen3 long-context instructions: yarn with the original context
    "yarn_qwen2": (
        "qwen2",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ),
    "yarn_qwen3_attention_factor": (
        "qwen3",
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "attention_factor": 0.8,
            "beta_fast": 16.0,
        },
    ),
    "yarn_mscale": (
        "llama",
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 0.7,
            "mscale_all_dim": 1.0,
        },
    ),
}


@pytest.mark.parametrize("name", sorted(ROPE_VARIANTS))
def test_rope_scaling_matches_transformers(tmp_path, name, draft_dir):
    """linear, dynamic and yarn RoPE scaling (refused before: only llama3 ran): the logits of a
    prefill match transformers' and greedy decoding (plain and speculative) equals its
    generate."""
    from transformers import AutoModelForCausalLM

    arch, scaling = ROPE_VARIANTS[name]
    path = save_variant(tmp_path, arch, 5, rope_scaling=scaling)
    engine = Engine(str(path), device="cpu", max_num_seqs=4, max_model_len=256, page_size=8)
    assert engine.model_config.rope_scaling["rope_type"] == scaling.get(
        "rope_type", scaling.get("type")
    )
    ids = prompts_of((90,), seed=1)[0]
    row = engine.kv.allocate(len(ids) + 1)
    hidden, _, _ = engine.runner.forward_prefill([row], [ids], [0])
    ours = engine.model.compute_logits(hidden)
    engine.kv.free(row)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    rel = (ours - theirs).norm() / theirs.norm()
    assert rel < 1e-5, f"{name}: relative error {rel:.2e}"
    prompts = prompts_of()
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [out.token_ids for out in outs] == expected
    spec = our_greedy(path, prompts, algo="draft-model", draft=str(draft_dir), num_draft_tokens=3)
    assert spec == expected


def test_rope_scaling_unknown_type_is_refused():
    hf = {"architectures": ["LlamaForCausalLM"], **SIZES, "rope_scaling": {"rope_type": "su"}}
    with pytest.raises(SpeculantError, match="rope scaling type 'su'.*supported: llama3, linear"):
        ModelConfig.from_hf(hf)


def test_sliding_window_limits_the_context(tmp_path, draft_dir):
    """Qwen2 with use_sliding_window (every layer from max_window_layers on slides): windowed
    attention is not implemented, so the context is capped at the window, where the output is
    exact; a longer --max-model-len is refused (it used to run, silently attending to every
    position past the window)."""
    path = save_variant(
        tmp_path, "qwen2", 6, use_sliding_window=True, sliding_window=12, max_window_layers=1
    )
    cfg = ModelConfig.from_dir(path)
    assert (cfg.sliding_window, cfg.max_position_embeddings) == (12, 12)
    with pytest.raises(SpeculantError, match="max_model_len=64 exceeds.*sliding_window=12"):
        Engine(str(path), device="cpu", max_model_len=64)
    prompts = prompts_of((5, 11, 2), seed=3)
    expected = [
        out[: 12 - len(p)] for p, out in zip(prompts, hf_greedy(path, prompts, 12), strict=True)
    ]
    for options in ({}, {"algo": "draft-model", "draft": str(draft_dir), "num_draft_tokens": 3}):
        assert our_greedy(path, prompts, 12, max_model_len=None, **options) == expected


@pytest.mark.parametrize(
    ("fields", "window"),
    [
        ({"architectures": ["MistralForCausalLM"]}, 4096),  # transformers' default
        ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, None),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 64}, 64),
        # Qwen2.5 / Qwen3 as published: a window that is not used
        ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}, None),
        (
            {
                "architectures": ["Qwen3ForCausalLM"],
                "use_sliding_window": False,
                "sliding_window": 8,
            },
            None,
        ),
        # used, but no layer from max_window_layers on exists
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 2,
            },
            None,
        ),
        (
            {
                "architectures": ["Qwen3ForCausalLM"],
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            8,
        ),
        ({"architectures": ["LlamaForCausalLM"], "sliding_window": 8}, None),
    ],
)
def test_sliding_window_as_transformers_reads_it(fields, window):
    cfg = ModelConfig.from_hf({**SIZES, **fields})
    assert cfg.sliding_window == window
    assert cfg.max_position_embeddings == min(512, window or 512)


def test_mistral_sliding_window_output(tmp_path):
    """Mistral-7B-v0.1 style (sliding_window set): exact up to the window."""
    path = save_variant(tmp_path, "mistral", 8, sliding_window=16)
    prompts = prompts_of((5, 15, 9), seed=4)
    expected = [
        out[: 16 - len(p)] for p, out in zip(prompts, hf_greedy(path, prompts, 12), strict=True)
    ]
    assert our_greedy(path, prompts, 12, max_model_len=None) == expected


def test_generation_config_eos_list(tmp_path):
    """generation_config.json listing several end-of-sequence ids (Llama-3 / Qwen instruct
    models: config.json names one): requests stop on each, as transformers' generate does."""
    path = save_variant(tmp_path, "llama", 11)
    prompts = prompts_of()
    plain = our_greedy(path, prompts)
    stop = plain[0][5]
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, stop]
    (path / "generation_config.json").write_text(json.dumps(generation))
    assert ModelConfig.from_dir(path).eos_token_ids == (2, stop)
    expected = hf_greedy(path, prompts, NEW_TOKENS, eos="config")
    assert len(expected[0]) == 6  # it stops at `stop`
    assert our_greedy(path, prompts, ignore_eos=False) == expected


def word_tokenizer(path: Path, vocab: int, specials: dict[int, str]) -> None:
    """A tokenizer.json of `vocab` word tokens ("t0", "t1", ...), `specials` added as special
    tokens in place of theirs (the layout of a chat fine-tune's <|im_end|>)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = {specials.get(i, f"t{i}"): i for i in range(vocab)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(text, special=True) for text in specials.values()])
    tokenizer.save(str(path / "tokenizer.json"))


@pytest.mark.parametrize("where", ["tokenizer_config", "special_tokens_map"])
def test_the_tokenizers_eos_token_ends_a_request_as_in_vllm(tmp_path, where):
    """A tokenizer whose eos_token is none of config.json's / generation_config.json's ids (a
    ChatML fine-tune of a base model: <|im_end|> there, </s> in the configs): vLLM stops on
    the tokenizer's eos_token_id too, so a request ends at it (stop, no stop_reason) unless
    ignore_eos; its text is left out."""
    path = save_variant(tmp_path, "llama", 11)
    prompts = prompts_of()
    plain = our_greedy(path, prompts)
    stop = plain[0][5]
    word_tokenizer(path, 256, {stop: "<|im_end|>", 2: "</s>"})
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "</s>"}
    if where == "tokenizer_config":
        config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
    else:  # the legacy layout: the config lists no added_tokens_decoder
        (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(path)).eos_token_id == stop
    assert stop not in ModelConfig.from_dir(path).eos_token_ids
    engine = Engine(str(path), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4)
    out = engine.generate(prompts[:1], SamplingParams(max_new_tokens=NEW_TOKENS))[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (plain[0][:6], "stop", None)
    assert "<|im_end|>" not in out.text
    kept = engine.generate(prompts[:1], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert kept[0].token_ids == plain[0]


def test_generation_config_that_is_not_an_object_is_refused(tmp_path):
    path = save_variant(tmp_path, "llama", 11)
    (path / "generation_config.json").write_text("[2]")
    with pytest.raises(SpeculantError, match="generation_config.json' holds a JSON list"):
        ModelConfig.from_dir(path)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_other_activations_are_refused(act):
    """The MLP computes SiLU(gate) * up: another hidden_act used to run silently wrong."""
    hf = {"architectures": ["LlamaForCausalLM"], **SIZES, "hidden_act": act}
    with pytest.raises(SpeculantError, match=f"hidden_act='{act}'.*supported: silu, swish"):
        ModelConfig.from_hf(hf)
    assert ModelConfig.from_hf({**hf, "hidden_act": "silu"}).hidden_size == 64


def test_tied_checkpoint_with_lm_head_copy_loads_the_embedding(tmp_path):
    """tie_word_embeddings=true with an lm_head.weight in a later shard: the shared table comes
    from model.embed_tokens.weight whatever the file order (as vLLM); the lm_head copy used to
    overwrite the embedding when its shard came later."""
    tied = save_variant(tmp_path / "tied", "llama", 12, tie_word_embeddings=True)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for file in ("config.json", "generation_config.json"):
        shutil.copy(tied / file, sharded / file)
    tensors = load_file(str(tied / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    other = {"lm_head.weight": torch.randn_like(tensors["model.embed_tokens.weight"])}
    files = {"model-00001-of-00002.safetensors": tensors, "model-00002-of-00002.safetensors": other}
    weight_map = {}
    for file, part in files.items():
        save_file(part, str(sharded / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    prompts = prompts_of()
    expected = hf_greedy(tied, prompts, NEW_TOKENS)
    assert our_greedy(sharded, prompts) == expected


def test_dflash_attention_bias_loads_every_projection_bias(tmp_path):
    """A DFLASH drafter (Qwen3 layers) with attention_bias: q, k, v and o_proj carry biases, as
    transformers' Qwen3 attention (and the z-lab reference built on it) has them; each loads
    (none is left unused) and greedy speculative output still equals plain greedy."""
    from helpers_dflash import write_random_dflash

    target = save_variant(tmp_path / "target", "llama", 11)
    draft = tmp_path / "dflash"
    tensors = write_random_dflash(draft, target, 2, 6, target_layer_ids=[0, 1], seed=4,
                                  config_overrides={"attention_bias": True})  # fmt: skip
    gen = torch.Generator().manual_seed(9)
    for i in range(2):
        for proj in "qkvo":
            rows = tensors[f"layers.{i}.self_attn.{proj}_proj.weight"].shape[0]
            bias = (0.1 * torch.randn(rows, generator=gen)).to(torch.bfloat16)
            tensors[f"layers.{i}.self_attn.{proj}_proj.bias"] = bias
    save_file(tensors, str(draft / "model.safetensors"), metadata={"format": "pt"})
    options = {"algo": "dflash", "draft": str(draft), "num_draft_tokens": 5}
    spec = Engine(str(target), device="cpu", dtype="float32", **options)
    layer = spec.drafter.model.layers[1].self_attn
    assert torch.equal(layer.o_proj.bias, tensors["layers.1.self_attn.o_proj.bias"].float())
    prompts = prompts_of((4, 9), seed=5)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = Engine(str(target), device="cpu", dtype="float32")
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want


def test_generation_config_eos_error_names_its_file(tmp_path):
    path = save_variant(tmp_path, "llama", 11)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, "x"]}))
    with pytest.raises(SpeculantError, match="must be .*; fix generation_config.json"):
        ModelConfig.from_dir(path)


def test_yarn_without_original_length_takes_max_position_embeddings():
    """transformers fills a yarn scaling's missing original_max_position_embeddings with
    max_position_embeddings (and then its factor of 4 gives the attention factor 0.1 ln 4 + 1)."""
    hf = {
        "architectures": ["Qwen3ForCausalLM"], **SIZES, "max_position_embeddings": 512,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    }  # fmt: skip
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 512
    from speculant.models.layers import RotaryEmbedding

    rope = RotaryEmbedding(cfg.head_dim, 8, cfg.rope_theta, cfg.rope_scaling)
    assert rope.cos[0, 0].item() == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_draft_model_window_shorter_than_the_context_is_refused(tmp_path):
    """A draft model whose sliding window ends before the positions a request reaches would
    attend past it (the target stays exact, acceptance drops silently): refused, naming the
    window, as for DFLASH; within the window it runs."""
    target = save_variant(tmp_path / "target", "llama", 11)
    draft = save_variant(tmp_path / "draft", "mistral", 12, sliding_window=16)
    options = {"algo": "draft-model", "draft": str(draft), "num_draft_tokens": 3}
    with pytest.raises(SpeculantError, match="sliding_window=16 .* shorter than the 72 positions"):
        Engine(str(target), device="cpu", dtype="float32", max_model_len=64, **options)
    Engine(str(target), device="cpu", dtype="float32", max_model_len=8, **options)


def test_dtype_wins_over_a_stale_torch_dtype():
    """A config.json holding both keys (transformers 4.56+ writes `dtype`; an older
    `torch_dtype` may remain) runs in `dtype`, as transformers and vLLM read it: the stale
    float16 would overflow bfloat16 weights on the GPU."""
    from speculant.models.loader import resolve_dtype

    hf = {"architectures": ["LlamaForCausalLM"], **SIZES}
    cfg = ModelConfig.from_hf({**hf, "torch_dtype": "float16", "dtype": "bfloat16"})
    assert resolve_dtype("auto", cfg.torch_dtype, "cuda") == torch.bfloat16
    assert ModelConfig.from_hf({**hf, "torch_dtype": "float16"}).torch_dtype == "float16"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_auto_dtype_without_a_config_dtype_reads_the_weights(tmp_path, dtype):
    """A config.json naming neither `dtype` nor `torch_dtype` (older exports) runs, under
    --dtype auto on a GPU, in its weights' dtype, as transformers' dtype "auto" reads it: it
    ran bfloat16 weights in float32 (twice the memory and time) and float16 ones too."""
    from speculant.models.loader import resolve_dtype

    weights = {"model.embed_tokens.weight": torch.zeros(4, 4, dtype=dtype)}
    save_file({"a.counter": torch.zeros(2, dtype=torch.int64), **weights},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    hf = {"architectures": ["LlamaForCausalLM"], **SIZES}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    name = str(dtype).removeprefix("torch.")
    assert ModelConfig.from_dir(tmp_path).torch_dtype == name
    assert resolve_dtype("auto", ModelConfig.from_dir(tmp_path).torch_dtype, "cuda") == dtype
    assert resolve_dtype("auto", ModelConfig.from_dir(tmp_path).torch_dtype, "cpu") == torch.float32
    (tmp_path / "config.json").write_text(json.dumps({**hf, "torch_dtype": "float32"}))
    assert ModelConfig.from_dir(tmp_path).torch_dtype == "float32"  # a named dtype wins


def test_auto_dtype_of_mixed_weights_is_the_first_by_name_as_transformers_reads_it(tmp_path):
    """bf16 weights beside float32 ones (norms, FP8 scales): safetensors writes the float32
    tensors first in the header (by dtype, then name), transformers' dtype "auto" takes the
    first floating tensor by name (safe_open's sorted keys): bfloat16 here, not float32."""
    from transformers.modeling_utils import get_state_dict_dtype, load_state_dict

    weights = {
        "lm_head.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
        "model.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
        "model.norm.weight": torch.zeros(4),
        "model.layers.0.mlp.down_proj.weight_scale": torch.zeros(1),
    }
    file = tmp_path / "model.safetensors"
    save_file(weights, str(file))
    hf = {"architectures": ["LlamaForCausalLM"], **SIZES}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    theirs = get_state_dict_dtype(load_state_dict(str(file), map_location="meta"))
    assert theirs == torch.bfloat16
    assert ModelConfig.from_dir(tmp_path).torch_dtype == "bfloat16"


@pytest.mark.parametrize(
    "fields",
    [
        {"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 5e5}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        {"rope_theta": 5e5},
    ],
)  # fmt: skip
def test_rope_theta_read_where_transformers_reads_it(fields):
    """rope_theta inside rope_parameters (or rope_scaling, which replaces it) wins over a
    top-level one, as transformers' config classes (and vLLM through them) read it: the other
    theta would rotate every position differently, silently."""
    import transformers

    hf = {"architectures": ["LlamaForCausalLM"], **SIZES, **fields}
    theirs = transformers.LlamaConfig(**json.loads(json.dumps(hf))).rope_parameters
    assert ModelConfig.from_hf(hf).rope_theta == theirs["rope_theta"] == 5e5


TOP_LEVEL_ORIGINAL = {
    # the scaling dict says nothing; the top-level field is the pretraining length
    "yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0}),
    # both say one: transformers overwrites the dict's with the top-level one
    "yarn_both": (
        "qwen2",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    ),
    # llama3 was refused for lacking the field the config holds at its top level
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TOP_LEVEL_ORIGINAL))
def test_top_level_original_max_position_embeddings(tmp_path, name):
    """A top-level `original_max_position_embeddings` (Phi-3 style) is the pretraining length a
    llama3 / yarn scaling uses, over the scaling dict's own (transformers'
    standardize_rope_params); yarn used to take max_position_embeddings, silently rotating
    otherwise, and llama3 was refused."""
    arch, scaling = TOP_LEVEL_ORIGINAL[name]
    path = save_variant(tmp_path, arch, 5)
    config = json.loads((path / "config.json").read_text())
    config.update(rope_scaling=scaling, original_max_position_embeddings=64)
    (path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_dir(path).rope_scaling["original_max_position_embeddings"] == 64
    prompts = prompts_of((90, 5), seed=1)
    assert our_greedy(path, prompts, n=8) == hf_greedy(path, prompts, 8)


# configs that name no max_position_embeddings: each architecture's transformers default (Llama
# 2048, Qwen 32768) is the length yarn's and llama3's missing original length and dynamic NTK's
# threshold come from
NO_MAX_POSITIONS = {
    "qwen2_yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0}, 32768),
    "llama_yarn": ("llama", {"rope_type": "yarn", "factor": 2.0}, 2048),
    "llama3_no_original": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0}, 2048),  # was refused
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(NO_MAX_POSITIONS))
def test_a_config_without_max_position_embeddings_takes_its_architectures_default(tmp_path, name):
    """max_position_embeddings missing from config.json was taken as 4096 for every
    architecture: a Qwen2 yarn scaling without an original length rotated as if pretrained on
    4096 positions (transformers: 32768) and generated other tokens, silently."""
    arch, scaling, default = NO_MAX_POSITIONS[name]
    path = save_variant(tmp_path, arch, 7)
    config = json.loads((path / "config.json").read_text())
    config.pop("max_position_embeddings")
    config.pop("original_max_position_embeddings", None)
    config["rope_scaling"] = scaling
    (path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_dir(path)
    assert cfg.max_position_embeddings == default
    assert cfg.rope_scaling["original_max_position_embeddings"] == default
    prompts = prompts_of((40, 5), seed=3)
    assert our_greedy(path, prompts, n=8) == hf_greedy(path, prompts, 8)


@pytest.mark.parametrize("kv_heads, tp", [(1, 2), (2, 4)])
def test_replicated_kv_heads_keep_their_biases(tmp_path, kv_heads, tp):
    """tp above the KV head count replicates each KV head on tp / kv ranks: a rank's k and v
    biases must be its head's whole bias vector (Qwen2 / attention_bias checkpoints). They were
    repeated element by element, so every rank but the first held the wrong bias values and
    Qwen2.5 under --tp 4 (2 KV heads) generated other tokens than transformers."""
    from speculant.comm.groups import ParallelContext
    from speculant.models.llama import CausalLM
    from speculant.models.loader import iter_safetensors, load_weights

    path = save_variant(tmp_path, "qwen2", 13, num_key_value_heads=kv_heads)
    cfg = ModelConfig.from_dir(path)
    full = dict(iter_safetensors(path))
    d, per_rank = cfg.head_dim, max(1, kv_heads // tp)
    for rank in range(tp):
        model = CausalLM(cfg, 64, ParallelContext(tp_size=tp, tp_rank=rank))
        load_weights(model, iter_safetensors(path), str(path))
        qkv = model.model.layers[0].self_attn.qkv_proj
        q_size, kv_size = qkv.shard_sizes[0], qkv.shard_sizes[1]
        assert kv_size == per_rank * d
        head = rank * kv_heads // tp  # the KV head this rank's query heads read
        for i, name in ((1, "k"), (2, "v")):
            start = q_size + (i - 1) * kv_size
            expected = full[f"model.layers.0.self_attn.{name}_proj.bias"][head * d :][:kv_size]
            torch.testing.assert_close(qkv.bias[start : start + kv_size], expected, rtol=0, atol=0)
            weight = full[f"model.layers.0.self_attn.{name}_proj.weight"][head * d :][:kv_size]
            torch.testing.assert_close(qkv.weight[start : start + kv_size], weight, rtol=0, atol=0)


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
)
def test_absent_head_dim_defaults_as_transformers_reads_it(arch):
    """Without head_dim, transformers' Qwen3Config takes 128 (every DFLASH drafter and Qwen3
    EAGLE-3 head is read through it by the z-lab and vLLM references); the others take
    hidden_size // num_attention_heads. Another width would refuse the checkpoint's q/k norms
    and projections as the wrong shape."""
    import transformers

    hf = {"architectures": [arch], **SIZES, "num_experts": 4, "num_experts_per_tok": 2}
    hf.pop("head_dim", None)
    kind = {"Llama": "LlamaConfig", "Qwen2": "Qwen2Config", "Qwen3Moe": "Qwen3MoeConfig"}
    config_class = getattr(transformers, kind.get(arch.removesuffix("ForCausalLM"), "Qwen3Config"))
    theirs = config_class(**hf)
    expected = getattr(theirs, "head_dim", None) or hf["hidden_size"] // hf["num_attention_heads"]
    assert ModelConfig.from_hf(hf).head_dim == expected
