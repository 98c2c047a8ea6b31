"""Our Llama / Qwen2 / Qwen3 against transformers on tiny random checkpoints (float32)."""

from __future__ import annotations

import pytest
import torch

from speculant import Engine, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "llama_tied", "llama_sharded"]


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def our_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, through the paged prefill path."""
    row = engine.kv.allocate(len(ids) + 1)
    try:
        hidden, _, _ = engine.runner.forward_prefill([row], [ids], [0])
        return engine.model.compute_logits(hidden)
    finally:
        engine.kv.free(row)


@pytest.mark.parametrize("name", ARCHS)
def test_logits_match_transformers(hf_model_dirs, name):
    path = hf_model_dirs[name]
    engine = Engine(path, device="cpu", max_num_seqs=4, max_model_len=256, page_size=8)
    ref = hf_model(path)
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    ids = torch.randint(0, engine.model_config.vocab_size, (37,), generator=gen).tolist()
    ours = our_logits(engine, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    rel = (ours - theirs).norm() / theirs.norm()
    assert rel < 1e-4, f"{name}: relative error {rel:.2e}"


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_generate(hf_model_dirs, name):
    path = hf_model_dirs[name]
    engine = Engine(path, device="cpu", max_num_seqs=4, max_model_len=256, page_size=8)
    ref = hf_model(path)
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 17, 2, 33)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        expected = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert out.token_ids == expected
        assert out.finish_reason == "length"


def test_qkv_split_over_two_ranks_reassembles(llama_dir):
    """The TP loaders slice q/k/v and gate/up so that the shards concatenate to the full tensor."""
    from speculant.comm.groups import ParallelContext
    from speculant.config import ModelConfig
    from speculant.models.llama import CausalLM
    from speculant.models.loader import iter_safetensors, load_weights

    cfg = ModelConfig.from_dir(llama_dir)
    shards = []
    for rank in range(2):
        model = CausalLM(cfg, 64, ParallelContext(tp_size=2, tp_rank=rank))
        load_weights(model, iter_safetensors(llama_dir), str(llama_dir))
        shards.append(model)
    full = dict(iter_safetensors(llama_dir))
    q_size = cfg.num_heads * cfg.head_dim // 2
    qkv = [m.model.layers[0].self_attn.qkv_proj.weight for m in shards]
    q = torch.cat([w[:q_size] for w in qkv])
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"])
    down = torch.cat([m.model.layers[1].mlp.down_proj.weight for m in shards], dim=1)
    assert torch.equal(down, full["model.layers.1.mlp.down_proj.weight"])


def test_prefill_after_cached_prefix_matches_one_shot(llama_dir):
    """A prompt prefilled in two chunks (the second attending to the cached first) gives the
    same logits as one prefill."""
    engine = Engine(llama_dir, device="cpu", max_num_seqs=2, max_model_len=128, page_size=4)
    ids = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    full = our_logits(engine, ids)
    row = engine.kv.allocate(40)
    engine.runner.forward_prefill([row], [ids[:21]], [0])
    hidden, _, _ = engine.runner.forward_prefill([row], [ids[21:]], [21])
    engine.kv.free(row)
    torch.testing.assert_close(engine.model.compute_logits(hidden), full[21:], rtol=1e-5, atol=1e-5)
