"""The EAGLE-3 head loads published checkpoints (names, d2t offsets, aux-id conventions) and its
forward matches a plain re-implementation of the published formula."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from helpers_eagle import tiny_target_config, write_random_eagle3, write_speculators_eagle3
from helpers_sampling import assert_follows, seeded_prefill

from speculant import Engine
from speculant.comm.groups import ParallelContext
from speculant.config import ModelConfig
from speculant.drafter.eagle import Eagle3Config, load_eagle3
from speculant.errors import SpeculantError
from speculant.executor.attention import TorchPagedAttention


def load(head_dir, target_cfg, **kwargs):
    return load_eagle3(
        head_dir,
        target_cfg,
        "cpu",
        torch.float32,
        ParallelContext.single(),
        max_positions=128,
        **kwargs,
    )


class CausalAttentionStub:
    """Test double of the paged backend's protocol: causal SDPA over the N tokens it is given,
    with the torch backend's element-wise ops."""

    ops = TorchPagedAttention.ops

    def __init__(self):
        self.layer_ids: list[int] = []

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.layer_ids.append(layer_id)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)


# ---------------------------------------------------------------- independent reference


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def reference(w, hf, embeds, hidden, positions, project=True, tokens=None):
    """The published EAGLE-3 forward in plain torch: returns (pre-norm output, logits). With
    `tokens` (and `embeds=None`) the head embeds them with its own `embed_tokens.weight`, as a
    head whose hidden differs from the target's does (SGLang `llama_eagle3`)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    w = {k: v.float() for k, v in w.items()}
    if tokens is not None:
        embeds = w["embed_tokens.weight"][tokens]
    eps, n = hf["rms_norm_eps"], hf["num_hidden_layers"]
    heads, kv_heads, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    rotary = LlamaRotaryEmbedding(
        LlamaConfig(**{k: v for k, v in hf.items() if k != "architectures"})
    )
    cos, sin = rotary(embeds[None], positions[None])
    cos, sin = cos[0][None], sin[0][None]  # [1, N, d], broadcast over heads
    N = embeds.shape[0]
    causal = torch.ones(N, N, dtype=torch.bool).tril()

    def prefix(i):
        if "midlayer.self_attn.q_proj.weight" in w:
            return "midlayer."
        return f"midlayer.{i}." if f"midlayer.{i}.mlp.up_proj.weight" in w else f"layers.{i}."

    def attention(x, p):
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(N, heads, d).transpose(0, 1)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(N, kv_heads, d).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(N, kv_heads, d).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = (t.repeat_interleave(heads // kv_heads, dim=0) for t in (k, v))
        scores = (q @ k.transpose(1, 2) / math.sqrt(d)).masked_fill(~causal, float("-inf"))
        out = scores.softmax(-1) @ v
        return out.transpose(0, 1).reshape(N, heads * d) @ w[p + "self_attn.o_proj.weight"].T

    def mlp(x, p):
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        return (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    if project:
        hidden = hidden @ w["fc.weight"].T
    p = prefix(0)
    x = torch.cat(
        [
            rms(embeds, w[p + "input_layernorm.weight"], eps),
            rms(hidden, w[p + "hidden_norm.weight"], eps),
        ],
        dim=-1,
    )
    h = hidden + attention(x, p)  # residual: the projected hidden, not the embeddings
    h = h + mlp(rms(h, w[p + "post_attention_layernorm.weight"], eps), p)
    for i in range(1, n):
        p = prefix(i)
        h = h + attention(rms(h, w[p + "input_layernorm.weight"], eps), p)
        h = h + mlp(rms(h, w[p + "post_attention_layernorm.weight"], eps), p)
    return h, rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T


# ---------------------------------------------------------------- layout


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_loads_published_tensors_and_d2t(tmp_path, llama_dir, fmt):
    target = ModelConfig.from_dir(llama_dir)
    w = write_random_eagle3(tmp_path, llama_dir, draft_vocab=64, fmt=fmt, seed=1)
    head = load(tmp_path, target)
    assert (head.num_layers, head.num_kv_heads, head.head_dim) == (1, 1, 16)
    assert torch.equal(head.fc.weight, w["fc.weight"].float())
    qkv = torch.cat([w[f"midlayer.self_attn.{x}_proj.weight"] for x in "qkv"]).float()
    assert torch.equal(head.layers[0].self_attn.qkv_proj.weight, qkv)
    gate_up = torch.cat([w["midlayer.mlp.gate_proj.weight"], w["midlayer.mlp.up_proj.weight"]])
    assert torch.equal(head.layers[0].mlp.gate_up_proj.weight, gate_up.float())
    assert torch.equal(head.layers[0].hidden_norm.weight, w["midlayer.hidden_norm.weight"].float())
    assert torch.equal(head.lm_head.weight, w["lm_head.weight"].float())
    assert head.d2t.dtype == torch.int64 and torch.equal(head.d2t, w["d2t"])
    assert torch.equal(head.t2d, w["t2d"])
    draft_ids = torch.arange(64)
    assert torch.equal(head.to_target_ids(draft_ids), draft_ids + w["d2t"])
    assert torch.equal(
        head.to_target_ids(torch.tensor([[3, 0]])), (torch.tensor([[3, 0]]) + w["d2t"][[3, 0]])
    )


def test_full_vocab_without_d2t_is_identity(tmp_path, llama_dir):
    target = ModelConfig.from_dir(llama_dir)
    w = write_random_eagle3(tmp_path, llama_dir, draft_vocab=None)
    assert "d2t" not in w and "t2d" not in w
    head = load(tmp_path, target)
    assert head.identity_vocab and not head.d2t.any() and head.t2d.all()
    ids = torch.tensor([0, 5, target.vocab_size - 1])
    assert torch.equal(head.to_target_ids(ids), ids)
    probs = torch.rand(2, target.vocab_size)
    assert head.draft_probs_to_target(probs) is probs


def test_draft_probs_scatter_into_target_vocab(tmp_path, llama_dir):
    target = ModelConfig.from_dir(llama_dir)
    w = write_random_eagle3(tmp_path, llama_dir, draft_vocab=48, seed=3)
    head = load(tmp_path, target)
    probs = torch.rand(2, 3, 48).softmax(-1)
    out = head.draft_probs_to_target(probs)
    target_ids = torch.arange(48) + w["d2t"]
    assert out.shape == (2, 3, target.vocab_size)
    assert torch.equal(out[..., target_ids], probs)
    assert torch.allclose(out.sum(-1), torch.ones(2, 3))
    assert not out[..., ~w["t2d"]].any()


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize(
    "num_layers,layer_keys,draft_vocab",
    [(1, "midlayer", 64), (2, "midlayer", None), (3, "layers", 100)],
)
def test_forward_matches_published_formula(
    tmp_path, llama_dir, num_layers, layer_keys, draft_vocab
):
    target = ModelConfig.from_dir(llama_dir)
    w = write_random_eagle3(
        tmp_path,
        llama_dir,
        draft_vocab=draft_vocab,
        num_layers=num_layers,
        layer_keys=layer_keys,
        num_heads=4,
        num_kv_heads=2,
        seed=5,
    )
    hf = json.loads((tmp_path / "config.json").read_text())
    head = load(tmp_path, target)
    gen = torch.Generator().manual_seed(0)
    N, H = 7, target.hidden_size
    embeds, aux = torch.randn(N, H, generator=gen), torch.randn(N, 3 * H, generator=gen)
    positions = torch.arange(N) + 3
    stub = CausalAttentionStub()
    with torch.no_grad():
        out = head(embeds, aux, positions, stub)
        logits = head.logits(out)
    ref_out, ref_logits = reference(w, hf, embeds, aux, positions)
    assert stub.layer_ids == list(range(num_layers))
    assert logits.dtype == torch.float32 and logits.shape == (N, draft_vocab or target.vocab_size)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)

    # The next draft step feeds the pre-norm output back: width H, so `fc` is skipped.
    with torch.no_grad():
        again = head(embeds.flip(0), out, positions + 1, CausalAttentionStub())
    ref_again, _ = reference(w, hf, embeds.flip(0), ref_out, positions + 1, project=False)
    torch.testing.assert_close(again, ref_again, rtol=1e-4, atol=1e-4)


def test_tie_word_embeddings_flag_is_not_read(tmp_path, llama_dir):
    """SpecForge's qwen3-4b-eagle3.json carries `tie_word_embeddings: true`, copied from its tied
    target; heads trained from it have their own lm_head over the draft vocabulary (SpecForge
    builds it untied whatever the flag), which vLLM uses: the head loads and its logits are its
    own lm_head's."""
    target = ModelConfig.from_dir(llama_dir)
    w = write_random_eagle3(
        tmp_path, llama_dir, draft_vocab=64, seed=5, config_overrides={"tie_word_embeddings": True}
    )
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["tie_word_embeddings"] is True
    head = load(tmp_path, target)
    gen = torch.Generator().manual_seed(0)
    N, H = 5, target.hidden_size
    embeds, aux = torch.randn(N, H, generator=gen), torch.randn(N, 3 * H, generator=gen)
    positions = torch.arange(N)
    with torch.no_grad():
        logits = head.logits(head(embeds, aux, positions, CausalAttentionStub()))
    _, ref_logits = reference(w, hf, embeds, aux, positions)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_dummy_weights(tmp_path, llama_dir):
    target = ModelConfig.from_dir(llama_dir)
    for draft_vocab, name in ((None, "full"), (40, "small")):
        write_random_eagle3(tmp_path / name, llama_dir, draft_vocab=draft_vocab)
        (tmp_path / name / "model.safetensors").unlink()
        head = load(tmp_path / name, target, load_format="dummy")
        ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size))
        assert ids.unique().numel() == ids.numel() and 0 <= ids.min() and ids.max() < 512
        assert torch.equal(ids, ids.sort().values)
        assert head.identity_vocab == (draft_vocab is None)
        with torch.no_grad():
            out = head(
                torch.randn(3, 64), torch.randn(3, 192), torch.arange(3), CausalAttentionStub()
            )
        assert torch.isfinite(head.logits(out)).all()


class TargetEmbedStub:
    """Stands in for the target model: records `embed` calls and returns a marker."""

    def __init__(self, hidden: int):
        self.hidden, self.calls = hidden, 0

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.full((*tokens.shape, self.hidden), 7.0)


def test_head_with_other_hidden_embeds_itself(tmp_path, llama_dir):
    target = ModelConfig.from_dir(llama_dir)
    w = write_random_eagle3(
        tmp_path, llama_dir, draft_vocab=64, num_layers=2, hidden=32, num_kv_heads=2, seed=7
    )
    hf = json.loads((tmp_path / "config.json").read_text())
    assert (hf["hidden_size"], hf["target_hidden_size"]) == (32, target.hidden_size)
    assert w["embed_tokens.weight"].shape == (target.vocab_size, 32)
    head = load(tmp_path, target)
    assert head.config.hidden_size == 32 and head.config.target_hidden_size == 64
    assert head.fc.weight.shape == (32, 3 * 64)
    assert torch.equal(head.embed_tokens.weight, w["embed_tokens.weight"].float())

    gen = torch.Generator().manual_seed(1)
    N = 6
    tokens = torch.randint(0, target.vocab_size, (N,), generator=gen)
    aux = torch.randn(N, 3 * target.hidden_size, generator=gen)
    positions = torch.arange(N) + 2
    stub_target = TargetEmbedStub(target.hidden_size)
    with torch.no_grad():
        embeds = head.embed(tokens, stub_target)
        out = head(embeds, aux, positions, CausalAttentionStub())
        logits = head.logits(out)
    assert stub_target.calls == 0 and embeds.shape == (N, 32)
    ref_out, ref_logits = reference(w, hf, None, aux, positions, tokens=tokens)
    assert out.shape == (N, 32) and logits.shape == (N, 64)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)

    # Fed back: the output is already 32 wide, so `fc` is skipped.
    with torch.no_grad():
        embeds = head.embed(tokens.flip(0), stub_target)
        again = head(embeds, out, positions + 1, CausalAttentionStub())
    ref_again, _ = reference(
        w, hf, None, ref_out, positions + 1, project=False, tokens=tokens.flip(0)
    )
    torch.testing.assert_close(again, ref_again, rtol=1e-4, atol=1e-4)


def test_head_as_wide_as_target_uses_target_embeddings(tmp_path, llama_dir):
    target = ModelConfig.from_dir(llama_dir)
    write_random_eagle3(tmp_path, llama_dir)  # ships embed_tokens.weight, ignored
    head = load(tmp_path, target)
    assert head.embed_tokens is None
    assert "embed_tokens.weight" not in dict(head.named_parameters())
    stub_target = TargetEmbedStub(target.hidden_size)
    embeds = head.embed(torch.tensor([1, 2, 3]), stub_target)
    assert stub_target.calls == 1 and torch.equal(embeds, torch.full((3, 64), 7.0))


def test_dummy_weights_head_with_other_hidden(tmp_path, llama_dir):
    target = ModelConfig.from_dir(llama_dir)
    write_random_eagle3(tmp_path, llama_dir, draft_vocab=40, hidden=32)
    (tmp_path / "model.safetensors").unlink()
    head = load(tmp_path, target, load_format="dummy")
    assert head.embed_tokens.weight.shape == (target.vocab_size, 32)
    with torch.no_grad():
        embeds = head.embed(torch.arange(3), TargetEmbedStub(64))
        out = head(embeds, torch.randn(3, 192), torch.arange(3), CausalAttentionStub())
    assert out.shape == (3, 32) and torch.isfinite(head.logits(out)).all()


# ---------------------------------------------------------------- aux layer ids


@pytest.mark.parametrize(
    "aux_ids,at,expected",
    [
        (None, None, (2, 16, 29)),  # SGLang's default [2, L//2, L-3], inputs of those layers
        ([1, 15, 28], "eagle_config", (2, 16, 29)),  # SpecForge: outputs of layers -> +1
        ([2, 16, 29], "top", (2, 16, 29)),  # vLLM / speculators: already inputs of layers
        ([28, 1, 15], "eagle_config", (2, 16, 29)),  # captured in layer order
        ([0, 16, 31], "eagle_config", (1, 17, 32)),  # 32: the last layer's output
    ],
)
def test_aux_layer_ids(tmp_path, aux_ids, at, expected):
    target = tiny_target_config(num_layers=32)
    write_random_eagle3(tmp_path, target, aux_ids=aux_ids, aux_ids_at=at or "eagle_config")
    assert Eagle3Config.from_dir(tmp_path, target).aux_layer_ids == expected


def test_nested_aux_ids_win_over_top_level(tmp_path):
    target = tiny_target_config(num_layers=32)
    write_random_eagle3(
        tmp_path,
        target,
        aux_ids=[3, 9, 20],
        config_overrides={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
    )
    assert Eagle3Config.from_dir(tmp_path, target).aux_layer_ids == (4, 10, 21)


def test_default_aux_ids_fit_a_two_layer_target(llama_dir, tmp_path):
    write_random_eagle3(tmp_path, llama_dir)
    assert Eagle3Config.from_dir(tmp_path, ModelConfig.from_dir(llama_dir)).aux_layer_ids == (
        0,
        1,
        2,
    )


# ---------------------------------------------------------------- errors


def errors_for(tmp_path, target, pattern, *, load_weights=False, **kwargs):
    write_random_eagle3(tmp_path, kwargs.pop("written_for", target), **kwargs)
    with pytest.raises(SpeculantError, match=pattern):
        if load_weights:
            load(tmp_path, target)
        else:
            Eagle3Config.from_dir(tmp_path, target)


def test_wrong_hidden_size(tmp_path):
    errors_for(
        tmp_path,
        tiny_target_config(hidden=32),
        r"hidden_size 64 .* target's 32",
        written_for=tiny_target_config(hidden=64),
    )


def test_wrong_target_hidden_size(tmp_path):
    errors_for(
        tmp_path,
        tiny_target_config(),
        r"target_hidden_size 128",
        config_overrides={"target_hidden_size": 128},
    )


def test_other_hidden_for_another_target(tmp_path):
    errors_for(
        tmp_path,
        tiny_target_config(hidden=64),
        r"target_hidden_size 128 .* target hidden size 64",
        hidden=32,
        written_for=tiny_target_config(hidden=128),
    )


def test_other_hidden_accepted_with_target_hidden_size(tmp_path):
    target = tiny_target_config(hidden=64)
    write_random_eagle3(tmp_path, target, hidden=32)
    cfg = Eagle3Config.from_dir(tmp_path, target)
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.own_embeddings) == (32, 64, True)


def test_missing_own_embed_tokens_is_named(tmp_path):
    errors_for(
        tmp_path,
        tiny_target_config(),
        r"lacks the tensor 'embed_tokens.weight'",
        load_weights=True,
        hidden=32,
        drop_keys=["embed_tokens.weight"],
    )


def test_aux_id_out_of_range(tmp_path):
    errors_for(
        tmp_path,
        tiny_target_config(num_layers=32),
        r"out of range .* 32 layers",
        aux_ids=[1, 15, 32],
    )


def test_aux_ids_need_three_layers(tmp_path):
    errors_for(tmp_path, tiny_target_config(), r"3 distinct", aux_ids=[1, 15])


def test_head_fed_without_aux_states_is_refused(tmp_path):
    # vLLM and SGLang feed such a head (nvidia's gpt-oss Eagle3-v2 style) the target's last
    # hidden state without fc: drafting from the aux concatenation would draft wrong
    nested = {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": False}
    errors_for(
        tmp_path,
        tiny_target_config(),
        r"eagle_config.use_aux_hidden_state=false .* not supported",
        config_overrides={"eagle_config": nested},
    )


def test_vocab_mismatch_without_d2t(tmp_path):
    errors_for(
        tmp_path,
        tiny_target_config(vocab=300),
        r"vocabulary 256 .* 300",
        written_for=tiny_target_config(vocab=256),
    )


def test_missing_tensor_is_named(tmp_path):
    errors_for(
        tmp_path,
        tiny_target_config(),
        r"lacks the tensor 'midlayer.mlp.down_proj.weight'",
        load_weights=True,
        drop_keys=["midlayer.mlp.down_proj.weight"],
    )


def test_missing_d2t_with_small_draft_vocab(tmp_path):
    errors_for(
        tmp_path,
        tiny_target_config(),
        r"no 'd2t'",
        load_weights=True,
        draft_vocab=32,
        drop_keys=["d2t"],
    )


def test_not_an_eagle_head(llama_dir):
    with pytest.raises(SpeculantError, match="not an EAGLE-3 head"):
        Eagle3Config.from_dir(llama_dir, ModelConfig.from_dir(llama_dir))


def test_missing_folder_config_and_weights(tmp_path):
    target = tiny_target_config()
    with pytest.raises(SpeculantError, match="does not exist"):
        Eagle3Config.from_dir(tmp_path / "nope", target)
    with pytest.raises(SpeculantError, match="config.json"):
        Eagle3Config.from_dir(tmp_path, target)
    write_random_eagle3(tmp_path, target)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(SpeculantError, match="no model.safetensors or pytorch_model.bin"):
        load(tmp_path, target)


# ---------------------------------------------------------------- decoder layers, window, tp


def layer_prefix(w, i):
    """Layer i's published prefix: `midlayer.` (one layer), `midlayer.{i}.` or `layers.{i}.`."""
    if "midlayer.self_attn.q_proj.weight" in w:
        return "midlayer."
    return f"midlayer.{i}." if f"midlayer.{i}.mlp.up_proj.weight" in w else f"layers.{i}."


def write_head(out_dir, target, architectures, model_type, *, qk_norms, overrides=None, **kwargs):
    """A random head (4 heads, 2 KV heads) with top-level `architectures` (none when empty) and
    `model_type`, and per-head q/k norm tensors in each layer when `qk_norms`."""
    from safetensors.torch import save_file

    w = write_random_eagle3(out_dir, target, num_heads=4, num_kv_heads=2, seed=6, **kwargs)
    hf = json.loads((out_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(9)
    for i in range(hf["num_hidden_layers"]) if qk_norms else ():
        for x in "qk":
            norm = 1.0 + 0.3 * torch.randn(hf["head_dim"], generator=gen)
            w[f"{layer_prefix(w, i)}self_attn.{x}_norm.weight"] = norm.to(torch.bfloat16)
    save_file(w, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf.update(architectures=list(architectures), model_type=model_type, **(overrides or {}))
    if not architectures:
        del hf["architectures"]
    (out_dir / "config.json").write_text(json.dumps(hf))
    return w, hf


def qwen3_reference(w, hf, embeds, aux, positions):
    """The head on transformers' Qwen3 decoder layers, as vLLM's Eagle3Qwen3ForCausalLM and the
    speculators package's Qwen3DecoderEagle3FirstLayer build it: layer 0 widens q/k/v to 2H and
    attends over cat([input_layernorm(embeds), hidden_norm(hidden)]) with the projected hidden
    as residual; layers i > 0 are plain Qwen3 layers. Returns (pre-norm output, logits)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3DecoderLayer,
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
    )

    cfg = Qwen3Config(**{k: v for k, v in hf.items() if k != "architectures"})
    cfg._attn_implementation = "eager"
    H, N = cfg.hidden_size, embeds.shape[0]
    w = {k: v.float() for k, v in w.items()}
    mask = torch.full((N, N), float("-inf")).triu(1)[None, None]
    rope = Qwen3RotaryEmbedding(cfg)(embeds[None], positions[None])
    h = aux @ w["fc.weight"].T
    for i in range(cfg.num_hidden_layers):
        layer, p = Qwen3DecoderLayer(cfg, i), layer_prefix(w, i)
        if i == 0:
            for x in "qkv":
                proj = getattr(layer.self_attn, f"{x}_proj")
                setattr(
                    layer.self_attn, f"{x}_proj", torch.nn.Linear(2 * H, proj.out_features, False)
                )
            layer.hidden_norm = Qwen3RMSNorm(H, cfg.rms_norm_eps)
        layer.load_state_dict({k[len(p) :]: t for k, t in w.items() if k.startswith(p)})
        with torch.no_grad():
            if i == 0:
                x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(h)], dim=-1)
                h = h + layer.self_attn(x[None], rope, mask)[0][0]
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            else:
                h = layer(h[None], attention_mask=mask, position_embeddings=rope)[0]
    return h, rms(h, w["norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T


@pytest.mark.parametrize(
    "architectures,model_type,num_layers,layer_keys",
    [
        (["Eagle3Qwen3ForCausalLM"], "qwen3", 2, "layers"),  # vLLM's qwen3_eagle3 head
        (["Qwen3ForCausalLMEagle3"], "qwen3", 1, "midlayer"),  # SpecForge's Qwen3 draft
        ([], "qwen3", 1, "midlayer"),  # no architecture: the model_type says it
    ],
)
def test_top_level_qwen3_head_has_qwen3_layers(
    tmp_path, llama_dir, architectures, model_type, num_layers, layer_keys
):
    """A top-level head whose architecture names Qwen3 layers gets their per-head q/k norms and
    follows transformers' Qwen3 layers (the Llama formula, without the norms, misses)."""
    target = ModelConfig.from_dir(llama_dir)
    w, hf = write_head(
        tmp_path,
        llama_dir,
        architectures,
        model_type,
        qk_norms=True,
        draft_vocab=64,
        num_layers=num_layers,
        layer_keys=layer_keys,
        aux_ids=[0, 1, 2],
        aux_ids_at="top",
    )
    head = load(tmp_path, target)
    assert head.config.layer.qk_norm and head.layers[0].self_attn.q_norm is not None
    gen = torch.Generator().manual_seed(2)
    embeds, aux = torch.randn(7, 64, generator=gen), torch.randn(7, 192, generator=gen) * 2
    positions = torch.arange(7) + 3
    with torch.no_grad():
        out = head(embeds, aux, positions, CausalAttentionStub())
        logits = head.logits(out)
    ref_out, ref_logits = qwen3_reference(w, hf, embeds, aux, positions)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    llama_out, _ = reference(w, hf, embeds, aux, positions)
    assert not torch.allclose(out, llama_out, atol=1e-3)


@pytest.mark.parametrize(
    "architectures,model_type,speculators,num_layers,layer_keys,named",
    [
        # vLLM and SGLang build LlamaForCausalLMEagle3 with Llama layers whatever the model_type
        (["LlamaForCausalLMEagle3"], "qwen3", False, 1, "midlayer", r"architectures=\['Llama"),
        (["LlamaForCausalLMEagle3"], "llama", False, 2, "layers", r"'layers\.1\.self_attn\.q_norm"),
        (["LlamaForCausalLMEagle3"], "llama", True, 1, "midlayer", r"model_type='llama'"),
    ],
)
def test_qk_norms_in_a_head_of_llama_layers_are_refused(
    tmp_path, llama_dir, architectures, model_type, speculators, num_layers, layer_keys, named
):
    """q/k norm tensors the head's Llama layers would drop are refused in one line naming them."""
    head_dir = tmp_path / "h"
    write_head(
        head_dir,
        llama_dir,
        architectures,
        model_type,
        qk_norms=True,
        num_layers=num_layers,
        layer_keys=layer_keys,
    )
    if speculators:
        write_speculators_eagle3(tmp_path / "s", head_dir, llama_dir, aux_ids=[0, 1, 2])
        head_dir = tmp_path / "s"
    with pytest.raises(SpeculantError, match=r"holds q/k norm tensors .*k_norm.*q_norm") as err:
        load(head_dir, ModelConfig.from_dir(llama_dir))
    assert re.search(named, str(err.value)) and "\n" not in str(err.value)
    assert "builds Llama layers without them" in str(err.value)


SLIDING = ["sliding_attention"]


@pytest.mark.parametrize(
    "architectures,model_type,fields,refused",
    [
        (["LlamaForCausalLMEagle3"], "llama", {"layer_types": SLIDING, "sliding_window": 32}, True),
        (
            ["Eagle3Qwen3ForCausalLM"],
            "qwen3",
            {"layer_types": SLIDING, "sliding_window": 32, "use_sliding_window": True},
            True,
        ),
        (  # Qwen3Config: the layers from max_window_layers on slide
            ["Eagle3Qwen3ForCausalLM"],
            "qwen3",
            {"sliding_window": 32, "use_sliding_window": True, "max_window_layers": 0},
            True,
        ),
        (  # Qwen3Config drops the window without use_sliding_window
            ["Eagle3Qwen3ForCausalLM"],
            "qwen3",
            {"layer_types": SLIDING, "sliding_window": 32},
            False,
        ),
        (["LlamaForCausalLMEagle3"], "llama", {"sliding_window": 32}, False),  # no layer slides
        (  # layer 0 is full; the other entry names no layer of this one-layer head
            ["LlamaForCausalLMEagle3"],
            "llama",
            {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 32},
            False,
        ),
        (  # the window covers the 128 positions: exact without windowed attention
            ["LlamaForCausalLMEagle3"],
            "llama",
            {"layer_types": SLIDING, "sliding_window": 128},
            False,
        ),
    ],
)
def test_top_level_sliding_window_is_checked(
    tmp_path, llama_dir, architectures, model_type, fields, refused
):
    """A top-level head's sliding layers are read as transformers' config class for its
    model_type reads them, and refused where the window binds, as a speculators head's are."""
    qwen3 = architectures == ["Eagle3Qwen3ForCausalLM"]
    write_head(tmp_path, llama_dir, architectures, model_type, qk_norms=qwen3, overrides=fields)
    target = ModelConfig.from_dir(llama_dir)
    if refused:
        with pytest.raises(SpeculantError, match=r"sliding_window=32 .* shorter than the 128"):
            load(tmp_path, target)
    else:
        assert load(tmp_path, target).config.sliding_window in (None, 128)


@pytest.mark.parametrize(
    "heads,kv_heads,intermediate,message",
    [
        (3, 1, None, r"num_attention_heads=3 is not divisible by --tp 2 .* divides 3$"),
        (6, 3, None, r"num_key_value_heads=3 neither divides nor is a multiple of --tp 2 "),
        (4, 1, 97, r"intermediate_size=97 is not divisible by --tp 2 .* divides 97$"),
        (4, 1, None, None),  # the one KV head is replicated on both ranks
    ],
)
def test_head_shapes_are_checked_against_tp(tmp_path, heads, kv_heads, intermediate, message):
    target = tiny_target_config(num_layers=8)
    write_random_eagle3(
        tmp_path,
        target,
        hidden=48,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=intermediate,
        aux_ids=[1, 3, 5],
    )
    pctx = ParallelContext(tp_size=2, tp_rank=1)
    args = (tmp_path, target, "cpu", torch.float32, pctx, 128)
    if message is None:
        head = load_eagle3(*args)
        assert (head.num_kv_heads, head.layers[0].self_attn.num_heads) == (1, heads // 2)
        return
    with pytest.raises(SpeculantError, match=message) as err:
        load_eagle3(*args)
    assert str(err.value).startswith(f"EAGLE-3 head {str(tmp_path)!r}: ")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "extra",
    [
        "midlayer.0.self_attn.q_proj.bias",  # vLLM builds q/k/v/o biases for `bias: true`
        "midlayer.0.mlp.down_proj.bias",
        "fc.bias",  # without `bias: true`
        "midlayer.1.input_layernorm.weight",  # a layer past num_hidden_layers
    ],
)
def test_tensors_the_head_would_drop_are_refused(tmp_path, extra):
    """A weight or bias under one of the head's own modules that the config builds no parameter
    for would be dropped (drafting with other weights than trained): refused in one line. The
    head is written with two layers and its config says one."""
    from safetensors.torch import load_file, save_file

    target = tiny_target_config()
    write_random_eagle3(tmp_path, target, draft_vocab=32, num_layers=2)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    if not extra.startswith("midlayer.1."):
        tensors = {k: t for k, t in tensors.items() if not k.startswith("midlayer.1.")}
        tensors[extra] = torch.ones(target.hidden_size, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        SpeculantError, match=f"holds {re.escape(repr(extra))}, but the EAGLE-3"
    ) as info:
        load(tmp_path, target)
    assert "\n" not in str(info.value)


def test_sampled_drafts_of_a_reduced_vocab_are_target_ids_drawn_from_q(tmp_path, llama_dir):
    """EAGLE-3 with its own 200-id vocabulary (d2t): a prefill of 512 seeded sampled rows of one
    prompt drafts target ids, each inside the support of the target-space q verify reads, and
    the drafts' counts follow the sum of those q's (a draft index taken for a target id fails)."""
    write_random_eagle3(tmp_path, llama_dir, draft_vocab=200, seed=5)
    n, k = 512, 3
    eng = Engine(
        str(llama_dir), device="cpu", max_num_seqs=n, max_model_len=32, page_size=8,
        algo="eagle3", draft=str(tmp_path), num_draft_tokens=k,
    )  # fmt: skip
    vocab = eng.model_config.vocab_size
    seeds = torch.arange(n, dtype=torch.int64) * 5 + 3
    _, drafts, q = seeded_prefill(eng, [5, 9, 14, 2, 7], n, 1.0, 0, seeds)
    assert q.shape == (n, k, vocab) and int((q[0, 0] > 0).sum()) <= 200
    expected = q.reshape(-1, vocab).double().sum(0)
    counts = torch.bincount(drafts.reshape(-1), minlength=vocab).double()
    assert counts[expected == 0].sum() == 0, "a draft outside the support of its q"
    assert_follows(counts, expected)
