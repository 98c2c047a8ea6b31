"""DFlash2 drafters (z-lab/dflash `DFlash2DraftModel`: a candidate selector and grouped dynamic
causal convolutions): checkpoints written by the reference package's own class load, run what its
`dflash_generate` runs (float32, greedy: the same tokens and verify steps), hand verify the q
their sampled drafts were drawn from, and are lossless: greedy equals plain greedy, sampled
output follows the target's distribution, seeded runs repeat, eager padding and chunked, mixed
steps change nothing. Every refused config names its field and value."""

from __future__ import annotations

import json
import time

import pytest
import torch
from helpers_dflash2 import write_random_dflash2, write_reference_dflash2
from helpers_workload import run_with_arrivals
from safetensors.torch import load_file
from scipy.stats import chisquare
from test_dflash import assert_second_token_follows_target
from test_speculative import GREEDY, TRITON_GREEDY, assert_lossless, engine, prompts_of

from speculant import Engine, SamplingParams
from speculant.errors import SpeculantError
from speculant.executor.forward_batch import SamplingInfo
from speculant.executor.sampling import FULL
from speculant.executor.sampling import GREEDY as GREEDY_VARIANT
from speculant.launch.accept_rate import bundled

TARGET, DFLASH = bundled("target"), bundled("dflash")


@pytest.fixture(scope="module")
def dflash2_dir(tmp_path_factory, llama_dir):
    path = tmp_path_factory.mktemp("dflash2")
    write_random_dflash2(path, llama_dir, block_size=8, target_layer_ids=[1, 0], seed=2)
    return path


@pytest.fixture(scope="module")
def plain(llama_dir):
    return engine(llama_dir)


def sampled(seed: int, n: int = 24, temperature: float = 0.8) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=n, temperature=temperature, top_p=0.9, seed=seed, ignore_eos=True
    )


# ------------------------------------------------------------ against the reference package


@pytest.mark.needs("dflash")
def test_dflash2_writer_layout_is_the_reference_save_pretrained(tmp_path, llama_dir):
    """helpers_dflash2's writer (used where the package is absent) writes what the reference's
    save_pretrained writes: the same tensors and shapes, the same DFlash2 fields."""
    write_random_dflash2(tmp_path / "ours", llama_dir)
    write_reference_dflash2(tmp_path / "ref", llama_dir)
    ours, ref = (load_file(tmp_path / d / "model.safetensors") for d in ("ours", "ref"))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in ref.items()}
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("ours", "ref")]
    assert configs[0]["architectures"] == configs[1]["architectures"] == ["DFlash2DraftModel"]
    assert configs[0]["dflash_config"] == configs[1]["dflash_config"]


def _reference_generate_check(model, hf_target, spec, prompts, n, reference):
    """Our greedy tokens equal `dflash_generate`'s, and each request takes as many verify steps
    as the reference needs to reach the same length (the reference shortens its last block to
    the tokens left, and fewer masks change a non-causal block's drafts, so it runs with room
    for one more block and is cut where we stop)."""
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    ours = spec.generate(prompts, params)
    steps_seen = []
    for prompt, out in zip(prompts, ours, strict=True):
        ref = reference.dflash_generate(
            model, hf_target, torch.tensor([prompt]), n + model.block_size, None,
            return_stats=True,
        )  # fmt: skip
        assert out.token_ids == ref.output_ids[0, len(prompt) : len(prompt) + n].tolist()
        produced, steps = 1, 0  # the first token comes from the prefill
        while produced < n:
            produced, steps = produced + ref.acceptance_lengths[steps], steps + 1
        assert out.stats["num_verify_steps"] == steps
        assert (n - 1) / steps <= out.stats["accept_len"]
        assert out.stats["accept_len"] <= sum(ref.acceptance_lengths[:steps]) / steps
        steps_seen.append(steps)
    return steps_seen


@pytest.mark.needs("dflash")
def test_dflash2_generate_reference_steps_bundled(tmp_path, monkeypatch):
    """The bundled target and a DFlash2 drafter made by the reference class from the bundled
    (trained) DFLASH drafter's weights, a random selector and near-identity convolutions:
    greedy float32 tokens and verify steps equal the reference's, and drafts are accepted (so
    the steps test the drafts, not only the target)."""
    import dflash.model as reference
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from speculant.launch.accept_rate import ASSETS

    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # it times with CUDA events
    write_reference_dflash2(tmp_path, TARGET, from_dflash=DFLASH, seed=4)
    hf_target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    model = reference.DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    lines = (ASSETS / "prompts" / "heldout_prompts_small.jsonl").read_text().splitlines()
    prompts = [tokenizer.encode(json.loads(line)["prompt"]).ids[:48] for line in lines[:3]]
    spec = Engine(TARGET, device="cpu", dtype="float32", max_num_seqs=4, max_model_len=256,
                  page_size=16, algo="dflash", draft=str(tmp_path))  # fmt: skip
    assert type(spec.drafter).__name__ == "DFlash2Drafter"
    assert spec.config.spec.num_draft_tokens == model.block_size - 1
    n = 40
    steps = _reference_generate_check(model, hf_target, spec, prompts, n, reference)
    assert min(steps) < n - 1, "no draft was ever accepted"


@pytest.mark.needs("dflash")
def test_dflash2_generate_reference_steps_random_target(tmp_path, llama_dir, monkeypatch):
    """A small random target and a random reference DFlash2 drafter (top-k 4, groups of 32): the
    same greedy tokens and verify steps as `dflash_generate`. (Kernel 3: the reference's
    convolution fails on a block shorter than kernel_size - 1, which its shortened last block
    reaches with a longer kernel; ours leaves out taps past the block's start.)"""
    import dflash.model as reference
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    sizes = {"selector_top_k": 4, "conv_kernel_size": 3, "conv_group_size": 32}
    write_reference_dflash2(tmp_path, llama_dir, block_size=6, sizes=sizes, seed=8)
    hf_target = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    model = reference.DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    spec = engine(llama_dir, algo="dflash", draft=str(tmp_path), dtype="float32")
    _reference_generate_check(
        model, hf_target, spec, prompts_of((5, 12, 20), seed=3), 20, reference
    )


def _reference_block(drafter_dir, target_dir, prompt, first, k):
    """The reference on one sequence: the block [first, mask x k] after `prompt`, its hidden
    states at positions 1..k and compute_logits, and the model."""
    from dflash.model import (
        DFlash2DraftModel,
        _draft_value,
        _raw_input_embeddings,
        extract_context_feature,
    )
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    model = DFlash2DraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        context = extract_context_feature(states, model.target_layer_ids)
        block = torch.tensor([[first] + [model.mask_token_id] * k])
        scale = float(_draft_value(model.config, "input_embedding_scale", 1.0))
        noise = _raw_input_embeddings(target, block, scale)
        positions = torch.arange(len(prompt) + k + 1)[None]
        hidden = model(target_hidden=context, noise_embedding=noise, position_ids=positions)
        hidden = hidden[:, 1:]
        logits = model.compute_logits(hidden, target.lm_head)
    return model, target, hidden, logits


def _prefill(spec, prompt, temperature, seed):
    """Our prefill of one request: its first token, k drafts and the q handed to verify."""
    row = spec.kv.allocate(len(prompt) + 40)
    info = SamplingInfo(
        torch.tensor([temperature]), torch.zeros(1, dtype=torch.int64), torch.ones(1),
        torch.tensor([seed]),
    )  # fmt: skip
    variant = GREEDY_VARIANT if temperature == 0 else FULL
    tokens, drafts = spec.runner.prefill([row], [prompt], [0], info, variant)
    q = spec.runner.draft_probs[row].clone() if variant == FULL else None
    spec.kv.free(row)
    return int(tokens[0]), drafts[0].tolist(), q


@pytest.mark.needs("dflash")
def test_dflash2_drafts_and_q_match_the_reference_selector(tmp_path, llama_dir):
    """After prefill, greedy: our drafts are the reference's `propose` path; sampled
    (temperature 0.7): the q of each draft equals the reference selector's softmax(scores / T)
    over its top-k candidates, scored with our drawn predecessors, in the target vocabulary;
    every draft is one of its position's candidates."""
    from dflash.model import _sampling_probs

    k, prompt = 7, [5, 9, 11, 3, 40, 7, 8, 200, 31]
    write_reference_dflash2(tmp_path, llama_dir, block_size=k + 1, seed=11)
    spec = engine(llama_dir, algo="dflash", draft=str(tmp_path), dtype="float32")
    first, drafts, _ = _prefill(spec, prompt, 0.0, 0)
    model, target, hidden, logits = _reference_block(tmp_path, llama_dir, prompt, first, k)
    with torch.no_grad():
        path, _, _ = model.propose(hidden, torch.tensor([first]), target.lm_head, 0.0)
    assert drafts == path[0].tolist()
    for seed in (1, 2, 3):
        first, drafts, q = _prefill(spec, prompt, 0.7, seed)
        model, target, hidden, logits = _reference_block(tmp_path, llama_dir, prompt, first, k)
        sel = model.candidate_selector
        with torch.no_grad():
            unary, candidates = torch.topk(logits, sel.top_k, dim=-1)
            projected = sel.hidden_projection(hidden)
            for i, previous in enumerate([first] + drafts[:-1]):
                scores = unary[:, i] + torch.einsum(
                    "br,bkr->bk",
                    sel.predecessor_codebook(torch.tensor([previous])) * projected[:, i],
                    sel.successor_codebook(candidates[:, i]),
                )
                q_ref = _sampling_probs(scores[:, None], 0.7)[:, 0]
                expected = torch.zeros(logits.shape[-1]).scatter(0, candidates[0, i], q_ref[0])
                torch.testing.assert_close(q[i], expected, rtol=1e-4, atol=1e-5)
                assert drafts[i] in candidates[0, i].tolist()
        assert int((q > 0).sum(-1).max()) <= sel.top_k


# ------------------------------------------------------------ lossless, padding, batching


@pytest.mark.parametrize("k", [7, 2])
@pytest.mark.parametrize("padding", [False, True])
def test_dflash2_greedy_equals_plain(plain, llama_dir, dflash2_dir, k, padding):
    prompts = prompts_of((3, 17, 1, 30, 9), seed=50 + k)
    spec = engine(
        llama_dir, algo="dflash", draft=str(dflash2_dir), num_draft_tokens=k, eager_padding=padding
    )
    assert type(spec.drafter).__name__ == "DFlash2Drafter"
    assert_lossless(spec, plain, prompts, k)


@pytest.mark.needs("triton")
def test_dflash2_greedy_equals_plain_triton_backend(plain, llama_dir, dflash2_dir):
    """The triton attention backend (on the CPU: the kernels' torch references or Triton's
    interpreter) runs the block attention through the paged pool; still lossless."""
    spec = engine(llama_dir, algo="dflash", draft=str(dflash2_dir), num_draft_tokens=3,
                  eager_padding=True, attention_backend="triton")  # fmt: skip
    assert_lossless(spec, plain, prompts_of((17, 9), seed=4), 3, TRITON_GREEDY)  # two rows


def test_dflash2_published_bare_codebook_names_load(tmp_path, llama_dir, plain):
    """Published checkpoints name the codebooks without `.weight` (the reference's from_pretrained
    maps them); they load to the same drafter."""
    write_random_dflash2(tmp_path / "w", llama_dir, seed=5)
    write_random_dflash2(tmp_path / "b", llama_dir, seed=5, bare_codebooks=True)
    assert "candidate_selector.successor_codebook" in load_file(tmp_path / "b/model.safetensors")
    models = [engine(llama_dir, algo="dflash", draft=str(tmp_path / d)).drafter.model for d in "wb"]
    for (name, a), (_, b) in zip(
        models[0].state_dict().items(), models[1].state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_dflash2_sampled_seeded_runs_repeat_and_padding_changes_nothing(llama_dir, dflash2_dir):
    """Seeded sampled runs (and a greedy request among them: a FULL-variant batch) repeat
    exactly, and eager padding (graph-like padded batches on the CPU) gives the same tokens."""
    prompts = prompts_of((4, 13, 7), seed=6)
    params = [sampled(11), GREEDY, sampled(12, temperature=1.0)]
    runs = []
    for padding in (False, False, True):
        spec = engine(llama_dir, algo="dflash", draft=str(dflash2_dir), eager_padding=padding)
        runs.append([o.token_ids for o in spec.generate(prompts, params)])
    assert runs[0] == runs[1] == runs[2]
    other = engine(llama_dir, algo="dflash", draft=str(dflash2_dir))
    assert [o.token_ids for o in other.generate(prompts, [sampled(13)] * 3)] != runs[0]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_dflash2_chunked_mixed_steps_equal_one_at_a_time(llama_dir, dflash2_dir, temperature):
    """A token budget of 9 per forward: prompts are split into chunks that share forwards with
    rows already verifying; every request's tokens equal its run alone."""
    spec = Engine(
        str(llama_dir), device="cpu", max_num_seqs=4, max_model_len=80, page_size=4,
        max_num_batched_tokens=9, algo="dflash", draft=str(dflash2_dir), num_draft_tokens=3,
    )  # fmt: skip
    prompts = prompts_of((14, 3, 21, 6), seed=17)
    params = [
        sampled(s, n=12, temperature=temperature) if temperature else GREEDY for s in range(4)
    ]
    plans = []
    step = spec.scheduler.schedule

    def recording():
        plan = step()
        plans.append((len(plan.decode), len(plan.chunks)))
        return plan

    alone = [spec.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    spec.scheduler.schedule = recording
    try:
        together = run_with_arrivals(spec, prompts, params, [0, 0, 1, 2])
    finally:
        del spec.scheduler.schedule
    assert together == alone
    assert any(decode and chunks for decode, chunks in plans), plans  # mixed forwards happened


# ------------------------------------------------------------ sampled losslessness


@pytest.mark.parametrize("target", ["random", "bundled"])
def test_dflash2_sampling_follows_target_distribution(tmp_path, llama_dir, dflash2_dir, target):
    """Seeded sampled generation with DFlash2 drafts: the second token (emitted by verify against
    the selector's sampled drafts) follows the target's p given the first (temperature 0.9,
    top-p 0.9); counts over many seeds against the summed per-run distributions. On the bundled
    target the drafter starts from the trained DFLASH drafter, so drafts are often accepted and
    a wrong q (not the one the drafts were drawn from) skews the counts."""
    if target == "bundled":
        write_random_dflash2(tmp_path, TARGET, from_dflash=DFLASH, seed=3)
        target_dir, draft = TARGET, tmp_path
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
        prompt = tokenizer.encode("def add(a, b):\n    return a + b\n\ndef ").ids
    else:
        target_dir, draft = llama_dir, dflash2_dir
        prompt = prompts_of((6,), seed=321)[0]
    spec = Engine(target_dir, device="cpu", max_num_seqs=64, max_model_len=64, page_size=4,
                  algo="dflash", draft=str(draft), num_draft_tokens=3)  # fmt: skip
    n = 800
    params = [
        SamplingParams(max_new_tokens=3, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True)
        for s in range(n)
    ]
    outs = spec.generate([prompt] * n, params, use_tqdm=False)
    if target == "bundled":
        accepted = sum(o.stats["accept_len"] for o in outs) / n
        assert accepted > 1.1, f"drafts are rarely accepted ({accepted:.2f} tokens per step)"
    assert_second_token_follows_target(engine(target_dir), prompt, outs)


def test_dflash2_sampled_drafts_follow_the_q_handed_to_verify(llama_dir, dflash2_dir):
    """Rejection sampling is exact when q is the distribution each draft was drawn from: over
    1024 seeds of one prompt (the request's top-k 1 fixes the first token, so every row drafts
    from one block), draft 0 is distributed as its (shared) q; the rows with the most common
    draft 0 share draft 1's q, and draft 1 follows it. q is the selector's softmax over its
    top-k (8) candidates at the request's temperature: the request's top-k / top-p apply to the
    target's p only, as in the reference."""
    n, k = 1024, 2
    spec = Engine(llama_dir, device="cpu", max_num_seqs=n, max_model_len=32, page_size=8,
                  algo="dflash", draft=str(dflash2_dir), num_draft_tokens=k)  # fmt: skip
    prompt = prompts_of((6,), seed=9)[0]
    rows = [spec.kv.allocate(16) for _ in range(n)]
    info = SamplingInfo(
        torch.full((n,), 1.0), torch.ones(n, dtype=torch.int64), torch.ones(n),
        torch.arange(n, dtype=torch.int64) * 7 + 1,
    )  # fmt: skip
    tokens, drafts = spec.runner.prefill(rows, [prompt] * n, [0] * n, info, FULL)
    q = spec.runner.draft_probs[torch.tensor(rows)]
    assert tokens.eq(tokens[0]).all()
    group = torch.arange(n)
    for i in range(k):
        assert group.numel() >= 100, f"draft {i}: too few rows share a context"
        probs = q[group[0], i].double()
        assert torch.allclose(q[group, i], q[group[0], i][None].expand(group.numel(), -1))
        assert int((probs > 0).sum()) == 8  # the selector's top-k candidates
        counts = torch.bincount(drafts[group, i], minlength=probs.numel()).double()
        assert counts[probs == 0].sum() == 0, f"draft {i} outside the support of its q"
        support = probs > 0
        expected = probs[support] / probs[support].sum() * group.numel()
        assert chisquare(counts[support], expected).pvalue > 0.001, f"draft {i}"
        group = group[drafts[group, i] == drafts[group, i].mode().values]


# ------------------------------------------------------------ refusals, one line each


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sizes": {"selector_top_k": None}}, "lacks the field 'selector_top_k'"),
        ({"sizes": {"selector_rank": None}}, "lacks the field 'selector_rank'"),
        ({"sizes": {"conv_kernel_size": 0}}, r"conv_kernel_size=0 .* integer >= 1"),
        ({"sizes": {"selector_top_k": 2.5}}, r"selector_top_k=2.5 .* integer >= 1"),
        ({"sizes": {"selector_top_k": 600}}, "selector_top_k=600 .* exceeds the target vocab"),
        ({"sizes": {"conv_group_size": 24}}, "conv_group_size=24 .* does not divide hidden_size"),
        ({"config_overrides": {"vocab_size": 300}}, "vocab_size=300 .* another target"),
        ({"drop_keys": ["layers.1.mlp_conv.base_kernel"]}, "lacks the tensor 'layers.1.mlp_conv"),
        (
            {"drop_keys": ["candidate_selector.hidden_projection.weight"]},
            "lacks the tensor 'candidate_selector.hidden_projection.weight'.* DFlash2",
        ),
    ],
)
def test_dflash2_bad_checkpoints_raise_one_clear_error(tmp_path, llama_dir, kwargs, message):
    write_random_dflash2(tmp_path, llama_dir, **kwargs)
    with pytest.raises(SpeculantError, match=message) as info:
        engine(llama_dir, algo="dflash", draft=str(tmp_path))
    assert "\n" not in str(info.value)


def test_dflash2_k_beyond_the_block_is_refused(llama_dir, dflash2_dir):
    with pytest.raises(SpeculantError, match="num_draft_tokens=8 does not fit the DFLASH block"):
        engine(llama_dir, algo="dflash", draft=str(dflash2_dir), num_draft_tokens=8)
