"""The host's keeping and writing of log-probabilities (executor/logprobs.py `KeptLogprobs`,
`RequestOutput.json_line`) give what the path before them gave, exactly: per output token its
step's columns decoded into {the token: its value, then the `keep` most likely: theirs}, a
repeated id kept once with its first value, alternatives of -inf (the kernel's id -1) left out
(`reference_entries`, the earlier decode less those), and
--output lines equal to json.dumps of the earlier `to_json` of those entries (`reference_line`).

Checked on fuzzed rows through `Request.append` (widths 1..5 with the row's other columns
after them, values with ties, -inf, NaN, +-0.0 and subnormals, ids at the vocab's end, the
chosen token among the top or not, a kernel's repeated -1 ids; stop tokens, stop strings and
the length limit dropping positions; n and keep from 0 up), on RequestOutputs (n > 1, stop
reasons, stats, texts to escape), and on the engine's and the CLI's outputs, every step's rows
spied (EAGLE-3 with forced adaptive widths, n > 1, stop strings)."""

from __future__ import annotations

import json
import random
import struct

import pytest

import speculant
from speculant import Engine, SamplingParams
from speculant.executor.logprobs import KeptLogprobs, TokenLogprobs, logprob_columns
from speculant.executor.request import Request, RequestOutput
from speculant.executor.stop_strings import StopStrings
from speculant.launch import cli

TARGET = speculant.bundled("target")
EAGLE3 = {"algo": "eagle3", "draft": speculant.bundled("eagle3")}
VOCAB = 128_256
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "for i in range(10):", "x = ["]


def f32(bits: int) -> float:
    """A float32's bits (an int32, as `pack_logprobs` reads them back) as a Python float."""
    return struct.unpack("=f", struct.pack("=i", bits))[0]


def reference_entries(kept: list[tuple[list[int], int, int, int]], tokens, keep) -> list[dict]:
    """The earlier decode (`decode_entries`): per token (its step's columns, their width, n,
    its position there), {token: value, then the min(keep, n) most likely, setdefault}."""
    out = []
    for (columns, width, n, position), token in zip(kept, tokens, strict=True):
        base, ids = position * (1 + n), width * (1 + n) + position * n
        entry = {token: f32(columns[base])}
        for j, top in enumerate(columns[ids : ids + min(keep, n)]):
            value = f32(columns[base + 1 + j])
            if top >= 0 and value != float("-inf"):  # (the kernel's -1 / -inf: no entry)
                entry.setdefault(top, value)
        out.append(entry)
    return out


def reference_line(out: RequestOutput) -> str:
    """The earlier --output line: json.dumps of the earlier `RequestOutput.to_json`."""
    line = {
        "index": out.index,
        **({"sample_index": out.sample_index} if out.n > 1 else {}),
        "token_ids": out.token_ids,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
    }
    if out.logprobs is not None:
        line["logprobs"] = [[[t, lp] for t, lp in step.items()] for step in out.logprobs]
        line["cumulative_logprob"] = out.cumulative_logprob
    return json.dumps({**line, **out.stats}) + "\n"


def exact(entries: list[dict] | None) -> list | None:
    """Entries compared bit for bit (NaN equal to NaN, -0.0 not to 0.0), in order."""
    if entries is None:
        return None
    return [[(t, struct.pack("=d", v)) for t, v in entry.items()] for entry in entries]


# ------------------------------------------------------------------ fuzzed rows


def random_value(rng: random.Random, previous: float) -> float:
    kind = rng.random()
    if kind < 0.06:
        return float("-inf")
    if kind < 0.08:
        return float("nan")
    if kind < 0.12:
        return rng.choice([0.0, -0.0, -1.1920928955078125e-07, -1e-45, -3.4e38])
    if kind < 0.25:
        return previous  # a tie
    return -abs(rng.gauss(0, 6)) * rng.choice([1, 1, 1e-3, 1e3])


def random_row(rng: random.Random, width: int, n: int, tokens: list[int], extra: int) -> list:
    """A read-back row: `pack_logprobs` columns of `width` positions (float32 bits, then ids),
    then `extra` other columns (tokens, drafts, accept_len)."""
    floats, ids = [], []
    for position in range(width):
        value = random_value(rng, -1.0)
        floats.append(struct.unpack("=i", struct.pack("=f", value))[0])
        tops = []
        for _ in range(n):
            value = random_value(rng, value)
            floats.append(struct.unpack("=i", struct.pack("=f", value))[0])
            kind = rng.random()
            if kind < 0.2 and position < len(tokens):
                tops.append(tokens[position])  # the chosen token among the top
            elif kind < 0.3:
                tops.append(-1)  # the kernel's id for a row of fewer finite logits
            elif kind < 0.4 and tops:
                tops.append(rng.choice(tops))
            else:
                tops.append(rng.choice([VOCAB - 1, VOCAB - 2, rng.randrange(VOCAB)]))
        ids += tops
    return floats + ids + [rng.randrange(VOCAB) for _ in range(extra)]


def test_kept_rows_decode_as_before(tiny_tokenizer_dir):
    """Requests fed fuzzed step rows through `Request.append` keep, per kept token, what the
    earlier decode read from its step's row; their lines are the earlier lines."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    words = [tokenizer.encode(w).ids for w in (" the", " and", "x", "\n", " of")]
    rng = random.Random(0)
    for case in range(300):
        n = rng.choice([0, 1, 2, 5, 20])
        keep = rng.randint(0, n + 2)
        stops = rng.choice([(), (), ("and",), ("x\n", "of")])
        request = Request(
            index=case,
            prompt_ids=[1],
            params=SamplingParams(logprobs=keep, stop=stops),
            seed=0,
            max_new_tokens=rng.randint(1, 40),
            stop_ids=frozenset(rng.sample(range(VOCAB), 3) if rng.random() < 0.5 else ()),
            stop_text=StopStrings(tokenizer, list(stops)) if stops else None,
            logprobs=KeptLogprobs(n),
        )
        kept = []
        while request.finish_reason is None:
            width = rng.randint(1, 5)
            tokens = [
                rng.choice([*request.stop_ids, *rng.choice(words)])
                if rng.random() < 0.1
                else rng.randrange(VOCAB)
                for _ in range(rng.randint(1, width))
            ]
            row = random_row(rng, width, n, tokens, extra=width + 2)
            before = len(request.output_ids)
            request.append(tokens, TokenLogprobs(row, width, n))
            assert logprob_columns(width, n) + width + 2 == len(row)
            kept += [(row, width, n, p) for p in range(len(request.output_ids) - before)]
        ids = request.output_ids
        entries = request.logprobs.entries(ids, keep)
        expected = reference_entries(kept, ids, keep)
        assert exact(entries) == exact(expected)
        out = RequestOutput(
            case, [1], ids, "t", request.finish_reason, {"num_output_tokens": len(ids)},
            request.stop_reason, entries, sum(e[t] for e, t in zip(entries, ids, strict=True)),
        )  # fmt: skip
        assert out.json_line() == reference_line(out)


@pytest.mark.parametrize("sample", [0, 1])
def test_output_lines_as_before(sample):
    """`json_line` writes every output's line as the earlier path did: any field values,
    ties, -inf, NaN, +-0.0, empty outputs, no stats, a stat named like a field."""
    rng = random.Random(sample)
    for _ in range(400):
        entries = None
        if rng.random() < 0.85:
            entries = []
            for _ in range(rng.choice([0, 1, 3, 40])):
                value = -1.0
                entry = {}
                for _ in range(rng.randint(1, 7)):
                    value = random_value(rng, value)
                    entry.setdefault(rng.choice([-1, 0, VOCAB - 1, rng.randrange(VOCAB)]), value)
                entries.append(entry)
        n = rng.choice([1, 1, 2, 4])
        stats = rng.choice([
            {},
            {"num_prompt_tokens": 3, "accept_len": None, "per_position_acceptance": [0.5, 1.0]},
            {"decode_time_s": 1e-7, "num_cached_tokens": 0, "x": float("inf")},
            {"text": "a stat named like a field"},
            {"cumulative_logprob": 1.0, "num_preemptions": 2},
        ])  # fmt: skip
        out = RequestOutput(
            index=rng.randrange(10_000),
            prompt_token_ids=[1, 2],
            token_ids=[rng.randrange(VOCAB) for _ in entries or ()],
            text=rng.choice([None, "", 'quote " and \\ and \n', "東京 🙂 \ud800", "}, {"]),
            finish_reason=rng.choice(["stop", "length"]),
            stats=stats,
            stop_reason=rng.choice([None, 7, "stop", '"logprobs": null']),
            logprobs=entries,
            cumulative_logprob=None if entries is None else rng.choice([-3.5, float("-inf")]),
            sample_index=rng.randrange(n),
            n=n,
        )
        assert out.json_line() == reference_line(out)


# ------------------------------------------------------------------ the engine and the CLI


@pytest.fixture
def spied(monkeypatch):
    """Every step row a request kept a token of (`Request.append`), and every output made
    (`Engine._output`) with its request."""
    rows: dict[Request, list] = {}
    outputs: list[tuple[Request, RequestOutput]] = []
    append, output = Request.append, Engine._output

    def spy_append(self, tokens, logprobs=None):
        before = len(self.output_ids)
        append(self, tokens, logprobs)
        if logprobs is not None:
            step = (list(logprobs.columns), logprobs.width, logprobs.n)
            rows.setdefault(self, []).extend(
                (*step, p) for p in range(len(self.output_ids) - before)
            )

    def spy_output(self, request):
        out = output(self, request)
        outputs.append((request, out))
        return out

    monkeypatch.setattr(Request, "append", spy_append)
    monkeypatch.setattr(Engine, "_output", spy_output)
    return rows, outputs


def check_outputs(rows, outputs) -> dict[tuple[int, int], str]:
    """Each output's entries and line against the earlier path's; the lines by key."""
    lines = {}
    for request, out in outputs:
        keep = request.params.logprobs
        if keep is None:
            assert out.logprobs is None and request not in rows
        else:
            expected = reference_entries(rows.get(request, []), out.token_ids, keep)
            assert exact(out.logprobs) == exact(expected)
            cumulative = sum(e[t] for e, t in zip(expected, out.token_ids, strict=True))
            assert struct.pack("=d", out.cumulative_logprob) == struct.pack("=d", cumulative)
        lines[out.key] = reference_line(out)
        assert out.json_line() == lines[out.key]
    return lines


def test_engine_outputs_as_before(spied):
    """Plain decoding and EAGLE-3 with forced adaptive widths (verify rows of 1 to k + 1 in
    decode and extend steps), sampled n > 1, stop strings and tokens, logprobs 0..N."""
    from test_adaptive import REST, ForcedChooser

    rows, outputs = spied
    params = [
        SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=3),
        SamplingParams(max_new_tokens=24, logprobs=1, n=3, temperature=0.9, seed=1),
        SamplingParams(max_new_tokens=24, logprobs=0, stop=["(", "\n"], temperature=0.7),
        SamplingParams(max_new_tokens=24, logprobs=None, n=2, temperature=0.7),
    ]
    plain = Engine(TARGET, device="cpu", num_draft_tokens=0, max_logprobs=3)
    plain.generate(PROMPTS, params)
    forced = Engine(TARGET, device="cpu", max_logprobs=3, speculation="auto", catch_up_depth=2,
                    max_num_batched_tokens=20, **EAGLE3)  # fmt: skip
    k = forced.chooser.k
    forced.chooser = ForcedChooser(k, [k, 0, k, 1, REST, 0, k, 2, k])
    forced.generate(PROMPTS, params)
    assert len(outputs) == 2 * (1 + 3 + 1 + 2)
    assert any(out.finish_reason == "stop" and out.stop_reason for _, out in outputs)
    widths = {width for kept in rows.values() for _, width, _, _ in kept}
    assert widths == {1, k + 1}  # narrower verify rows are laid out k + 1 wide (`widen`)
    check_outputs(rows, outputs)


def test_cli_lines_as_before(spied, tmp_path):
    """The --output file holds the earlier path's lines (EAGLE-3, --n 2, stop strings,
    per-line logprobs)."""
    rows, outputs = spied
    prompts = tmp_path / "p.jsonl"
    lines = [{"prompt": p, "logprobs": w} for p, w in zip(PROMPTS, [2, 0, None, 1], strict=True)]
    lines[3]["stop"] = ["("]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out_path = tmp_path / "out.jsonl"
    args = ["generate", "--device", "cpu", "--max-new-tokens", "20", "--prompts", str(prompts),
            "--logprobs", "2", "--n", "2", "--temperature", "0.8", "--seed", "3",
            "--output", str(out_path)]  # fmt: skip
    assert cli.main(args) == 0
    expected = check_outputs(rows, outputs)
    written = out_path.read_text().splitlines(keepends=True)
    assert sorted(written) == sorted(expected.values()) and len(written) == 2 * len(PROMPTS)
