"""Log-probabilities of the output tokens (`SamplingParams.logprobs`, `Engine(max_logprobs=N)`,
`--logprobs` / `--max-logprobs`, a --prompts line's "logprobs"; vLLM's layout and its default
`raw_logprobs`: log_softmax of the target's logits, before temperature, top-k and top-p).

Checked against transformers' forward over prompt + output (the bundled model, float32): every
kept token's value and its position's most likely alternatives, for plain decoding and every
drafter (the values a speculative step reads come from its verify forward, so they must not
depend on what was drafted), greedy and sampled rows in one batch, chunked prefill, preemption,
forced adaptive shapes (verify rows narrower than k + 1 inside extend steps), stop strings and
tokens (values only for the tokens kept), the CLI (flags, lines, `--dp 2`) and the refusals."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from helpers_io import dp2_run, refused_in_one_line

import speculant
from speculant import Engine, SamplingParams, SpeculantError
from speculant.executor.logprobs import KeptLogprobs, pack_logprobs, unpack_logprobs, widen
from speculant.launch import cli

TARGET = speculant.bundled("target")
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Parser:\n    def __init__(self, text):\n",
    "for i in range(10):",
    "# read the file\nwith open(path) as f:",
    "x = [",
]
MAX_NEW = 24
N = 3  # the engine's max_logprobs
ATOL = 2e-4


@pytest.fixture(scope="module")
def reference():
    """log_softmax of transformers' logits over prompt + output, per (prompt ids, output ids)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    cache: dict[tuple, torch.Tensor] = {}

    def logprobs_of(prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        key = (tuple(prompt_ids), tuple(output_ids))
        if key not in cache:
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
            start = len(prompt_ids) - 1  # the position that predicts the first output token
            cache[key] = logits[start : start + len(output_ids)].log_softmax(-1)
        return cache[key]

    return logprobs_of


def mixed_params() -> list[SamplingParams]:
    """Greedy and seeded sampled rows, with and without logprobs, several widths."""
    widths = [N, 0, None, 2, N, 1]
    return [
        SamplingParams(
            max_new_tokens=MAX_NEW,
            ignore_eos=True,
            logprobs=w,
            temperature=0.0 if i % 2 == 0 else 0.8,
            top_k=0 if i % 3 else 20,
            seed=i,
        )  # fmt: skip
        for i, w in enumerate(widths)
    ]


def check_against_reference(outputs, params, reference) -> None:
    for out, sp in zip(outputs, params, strict=True):
        if sp.logprobs is None:
            assert out.logprobs is None and out.cumulative_logprob is None
            assert "logprobs" not in out.to_json()
            continue
        assert len(out.logprobs) == len(out.token_ids) > 0
        ref = reference(out.prompt_token_ids, out.token_ids)
        for position, (step, token) in enumerate(zip(out.logprobs, out.token_ids, strict=True)):
            assert next(iter(step)) == token  # the chosen token first
            assert step[token] == pytest.approx(ref[position, token].item(), abs=ATOL)
            # then the `logprobs` most likely, most likely first (the chosen one not repeated)
            alternatives = list(step.values())[1:]
            assert len(step) in (sp.logprobs, sp.logprobs + 1)
            assert alternatives == sorted(alternatives, reverse=True)
            for t, value in step.items():
                assert value == pytest.approx(ref[position, t].item(), abs=ATOL)
            top = ref[position].topk(sp.logprobs).values.tolist()
            kept = sorted(step.values(), reverse=True)[: sp.logprobs]
            assert kept == pytest.approx(top, abs=ATOL)
        assert out.cumulative_logprob == pytest.approx(
            sum(s[t] for s, t in zip(out.logprobs, out.token_ids, strict=True)), abs=1e-6
        )
        line = out.to_json()
        assert line["logprobs"] == [[[t, v] for t, v in s.items()] for s in out.logprobs]
        assert json.loads(json.dumps(line))["logprobs"][0][0][0] == out.token_ids[0]


@pytest.fixture(scope="module")
def plain_outputs():
    engine = Engine(TARGET, device="cpu", num_draft_tokens=0, max_logprobs=N)
    return engine.generate(PROMPTS, mixed_params())


def test_plain_logprobs_equal_transformers(plain_outputs, reference):
    check_against_reference(plain_outputs, mixed_params(), reference)


DRAFTERS = {
    "eagle3": {"algo": "eagle3", "draft": speculant.bundled("eagle3")},
    "dflash": {"algo": "dflash", "draft": speculant.bundled("dflash")},
    "draft-model": {"algo": "draft-model", "draft": speculant.bundled("draft_lm")},
}


@pytest.mark.parametrize(
    "drafter, options",
    [
        ("eagle3", {}),
        ("eagle3", {"overlap": False, "max_num_batched_tokens": 16, "max_num_seqs": 3}),
        ("dflash", {"sampled_verify": "match"}),
        ("draft-model", {"pool": 1.5, "max_num_seqs": 4, "page_size": 4}),
        ("eagle3", {"forced": True, "max_num_batched_tokens": 20}),
    ],
)
def test_speculative_logprobs_equal_transformers(plain_outputs, reference, drafter, options):
    """Every drafter, chunked prefill, a pool that preempts, adaptive shapes forced step by
    step: the values are the target's, and greedy rows keep plain decoding's tokens."""
    options = dict(options)
    forced = options.pop("forced", False)
    if "pool" in options:  # pages for about 1.5 of the longest requests: preempts
        longest = max(len(o.prompt_token_ids) for o in plain_outputs) + MAX_NEW + 8
        options["num_pages"] = 1 + math.ceil(options.pop("pool") * longest / 4)
    if forced:
        from test_adaptive import REST, ForcedChooser

        engine = Engine(TARGET, device="cpu", max_logprobs=N, speculation="auto",
                        catch_up_depth=2, **DRAFTERS[drafter], **options)  # fmt: skip
        k = engine.chooser.k
        engine.chooser = ForcedChooser(k, [k, 0, k, k, REST, 0, k, k, k])
    else:
        engine = Engine(TARGET, device="cpu", max_logprobs=N, **DRAFTERS[drafter], **options)
    params = mixed_params()
    seen, extend = set(), engine._extend

    def spied(plan):  # which kinds of extend steps ran
        seen.update(["mixed"] * bool(plan.decode and plan.chunks))
        seen.update(["split"] * any(not c.last for c in plan.chunks))
        seen.update(["narrow"] * bool(plan.decode and plan.shape.verify < engine.chooser.k))
        return extend(plan)

    engine._extend = spied
    outputs = engine.generate(PROMPTS, params)
    check_against_reference(outputs, params, reference)
    for out, base, sp in zip(outputs, plain_outputs, params, strict=True):
        if sp.temperature == 0:
            assert out.token_ids == base.token_ids
    if "num_pages" in options:
        assert engine.stats()["preemptions"] > 0
    if "max_num_batched_tokens" in options:  # prompts split over steps, mixed with decode rows
        assert {"mixed", "split"} <= seen
    if forced:  # verify rows of fewer than k + 1 tokens in extend steps
        assert "narrow" in seen


def test_logprobs_stop_where_the_tokens_stop(plain_outputs):
    """A stop string or stop token ends the values with the tokens kept; later ones (drafts
    accepted after it) are dropped with their tokens."""
    engine = Engine(TARGET, device="cpu", max_logprobs=N, **DRAFTERS["eagle3"])
    base = plain_outputs[0]
    stop_token = base.token_ids[7]
    params = [
        SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=1,
                       stop_token_ids=[stop_token]),
        SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=1,
                       stop=[base.text[12:15]]),
        SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=1),
    ]  # fmt: skip
    outputs = engine.generate([PROMPTS[0]] * 3, params)
    assert [o.finish_reason for o in outputs] == ["stop", "stop", "length"]
    for out in outputs:
        assert 0 < len(out.token_ids) < MAX_NEW
        assert len(out.logprobs) == len(out.token_ids)
        for mine, theirs, token in zip(out.logprobs, base.logprobs, out.token_ids, strict=False):
            assert mine[token] == pytest.approx(theirs[token], abs=ATOL)


@pytest.mark.needs("triton")
def test_rows_of_few_finite_logits_give_the_same_entries_on_either_ops():
    """A position with fewer finite logits than alternatives asked: the torch reference's top-k
    names real ids at -inf, the Triton kernel id -1; the output entries are the same (the
    finite ones only), and a position of finite logits keeps all it asked."""
    from speculant.executor.logprobs import TORCH_OPS
    from speculant.kernels import runtime

    if not runtime.INTERPRET:
        pytest.skip("the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")
    from speculant.kernels.ops import TritonOps

    logits = torch.full((1, 2, 300), float("-inf"))
    logits[0, 0, [5, 17]] = torch.tensor([1.0, 2.0])
    logits[0, 1] = torch.randn(300, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[17, 3]])
    entries = {}
    for name, ops in (("torch", TORCH_OPS), ("triton", TritonOps())):
        kept = KeptLogprobs(5)
        kept.add(unpack_logprobs(pack_logprobs(logits, tokens, 5, ops)[0].tolist(), 2, 5), 2)
        entries[name] = kept.entries([17, 3], 5)
    assert entries["torch"] == entries["triton"], entries
    assert list(entries["torch"][0]) == [17, 5] and len(entries["torch"][1]) >= 5


def test_widened_rows_read_back_alike():
    """An extend step's verify rows narrower than k + 1 (adaptive shapes) are laid out as full
    ones: reading the widened columns gives the narrow row's values, which are torch's."""
    torch.manual_seed(0)
    logits, tokens = torch.randn(3, 2, 50), torch.randint(0, 50, (3, 2))
    narrow = pack_logprobs(logits, tokens, 4)
    wide = widen(narrow, 2, 5, 4)
    for row, (narrow_row, wide_row) in enumerate(zip(narrow.tolist(), wide.tolist(), strict=True)):
        a, b = KeptLogprobs(4), KeptLogprobs(4)
        a.add(unpack_logprobs(narrow_row, 2, 4), 2)
        b.add(unpack_logprobs(wide_row, 5, 4), 2)
        entries = a.entries(tokens[row].tolist(), 4)
        assert entries == b.entries(tokens[row].tolist(), 4)
        for position, entry in enumerate(entries):
            token = tokens[row, position].item()
            ref = logits[row, position].log_softmax(-1)
            assert entry[token] == pytest.approx(ref[token].item(), abs=1e-6)
            top = ref.topk(4)
            assert set(entry) == {token, *top.indices.tolist()}
            assert list(entry.values())[1:] == sorted(list(entry.values())[1:], reverse=True)


def test_logprobs_refusals(qwen2_dir):
    engine = Engine(TARGET, device="cpu", num_draft_tokens=0)
    with pytest.raises(SpeculantError, match=re.escape(
        "prompt 0 asks for logprobs=2, more alternatives than this engine computes "
        "(max_logprobs=None); build it with Engine(max_logprobs=2) (--max-logprobs 2)"
    )):  # fmt: skip
        engine.generate(["x"], SamplingParams(logprobs=2))
    small = Engine(TARGET, device="cpu", num_draft_tokens=0, max_logprobs=1)
    with pytest.raises(SpeculantError, match="prompt 1 asks for logprobs=2, .*max_logprobs=1"):
        small.generate(["x", "y"], [SamplingParams(logprobs=1), SamplingParams(logprobs=2)])
    for value in (-1, 1.5, True, "2", 10**6):
        with pytest.raises(SpeculantError, match=re.escape(f"logprobs={value!r} must be None or")):
            small.generate(["x"], SamplingParams(logprobs=value))
    for value in (-1, 2.0, True, 10**6):
        with pytest.raises(SpeculantError, match=re.escape(f"max_logprobs={value!r} must be")):
            Engine(str(qwen2_dir), device="cpu", max_logprobs=value)
    # a vocabulary smaller than max_logprobs: every token, most likely first
    tiny = Engine(str(qwen2_dir), device="cpu", max_logprobs=1024)
    vocab = tiny.model_config.vocab_size
    out = tiny.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, logprobs=1024))[0]
    assert len(out.logprobs[0]) == vocab
    assert math.fsum(math.exp(v) for v in out.logprobs[0].values()) == pytest.approx(1, abs=1e-4)


# ------------------------------------------------------------------ the CLI


def test_cli_logprobs_flags_lines_and_dp(plain_outputs, tmp_path, capsys):
    params = mixed_params()
    prompts = tmp_path / "p.jsonl"
    lines = []
    for prompt, sp in zip(PROMPTS, params, strict=True):
        line = {"prompt": prompt, "temperature": sp.temperature, "top_k": sp.top_k, "seed": sp.seed}
        if sp.logprobs != 1:  # the flag's 1 for the others (None is written as null)
            line["logprobs"] = sp.logprobs
        lines.append(line)
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    base = ["generate", "--device", "cpu", "--max-new-tokens", str(MAX_NEW), "--ignore-eos",
            "--prompts", str(prompts), "--logprobs", "1"]  # fmt: skip

    def read(path):
        outs = {json.loads(line)["index"]: json.loads(line) for line in open(path)}
        return [outs[i] for i in range(len(PROMPTS))]

    assert cli.main([*base, "--num-draft-tokens", "0", "--output", str(tmp_path / "one")]) == 0
    one = read(tmp_path / "one")
    for line, out in zip(one, plain_outputs, strict=True):
        assert line["token_ids"] == out.token_ids
        if out.logprobs is None:
            assert "logprobs" not in line
            continue
        assert [[t for t, _ in step] for step in line["logprobs"]] == [
            list(step) for step in out.logprobs
        ]
        written = [v for step in line["logprobs"] for _, v in step]
        assert written == pytest.approx([v for s in out.logprobs for v in s.values()], abs=1e-5)
    dp2_run(base, tmp_path / "dp")
    dp = read(tmp_path / "dp")
    for a, b in zip(dp, one, strict=True):
        assert ("logprobs" in a) == (params[a["index"]].logprobs is not None)
        if params[a["index"]].temperature == 0:  # greedy: the same tokens, values within ATOL
            assert a["token_ids"] == b["token_ids"]
            if "logprobs" in a:
                assert [v for s in a["logprobs"] for _, v in s] == pytest.approx(
                    [v for s in b["logprobs"] for _, v in s], abs=ATOL
                )

    bad = tmp_path / "bad.jsonl"
    refused_in_one_line(capsys, tmp_path, [
        (["--logprobs", "-1"], None, "argument --logprobs: '-1' is not an integer >= 0"),
        (["--logprobs", "4000"], None, "'4000' is too large; use an integer in 0..1024"),
        (["--logprobs", "3", "--max-logprobs", "2"], None,
         "--logprobs 3 is more than --max-logprobs 2 allows; raise --max-logprobs to 3"),
        (["--logprobs", "1"], None, "--logprobs: log-probabilities are written in --output "
         "lines, and none is given (printed completions show their text alone); pass --output"),
        ([], {"prompt": "x", "logprobs": 0}, f"{bad}:1: log-probabilities are written in "
         "--output lines"),
        (["--max-logprobs", "1"], {"prompt": "x", "logprobs": 2},
         f"{bad}:1: logprobs=2 is more than --max-logprobs allows"),
        ([], {"prompt": "x", "logprobs": -2}, f"{bad}:1: logprobs=-2 is invalid; use an integer"),
        ([], {"prompt": "x", "logprobs": "3"}, f"{bad}:1: logprobs='3' is invalid"),
    ], "logprobs")  # fmt: skip


def test_torchrun_rank_asks_for_the_limit(tmp_path, monkeypatch, capsys):
    """Under torchrun only rank 0 reads the prompts, so a line asking more than the flags
    allow cannot raise every rank's limit: it is refused, naming the flag; --logprobs itself,
    which every rank sees, sets the limit (an audit: it was refused too)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", "logprobs": 2}) + "\n")
    out = ["--output", str(tmp_path / "out.jsonl")]

    def prepared(*flags):
        args = cli.build_parser().parse_args(
            ["generate", "--device", "cpu", "--prompts", str(prompts), *out, *flags]
        )
        args.argv = ["generate"]
        cli._prepare(args)
        return args

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SpeculantError, match=re.escape(
        f"{prompts}:1: logprobs=2 is more than --max-logprobs allows (it is not given); pass "
        "--max-logprobs 2"
    )):  # fmt: skip
        prepared()
    assert prepared("--logprobs", "2").max_logprobs == 2
    monkeypatch.setenv("RANK", "1")  # reads no prompts: the flag alone decides, as on rank 0
    assert prepared("--logprobs", "2").max_logprobs == 2
    assert prepared().max_logprobs is None
    monkeypatch.delenv("RANK")
    args = prepared()
    assert args.max_logprobs == 2 and args.argv[-2:] == ["--max-logprobs", "2"]


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", [None, "eagle3", "dflash"])
def test_logprobs_on_cuda_graphs_equal_eager(drafter, reference):
    """On CUDA in float32: the values replayed graphs (and steps run ahead) give equal the
    eager steps', token for token, and both are transformers' (on the CPU)."""
    spec = {} if drafter is None else DRAFTERS[drafter]
    options = dict(device="cuda", dtype="float32", max_num_seqs=8, max_logprobs=N, **spec)
    params = mixed_params()
    graphs = Engine(TARGET, **options)
    eager = Engine(TARGET, **options, enforce_eager=True, overlap=False)
    a, b = graphs.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    for x, y, sp in zip(a, b, params, strict=True):
        assert x.token_ids == y.token_ids
        if sp.logprobs is None:
            assert x.logprobs is None
            continue
        for s, t in zip(x.logprobs, y.logprobs, strict=True):
            assert list(s) == list(t)
            assert list(s.values()) == pytest.approx(list(t.values()), abs=1e-4)
    assert graphs.stats()["steps_ahead"] > 0
    check_against_reference(a, params, reference)
