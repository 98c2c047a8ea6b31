"""Qwen3-MoE against transformers (both checkpoint layouts), speculative decoding on an MoE target,
the dispatchers (local, all-to-all over two gloo processes) against a dense reference, and the
DeepEP graph adapter's replay protocol with a recording stand-in for `deep_ep.Buffer`."""

from __future__ import annotations

import json
import multiprocessing
import re
import socket
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers_eagle import write_random_eagle3

from speculant import Engine, SamplingParams, SpeculantError
from speculant.comm.deepep import (
    DeepEPBuffer,
    DeepEPDispatcher,
    DeepEPGraphAdapter,
    DispatchMode,
    check_low_latency_sizes,
)
from speculant.comm.groups import ParallelContext
from speculant.comm.moe_dispatch import (
    AllToAllDispatcher,
    ExpertSlots,
    ExpertTokens,
    LocalDispatcher,
    combine_weighted,
    pack_by_expert,
)
from speculant.config import GraphConfig, ModelConfig, MoeConfig
from speculant.executor.attention import TorchPagedAttention
from speculant.executor.cuda_graph import GraphRunner
from speculant.executor.model_runner import StepOutput
from speculant.executor.speculation import DraftShape
from speculant.models.loader import build_causal_lm, iter_safetensors, load_weights
from speculant.models.qwen3_moe import (
    DENSE_EXPERT_ROWS,
    Experts,
    Qwen3MoeForCausalLM,
    make_dispatcher,
)

TINY_MOE = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    num_experts=8,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    dtype="float32",
)
GREEDY16 = SamplingParams(max_new_tokens=16, ignore_eos=True)


def save_moe(out_dir: Path, seed: int, fused: bool, **overrides):
    """A random Qwen3MoeForCausalLM saved by transformers (per-expert tensors), or with `fused`
    its in-memory transformers-5 layout (mlp.experts.gate_up_proj [E, 2I, H] / down_proj)."""
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**{**TINY_MOE, **overrides})
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    if fused:
        config.architectures = ["Qwen3MoeForCausalLM"]
        config.save_pretrained(out_dir)
        tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """name -> (checkpoint dir, the transformers model it holds)."""
    per_expert = tmp_path_factory.mktemp("qwen3_moe")
    fused = tmp_path_factory.mktemp("qwen3_moe_fused")
    return {
        # 3 layers, layer 1 dense (mlp_only_layers), renormalised top-2
        "per_expert": (
            per_expert,
            save_moe(
                per_expert,
                0,
                False,
                num_hidden_layers=3,
                mlp_only_layers=[1],
                norm_topk_prob=True,
            ),
        ),
        # 4 layers, every second one sparse (decoder_sparse_step), raw top-2 probabilities
        "fused": (
            fused,
            save_moe(fused, 1, True, num_hidden_layers=4, decoder_sparse_step=2),
        ),
    }


@pytest.fixture(scope="module")
def moe_dir(moe_models):
    return moe_models["per_expert"][0]


def engine(target, **kwargs):
    return Engine(target, device="cpu", max_num_seqs=4, max_model_len=160, page_size=4, **kwargs)


def prompts_of(lengths, seed, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


# ---------------------------------------------------------------- the model


def test_config_fields(moe_dir):
    cfg = ModelConfig.from_dir(moe_dir)  # transformers 5 writes num_local_experts
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.moe_layer_ids == (0, 2) and cfg.norm_topk_prob and cfg.qk_norm
    hub = json.loads((moe_dir / "config.json").read_text())
    hub.pop("num_local_experts")
    hub.update(num_experts=16, decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=6)
    cfg = ModelConfig.from_hf(hub)
    assert cfg.num_experts == 16 and cfg.moe_layer_ids == (1, 3, 5)


@pytest.mark.parametrize("name", ["per_expert", "fused"])
def test_logits_match_transformers(moe_models, name):
    path, ref = moe_models[name]
    eng = engine(path)
    assert isinstance(eng.model, Qwen3MoeForCausalLM)
    ids = prompts_of([37], seed=3)[0]
    row = eng.kv.allocate(len(ids) + 1)
    hidden, _, _ = eng.runner.forward_prefill([row], [ids], [0])
    ours = eng.model.compute_logits(hidden)
    eng.kv.free(row)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    rel = (ours - theirs).norm() / theirs.norm()
    assert rel < 1e-4, f"{name}: relative error {rel:.2e}"


def test_greedy_matches_transformers_generate(moe_models):
    path, ref = moe_models["per_expert"]
    prompts = prompts_of((5, 17, 2), seed=7)
    outs = engine(path).generate(prompts, GREEDY16)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        expected = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert out.token_ids == expected


@pytest.mark.parametrize("padding", [False, True])
def test_eagle3_on_moe_target_equals_plain_greedy(tmp_path, moe_dir, padding):
    write_random_eagle3(tmp_path, moe_dir, draft_vocab=200)
    prompts = prompts_of((3, 17, 9), seed=11)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = [o.token_ids for o in engine(moe_dir).generate(prompts, params)]
    spec = engine(
        moe_dir, algo="eagle3", draft=str(tmp_path), num_draft_tokens=3, eager_padding=padding
    )
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert all(1.0 <= o.stats["accept_len"] <= 4 for o in outs)
    assert len(spec.kv.free_pages) == spec.kv.num_pages - 1


def test_dummy_weights_any_shape(tmp_path):
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        **{k: v for k, v in TINY_MOE.items() if k != "dtype"},
        "hidden_size": 48,
        "head_dim": 12,
        "num_experts": 6,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 20,
        "num_hidden_layers": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    eng = engine(tmp_path, load_format="dummy")
    assert eng.model.model.layers[0].mlp.experts.gate_up_proj.shape == (6, 40, 48)
    out = eng.generate(prompts_of([4], seed=1), SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert len(out[0].token_ids) == 5


@pytest.mark.parametrize("name", ["per_expert", "fused"])
def test_experts_split_over_ranks(moe_models, name):
    """Rank 1 of 2 loads experts 4..7 of either layout (building needs no process group)."""
    path, ref = moe_models[name]
    cfg = ModelConfig.from_dir(path)
    moe = MoeConfig(backend="all2all", max_tokens_per_rank=8)
    model = build_causal_lm(cfg, 64, ParallelContext(dp_size=2, dp_rank=1), moe)
    load_weights(model, iter_safetensors(path), str(path))
    layer = cfg.moe_layer_ids[-1]
    ours, theirs = model.model.layers[layer].mlp, ref.model.layers[layer].mlp
    assert torch.equal(ours.experts.gate_up_proj, theirs.experts.gate_up_proj[4:])
    assert torch.equal(ours.experts.down_proj, theirs.experts.down_proj[4:])
    assert torch.equal(ours.gate.weight, theirs.gate.weight)


def test_missing_expert_tensor_is_named(moe_dir):
    cfg = ModelConfig.from_dir(moe_dir)
    model = build_causal_lm(cfg, 64, ParallelContext.single())
    weights = (
        (n, t) for n, t in iter_safetensors(moe_dir) if "layers.2.mlp.experts.3.up_proj" not in n
    )
    with pytest.raises(SpeculantError, match=r"experts\.gate_up_proj \(part \(3, 1\)\)"):
        load_weights(model, weights, str(moe_dir))


def test_unread_expert_layout_is_named(moe_dir):
    """Experts stacked per projection (`mlp.experts.gate_proj` [E, I, H], up, down), a layout
    the loader does not read: the refusal names the tensors the checkpoint holds there, not only
    the part it lacks (the warning naming them came after the error, so never showed)."""
    cfg = ModelConfig.from_dir(moe_dir)
    model = build_causal_lm(cfg, 64, ParallelContext.single())
    per_expert = re.compile(r"(.*\.experts)\.(\d+)\.(\w+_proj)\.weight$")
    stacked: dict[str, list] = {}
    weights = {}
    for name, tensor in iter_safetensors(moe_dir):
        if m := per_expert.match(name):
            stacked.setdefault(f"{m[1]}.{m[3]}", []).append((int(m[2]), tensor))
        else:
            weights[name] = tensor
    for name, parts in stacked.items():
        weights[name] = torch.stack([t for _, t in sorted(parts, key=lambda p: p[0])])
    with pytest.raises(SpeculantError) as info:
        load_weights(model, iter(sorted(weights.items())), str(moe_dir))
    message = str(info.value)
    assert "\n" not in message and "lacks the tensor for 'model.layers.0.mlp.experts" in message
    # what it holds there (its down_proj is the fused layout's, and loads)
    assert "'model.layers.0.mlp.experts.gate_proj', 'model.layers.0.mlp.experts.up_proj'" in message


def test_moe_draft_model_is_refused_naming_the_architecture(moe_dir):
    """A Qwen3-MoE checkpoint as --algo draft-model's drafter: one line naming it (its experts
    were once looked for as a dense MLP's fused tensor)."""
    with pytest.raises(SpeculantError) as info:
        Engine(str(moe_dir), device="cpu", algo="draft-model", draft=str(moe_dir))
    message = str(info.value)
    assert "\n" not in message and f"{moe_dir}/config.json is a mixture-of-experts" in message
    assert "Qwen3MoeForCausalLM" in message and "pass a dense --draft" in message


def test_backend_and_limit_errors(moe_dir):
    cfg, single = ModelConfig.from_dir(moe_dir), ParallelContext.single()
    with pytest.raises(SpeculantError, match="backend 'nccl' is not supported"):
        make_dispatcher(cfg, single, MoeConfig(backend="nccl"), 4, "cpu")
    with pytest.raises(SpeculantError, match="needs CUDA"):
        make_dispatcher(cfg, single, MoeConfig(backend="deepep"), 4, "cpu")
    with pytest.raises(SpeculantError, match="--moe-backend local keeps every expert"):
        make_dispatcher(cfg, ParallelContext(dp_size=2), MoeConfig(backend="local"), 4, "cpu")
    # all2all on one rank had no process group: torch's "Default process group has not been
    # initialized" at the first MoE forward
    with pytest.raises(SpeculantError, match="--moe-backend all2all moves tokens between ranks"):
        make_dispatcher(cfg, single, MoeConfig(backend="all2all"), 4, "cpu")
    with pytest.raises(SpeculantError, match=r"max_tokens_per_rank=4 .* at least 8"):
        make_dispatcher(cfg, single, MoeConfig(max_tokens_per_rank=4), 8, "cpu")
    with pytest.raises(SpeculantError, match="not divisible by the 3 expert-parallel ranks"):
        make_dispatcher(cfg, ParallelContext(dp_size=3), MoeConfig(backend="all2all"), 4, "cpu")


# ---------------------------------------------------------------- dispatchers on one rank


def random_experts(num_experts, hidden, inter, first=0, num_local=None, seed=0):
    """Experts whose weights depend only on the seed (the same on every rank), keeping
    [first, first + num_local)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    num_local = num_local or num_experts
    experts = Experts(num_experts, hidden, inter, first, num_local)
    experts.gate_up_proj.data.copy_(gate_up[first : first + num_local])
    experts.down_proj.data.copy_(down[first : first + num_local])
    return experts


def random_routing(num_tokens, num_experts, k, hidden, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    probs = torch.rand(num_tokens, num_experts, generator=gen)
    weights, ids = probs.topk(k, dim=-1)
    return x, ids, weights


def dense_reference(experts: Experts, x, ids, weights):
    """Token by token: sum_j w_j * SwiGLU_{ids_j}(x), skipping ids -1."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist(), strict=True):
            if e >= 0:
                gate, up = F.linear(x[t], experts.gate_up_proj[e]).chunk(2)
                out[t] += w * F.linear(F.silu(gate) * up, experts.down_proj[e])
    return out


@pytest.mark.parametrize("dense", [False, True])
def test_local_dispatcher_matches_dense_reference(dense):
    experts = random_experts(8, 16, 8)
    x, ids, weights = random_routing(11, 8, 3, 16, seed=1)
    ids[4, 1] = -1  # a choice of no expert is ignored
    d = LocalDispatcher(8, max_tokens_per_rank=16)
    tokens, slots = d.dispatch(x, ids, weights)
    valid_ids = ids[ids >= 0]
    assert tokens.counts.tolist() == torch.bincount(valid_ids, minlength=8).tolist()
    for e in range(8):  # expert e's rows are its tokens, in token order
        members = (ids == e).any(dim=1).nonzero().flatten()
        assert torch.equal(tokens.hidden[e, : len(members)], x[members])
    out = experts(tokens, dense=dense)
    out[torch.arange(11) >= tokens.counts[:, None].long()] = float("nan")
    combined = d.combine(out, slots)  # padding rows are never read
    torch.testing.assert_close(combined, dense_reference(experts, x, ids, weights))


def test_local_dispatcher_token_limit():
    x, ids, weights = random_routing(5, 8, 2, 16, seed=2)
    with pytest.raises(SpeculantError, match=r"5 tokens .* max_tokens_per_rank=4; raise "):
        LocalDispatcher(8, max_tokens_per_rank=4).dispatch(x, ids, weights)


def test_pack_handles_no_tokens():
    tokens, rows, valid = pack_by_expert(
        torch.zeros(0, 4), torch.zeros(0, 2, dtype=torch.int64), 3, 0
    )
    assert tokens.hidden.shape == (3, 0, 4) and tokens.counts.tolist() == [0, 0, 0]
    out = combine_weighted(tokens.hidden, ExpertSlots(rows, valid, torch.zeros(0, 2)))
    assert out.shape == (0, 4)


# Tensor -> Python conversions: each one waits for the device on CUDA (a host sync)
HOST_READS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def host_reads_fail(monkeypatch, *also: str):
    """Inside, reading a tensor's values on the host raises (so does each `torch` function
    named in `also`); outside, everything is restored."""
    with monkeypatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, _refuse(f"Tensor.{name}"), raising=False)
        for name in also:
            patch.setattr(torch, name, _refuse(f"torch.{name}"))
        yield


def _refuse(name: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"{name} called: a host sync in the eager MoE forward")

    return refused


def per_expert_swiglu(experts: Experts, tokens: ExpertTokens) -> list[torch.Tensor]:
    """Expert by expert over its valid rows (the reading of the counts the forward avoids)."""
    outs = []
    for e, n in enumerate(tokens.counts.tolist()):
        gate, up = F.linear(tokens.hidden[e, :n], experts.gate_up_proj[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, experts.down_proj[e]))
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_moe_block_reads_nothing_on_the_host(moe_models, monkeypatch, dtype):
    """A sparse block's eager forward on a buffer above DENSE_EXPERT_ROWS (router, dispatch,
    experts over the valid rows only, combine) reads no tensor value on the host, calls no
    batched matmul over the padding, and gives, row for row, what the experts give run one
    by one over their valid rows (bitwise on the CPU); the block's output equals the dense
    reference."""
    path = moe_models["per_expert"][0]
    model = build_causal_lm(ModelConfig.from_dir(path), 64, ParallelContext.single(), None, 512)
    load_weights(model, iter_safetensors(path), path)
    block = model.model.layers[0].mlp.to(dtype)
    num_tokens = DENSE_EXPERT_ROWS // block.experts.num_local + 45  # 8 x 301 rows
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    block.dispatcher.begin_forward(num_tokens)
    tokens, slots = block.dispatcher.dispatch(x, *block.gate(x))
    assert tokens.hidden.shape[0] * tokens.hidden.shape[1] > DENSE_EXPERT_ROWS
    with torch.inference_mode(), host_reads_fail(monkeypatch, "bmm"):
        out = block.experts(tokens)
        got = block(x)
    for e, expected in enumerate(per_expert_swiglu(block.experts, tokens)):
        assert torch.equal(out[e, : len(expected)], expected), e
    ids, weights = block.gate(x)
    reference = dense_reference(block.experts.float(), x.float(), ids, weights)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), reference, rtol=tol, atol=tol)


def test_grouped_experts_cover_empty_and_full_experts(monkeypatch):
    """Experts with no rows, with every row, and a buffer whose rows are all real: the grouped
    path without host reads equals the dense batched matmuls on every valid row."""
    experts = random_experts(4, 16, 8)
    counts = torch.tensor([0, 700, 0, 699], dtype=torch.int32)
    hidden = torch.randn(4, 700, 16, generator=torch.Generator().manual_seed(4))
    for max_rows in (None, 1399):
        tokens = ExpertTokens(hidden, counts, max_rows=max_rows)
        with host_reads_fail(monkeypatch, "bmm"):
            out = experts(tokens, dense=False)
        dense = experts(tokens, dense=True)
        for e, n in enumerate(counts.tolist()):
            torch.testing.assert_close(out[e, :n], dense[e, :n], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- two gloo ranks


class CausalSDPA:
    """Whole-prompt causal attention without a KV cache (one prompt per forward), with the
    element-wise ops of the torch backend."""

    ops = TorchPagedAttention.ops

    def forward(self, layer_id, q, k, v):
        rep = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(rep, dim=1).transpose(0, 1) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
        return out.transpose(0, 1)


def prompt_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden, _ = model(torch.tensor(ids), torch.arange(len(ids)), CausalSDPA())
        return model.compute_logits(hidden)


def max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return (got - expected).abs().max().item() if got.numel() else 0.0


def _ep_worker(rank: int, port: int, moe_dir: str, results) -> None:
    """Rank `rank` of 2: the all-to-all dispatcher and an EP=2 Qwen3-MoE against one rank."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=60),
        )
        report = {}
        full = random_experts(8, 16, 8)
        mine = random_experts(8, 16, 8, first=4 * rank, num_local=4)
        a2a = AllToAllDispatcher(8, 2, rank, max_tokens_per_rank=6)
        # uneven token counts; rank 1 also dispatches nothing once (an idle rank)
        for case, num_tokens in enumerate(((5, 3), (4, 0))):
            x, ids, weights = random_routing(num_tokens[rank], 8, 2, 16, seed=10 * case + rank)
            expected = dense_reference(full, x, ids, weights)
            for dense in (False, True):
                tokens, handle = a2a.dispatch(x, ids, weights)
                out = mine(tokens, dense=dense)
                pad = torch.arange(out.shape[1]) >= tokens.counts[:, None].long()
                out[pad] = float("nan")  # padding rows must never be read back
                got = a2a.combine(out, handle)
                report[f"case{case}_dense{dense}"] = max_error(got, expected)
                report[f"case{case}_counts"] = tokens.counts.tolist()
        try:  # raised before any collective, so the ranks stay aligned
            a2a.dispatch(*random_routing(7, 8, 2, 16, seed=5))
        except SpeculantError as exc:
            report["limit_error"] = str(exc)
        # an EP=2 model: 13 and 5 tokens with a limit of 4 -> both ranks run 4 dispatches
        cfg = ModelConfig.from_dir(moe_dir)
        pctx = ParallelContext(dp_size=2, dp_rank=rank)
        moe = MoeConfig(backend="all2all", max_tokens_per_rank=4)
        models = {
            "ep2": build_causal_lm(cfg, 64, pctx, moe),
            "single": build_causal_lm(cfg, 64, ParallelContext.single()),
        }
        for model in models.values():
            load_weights(model, iter_safetensors(moe_dir), moe_dir)
        ids = prompts_of([(13, 5)[rank]], seed=20 + rank)[0]
        logits = {name: prompt_logits(model, ids) for name, model in models.items()}
        report["chunks"] = models["ep2"].dispatcher.num_chunks
        report["model_err"] = max_error(logits["ep2"], logits["single"])
        report["experts"] = tuple(models["ep2"].model.layers[0].mlp.experts.gate_up_proj.shape)
        dist.barrier()
        results.put((rank, report))
    except Exception:
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ep_reports(moe_dir):
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_ep_worker, args=(r, port, str(moe_dir), results)) for r in range(2)
    ]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in procs:
            rank, report = results.get(timeout=90)
            assert isinstance(report, dict), f"rank {rank} failed:\n{report}"
            reports[rank] = report
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return reports


def test_all_to_all_equals_local_over_two_gloo_ranks(ep_reports):
    for report in ep_reports.values():
        for key, err in report.items():
            if "_dense" in key:
                assert err < 1e-5, (key, err)
    # rank r holds experts 4r..4r+3; the two ranks' counts cover every routed choice
    assert sum(sum(r["case0_counts"]) for r in ep_reports.values()) == (5 + 3) * 2
    assert sum(sum(r["case1_counts"]) for r in ep_reports.values()) == 4 * 2


def test_all_to_all_token_limit(ep_reports):
    for report in ep_reports.values():
        assert "7 tokens" in report["limit_error"]
        assert "max_tokens_per_rank=6; raise --moe-max-tokens-per-rank" in report["limit_error"]


def test_expert_parallel_model_equals_one_rank(ep_reports):
    for report in ep_reports.values():
        assert report["experts"] == (4, 64, 64)  # half of the 8 experts per rank
        assert report["chunks"] == 4  # ceil(13 / 4) on both ranks, though rank 1 has 5 tokens
        assert report["model_err"] < 1e-4


# ---------------------------------------------------------------- DeepEP, with a stand-in buffer


class RecordingBuffer:
    """Records the DeepEP calls the wrapper makes; the LL and normal kernels are emulated for one
    rank with the reference packing."""

    def __init__(self, calls: list):
        self.calls = calls

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        self.calls.append(("clean", num_max_dispatch_tokens_per_rank, hidden, num_experts))

    def low_latency_dispatch(self, x, topk_idx, num_max, num_experts, **flags):
        assert x.dtype == torch.bfloat16 and topk_idx.dtype == torch.int64
        self.calls.append(("ll_dispatch", x.shape[0], num_max, num_experts, flags["use_fp8"]))
        tokens, rows, valid = pack_by_expert(x, topk_idx, num_experts, num_max)
        return tokens.hidden, tokens.counts, (rows, valid), None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, **flags):
        assert x.dtype == torch.bfloat16 and topk_weights.dtype == torch.float32
        self.calls.append(("ll_combine",))
        return combine_weighted(x, ExpertSlots(*handle, topk_weights)), None, None

    def get_dispatch_layout(self, topk_idx, num_experts):
        self.calls.append(("layout",))
        return None, None, None, None, None

    def dispatch(self, x, topk_idx, topk_weights, **layout):
        self.calls.append(("dispatch", x.shape[0]))
        return x, topk_idx, topk_weights, None, "handle", None

    def combine(self, x, handle):
        self.calls.append(("combine", handle))
        return x, None, None


def test_deepep_adapter_sets_low_latency_and_cleans_before_every_replay():
    calls = []
    ep = DeepEPBuffer(RecordingBuffer(calls), hidden=2048, num_experts=8, max_tokens_per_rank=16)
    adapter = DeepEPGraphAdapter(ep)

    class RecordingGraph:
        def replay(self):
            calls.append(("replay", ep.mode))

    class NoRunner:
        device = torch.device("cpu")

        def full_shape(self):
            return DraftShape(0, 0)

    single = ParallelContext.single()
    graphs = GraphRunner(NoRunner(), GraphConfig(capture_sizes=[1]), 4, ("greedy",), single)
    graphs.use_graphs = True  # RecordingGraph stands in for a captured CUDA graph
    graphs.graphs[graphs.key("greedy", 1)] = RecordingGraph()
    output = StepOutput(torch.zeros(1, 1), torch.ones(1), torch.zeros(1, 0))
    graphs.outputs[graphs.key("greedy", 1)] = output
    graphs.hooks.append(adapter)

    ep.set_mode(DispatchMode.NORMAL)  # a prefill ran in normal mode before capture
    adapter.capture()
    assert ep.mode is DispatchMode.LOW_LATENCY
    assert calls == [("clean", 16, 2048, 8)]  # the NORMAL -> LL switch cleans
    calls.clear()
    graphs.run(1, 1, "greedy")
    graphs.run(1, 1, "greedy")
    ep.set_mode(DispatchMode.NORMAL)  # a prefill between two decode steps
    graphs.run(1, 1, "greedy")
    clean, replay = ("clean", 16, 2048, 8), ("replay", DispatchMode.LOW_LATENCY)
    assert calls == [clean, replay, clean, replay, clean, replay]  # one clean per replay

    calls.clear()  # without the per-replay clean only a NORMAL -> LL switch cleans
    adapter.clean_before_replay = False
    graphs.run(1, 1, "greedy")
    ep.set_mode(DispatchMode.NORMAL)
    graphs.run(1, 1, "greedy")
    assert calls == [replay, clean, replay]


def test_deepep_dispatcher_modes_with_a_recording_buffer():
    calls = []
    ep = DeepEPBuffer(RecordingBuffer(calls), hidden=16, num_experts=8, max_tokens_per_rank=6)
    d = DeepEPDispatcher(ep, ep_size=1, ep_rank=0)
    experts = random_experts(8, 16, 8)
    for num_tokens, mode in ((5, DispatchMode.LOW_LATENCY), (9, DispatchMode.NORMAL)):
        x, ids, weights = random_routing(num_tokens, 8, 2, 16, seed=num_tokens)
        d.begin_forward(num_tokens)  # decode-sized batches go low-latency, prefills normal
        assert ep.mode is mode and d.num_chunks == 1
        tokens, handle = d.dispatch(x, ids, weights)
        got = d.combine(experts(ExpertTokens(tokens.hidden.float(), tokens.counts)), handle)
        expected = dense_reference(experts, x.bfloat16().float(), ids, weights)
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    d.begin_forward(3)  # back to LL after a normal-mode prefill: cleaned once
    assert [c[0] for c in calls] == [
        "ll_dispatch",
        "ll_combine",
        "layout",
        "dispatch",
        "combine",
        "clean",
    ]
    assert calls[0] == ("ll_dispatch", 5, 6, 8, False)
    assert d.replay_hooks()[0].ep is ep


def test_engine_wires_the_dispatchers_replay_hooks_into_its_graph_runner(moe_dir, monkeypatch):
    """An Engine on a DeepEP target registers the dispatcher's graph adapter on its own graph
    runner, so every replay resets low-latency mode and cleans the buffer first. On the CPU a
    recording stand-in for deep_ep.Buffer is built where make_dispatcher would build the real
    one: the engine's wiring and the replay protocol are checked, not DeepEP's kernels."""
    import speculant.models.loader as loader

    calls, made = [], []

    def deepep_dispatcher(cfg, pctx, moe, decode_tokens, device):
        ep = DeepEPBuffer(RecordingBuffer(calls), cfg.hidden_size, cfg.num_experts, decode_tokens)
        made.append(DeepEPDispatcher(ep, pctx.ep_size, pctx.rank))
        return made[-1]

    monkeypatch.setattr(loader, "make_dispatcher", deepep_dispatcher)
    eng = engine(moe_dir)
    dispatcher, graphs = eng.model.dispatcher, eng.graphs
    assert made == [dispatcher]
    adapters = [hook for hook in graphs.hooks if isinstance(hook, DeepEPGraphAdapter)]
    assert len(adapters) == 1 and adapters[0].ep is dispatcher.ep
    eng.generate(prompts_of((9, 3), seed=8), SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert {"dispatch", "ll_dispatch"} <= {c[0] for c in calls}  # prefill normal, decode LL

    class RecordingGraph:
        def replay(self):
            calls.append(("replay", dispatcher.ep.mode))

    graphs.use_graphs = graphs.pad = True  # RecordingGraph stands in for a captured graph
    graphs.graphs[graphs.key("greedy", 1)] = RecordingGraph()
    output = StepOutput(torch.zeros(1, 1), torch.ones(1), torch.zeros(1, 0))
    graphs.outputs[graphs.key("greedy", 1)] = output
    dispatcher.ep.set_mode(DispatchMode.NORMAL)  # a prefill ran in normal mode
    calls.clear()
    graphs.run(1, 1, "greedy")
    graphs.run(1, 1, "greedy")
    clean = ("clean", dispatcher.ep.max_tokens_per_rank, 64, 8)
    assert calls == [clean, ("replay", DispatchMode.LOW_LATENCY)] * 2
    assert graphs.num_replays == 2


def test_deepep_size_checks_and_missing_wheel():
    with pytest.raises(SpeculantError, match=r"hidden size 64 is not supported .*2048, 2560"):
        check_low_latency_sizes(64, 8, 2, 16, 4)
    with pytest.raises(SpeculantError, match=r"=8 is below one decode step's 12 tokens"):
        check_low_latency_sizes(2048, 8, 2, 8, 12)

    class TwoRanks:
        def size(self):
            return 2

    with pytest.raises(SpeculantError, match="pip install tokenspeed-deepep"):
        DeepEPBuffer.create(TwoRanks(), 2048, 8, 16, 4)
