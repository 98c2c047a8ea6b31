"""A draft LM whose vocab_size differs from the target's (--algo draft-model): one tokenizer
whose embedding tables are padded to different sizes, as Qwen2.5-0.5B (151936) drafting for
Qwen2.5-7B (152064). Tiny Llama checkpoints share the demo tokenizer (512 tokens) at vocab_size
SMALL = 520 and LARGE = 576, in both directions. Greedy output equals plain decoding (eager, the
CPU's stand-ins for the decode and piecewise graphs, adaptive steps with deferred catch-up),
also when the target emits and the prompts hold ids the draft LM has no row for; a draft whose
extra rows (ids the target lacks) dominate still drafts the target's argmax; sampled drafts are
drawn from exactly the q verify reads, and sampled output follows the target's distribution;
another tokenizer (or no evidence of the same one) is refused. On CUDA (`gpu`): the captured
decode, extend and per-sequence graphs equal the eager steps."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from helpers_ckpt import TINY
from helpers_sampling import assert_follows, seeded_prefill

from speculant import Engine, SamplingParams, SpeculantError
from speculant.drafter.tokenizer_vocab import check_draft_tokenizer, token_map
from speculant.executor.sampling import filtered_probs
from speculant.executor.speculation import AUTO, DraftLengthChooser, DraftShape, StepCosts

SMALL, LARGE = 520, 576  # vocab_size values; the tokenizer has 512 tokens
FAVOURED = 560  # an id >= SMALL that a SMALL draft LM cannot embed
K = 3
NOISE = 0.3  # on lm_head: the sampled tests' drafts are close to the target, not equal
ENGINE = dict(device="cpu", max_num_seqs=8, max_model_len=96, page_size=4)
GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
MODES = {
    "eager": {},
    # the CPU's stand-ins: decode graphs padded eagerly, extend steps by token bucket (the draft
    # model's N-token piece) and greedy per-sequence drafting by row count (ProposeGraphs)
    "graphs": dict(eager_padding=True, max_num_batched_tokens=32),
    # adaptive steps: plain ones record the inputs, a deferred catch-up feeds them to the LM
    "catch-up": dict(speculation=AUTO, catch_up_depth=2, max_num_batched_tokens=32),
}


def write_lm(
    path: Path, vocab: int, seed: int, tokenizer: Path | None, copy=None, scale=None, noise=0.0
):
    """A tiny Llama of `vocab` ids saved as safetensors (float32). `copy`: another one's state
    dict, its vocabulary rows truncated or extended by this one's own random rows; `noise`:
    the std of Gaussian noise added to lm_head (a draft close to the target, not equal);
    `scale`: {id: factor} on lm_head rows (a row scaled up wins the argmax often, scaled to 0
    never). `tokenizer`: a folder whose tokenizer.json is copied in."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": vocab})
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        state = model.state_dict()
        for name, value in (copy or {}).items():
            rows = min(value.shape[0], state[name].shape[0])
            state[name][:rows] = value[:rows]
        if noise:
            state["lm_head.weight"] += noise * torch.randn_like(state["lm_head.weight"])
        for i, factor in (scale or {}).items():
            state["lm_head.weight"][i] *= factor
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        shutil.copy(tokenizer / "tokenizer.json", path / "tokenizer.json")
    return {name: value.clone() for name, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, tiny_tokenizer_dir):
    """Checkpoints by name:
    - small_target (SMALL), large_draft: its copy at LARGE whose extra rows dominate its logits;
    - large_target (LARGE) whose rows >= SMALL never win, small_draft: its copy at SMALL (no
      tokenizer files: the padding rule admits it);
    - favouring_target (LARGE, FAVOURED often wins), favouring_draft: its copy at SMALL;
    - small_other, large_other: noisy copies of favouring_target at SMALL and of small_target
      at LARGE (the sampled tests: q near p, not equal), large_other's extra rows scaled up
      (most of its mass on ids the target lacks)."""
    root, tok = tmp_path_factory.mktemp("draft_vocab"), tiny_tokenizer_dir
    out = {}

    def put(name, vocab, seed, tokenizer=tok, **kwargs):
        out[name] = root / name
        return write_lm(out[name], vocab, seed, tokenizer, **kwargs)

    small = put("small_target", SMALL, 0)
    put("large_draft", LARGE, 1, copy=small, scale=dict.fromkeys(range(SMALL, LARGE), 4.0))
    large = put("large_target", LARGE, 2, scale=dict.fromkeys(range(SMALL, LARGE), 0.0))
    put("small_draft", SMALL, 3, tokenizer=None, copy=large)
    favouring = put("favouring_target", LARGE, 4, scale={FAVOURED: 3.0})
    put("favouring_draft", SMALL, 5, copy=favouring)
    put("small_other", SMALL, 6, copy=favouring, noise=NOISE)
    extra = dict.fromkeys(range(SMALL, LARGE), 2.0)
    put("large_other", LARGE, 7, copy=small, noise=NOISE, scale=extra)
    return out


def prompts_of(lengths, seed, vocab):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


class ForcedChooser(DraftLengthChooser):
    """Adaptive speculation with a fixed pattern of draft lengths (plain steps in between)."""

    def __init__(self, k: int, pattern: list[int]):
        super().__init__(k, AUTO, StepCosts({(DraftShape(k, k), 1): 1.0}))
        self.pattern, self.steps = pattern, 0

    def _choose(self, request_indices, bs, proposes=True):
        self.steps += 1
        return self.pattern[(self.steps - 1) % len(self.pattern)]


def spec_engine(target: Path, draft: Path, mode: str, **options) -> Engine:
    options = {**ENGINE, **MODES[mode], **options}
    eng = Engine(str(target), algo="draft-model", draft=str(draft), num_draft_tokens=K, **options)
    if mode == "catch-up":
        eng.chooser = ForcedChooser(K, [0, 0, 0, K, K])
    return eng


def check_mode_ran(eng: Engine, mode: str) -> None:
    """The mode's paths drafted: padded decode / extend pieces, or catch-ups."""
    if mode == "graphs":
        assert eng.piecewise.drafter.stats.padded_eager > 0
        assert eng.piecewise.per_sequence is not None
    if mode == "catch-up":
        assert eng.chooser.summary().get(0)  # plain steps ran (their entries caught up later)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("direction", ["draft-smaller", "draft-larger"])
def test_greedy_equals_plain_and_the_copy_drafts_the_target(ckpts, direction, mode):
    """A draft that is the target's copy at another vocabulary size drafts the target's argmax:
    its acceptance is the target's drafting for itself, every draft that the length limit does
    not cut (at LARGE, its extra rows would win an argmax over all its ids: they are dropped),
    and the output is plain greedy's."""
    if direction == "draft-smaller":  # the target's rows >= SMALL never win
        target, draft = ckpts["large_target"], ckpts["small_draft"]
    else:
        target, draft = ckpts["small_target"], ckpts["large_draft"]
    prompts = prompts_of((3, 17, 1, 30), seed=1, vocab=SMALL)
    expected = [o.token_ids for o in Engine(str(target), **ENGINE).generate(prompts, GREEDY)]
    eng = spec_engine(target, draft, mode)
    assert eng.drafter.vocab != eng.model_config.vocab_size
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    oracle = spec_engine(target, target, mode).generate(prompts, GREEDY)
    for out, ref in zip(outs, oracle, strict=True):
        assert out.stats["num_verify_steps"] > 0
        assert out.stats["per_position_acceptance"] == ref.stats["per_position_acceptance"]
        assert out.stats["accept_len"] == ref.stats["accept_len"] > 2.5
    check_mode_ran(eng, mode)
    assert len(eng.kv.free_pages) == eng.kv.num_pages - 1


@pytest.mark.parametrize("mode", sorted(MODES))
def test_target_emitting_ids_the_draft_lacks(ckpts, mode):
    """The target (LARGE) often emits FAVOURED and other ids >= SMALL, and the prompts hold
    such ids: the SMALL draft LM (the target's copy) gets them mapped into its range in every
    path (prefill, chain, N-token piece, per-sequence drafting, catch-up) and greedy output is
    plain greedy's."""
    target = ckpts["favouring_target"]
    prompts = prompts_of((3, 17, 1, 30), seed=2, vocab=LARGE)
    prompts[2] = [FAVOURED]
    expected = [o.token_ids for o in Engine(str(target), **ENGINE).generate(prompts, GREEDY)]
    assert sum(t >= SMALL for p in prompts for t in p) >= 3
    assert sum(o.count(FAVOURED) for o in expected) >= 8  # the draft LM is fed them
    eng = spec_engine(target, ckpts["favouring_draft"], mode)
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.stats["num_verify_steps"] > 0 for o in outs)
    check_mode_ran(eng, mode)


SAMPLED = dict(temperature=0.9, top_k=40)


def sampled_engine(ckpts, target: str, draft: str, max_num_seqs: int) -> Engine:
    return Engine(
        str(ckpts[target]), device="cpu", max_num_seqs=max_num_seqs, max_model_len=32,
        page_size=8, algo="draft-model", draft=str(ckpts[draft]), num_draft_tokens=K,
    )  # fmt: skip


@pytest.mark.parametrize(
    "target, draft", [("favouring_target", "small_other"), ("small_target", "large_other")]
)
def test_sampled_drafts_follow_the_q_verify_reads(ckpts, target, draft):
    """A prefill of 1024 seeded rows of one prompt: q is over the target's vocabulary,
    normalised, zero on the ids the draft lacks (SMALL draft), renormalised over the target's
    ids (LARGE draft, whose extra ids hold much of its mass), and the drafts follow the q
    recorded for them."""
    n = 1024
    eng = sampled_engine(ckpts, target, draft, n)
    vocab, lacking = eng.model_config.vocab_size, eng.drafter.vocab
    prompt = prompts_of((6,), seed=9, vocab=SMALL)[0]
    seeds = torch.arange(n, dtype=torch.int64) * 7 + 1
    _, drafts, q = seeded_prefill(eng, prompt, n, SAMPLED["temperature"], SAMPLED["top_k"], seeds)
    assert q.shape == (n, K, vocab)
    torch.testing.assert_close(q.sum(-1), torch.ones(n, K))
    assert q[..., lacking:].sum() == 0 and int(drafts.max()) < min(vocab, lacking)
    assert ((q > 0).sum(-1) == SAMPLED["top_k"]).all()  # top-k applied to q
    # every draft is drawn from its own row's q: the counts follow the sum of the q's
    expected = q.reshape(-1, vocab).double().sum(0)
    counts = torch.bincount(drafts.reshape(-1), minlength=vocab).double()
    assert counts[expected == 0].sum() == 0, "a draft outside the support of its q"
    assert_follows(counts, expected)


@pytest.mark.parametrize(
    "target, draft", [("favouring_target", "small_other"), ("small_target", "large_other")]
)
def test_sampled_output_follows_the_target_distribution(ckpts, target, draft):
    """Seeded sampled generation (temperature 0.9, top-k 40) of one prompt over 300 seeds: every
    token verify emitted (positions 1..5) against the target's filtered p given its prefix;
    nothing outside the support, and a chi-square over the summed per-token distributions."""
    import transformers

    n, new = 300, 6
    eng = sampled_engine(ckpts, target, draft, 64)
    prompt = prompts_of((6,), seed=5, vocab=SMALL)[0]
    params = [
        SamplingParams(max_new_tokens=new, seed=1000 + s, ignore_eos=True, **SAMPLED)
        for s in range(n)
    ]
    outs = eng.generate([prompt] * n, params, use_tqdm=False)
    assert sum(o.stats["num_verify_steps"] for o in outs) >= n
    seqs = torch.tensor([prompt + o.token_ids for o in outs])
    hf = transformers.LlamaForCausalLM.from_pretrained(ckpts[target]).eval()
    with torch.no_grad():
        logits = hf(seqs).logits[:, len(prompt) : len(prompt) + new - 1].float()
    bs = logits.shape[0] * logits.shape[1]
    p = filtered_probs(
        logits.reshape(bs, -1),
        torch.full((bs,), SAMPLED["temperature"]),
        torch.full((bs,), SAMPLED["top_k"]),
        torch.ones(bs),
    ).double()
    emitted = seqs[:, len(prompt) + 1 :].reshape(-1)
    expected = p.sum(0)
    counts = torch.bincount(emitted, minlength=expected.numel()).double()
    assert counts[expected == 0].sum() == 0, "a token outside the target's top-k was emitted"
    assert_follows(counts, expected)


# ------------------------------------------------------------------------------ the tokenizer


def other_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of `src`'s tokenizer.json with two tokens' ids swapped (another tokenizer)."""
    data = json.loads((src / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = "the", "Ġthe"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.json").write_text(json.dumps(data))
    return dst


def copy_ckpt(src: Path, dst: Path, tokenizer: Path | None) -> Path:
    """`src`'s config and weights, with `tokenizer`'s tokenizer.json (or none)."""
    dst.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    if tokenizer is not None:
        shutil.copy(tokenizer / "tokenizer.json", dst / "tokenizer.json")
    return dst


def test_another_tokenizer_of_another_size_is_refused(ckpts, tmp_path):
    other = other_tokenizer(ckpts["small_target"], tmp_path / "tok")
    draft = copy_ckpt(ckpts["large_draft"], tmp_path / "draft", other)
    target = ckpts["small_target"]
    with pytest.raises(SpeculantError) as err:
        spec_engine(target, draft, "eager")
    message = str(err.value)
    assert "\n" not in message
    parts = (str(draft), str(target), f"vocab_size {LARGE}", f"vocab_size {SMALL}")
    for part in (*parts, "different tokenizers (token id", "must share the target's tokenizer"):
        assert part in message


def test_evidence_of_one_tokenizer(ckpts, tmp_path, tiny_tokenizer_dir):
    """Other sizes need the tokenizer files: both (compared over the common ids), or one whose
    tokens fit both sizes (padding); none, or one whose tokens do not fit, is refused; the same
    size is not checked."""
    target, draft = ckpts["large_target"], ckpts["small_draft"]  # only the target's tokenizer
    check_draft_tokenizer(str(target), str(draft), LARGE, SMALL)
    check_draft_tokenizer(str(draft), str(target), SMALL, LARGE)
    check_draft_tokenizer(str(draft), str(draft), SMALL, SMALL)  # neither: same size
    with pytest.raises(SpeculantError, match="do not fit vocab_size 500, so the difference"):
        check_draft_tokenizer(str(target), str(draft), LARGE, 500)
    bare = copy_ckpt(ckpts["large_target"], tmp_path / "bare", None)
    with pytest.raises(SpeculantError, match="have no tokenizer files to show they share one"):
        spec_engine(bare, draft, "eager")
    other = other_tokenizer(tiny_tokenizer_dir, tmp_path / "other")
    check_draft_tokenizer(str(other), str(target), LARGE, LARGE)  # same size: unchanged


def _proto_field(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload


def test_token_maps_of_the_tokenizer_formats(tmp_path, tiny_tokenizer_dir):
    """vocab.json (+ added tokens), vocab.txt, a SentencePiece tokenizer.model and tiktoken's
    lines give the same id -> token map as the tokenizer.json they were made from."""
    ref = token_map(tiny_tokenizer_dir)
    assert len(ref) == 512 and ref[0] == "<|endoftext|>"
    data = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())
    forms = {
        "vocab.json": json.dumps({t: i for i, t in ref.items() if i}),
        "vocab.txt": "\n".join(ref[i] for i in range(512)),
        "tokenizer.model": b"".join(
            _proto_field(1, _proto_field(1, ref[i].encode()) + b"\x15" + struct.pack("<f", -i))
            for i in range(512)
        ),
    }
    for name, content in forms.items():
        folder = tmp_path / name
        folder.mkdir()
        write = (folder / name).write_bytes if isinstance(content, bytes) else None
        (write or (folder / name).write_text)(content)
        if name == "vocab.json":
            (folder / "tokenizer_config.json").write_text(
                json.dumps({"added_tokens_decoder": {"0": data["added_tokens"][0]}})
            )
        assert token_map(folder) == ref, name
    tiktoken = tmp_path / "tiktoken"
    tiktoken.mkdir()
    (tiktoken / "tokenizer.model").write_text("IQ== 0\nImE= 1\n")
    assert token_map(tiktoken) == {0: "!", 1: '"a'}
    only_config = tmp_path / "config_only"
    only_config.mkdir()
    (only_config / "tokenizer_config.json").write_text("{}")
    assert token_map(only_config) is None
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("[")
    with pytest.raises(SpeculantError, match="cannot read the tokenizer in"):
        token_map(broken)


# ------------------------------------------------------------------------------ CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize(
    "target, draft",
    [("large_target", "small_draft"), ("small_target", "large_draft"),
     ("favouring_target", "favouring_draft"), ("small_target", "large_other")],
)  # fmt: skip
def test_cuda_graph_replay_equals_eager(ckpts, target, draft):
    """On CUDA (float32): mixed greedy and sampled requests through the captured decode steps
    (both sampler variants), the draft model's extend graphs and per-sequence drafting graphs
    run without a device assert on the ids the draft LM lacks, give the eager decode steps'
    tokens, and greedy rows give plain greedy's."""
    options = dict(device="cuda", dtype="float32", max_num_seqs=16, max_model_len=128)
    spec = dict(algo="draft-model", draft=str(ckpts[draft]), num_draft_tokens=K)
    eng = Engine(str(ckpts[target]), **spec, **options)
    plain = Engine(str(ckpts[target]), **options)
    prompts = prompts_of((1, 9, 33, 4, 17, 2, 25, 40, 6, 12, 3, 28), seed=7, vocab=LARGE)
    prompts = [[min(t, plain.model_config.vocab_size - 1) for t in p] for p in prompts]
    params = [
        SamplingParams(max_new_tokens=17, ignore_eos=True, temperature=0.9 * (i % 2), seed=i)
        for i in range(len(prompts))
    ]
    graphs, pieces = eng.graphs, eng.piecewise
    replayed = eng.generate(prompts, params)
    assert graphs.num_replays > 0 and pieces.drafter.stats.replays > 0
    graphs.use_graphs = graphs.pad = False  # the decode steps eagerly (as test_gpu.py)
    eager = eng.generate(prompts, params)
    graphs.use_graphs = graphs.pad = True
    assert [o.token_ids for o in replayed] == [o.token_ids for o in eager]
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    greedy_prompts, greedy_params = [prompts[i] for i in greedy], [params[i] for i in greedy]
    expected = [o.token_ids for o in plain.generate(greedy_prompts, greedy_params)]
    assert [replayed[i].token_ids for i in greedy] == expected
    # greedy-only extend steps draft through the per-sequence graphs
    alone = eng.generate(greedy_prompts, greedy_params)
    assert [o.token_ids for o in alone] == expected and pieces.per_sequence.stats.replays > 0
