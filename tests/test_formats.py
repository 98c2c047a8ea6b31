"""Drafter checkpoints as users have them: vLLM's speculators format for EAGLE-3 and DFLASH (as the
speculators package's own converters write it, and as tests/helpers_*.py write it where that
package is absent), EAGLE-3 heads stored with `layers.0.*`, the EAGLE-3.1 flags, and the DFLASH
config fields of the z-lab reference (`dflash` package): each honoured, checked against the
reference, or refused with one line naming the field and its value."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F
from helpers_dflash import write_random_dflash, write_speculators_dflash
from helpers_eagle import write_random_eagle3, write_speculators_eagle3
from safetensors.torch import load_file

from speculant import Engine, SamplingParams
from speculant.comm.groups import ParallelContext
from speculant.config import ModelConfig
from speculant.drafter.checkpoint import drafter_format
from speculant.drafter.eagle import load_eagle3
from speculant.errors import SpeculantError
from speculant.executor.attention import TorchPagedAttention
from speculant.launch.accept_rate import ASSETS, bundled

TARGET, EAGLE3, DFLASH = bundled("target"), bundled("eagle3"), bundled("dflash")
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def engine(target, **kwargs) -> Engine:
    return Engine(target, device="cpu", max_num_seqs=4, max_model_len=256, page_size=16, **kwargs)


@pytest.fixture(scope="module")
def code_prompts() -> list[list[int]]:
    """Three held-out prompts of the bundled code model, 48 tokens each."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    lines = (ASSETS / "prompts" / "heldout_prompts_small.jsonl").read_text().splitlines()
    return [tokenizer.encode(json.loads(line)["prompt"]).ids[:48] for line in lines[:3]]


def assert_same_run(ours, theirs):
    """Same tokens and the same verify steps and acceptance, request by request."""
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids
        keys = ("num_verify_steps", "accept_len", "per_position_acceptance")
        assert {k: a.stats[k] for k in keys} == {k: b.stats[k] for k in keys}


# ------------------------------------------------------------ the speculators package's converters

# speculators imports its training and data-generation stack (openai, datasets, ...) when it is
# imported; the converters use none of it, so the script stands in empty modules for those that
# are not installed. It runs in its own process so the stand-ins never reach other tests.
CONVERT = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, importlib.util, sys
    from unittest import mock

    IMPORT_ONLY = {"openai", "datasets", "httpx", "psutil", "hs_connectors", "pydantic_settings"}
    IMPORT_ONLY = {m for m in IMPORT_ONLY if importlib.util.find_spec(m) is None}

    class StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in IMPORT_ONLY:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def create_module(self, spec):
            module = mock.MagicMock(name=spec.name)
            module.__path__, module.__spec__ = [], spec
            return module

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, StandIn())
    from speculators.convert.dflash.converter import DFlashConverter
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    kind, source, out, target = sys.argv[1:5]
    if kind == "eagle3":
        ids = [int(i) for i in sys.argv[5].split(",")] if len(sys.argv) > 5 else None
        Eagle3Converter().convert(source, out, target, eagle_aux_hidden_state_layer_ids=ids)
    else:
        DFlashConverter().convert(source, out, target)
    """
)


def convert(kind: str, source, out, target, *extra: str):
    """Run the speculators package's own converter (validation included)."""
    args = [sys.executable, "-c", CONVERT, kind, str(source), str(out), str(target), *extra]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        if "ModuleNotFoundError" in done.stderr or "ImportError" in done.stderr:
            pytest.skip(f"speculators cannot be imported here: {done.stderr.splitlines()[-1]}")
        raise AssertionError(f"the {kind} converter failed:\n{done.stderr[-3000:]}")
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The bundled EAGLE-3 head and DFLASH drafter, converted by the speculators package. The
    EAGLE-3 converter does not carry eagle_config's aux ids over: they are passed, shifted to
    its input-of-layer convention ([1, 3, 4] -> [2, 4, 5])."""
    root = tmp_path_factory.mktemp("speculators")
    nested = json.loads((EAGLE3 / "config.json").read_text())["eagle_config"]
    ids = ",".join(str(i + 1) for i in nested["eagle_aux_hidden_state_layer_ids"])
    return {
        "eagle3": convert("eagle3", EAGLE3, root / "eagle3", TARGET, ids),
        "dflash": convert("dflash", DFLASH, root / "dflash", TARGET),
    }


@pytest.mark.needs("speculators", "loguru")
@pytest.mark.parametrize("algo, original", [("eagle3", EAGLE3), ("dflash", DFLASH)])
def test_real_converter_output_drafts_as_the_original(converted, code_prompts, algo, original):
    """No --algo, no --num-draft-tokens: the config says the algorithm and k (the converter's
    speculative_tokens: 3 for EAGLE-3, block - 1 = 7 for DFLASH); then the same tokens, verify
    steps and acceptance as the published-layout original."""
    ours = engine(TARGET, draft=str(converted[algo]))
    assert ours.config.spec.algo == algo
    assert ours.config.spec.num_draft_tokens == (3 if algo == "eagle3" else 7)
    theirs = engine(
        TARGET, algo=algo, draft=str(original), num_draft_tokens=ours.config.spec.num_draft_tokens
    )
    assert_same_run(ours.generate(code_prompts, GREEDY), theirs.generate(code_prompts, GREEDY))
    if algo == "eagle3":  # the shipped embed_tokens is the target's: shared, not held twice
        assert ours.drafter.head.embed_tokens is None


@pytest.mark.needs("speculators", "loguru")
@pytest.mark.parametrize("algo", ["eagle3", "dflash"])
def test_helper_writers_match_the_real_converters(converted, tmp_path, algo):
    """tests/helpers_*.py write the speculators format where the package is absent: the same
    config fields (save transformers' bookkeeping) and the same tensors as the converters."""
    if algo == "eagle3":
        ours = write_speculators_eagle3(tmp_path, EAGLE3, TARGET, aux_ids=[2, 4, 5])
    else:
        ours = write_speculators_dflash(tmp_path, DFLASH, TARGET)
    theirs = json.loads((converted[algo] / "config.json").read_text())
    for key, value in ours.items():
        if key == "transformer_layer_config":  # transformers 5 renames dtype and nests rope
            layer = {**theirs[key], "torch_dtype": theirs[key].get("dtype")}
            for name, v in value.items():
                assert name.startswith("rope_") or layer.get(name) == v, f"{key}.{name}"
            arch = {"architectures": ["LlamaForCausalLM"]}
            a, b = (ModelConfig.from_hf({**c, **arch}) for c in (value, theirs[key]))
            assert (a.rope_theta, a.rope_scaling) == (b.rope_theta, b.rope_scaling)
        elif key == "speculators_config":
            method = theirs[key]["proposal_methods"][0]
            assert (
                method["speculative_tokens"] == value["proposal_methods"][0]["speculative_tokens"]
            )
            assert theirs[key]["algorithm"] == value["algorithm"]
        elif key not in ("architectures", "speculators_version"):
            assert theirs.get(key) == value, key
    ours_t = load_file(str(tmp_path / "model.safetensors"))
    theirs_t = load_file(str(converted[algo] / "model.safetensors"))
    assert sorted(ours_t) == sorted(theirs_t)
    for name, t in ours_t.items():
        assert torch.equal(t, theirs_t[name]), name


# ------------------------------------------------------------ speculators format, no package


def test_speculators_heads_load_without_algo(tmp_path, code_prompts):
    """As written by the helpers (no speculators needed): the algorithm and k come from the
    config (speculative_tokens 5 here); explicit flags win; runs match the originals."""
    write_speculators_eagle3(
        tmp_path / "e", EAGLE3, TARGET, aux_ids=[2, 4, 5], speculative_tokens=5
    )
    write_speculators_dflash(tmp_path / "d", DFLASH, TARGET)
    assert drafter_format(tmp_path / "e").num_draft_tokens == 5
    published = [drafter_format(d).algo for d in (EAGLE3, DFLASH, bundled("draft_lm"))]
    assert published == ["eagle3", "dflash", None]  # the architectures say it too
    spec = engine(TARGET, draft=str(tmp_path / "e"))
    assert (spec.config.spec.algo, spec.config.spec.num_draft_tokens) == ("eagle3", 5)
    explicit = engine(TARGET, algo="eagle3", draft=str(tmp_path / "e"), num_draft_tokens=2)
    assert explicit.config.spec.num_draft_tokens == 2
    original = engine(TARGET, algo="eagle3", draft=str(EAGLE3), num_draft_tokens=2)
    assert_same_run(
        explicit.generate(code_prompts, GREEDY), original.generate(code_prompts, GREEDY)
    )
    dflash = engine(TARGET, draft=str(tmp_path / "d"), num_draft_tokens=4)
    assert dflash.config.spec.algo == "dflash"
    assert dflash.drafter.model.config.target_layer_ids == (1, 3, 5)  # aux ids 2, 4, 6 minus 1
    original = engine(TARGET, algo="dflash", draft=str(DFLASH), num_draft_tokens=4)
    assert_same_run(dflash.generate(code_prompts, GREEDY), original.generate(code_prompts, GREEDY))


def test_cli_generate_with_a_speculators_drafter_needs_no_algo(capsys, tmp_path):
    from speculant.launch.cli import main

    write_speculators_dflash(tmp_path / "d", DFLASH, TARGET)
    out = {}
    for name, extra in (("spec", ["--draft", tmp_path / "d"]), ("plain", [])):
        path = tmp_path / f"{name}.jsonl"
        args = ["generate", "--device", "cpu", "--target", TARGET, "--prompt", "import os\n"]
        args += ["--max-new-tokens", "12", "--ignore-eos", "--output", path, *extra]
        assert main([str(a) for a in args]) == 0
        err = capsys.readouterr().err
        out[name] = json.loads(path.read_text())
        if name == "spec":
            assert len(err.split("per_position=")[1].split()[0].split(",")) == 7, err
    assert out["spec"]["token_ids"] == out["plain"]["token_ids"]


def test_cli_refuses_a_draft_that_names_no_algorithm(capsys, tmp_path, llama_dir):
    from speculant.launch.cli import main

    args = ["generate", "--device", "cpu", "--target", llama_dir, "--draft", llama_dir]
    assert main([str(a) for a in [*args, "--prompt", "x"]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("speculant: error:") and "need --algo" in err and "\n" not in err


def test_layers_0_naming_in_the_published_layout(tmp_path, code_prompts):
    """A LlamaForCausalLMEagle3 head stored with layers.0.* instead of midlayer.* (TokenSpeed
    reads both) loads the same weights and drafts the same tokens."""
    src = load_file(str(EAGLE3 / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0."): t for k, t in src.items()}
    (tmp_path / "config.json").write_text((EAGLE3 / "config.json").read_text())
    from safetensors.torch import save_file

    save_file(renamed, str(tmp_path / "model.safetensors"))
    ours = engine(TARGET, algo="eagle3", draft=str(tmp_path))
    assert_same_run(
        ours.generate(code_prompts, GREEDY),
        engine(TARGET, algo="eagle3", draft=str(EAGLE3)).generate(code_prompts, GREEDY),
    )


def test_speculators_head_embeds_with_its_own_table(tmp_path, llama_dir):
    """A speculators head that ships an embed_tokens other than the target's embeds with it (as
    vLLM does); the published layout at the target's width ignores it (as SGLang does)."""
    target = ModelConfig.from_dir(llama_dir)
    w = write_random_eagle3(tmp_path / "head", llama_dir, draft_vocab=64, seed=2)
    write_speculators_eagle3(tmp_path / "spec", tmp_path / "head", llama_dir)
    plain, spec = (load(tmp_path / d, target) for d in ("head", "spec"))
    assert plain.embed_tokens is None
    tokens = torch.tensor([3, 17, 5])
    torch.testing.assert_close(spec.embed(tokens, None), w["embed_tokens.weight"][tokens].float())


# ------------------------------------------------------------ EAGLE-3.1 flags


class CausalAttentionStub:
    """Causal SDPA over the N tokens given, with the torch backend's element-wise ops."""

    ops = TorchPagedAttention.ops

    def forward(self, layer_id, q, k, v):
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)


def load(head_dir, target_cfg):
    pctx = ParallelContext.single()
    return load_eagle3(head_dir, target_cfg, "cpu", torch.float32, pctx, max_positions=64)


def rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def eagle31_reference(w, cfg, embeds, aux, positions, flags, fed_back=None):
    """speculators' Eagle3DraftModel step (one layer), from its source: the aux norms before fc,
    layer 0 with norm_before_residual, and norm_output's post-norm hidden. Returns (hidden to
    feed back, logits)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    w = {k: v.float() for k, v in w.items()}
    heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    if fed_back is None:
        if flags.get("norm_before_fc"):
            aux = rms(aux, w["input_norm.weight"])
        if flags.get("fc_norm"):
            aux = torch.cat(
                [rms(c, w[f"fc_norm.{j}.weight"]) for j, c in enumerate(aux.chunk(3, -1))], -1
            )
        hidden = aux @ w["fc.weight"].T
    else:
        hidden = fed_back
    rotary = LlamaRotaryEmbedding(
        LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    )
    cos, sin = (t[0][None] for t in rotary(embeds[None], positions[None]))
    p, N = "midlayer.", embeds.shape[0]
    normed = rms(hidden, w[p + "hidden_norm.weight"])
    residual = normed if flags.get("norm_before_residual") else hidden
    x = torch.cat([rms(embeds, w[p + "input_layernorm.weight"]), normed], -1)
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(N, heads, d).transpose(0, 1)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(N, kv_heads, d).transpose(0, 1)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(N, kv_heads, d).transpose(0, 1)
    half = d // 2
    rot = lambda t: torch.cat([-t[..., half:], t[..., :half]], -1)  # noqa: E731
    if flags.get("qk_norm"):  # Qwen3 layers: per-head RMSNorm before RoPE
        q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    h = residual + out.transpose(0, 1).reshape(N, -1) @ w[p + "self_attn.o_proj.weight"].T
    m = rms(h, w[p + "post_attention_layernorm.weight"])
    h = (
        h
        + (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T))
        @ w[p + "mlp.down_proj.weight"].T
    )
    final = rms(h, w["norm.weight"])
    return (final if flags.get("norm_output") else h), final @ w["lm_head.weight"].T


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"norm_before_residual": True},
        {"norm_before_fc": True},
        {"fc_norm": True},
        {"norm_output": True},
        {"norm_before_residual": True, "fc_norm": True, "norm_output": True},
    ],
    ids=lambda f: "+".join(f) or "eagle3",
)
@pytest.mark.parametrize("layout", ["published", "speculators"])
def test_eagle31_flags_match_the_speculators_forward(tmp_path, llama_dir, flags, layout):
    """Each flag changes the head's output (the no-flag reference misses), and the head follows
    the speculators model's formula for it, through one aux step and one fed-back step."""
    target = ModelConfig.from_dir(llama_dir)
    w = write_random_eagle3(
        tmp_path / "head", llama_dir, num_kv_heads=2, seed=4, config_overrides=flags
    )
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    head_dir = tmp_path / "head"
    if layout == "speculators":
        write_speculators_eagle3(tmp_path / "spec", head_dir, llama_dir, aux_ids=[0, 1, 2])
        head_dir = tmp_path / "spec"
    head = load(head_dir, target)
    gen = torch.Generator().manual_seed(0)
    N, H = 6, target.hidden_size
    embeds, aux = torch.randn(N, H, generator=gen), torch.randn(N, 3 * H, generator=gen) * 3
    positions = torch.arange(N) + 2
    with torch.no_grad():
        out = head(embeds, aux, positions, CausalAttentionStub())
        again = head(embeds.flip(0), out, positions + 1, CausalAttentionStub())
        logits = head.logits(again)
    ref_out, _ = eagle31_reference(w, cfg, embeds, aux, positions, flags)
    ref_again, ref_logits = eagle31_reference(
        w, cfg, embeds.flip(0), None, positions + 1, flags, ref_out
    )
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    if flags:
        plain_out, plain_logits = eagle31_reference(w, cfg, embeds, aux, positions, {})
        assert not torch.allclose(out, plain_out, atol=1e-3) or not torch.allclose(
            head.logits(out), plain_logits, atol=1e-3
        )


@pytest.mark.parametrize(
    "overrides, drop, message",
    [
        ({"norm_before_fc": True, "fc_norm": True}, (), "norm_before_fc and fc_norm are both true"),
        ({"norm_before_fc": True}, ("input_norm.weight",), "lacks the tensor 'input_norm.weight'"),
        ({"fc_norm": True}, ("fc_norm.2.weight",), "lacks the tensor 'fc_norm.2.weight'"),
    ],
)
def test_eagle31_bad_heads_raise_one_clear_error(tmp_path, llama_dir, overrides, drop, message):
    write_random_eagle3(tmp_path, llama_dir, config_overrides=overrides, drop_keys=drop)
    with pytest.raises(SpeculantError, match=message):
        load(tmp_path, ModelConfig.from_dir(llama_dir))


def test_eagle31_norm_tensors_without_their_flag_are_refused(tmp_path, llama_dir):
    write_random_eagle3(tmp_path / "h", llama_dir, config_overrides={"fc_norm": True})
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    cfg["fc_norm"] = False
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpeculantError, match=r"holds 'fc_norm.0.weight' but fc_norm is not true"):
        load(tmp_path / "h", ModelConfig.from_dir(llama_dir))


# ------------------------------------------------------------ DFLASH fields vs the z-lab reference


def reference_block_probs(drafter_dir, target_dir, prompt: list[int], first: int, k: int):
    """The z-lab reference (`dflash` package) on one sequence: its context features of `prompt`,
    the block [first, mask x k] after it, its compute_logits, softmax at temperature 1."""
    from dflash.model import (
        DFlashDraftModel,
        _draft_value,
        _raw_input_embeddings,
        _sampling_probs,
        extract_context_feature,
    )
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    model = DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        context = extract_context_feature(states, model.target_layer_ids)
        block = torch.tensor([[first] + [model.mask_token_id] * k])
        scale = float(_draft_value(model.config, "input_embedding_scale", 1.0))
        noise = _raw_input_embeddings(target, block, scale)
        positions = torch.arange(len(prompt) + k + 1)[None]
        hidden = model(target_hidden=context, noise_embedding=noise, position_ids=positions)
        logits = model.compute_logits(hidden[:, 1:], target.lm_head)
    return _sampling_probs(logits, 1.0)[0]


def our_block_probs(spec: Engine, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """Prefill one sampled request: the first token and the q its drafts were drawn from."""
    params = SamplingParams(max_new_tokens=1, temperature=1.0, seed=7, ignore_eos=True)
    first = spec.generate([prompt], params, use_tqdm=False)[0].token_ids[0]
    q = spec.runner.draft_probs
    rows = (q.sum(-1) > 0.5).all(-1).nonzero()[:, 0]
    assert rows.numel() == 1
    return first, q[rows[0]]


SLIDING = ["sliding_attention", "sliding_attention"]


@pytest.mark.needs("dflash")
@pytest.mark.parametrize(
    "top, fields",
    [
        ({}, {}),
        ({"input_embedding_scale": 3.0}, {}),
        ({}, {"input_embedding_scale": 0.5}),
        ({}, {"output_multiplier": 4.0}),
        ({"final_logit_softcapping": 0.5}, {}),
        ({"is_causal": True}, {}),
        ({"layer_types": SLIDING}, {}),  # sliding layers: a causal block
        ({"layer_types": SLIDING, "is_causal": False}, {}),  # ... unless is_causal says not
        ({"layer_types": SLIDING, "use_sliding_window": True, "sliding_window": 4096}, {}),
        ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0}, {}),
    ],
    ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()) or "-",
)
def test_dflash_fields_match_the_reference_forward(tmp_path, llama_dir, top, fields):
    """The drafts' q after prefill equals the reference's softmax of its compute_logits for the
    same block, field by field; each field but is_causal=False changes q (the no-field drafter
    misses)."""
    k, prompt = 7, [5, 9, 11, 3, 40, 7, 8, 200, 31]
    write_random_dflash(
        tmp_path / "d", llama_dir, block_size=k + 1, target_layer_ids=[0, 1], seed=6,
        config_overrides=top, dflash_fields=fields,
    )  # fmt: skip
    spec = engine(llama_dir, draft=str(tmp_path / "d"))
    assert spec.config.spec.num_draft_tokens == k
    first, q = our_block_probs(spec, prompt)
    expected = reference_block_probs(tmp_path / "d", llama_dir, prompt, first, k)
    torch.testing.assert_close(q, expected, rtol=1e-4, atol=1e-5)
    if (top or fields) and top.get("is_causal") is not False:
        write_random_dflash(
            tmp_path / "p", llama_dir, block_size=k + 1, target_layer_ids=[0, 1], seed=6
        )
        plain = reference_block_probs(tmp_path / "p", llama_dir, prompt, first, k)
        assert not torch.allclose(plain, expected, atol=1e-4), "the field changes nothing here"


@pytest.mark.needs("dflash")
def test_dflash_generate_reference_steps(code_prompts, monkeypatch):
    """Greedy, float32, the bundled drafter: our tokens equal the reference's `dflash_generate`
    and each request takes as many verify steps as the reference needs to reach the same length.
    The reference shortens its last block to the tokens left (fewer masks change a non-causal
    block's drafts), so it runs with room for one more block and is cut where we stop."""
    import dflash.model as reference
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # it times with CUDA events
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    model = reference.DFlashDraftModel.from_pretrained(DFLASH, dtype=torch.float32).eval()
    n = GREEDY.max_new_tokens
    ours = engine(TARGET, algo="dflash", draft=str(DFLASH)).generate(code_prompts, GREEDY)
    for prompt, out in zip(code_prompts, ours, strict=True):
        ref = reference.dflash_generate(
            model, target, torch.tensor([prompt]), n + model.block_size, None, return_stats=True
        )
        assert out.token_ids == ref.output_ids[0, len(prompt) : len(prompt) + n].tolist()
        produced, steps = 1, 0  # the first token comes from the prefill
        while produced < n:
            produced, steps = produced + ref.acceptance_lengths[steps], steps + 1
        assert out.stats["num_verify_steps"] == steps
        assert (
            (n - 1) / steps
            <= out.stats["accept_len"]
            <= sum(ref.acceptance_lengths[:steps]) / steps
        )


# ------------------------------------------------------------ refusals, one line each


def dflash_error(tmp_path, llama_dir, message, *, max_model_len=256, speculators=None, **kwargs):
    kwargs.setdefault("target_layer_ids", [0, 1])
    write_random_dflash(tmp_path / "d", llama_dir, **kwargs)
    draft = tmp_path / "d"
    if speculators is not None:
        write_speculators_dflash(tmp_path / "s", draft, llama_dir, **speculators)
        draft = tmp_path / "s"
    with pytest.raises(SpeculantError, match=message) as info:
        Engine(
            llama_dir, device="cpu", max_model_len=max_model_len, algo="dflash", draft=str(draft)
        )
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"config_overrides": {"layer_types": ["sliding_attention", "full_attention"]}},
            "not a mix",
        ),
        ({"config_overrides": {"layer_types": ["full_attention"]}}, "names 1 layers"),
        ({"config_overrides": {"layer_types": ["chunked_attention"] * 2}}, "'chunked_attention'"),
        ({"dflash_fields": {"is_causal": True}}, "dflash_config.is_causal .* move it there"),
        (
            {
                "config_overrides": {
                    "layer_types": SLIDING,
                    "use_sliding_window": True,
                    "sliding_window": 64,
                }
            },
            r"sliding_window=64 .* shorter than the \d+ positions",
        ),
    ],
)
def test_dflash_unsupported_fields_are_named(tmp_path, llama_dir, kwargs, message):
    dflash_error(tmp_path, llama_dir, message, block_size=8, **kwargs)


def test_dflash_window_that_covers_every_position_is_honoured(tmp_path, llama_dir):
    top = {"layer_types": SLIDING, "use_sliding_window": True, "sliding_window": 64}
    write_random_dflash(
        tmp_path, llama_dir, block_size=4, target_layer_ids=[0, 1], config_overrides=top
    )
    spec = Engine(llama_dir, device="cpu", max_model_len=40, algo="dflash", draft=str(tmp_path))
    assert spec.drafter.model.config.causal_block and spec.drafter.model.config.sliding_window == 64


@pytest.mark.parametrize(
    "speculators, message",
    [
        ({"sample_from_anchor": True}, "sample_from_anchor=true"),
        ({"draft_vocab_size": 100}, "draft_vocab_size=100 .* != the target's 512"),
        ({"target_hidden_size": 32}, "target_hidden_size=32"),
        ({"aux_hidden_state_layer_ids": [1, 2]}, r"aux_hidden_state_layer_ids=\[1, 2\] .* 1\.\.1"),
        ({"aux_hidden_state_layer_ids": None}, "lacks aux_hidden_state_layer_ids"),
        ({"speculators_model_type": "dspark"}, "speculators_model_type='dspark' .* not supported"),
    ],
)
def test_speculators_dflash_unsupported_variants_are_named(
    tmp_path, llama_dir, speculators, message
):
    dflash_error(
        tmp_path, llama_dir, message, block_size=4, target_layer_ids=[0], speculators=speculators
    )


def test_speculators_dflash_sliding_layers_follow_sliding_window_non_causal(tmp_path, llama_dir):
    """Speculators' mask: windowed sliding layers are causal unless sliding_window_non_causal."""
    top = {"layer_types": SLIDING, "use_sliding_window": True, "sliding_window": 4096}
    write_random_dflash(
        tmp_path / "d", llama_dir, block_size=4, target_layer_ids=[0], config_overrides=top
    )
    for non_causal in (False, True):
        out = tmp_path / f"s{non_causal}"
        write_speculators_dflash(
            out, tmp_path / "d", llama_dir, sliding_window_non_causal=non_causal
        )
        spec = Engine(llama_dir, device="cpu", max_model_len=40, draft=str(out))
        assert spec.drafter.model.config.causal_block is not non_causal


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"speculators_model_type": "dflash"},
            "contradicts speculators_model_type='dflash'",
        ),
        ({"transformer_layer_config": None}, "no transformer_layer_config"),
        (
            {"eagle_aux_hidden_state_layer_ids": [0, 1]},
            # the key as a speculators config holds it (top level, not under eagle_config)
            "must name 3 distinct target layers .*; fix eagle_aux_hidden_state_layer_ids in",
        ),
    ],
)
def test_speculators_eagle3_bad_configs_are_named(tmp_path, llama_dir, fields, message):
    write_random_eagle3(tmp_path / "h", llama_dir)
    write_speculators_eagle3(tmp_path / "s", tmp_path / "h", llama_dir, **fields)
    with pytest.raises(SpeculantError, match=message):
        load(tmp_path / "s", ModelConfig.from_dir(llama_dir))


def test_speculators_drafter_of_the_other_algorithm_is_named(tmp_path, llama_dir):
    write_random_dflash(tmp_path / "d", llama_dir, block_size=4, target_layer_ids=[0])
    write_speculators_dflash(tmp_path / "s", tmp_path / "d", llama_dir)
    with pytest.raises(SpeculantError, match="is a speculators dflash drafter, not an EAGLE-3"):
        engine(llama_dir, algo="eagle3", draft=str(tmp_path / "s"))
    write_random_eagle3(tmp_path / "h", llama_dir)
    write_speculators_eagle3(tmp_path / "e", tmp_path / "h", llama_dir)
    with pytest.raises(SpeculantError, match="is a speculators eagle3 drafter, not a DFLASH"):
        engine(llama_dir, algo="dflash", draft=str(tmp_path / "e"))


def test_speculators_eagle3_qwen3_layers_match_the_speculators_forward(tmp_path, llama_dir):
    """transformer_layer_config.model_type qwen3 (vLLM's Eagle3Qwen3ForCausalLM): layers with
    per-head q/k RMSNorm before RoPE; the head follows that formula (without the norms it
    misses)."""
    target = ModelConfig.from_dir(llama_dir)
    write_random_eagle3(tmp_path / "h", llama_dir, num_kv_heads=2, seed=4)
    write_speculators_eagle3(tmp_path / "s", tmp_path / "h", llama_dir, layer_type="qwen3")
    saved = load_file(str(tmp_path / "s" / "model.safetensors"))
    w = {k.replace("layers.0.", "midlayer."): t for k, t in saved.items()}
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    head = load(tmp_path / "s", target)
    gen = torch.Generator().manual_seed(0)
    embeds, aux = torch.randn(6, 64, generator=gen), torch.randn(6, 192, generator=gen)
    positions = torch.arange(6) + 2
    with torch.no_grad():
        out = head(embeds, aux, positions, CausalAttentionStub())
    ref, _ = eagle31_reference(w, cfg, embeds, aux, positions, {})
    assert not torch.allclose(out, ref, atol=1e-3)
    ref, _ = eagle31_reference(w, cfg, embeds, aux, positions, {"qk_norm": True})
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "layer, max_positions, message",
    [
        ({"model_type": "mistral"}, 64, "model_type='mistral' .* supported: llama, qwen3"),
        ({"layer_types": ["sliding_attention"], "sliding_window": 32}, 64, "sliding_window=32"),
        ({"layer_types": ["sliding_attention"], "sliding_window": 64}, 64, None),
        ({"layer_types": ["chunked_attention"]}, 64, "'chunked_attention'"),
    ],
)
def test_speculators_eagle3_layer_config_is_honoured_or_named(
    tmp_path, llama_dir, layer, max_positions, message
):
    """A speculators head's sliding layers (its training masks apply the window) load where the
    window covers every position, and are refused where it would bind."""
    write_random_eagle3(tmp_path / "h", llama_dir)
    config = write_speculators_eagle3(tmp_path / "s", tmp_path / "h", llama_dir)
    config["transformer_layer_config"].update(layer)
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    pctx, target = ParallelContext.single(), ModelConfig.from_dir(llama_dir)
    args = (tmp_path / "s", target, "cpu", torch.float32, pctx, max_positions)
    if message is None:
        assert load_eagle3(*args).config.sliding_window == 64
        return
    with pytest.raises(SpeculantError, match=message):
        load_eagle3(*args)
