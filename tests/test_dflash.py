"""DFLASH: a drafter in the published layout loads, drafts what the published forward pass drafts,
and speculative output is lossless (greedy equals plain greedy; sampled output follows the
target's distribution), eager and eager-padded, with padded rows inert."""

from __future__ import annotations

import json

import pytest
import torch
from helpers_dflash import reference_drafts, write_random_dflash
from helpers_sampling import seeded_prefill
from safetensors.torch import load_file
from scipy.stats import chisquare
from test_speculative import GREEDY, TRITON_GREEDY, assert_lossless, engine, prompts_of

from speculant import SamplingParams
from speculant.comm.groups import ParallelContext
from speculant.config import ModelConfig
from speculant.drafter.dflash import default_target_layer_ids, load_dflash
from speculant.errors import SpeculantError
from speculant.executor.sampling import GREEDY as GREEDY_VARIANT
from speculant.executor.sampling import filtered_probs

# On the CPU the triton backend runs through the kernels' torch references or Triton's
# interpreter; either way it needs triton itself to build.
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.needs("triton"))]


@pytest.fixture(scope="module")
def dflash_dir(tmp_path_factory, llama_dir):
    path = tmp_path_factory.mktemp("dflash")
    write_random_dflash(path, llama_dir, num_layers=2, block_size=8, target_layer_ids=[1, 0])
    return path


@pytest.fixture(scope="module")
def plain(llama_dir):
    return engine(llama_dir)


# the torch backend over every k and padding; the triton backend (Triton's interpreter on the
# CPU: 20-55 s a case, on three prompts) at the block's two ends, one per padding mode
LOSSLESS_CASES = [("torch", padding, k) for padding in (False, True) for k in (7, 3, 1)] + [
    pytest.param("triton", True, 7, marks=pytest.mark.needs("triton")),
    pytest.param("triton", False, 1, marks=pytest.mark.needs("triton")),
]


@pytest.mark.parametrize("backend, padding, k", LOSSLESS_CASES)
def test_dflash_greedy_equals_plain(plain, llama_dir, dflash_dir, k, padding, backend):
    """Lossless on both attention backends (on the CPU the triton backend runs its block
    attention through the kernels' torch references, or Triton's interpreter)."""
    # Triton's interpreter runs a program per (row, tile, head): fewer rows there (the one-token
    # prompt and the longest in both cases, the middle one once)
    lengths = (3, 17, 1, 30, 9) if backend == "torch" else (17, 1, 30)[k == 7 :]
    prompts = prompts_of(lengths, seed=40 + k)
    spec = engine(
        llama_dir, algo="dflash", draft=str(dflash_dir), num_draft_tokens=k,
        eager_padding=padding, attention_backend=backend,
    )  # fmt: skip
    assert_lossless(spec, plain, prompts, k, GREEDY if backend == "torch" else TRITON_GREEDY)


def test_dflash_block_size_sets_k_and_caps_it(llama_dir, dflash_dir):
    spec = engine(llama_dir, algo="dflash", draft=str(dflash_dir))
    assert spec.config.spec.num_draft_tokens == 7  # block 8 from the checkpoint
    with pytest.raises(SpeculantError, match="num_draft_tokens=8 does not fit the DFLASH block"):
        engine(llama_dir, algo="dflash", draft=str(dflash_dir), num_draft_tokens=8)


def _hf_target(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("backend", BACKENDS)
def test_dflash_drafts_match_the_published_forward(llama_dir, tmp_path, backend):
    """After prefill and after two verify steps, our drafts equal a float64 dense reference of
    the published model fed with transformers' hidden states of the accepted sequence, on both
    attention backends (triton: the block's K/V go through the paged pool)."""
    k, ids = 5, [0, 1]  # layer 1 is the last: its output is the final-norm hidden, as in HF
    tensors = write_random_dflash(tmp_path, llama_dir, 2, k + 1, target_layer_ids=ids, seed=3)
    config = json.loads((tmp_path / "config.json").read_text())
    hf = _hf_target(llama_dir)
    target = load_file(str(llama_dir / "model.safetensors"))
    embed, lm_head = target["model.embed_tokens.weight"], target["lm_head.weight"]
    spec = engine(
        llama_dir, algo="dflash", draft=str(tmp_path), num_draft_tokens=k,
        attention_backend=backend,
    )  # fmt: skip
    kind = "TritonBlockContextAttention" if backend == "triton" else "BlockContextAttention"
    assert type(spec.drafter.attn).__name__ == kind
    runner, info = spec.runner, spec._sampling_info
    gen = torch.Generator().manual_seed(5)
    for length in (6, 13):
        prompt = torch.randint(3, 256, (length,), generator=gen).tolist()
        row = spec.kv.allocate(length + 40)
        request = type("R", (), {"params": GREEDY, "seed": 0})()
        tokens, drafts = runner.prefill([row], [prompt], [0], info([request]), GREEDY_VARIANT)
        sequence = prompt + tokens.tolist()
        for _ in range(3):
            with torch.no_grad():
                states = hf(torch.tensor([sequence[:-1]]), output_hidden_states=True).hidden_states
            expected = reference_drafts(
                tensors, config, [s[0] for s in states], embed, lm_head, sequence, k
            )
            assert drafts[0].tolist() == expected, f"drafts after {len(sequence)} tokens"
            runner.buffers.fill(
                [row],
                [[sequence[-1]] + drafts[0].tolist()],
                [0.0],
                [0],
                [1.0],
                [0],
                1,
                spec.kv.sentinel_row,
            )
            out = runner.decode_step(1, GREEDY_VARIANT)
            sequence += out.tokens[0, : int(out.accept_len[0])].tolist()
            drafts = out.drafts
        spec.kv.free(row)


def test_dflash_padded_rows_are_inert(llama_dir, dflash_dir, plain):
    spec = engine(llama_dir, algo="dflash", draft=str(dflash_dir), eager_padding=True)
    sentinel = spec.kv.sentinel_row
    before = int(spec.kv.cache_lens[sentinel])
    prompts = prompts_of((5, 11, 3), seed=77)  # bs 3 pads to 4: one sentinel row per step
    outs = spec.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert int(spec.kv.cache_lens[sentinel]) == before
    assert spec.kv.req_to_page[sentinel].eq(0).all()  # the sentinel row never gains pages


def test_dflash_default_layer_ids_and_top_level_fields(tmp_path, qwen3_dir):
    """Without target_layer_ids the published spread applies (here [1, 0]: unsorted, and fc
    takes them in that order); fields at the top level of config.json are read too."""
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, 5 draft layers
    assert default_target_layer_ids(3, 2) == [1, 0]
    assert default_target_layer_ids(8, 1) == [4]
    write_random_dflash(tmp_path, qwen3_dir, num_layers=2, block_size=4, ids_at="top")
    spec = engine(qwen3_dir, algo="dflash", draft=str(tmp_path))
    assert spec.drafter.model.config.target_layer_ids == (1, 0)
    assert spec.drafter.aux_layer_ids == (1, 2)
    prompts = prompts_of((7, 2, 19), seed=5)
    assert_lossless(spec, engine(qwen3_dir), prompts, 3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target_layer_ids": [0, 2]}, r"target_layer_ids=\[0, 2\] .* out of range"),
        ({"mask_token_id": 5000}, "mask_token_id=5000 .* below the target vocabulary"),
        ({"drop_keys": ["layers.1.self_attn.k_norm.weight"]}, "lacks the tensor"),
        ({"config_overrides": {"hidden_size": 32}}, "hidden_size 32 .* for another target"),
        ({"config_overrides": {"architectures": ["LlamaForCausalLMEagle3"]}}, "not a DFLASH"),
        (
            {"config_overrides": {"layer_types": ["sliding_attention", "full_attention"]}},
            "not a mix",
        ),
        ({"dflash_fields": {"causal_head": True}}, "dflash_config.causal_head=True .* not supp"),
        ({"dflash_fields": {"causal": "yes"}}, "dflash_config.causal='yes' .* true or false"),
    ],
)
def test_dflash_bad_checkpoints_raise_one_clear_error(tmp_path, llama_dir, kwargs, message):
    kwargs.setdefault("target_layer_ids", [0, 1])
    write_random_dflash(tmp_path, llama_dir, **kwargs)
    with pytest.raises(SpeculantError, match=message) as info:
        engine(llama_dir, algo="dflash", draft=str(tmp_path))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "heads, kv_heads, overrides, tp, message",
    [
        (6, 2, {}, 4, r"num_attention_heads=6 is not divisible by --tp 4 .* divides 6$"),
        (6, 3, {}, 2, r"num_key_value_heads=3 neither divides nor is a multiple of --tp 2 "),
        (4, 2, {"intermediate_size": 130}, 4, r"intermediate_size=130 is not divisible by --tp 4"),
    ],
)
def test_dflash_heads_tp_cannot_split_raise_one_line(
    tmp_path, llama_dir, heads, kv_heads, overrides, tp, message
):
    """A drafter whose heads (or MLP) --tp cannot split: one line naming the head (DFLASH) and
    its folder, the field and its value, the tp and the fix, before any layer is built (not
    models/layers.py's bare ValueError)."""
    write_random_dflash(
        tmp_path, llama_dir, num_heads=heads, num_kv_heads=kv_heads, target_layer_ids=[0, 1],
        config_overrides=overrides,
    )  # fmt: skip
    pctx = ParallelContext(tp_size=tp, tp_rank=0)
    with pytest.raises(SpeculantError, match=message) as info:
        load_dflash(tmp_path, ModelConfig.from_dir(llama_dir), "cpu", torch.float32, pctx, 64)
    assert str(info.value).startswith(f"DFLASH drafter {str(tmp_path)!r}: ")
    assert "\n" not in str(info.value)


def _reference_probs(drafter_dir, target_dir, prompt, first, k, top_level=None):
    """The z-lab reference (`dflash` package) over `prompt` and the block [first, mask x k]:
    softmax of its compute_logits at temperature 1, `top_level` fields set in a copy of the
    drafter's config.json first (the reference reads `is_causal` there only)."""
    from dflash.model import DFlashDraftModel, _raw_input_embeddings, extract_context_feature
    from transformers import AutoModelForCausalLM

    if top_level:
        copy = drafter_dir.parent / f"{drafter_dir.name}_ref"
        copy.mkdir(exist_ok=True)
        config = json.loads((drafter_dir / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, **top_level}))
        (copy / "model.safetensors").write_bytes((drafter_dir / "model.safetensors").read_bytes())
        drafter_dir = copy
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    model = DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        context = extract_context_feature(states, model.target_layer_ids)
        noise = _raw_input_embeddings(target, torch.tensor([[first] + [model.mask_token_id] * k]))
        positions = torch.arange(len(prompt) + k + 1)[None]
        hidden = model(target_hidden=context, noise_embedding=noise, position_ids=positions)
        logits = model.compute_logits(hidden[:, 1:], target.lm_head)
    return torch.softmax(logits[0].float(), -1)


SLIDING = ["sliding_attention", "sliding_attention"]


@pytest.mark.needs("dflash")
@pytest.mark.parametrize(
    "top, causal, block",
    [
        ({}, True, True),  # full layers, made causal
        ({"layer_types": SLIDING}, False, False),  # sliding layers, made non-causal
        ({"layer_types": ["sliding_attention", "full_attention"]}, True, True),  # no mix left
        ({"is_causal": False}, True, False),  # a top-level is_causal wins (the reference's own)
    ],
    ids=["full-causal", "sliding-noncausal", "mixed-causal", "is_causal-wins"],
)
def test_dflash_config_causal_as_vllm_reads_it(tmp_path, llama_dir, top, causal, block):
    """`dflash_config.causal` sets every layer's block as vLLM's `_dflash_layer_causal` does
    (after a top-level is_causal, before layer_types); the z-lab reference, which ignores the
    key, computes that block when given the same causality as a top-level is_causal. Our q after
    prefill equals it, and (where the key decides) differs from the key-blind reference's."""
    k, prompt = 5, [5, 9, 11, 3, 40, 7, 8, 200, 31]
    d = tmp_path / "d"
    write_random_dflash(
        d, llama_dir, block_size=k + 1, target_layer_ids=[0, 1], seed=6, config_overrides=top,
        dflash_fields={"causal": causal},
    )  # fmt: skip
    spec = engine(llama_dir, algo="dflash", draft=str(d), num_draft_tokens=k)
    assert spec.drafter.model.config.causal_block is block
    params = SamplingParams(max_new_tokens=1, temperature=1.0, seed=7, ignore_eos=True)
    first = spec.generate([prompt], params, use_tqdm=False)[0].token_ids[0]
    q = spec.runner.draft_probs
    q = q[(q.sum(-1) > 0.5).all(-1).nonzero()[0, 0]]
    expected = _reference_probs(d, llama_dir, prompt, first, k, {"is_causal": block})
    torch.testing.assert_close(q, expected, rtol=1e-4, atol=1e-5)
    if "is_causal" not in top:
        blind = _reference_probs(d, llama_dir, prompt, first, k)
        assert not torch.allclose(blind, expected, atol=1e-4), "the key changes nothing here"


def test_dflash_config_causal_is_lossless(plain, llama_dir, tmp_path):
    """A causal block from `dflash_config.causal`: greedy speculative output equals plain greedy,
    eager and eager-padded."""
    k = 4
    write_random_dflash(
        tmp_path, llama_dir, block_size=k + 1, target_layer_ids=[1, 0],
        dflash_fields={"causal": True},
    )  # fmt: skip
    for padding in (False, True):
        spec = engine(
            llama_dir, algo="dflash", draft=str(tmp_path), num_draft_tokens=k,
            eager_padding=padding,
        )  # fmt: skip
        assert spec.drafter.model.config.causal_block
        assert_lossless(spec, plain, prompts_of((3, 17, 1, 30, 9), seed=11), k)


def test_dflash_sampling_follows_target_distribution(llama_dir, dflash_dir):
    """Seeded sampled generation with DFLASH drafts: the second token (emitted by verify against
    DFLASH's sampled drafts) follows the target's p given the first (temperature 0.9, top-p
    0.9); the counts over many seeds are compared with the summed per-run distributions."""
    spec = engine(llama_dir, algo="dflash", draft=str(dflash_dir), num_draft_tokens=3)
    prompt = prompts_of((6,), seed=123)[0]
    n = 800
    params = [
        SamplingParams(max_new_tokens=3, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True)
        for s in range(n)
    ]
    outs = spec.generate([prompt] * n, params, use_tqdm=False)
    assert_second_token_follows_target(engine(llama_dir), prompt, outs)


def assert_second_token_follows_target(plain, prompt, outs) -> None:
    """The second emitted token of `outs` (seeded runs of `prompt`, temperature 0.9, top-p 0.9)
    against the target's p given each run's first token: nothing outside top-p, and a
    chi-square over the merged bins."""
    p_after: dict[int, torch.Tensor] = {}
    expected = torch.zeros(plain.model_config.vocab_size, dtype=torch.float64)
    counts = torch.zeros_like(expected)
    for out in outs:
        first, second = out.token_ids[:2]
        if first not in p_after:
            logits = _next_logits(plain, prompt + [first])[None]
            p_after[first] = filtered_probs(
                logits, torch.tensor([0.9]), torch.tensor([0]), torch.tensor([0.9])
            )[0].double()
        expected += p_after[first]
        counts[second] += 1
    assert counts[expected == 0].sum() == 0, "a token outside top-p was emitted"
    order = expected.argsort(descending=True)
    exp_sorted, obs_sorted = expected[order], counts[order]
    keep = exp_sorted >= 5  # merge rare bins so the chi-square approximation holds
    exp = torch.cat([exp_sorted[keep], exp_sorted[~keep].sum()[None]])
    obs = torch.cat([obs_sorted[keep], obs_sorted[~keep].sum()[None]])
    assert keep.sum() >= 10
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 0.001


def _next_logits(eng, tokens: list[int]) -> torch.Tensor:
    """The target's float32 logits for the token after `tokens`."""
    row = eng.kv.allocate(len(tokens) + 4)
    hidden, _, batch = eng.runner.forward_prefill([row], [tokens], [0])
    logits = eng.model.compute_logits(hidden[len(tokens) - 1 : len(tokens)])[0]
    eng.kv.free(row)
    return logits


def test_dflash_sampled_drafts_follow_the_q_handed_to_verify(llama_dir, dflash_dir):
    """Rejection sampling is exact when q is the distribution each draft was drawn from: over
    1024 seeds of one prompt, the rows that sampled the same first token share one block
    context, and draft i is distributed as the q recorded for draft i (top-k 8)."""
    from speculant import Engine

    n, k = 1024, 3
    spec = Engine(
        llama_dir,
        device="cpu",
        max_num_seqs=n,
        max_model_len=32,
        page_size=8,
        algo="dflash",
        draft=str(dflash_dir),
        num_draft_tokens=k,
    )
    prompt = prompts_of((6,), seed=9)[0]
    seeds = torch.arange(n, dtype=torch.int64) * 7 + 1
    tokens, drafts, q = seeded_prefill(spec, prompt, n, 0.9, 8, seeds)
    group = (tokens == tokens.mode().values).nonzero()[:, 0]
    assert group.numel() >= 100
    for i in range(k):
        probs = q[group[0], i].double()
        assert torch.allclose(q[group, i], q[group[0], i][None].expand(group.numel(), -1))
        assert int((probs > 0).sum()) == 8  # top-k 8 applied to q
        counts = torch.bincount(drafts[group, i], minlength=probs.numel()).double()
        assert counts[probs == 0].sum() == 0, f"draft {i} outside the support of its q"
        support = probs > 0
        expected = probs[support] / probs[support].sum() * group.numel()
        assert chisquare(counts[support], expected).pvalue > 0.001, f"draft {i}"


def test_cli_dflash_reports_acceptance(capsys, llama_dir, dflash_dir, tmp_path):
    """`speculant generate --algo dflash --draft DIR`: the block size comes from the checkpoint
    (7 drafts per step), `--num-draft-tokens` lowers it; the output matches plain greedy."""
    from speculant.launch.cli import main

    out = {}
    for name, extra in (("plain", []), ("dflash", ["--algo", "dflash", "--draft", dflash_dir])):
        for k in ([], ["--num-draft-tokens", "2"]) if name == "dflash" else ([],):
            path = tmp_path / f"{name}{len(k)}.jsonl"
            args = ["generate", "--device", "cpu", "--target", llama_dir, "--prompt", "def f(x):"]
            args += ["--max-new-tokens", "12", "--ignore-eos", "--output", path, *extra, *k]
            assert main([str(a) for a in args]) == 0
            err = capsys.readouterr().err
            out[name, len(k)] = json.loads(path.read_text())
            if name == "dflash":
                per_position = err.split("per_position=")[1].split()[0].split(",")
                assert len(per_position) == (2 if k else 7), err
    assert out["dflash", 0]["token_ids"] == out["plain", 0]["token_ids"]
    assert out["dflash", 2]["token_ids"] == out["plain", 0]["token_ids"]


@pytest.mark.parametrize("extra", ["layers.0.self_attn.q_proj.bias", "layers.2.mlp.up_proj.weight"])
def test_dflash_tensors_the_drafter_would_drop_are_refused(tmp_path, llama_dir, extra):
    """A bias attention_bias does not switch on, or a layer past num_hidden_layers, would be
    dropped and draft wrong tokens: refused naming the tensor. Tensors of modules the drafter
    shares with the target (embed_tokens, lm_head) are still only warned about."""
    from safetensors.torch import save_file

    tensors = write_random_dflash(tmp_path, llama_dir, block_size=4, target_layer_ids=[0, 1])
    H = ModelConfig.from_dir(llama_dir).hidden_size
    shared = {"embed_tokens.weight": torch.zeros(8, H, dtype=torch.bfloat16)}
    save_file({**tensors, **shared}, str(tmp_path / "model.safetensors"))
    engine(llama_dir, algo="dflash", draft=str(tmp_path))
    save_file(
        {**tensors, extra: torch.ones(H, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(SpeculantError, match=f"holds '{extra}', but the DFLASH drafter") as info:
        engine(llama_dir, algo="dflash", draft=str(tmp_path))
    assert "\n" not in str(info.value)
