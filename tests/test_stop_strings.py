"""Stop strings (`SamplingParams.stop`, `--stop`, a --prompts line's "stop"; vLLM's semantics):
a request ends at the first token whose output text holds a stop string, its text cut before
the stop string (or after it with include_stop_str_in_output), `stop_reason` naming it.

Checked against a brute-force reference that decodes every prefix of the output whole: the
incremental text (executor/stop_strings.py, detokenize.py) for byte-level BPE (multi-byte
characters split over tokens, invalid bytes) and SentencePiece-style tokenizers (a leading space
stripped, byte fallback; more in tests/test_detokenize.py); the engine's greedy plain run with
stops against its own run without them, cut by that reference; EAGLE-3, DFLASH and draft-model
runs (overlap on and off, a pool small enough to preempt) equal to the plain run with stops,
their acceptance counting only kept tokens; the CLI (flags, per-line stops, `--dp 2`) equal to
the API; bad values refused with one line. The output text continues the prompt: byte-level
BPE's is decode(output) after any prompt; a SentencePiece-style checkpoint's (Llama 2 / Mistral
layouts) keeps its first token's space, its stops, stop tokens and CLI line reading whole."""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
import time

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

import speculant
from speculant import Engine, SamplingParams, SpeculantError
from speculant.errors import PromptError
from speculant.executor.detokenize import (
    INCOMPLETE,
    ByteLevelText,
    continuation,
    incremental_text,
    prompt_tail,
)
from speculant.executor.stop_strings import StopStrings
from speculant.launch import cli
from speculant.launch.accept_rate import bundled_prompts

TEXTS = [
    "the café serves crème brûlée — naïve guests pay 5€",
    "東京 and 北京 are cities; emoji 🙂🚀 end lines",
    "def f(x):\n    return x  # done\n\nclass A:\n    pass",
    "hello world, hello there, well well",
]


def bundled_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(speculant.bundled("target") / "tokenizer.json"))


def llama2_style_tokenizer() -> Tokenizer:
    """SentencePiece as Llama 2's tokenizer.json writes it: '▁' for spaces (prepended), byte
    fallback tokens <0xXX>, a decoder that strips the first space."""
    bytes_vocab = {f"<0x{b:02X}>": b for b in range(256)}
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trained.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    trained.train_from_iterator(TEXTS[::2], trainers.BpeTrainer(vocab_size=200))  # no CJK
    model = json.loads(trained.to_str())["model"]
    vocab = dict(bytes_vocab)
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.normalizer = trained.normalizer
    tok.pre_tokenizer = trained.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    return tok


def metaspace_tokenizer() -> Tokenizer:
    """SentencePiece in the newer layout: a Metaspace pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    return tok


TOKENIZERS = {
    "byte-level": bundled_tokenizer,
    "llama2": llama2_style_tokenizer,
    "metaspace": metaspace_tokenizer,
}


def reference_stop(tokenizer, ids, stops, include=False):
    """(tokens kept, stop, text) at the first prefix of `ids` whose whole decode (less a
    trailing incomplete character) holds a stop string, the earliest one; None if none does."""
    for j in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:j]).rstrip(INCOMPLETE)
        hits = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
        if hits:
            at, _, stop = min(hits)
            return j, stop, text[: at + len(stop) if include else at]
    return None


def watch(tokenizer, ids, stops, include=False):
    """What StopStrings reports, fed `ids` one at a time: (tokens taken, stop, text) or None."""
    watcher = StopStrings(tokenizer, stops, include)
    for j, token in enumerate(ids, start=1):
        if (stop := watcher.add(token)) is not None:
            return j, stop, watcher.text
    return None


def token_sequences(tokenizer, rng, count=40):
    """Encoded texts with random ids inserted, and random ids. Byte-level BPE: any id (bytes that
    form no character included). Byte fallback: no lone <0xXX> ids, whose runs that are not
    UTF-8 the whole decode shows as one U+FFFD a byte, even an ASCII one, and no tokenizer's
    incremental decode (vLLM's neither) can know that before the run ends."""
    encoded = [tokenizer.encode(t).ids for t in TEXTS]
    vocab = tokenizer.get_vocab_size()
    if tokenizer.id_to_token(0) == "<0x00>":
        vocab = range(256, vocab)
    else:
        vocab = range(vocab)
    out = list(encoded)
    for _ in range(count):
        ids = list(rng.choice(encoded))
        for _ in range(rng.randrange(4)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(vocab))
        out.append(ids)
        out.append([rng.choice(vocab) for _ in range(rng.randrange(1, 30))])
    return out


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_incremental_text_equals_the_whole_decode(name):
    tokenizer = TOKENIZERS[name]()
    rng = random.Random(0)
    for ids in token_sequences(tokenizer, rng):
        watcher = StopStrings(tokenizer, [NEVER])
        for j, token in enumerate(ids, start=1):
            assert watcher.add(token) is None
            whole = tokenizer.decode(ids[:j])
            if not whole.endswith(INCOMPLETE):  # else a character waits for its bytes
                assert watcher.text == whole, (ids[:j], whole, watcher.text)
        assert watcher.text == tokenizer.decode(ids).rstrip(INCOMPLETE)


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("include", [False, True])
def test_stop_found_at_the_first_token_whose_text_holds_it(name, include):
    tokenizer = TOKENIZERS[name]()
    rng = random.Random(1)
    checked = 0
    for ids in token_sequences(tokenizer, rng):
        text = tokenizer.decode(ids).rstrip(INCOMPLETE)
        if len(text) < 3:
            continue
        stops = []
        for _ in range(3):  # substrings of the output (multi-byte characters among them)
            a = rng.randrange(len(text) - 1)
            stops.append(text[a : a + rng.randrange(1, 5)])
        stops.append(NEVER)
        expected = reference_stop(tokenizer, ids, stops, include)
        assert expected is not None
        assert watch(tokenizer, ids, stops, include) == expected, (ids, stops)
        checked += 1
    assert checked > 40


def byte_level_ids(tokenizer) -> dict[int, int]:
    """byte -> the id of its one-byte token in a byte-level BPE vocabulary (GPT-2's mapping of
    bytes to printable characters)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return {b: tokenizer.token_to_id(c) for b, c in chars.items()}


def test_a_token_that_completes_a_stop_and_starts_a_split_character_ends_there():
    tokenizer = bundled_tokenizer()
    byte_ids = byte_level_ids(tokenizer)
    # a token of text and then the first byte of "—" (E2 80 94): " \xe2" in this vocabulary
    lead = next(
        i for i in range(tokenizer.get_vocab_size())
        if (token := tokenizer.id_to_token(i)) and len(token) > 1
        and tokenizer.decode([i]).endswith(INCOMPLETE)
        and tokenizer.token_to_id(token[-1]) == byte_ids[0xE2]
    )  # fmt: skip
    head = tokenizer.decode([lead])[:-1]  # its text before the split character
    ids = tokenizer.encode("xa").ids + [lead, byte_ids[0x80], byte_ids[0x94]]
    assert tokenizer.decode(ids) == "xa" + head + "—"
    at = len(ids) - 2  # the lead token: "a" + head is whole there, the dash not yet
    assert watch(tokenizer, ids, ["a" + head]) == (at, "a" + head, "x")
    assert watch(tokenizer, ids, [head + "—"], include=True) == (
        len(ids),
        head + "—",
        "xa" + head + "—",
    )
    assert reference_stop(tokenizer, ids, ["a" + head]) == (at, "a" + head, "x")


def test_each_token_costs_its_own_text_however_long_the_output():
    """The text is kept in pieces and a stop string searched for only in the tail and the new
    text, so a token's cost does not grow with the output: after 32 MB of text (32 added
    tokens of a million characters), 3,000 ordinary tokens take well under what copying the
    text per token took (~10 s here); the text is still the decode, the stop still found."""
    tokenizer = bundled_tokenizer()
    tokenizer.add_tokens(["ab" * 500_000])
    big = tokenizer.token_to_id("ab" * 500_000)
    small = tokenizer.encode(" the cat sat on the mat and").ids
    ids = [big] * 32 + small * (3000 // len(small))
    watcher = StopStrings(tokenizer, [NEVER, "mat and the cat sat on the mat and§"])
    for token in ids[:32]:
        assert watcher.add(token) is None
    started = time.perf_counter()
    assert all(watcher.add(token) is None for token in ids[32:])
    seconds = time.perf_counter() - started
    assert watcher.text == tokenizer.decode(ids)
    assert seconds < 1.5, seconds
    stop = " cat sat on the mat and the"
    watcher = StopStrings(tokenizer, [stop], include=True)
    taken = next(j for j, token in enumerate(ids, start=1) if watcher.add(token) is not None)
    assert watcher.text == tokenizer.decode(ids[:taken]) and watcher.text.endswith(stop)


def byte_level_with_added_tokens() -> Tokenizer:
    """The bundled byte-level BPE with added tokens as published tokenizers carry them: a
    special one (skipped by decode), plain ones of ASCII and of characters outside the byte
    alphabet (decoded as their UTF-8)."""
    tokenizer = bundled_tokenizer()
    tokenizer.add_special_tokens(["<|im_start|>"])
    tokenizer.add_tokens(["<think>", "中文词", "ünï"])
    return tokenizer


def test_byte_level_text_grows_by_each_tokens_bytes():
    """A byte-level BPE's text comes from its tokens' bytes through one incremental UTF-8
    decoder (executor/detokenize.py `ByteLevelText`): equal to the tokenizer's own decode of the
    ids so far (less trailing U+FFFD) for random ids over the whole vocabulary, added and
    special tokens and ids past it included; and linear: 20,000 tokens of bytes that form no
    character, then a stop string, in well under the seconds a re-decoded window took."""
    tokenizer = byte_level_with_added_tokens()
    assert isinstance(incremental_text(tokenizer), ByteLevelText)
    assert isinstance(incremental_text(bundled_tokenizer()), ByteLevelText)
    vocab = tokenizer.get_vocab_size()
    added = [tokenizer.token_to_id(t) for t in ("<|im_start|>", "<think>", "中文词", "ünï")]
    rng = random.Random(5)
    for _ in range(60):
        ids = [rng.choice([*added, vocab + 7]) if rng.random() < 0.15 else rng.randrange(vocab)
               for _ in range(rng.randrange(1, 40))]  # fmt: skip
        watcher = StopStrings(tokenizer, [NEVER])
        for j, token in enumerate(ids, start=1):
            assert watcher.add(token) is None
            assert watcher.text == tokenizer.decode(ids[:j]).rstrip(INCOMPLETE), ids[:j]
    byte_ids = byte_level_ids(tokenizer)
    ids = [byte_ids[0x80]] * 20000 + tokenizer.encode(" stop here").ids
    watcher = StopStrings(tokenizer, ["stop"])
    started = time.perf_counter()
    taken = next(j for j, token in enumerate(ids, start=1) if watcher.add(token) is not None)
    seconds = time.perf_counter() - started
    assert (taken, watcher.matched, watcher.text) == (20001, "stop", INCOMPLETE * 20000 + " ")
    assert seconds < 2.0, seconds


class ByteTokenizer:
    """Tokens that are byte strings, decoded as one UTF-8 decode of their bytes (a byte-level
    BPE's decode), for vocabularies the bundled one lacks."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, ids) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", "replace")


def test_long_pending_runs_never_split_a_character():
    """A run of 17+ tokens each ending mid-character (tokens straddling characters, as byte-level
    BPEs trained on CJK text have), and a character whose bytes special tokens (decoded to
    nothing) hold apart: the text is the whole decode's and the stops are found (a version that
    moved the window on through long pending runs broke both; reverted)."""
    text = "中文字符的输出一二三四五六七八九十百千万亿"
    data = text.encode()
    pieces = [data[:1]] + [data[i : i + 3] for i in range(1, len(data), 3)]  # shifted a byte
    tokenizer = ByteTokenizer(pieces)
    ids = list(range(len(pieces)))
    assert tokenizer.decode(ids) == text
    assert watch(tokenizer, ids, [NEVER]) is None
    watcher = StopStrings(tokenizer, [NEVER])
    for token in ids:
        watcher.add(token)
    assert watcher.text == text
    assert watch(tokenizer, ids, ["六七八九十百千万"])[1:] == (
        "六七八九十百千万",
        "中文字符的输出一二三四五",
    )
    bundled = bundled_tokenizer()
    byte_ids = byte_level_ids(bundled)
    eos = bundled.token_to_id("<|endoftext|>")
    assert bundled.decode([eos]) == ""
    ids = bundled.encode("x").ids + [byte_ids[0xE2]] + [eos] * 40 + [byte_ids[0x80], byte_ids[0x94]]
    assert bundled.decode(ids) == "x—"
    assert watch(bundled, ids, ["—"]) == (len(ids), "—", "x")
    # byte fallback decodes a run of <0xXX> tokens together: one stray byte makes every byte of
    # the run U+FFFD, ASCII ones too, so no "A" is ever in the text
    llama = llama2_style_tokenizer()
    ids = [0x80] + [0x41] * 29 + [llama.token_to_id("x")]
    assert llama.decode(ids) == INCOMPLETE * 30 + "x"
    assert watch(llama, ids, ["A"]) is None
    assert watch(llama, ids, ["x"]) == (len(ids), "x", INCOMPLETE * 30)


def test_byte_level_output_text_is_its_own_decode_after_any_prompt():
    """Byte-level BPE: the output's text after a prompt (the engine's `continuation`, the text
    grown for stop strings) is decode(output) as before, whatever the prompt: one ending in a
    character's first bytes included (its tail stops before them)."""
    tokenizer = bundled_tokenizer()
    rng = random.Random(4)
    sequences = token_sequences(tokenizer, rng)
    for out in sequences:
        for prompt in (rng.choice(sequences), [rng.randrange(512) for _ in range(5)]):
            text = continuation(tokenizer, prompt_tail(tokenizer, prompt), out)
            assert text == tokenizer.decode(out), (prompt, out)
            watcher = StopStrings(tokenizer, [NEVER], prompt=prompt)
            for token in out:
                watcher.add(token)
            assert watcher.text == text.rstrip(INCOMPLETE)


# ------------------------------------------------------------------ the engine

NEVER = "§never§"  # a stop no output holds
PROMPTS = [json.loads(line)["prompt"][:300] for line in bundled_prompts().open()][:6]
MAX_NEW = 40


@pytest.fixture(scope="module")
def plain():
    return Engine(speculant.bundled("target"), device="cpu")


@pytest.fixture(scope="module")
def base_outputs(plain):
    return plain.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))


def stop_params(base_outputs, include=False):
    """Per prompt: stops cut from its own output at varying places (the last prompt's never
    occurs), as the API takes them (a string, a list)."""
    rng = random.Random(2)
    params = []
    for i, out in enumerate(base_outputs):
        text = out.text
        if i == len(base_outputs) - 1:
            stop = [NEVER]
        else:
            a = rng.randrange(len(text) // 4, len(text) - 3)
            stop = text[a : a + 3] if i % 2 else [text[a : a + 2], NEVER]
        params.append(SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, stop=stop,
                                     include_stop_str_in_output=include))  # fmt: skip
    return params


def expected_outputs(base_outputs, params):
    tokenizer = bundled_tokenizer()
    rows = []
    for out, p in zip(base_outputs, params, strict=True):
        stops = (p.stop,) if isinstance(p.stop, str) else tuple(p.stop)
        hit = reference_stop(tokenizer, out.token_ids, stops, p.include_stop_str_in_output)
        if hit is None:
            rows.append((out.token_ids, out.text, "length", None))
        else:
            j, stop, text = hit
            rows.append((out.token_ids[:j], text, "stop", stop))
    return rows


def rows(outputs):
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outputs]


@pytest.mark.parametrize("include", [False, True])
def test_plain_greedy_stops_where_its_output_first_holds_a_stop(plain, base_outputs, include):
    params = stop_params(base_outputs, include)
    expected = expected_outputs(base_outputs, params)
    assert sum(e[2] == "stop" for e in expected) == len(PROMPTS) - 1
    assert rows(plain.generate(PROMPTS, params)) == expected
    for p in params:  # the caller's params are not changed (a str stays a str)
        assert isinstance(p.stop, (str, list))


@pytest.mark.parametrize(
    "algo, draft, options",
    [
        ("eagle3", "eagle3", {}),
        ("eagle3", "eagle3", {"overlap": False}),
        ("dflash", "dflash", {}),
        ("draft-model", "draft_lm", {"pool": 1.5, "max_num_seqs": 4, "page_size": 4}),
    ],
)
def test_speculative_output_with_stops_equals_plain(base_outputs, algo, draft, options):
    params = stop_params(base_outputs)
    if "pool" in options:  # pages for about 1.5 of the longest requests: preempts
        longest = max(len(bundled_tokenizer().encode(p).ids) for p in PROMPTS) + MAX_NEW + 8
        options = dict(options)
        options["num_pages"] = 1 + math.ceil(options.pop("pool") * longest / 4)
    engine = Engine(speculant.bundled("target"), device="cpu", algo=algo,
                    draft=speculant.bundled(draft), **options)  # fmt: skip
    outputs = engine.generate(PROMPTS, params)
    assert rows(outputs) == expected_outputs(base_outputs, params)
    for out in outputs:  # acceptance counts the tokens kept, none past the stop
        stats = out.stats
        assert stats["num_output_tokens"] == len(out.token_ids)
        steps = stats["num_verify_steps"]  # none: it stopped at the prefill's token
        kept = stats["accept_len"] * steps if steps else 0
        assert kept == pytest.approx(len(out.token_ids) - 1)
    if "num_pages" in options:
        assert engine.stats()["preemptions"] > 0


def test_stop_reason_of_stop_token_ids_and_eos(plain, base_outputs):
    ids = base_outputs[0].token_ids
    out = plain.generate(PROMPTS[:1], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True,
                                                     stop_token_ids=[ids[5]]))[0]  # fmt: skip
    first = ids.index(ids[5])
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[: first + 1], "stop", ids[5])
    tokenizer = bundled_tokenizer()  # the stop token's text is left out, as vLLM does
    assert out.text == tokenizer.decode(ids[:first]) != tokenizer.decode(ids[: first + 1])
    kept = plain.generate(PROMPTS[:1], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True,
                          stop_token_ids=[ids[5]], include_stop_str_in_output=True))[0]  # fmt: skip
    assert kept.text == tokenizer.decode(ids[: first + 1])
    eos = plain.model_config.eos_token_ids[0]
    out = plain.generate([[5, 6, 7]], SamplingParams(max_new_tokens=MAX_NEW))[0]
    if out.token_ids[-1] == eos:  # EOS is no stop reason (vLLM: None)
        assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.to_json()["stop_reason"] == out.stop_reason


def test_bad_stop_values_are_refused(plain, qwen2_dir):
    original = SamplingParams(stop="ab")
    assert original.validate().stop == ("ab",) and original.stop == "ab"
    assert SamplingParams(stop=None).validate().stop == ()  # vLLM's default
    for kwargs, message in [
        ({"stop": 5}, "stop=5 must be a string or a list of strings"),
        ({"stop": ["a", 1]}, "holds 1 (int); stop strings are strings"),
        ({"stop": [""]}, "holds an empty string"),
        ({"stop": "\ud800"}, "lone surrogate"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output='yes' must be True"),
        ({"stop": ["a\ufffd"]}, "with U+FFFD, the character a decode writes for bytes"),
        ({"stop": ["ab"] * 10_000 + [""]}, "(60004 characters) holds an empty string"),
    ]:
        with pytest.raises(SpeculantError, match=re.escape(message)):
            plain.generate(["x"], SamplingParams(**kwargs))
    no_tokenizer = Engine(str(qwen2_dir), device="cpu")
    with pytest.raises(PromptError, match="has stop strings .* has no tokenizer.json"):
        no_tokenizer.generate([[1, 2]], SamplingParams(stop=["a"]))


SP_PROMPTS = ["naïve guests", "北京 are", "東京 and", "done class", "the café", "hello there,"]


@pytest.fixture(scope="module", params=["llama2", "metaspace"])
def sentencepiece_target(request, tmp_path_factory):
    """A tiny random Llama whose tokenizer.json is SentencePiece style (Llama 2's layout:
    Strip of the first space; the newer Metaspace one), and the tokenizer. Its lm_head rows
    of byte tokens are zero: the random model's argmax is then mostly a piece, often one
    starting with '▁', not <0xXX>."""
    import helpers_ckpt
    from safetensors.torch import load_file, save_file

    tokenizer = TOKENIZERS[request.param]()
    out = tmp_path_factory.mktemp(f"sp-{request.param}")
    helpers_ckpt.save_hf_model(out, "llama", vocab_size=tokenizer.get_vocab_size())
    tokenizer.save(str(out / "tokenizer.json"))
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"][[i for t, i in tokenizer.get_vocab().items() if "<0x" in t]] = 0
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, tokenizer


def test_sentencepiece_output_text_continues_the_prompt(sentencepiece_target, capsys):
    """Llama 2 / Mistral-style tokenizers, whose decode strips a text's first space: the output
    text is what it adds to the prompt (vLLM's), so the prompt and it read whole: decode(prompt)
    + text == decode(prompt + output), its first token's space kept (it was decode(output),
    'the cat' + 'naïve'); a stop string starting with that space ends the request at the start;
    a stop token's text is left out of that same text (kept with include_stop_str_in_output);
    the CLI prints `[0] PROMPT+TEXT` reading whole."""
    target, tokenizer = sentencepiece_target
    engine = Engine(str(target), device="cpu")
    base = engine.generate(SP_PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    spaced = 0
    for prompt, out in zip(SP_PROMPTS, base, strict=True):
        ids = tokenizer.encode(prompt).ids
        assert tokenizer.decode(ids) == prompt
        assert prompt + out.text == tokenizer.decode(ids + out.token_ids), prompt
        if not out.text.startswith(" ") or len(out.text.rstrip(INCOMPLETE)) < 3:
            continue
        spaced += 1
        stop = out.text[:3]  # a space, then the first characters
        assert not tokenizer.decode(out.token_ids).startswith(stop)  # the old text missed it
        for include in (False, True):
            params = SamplingParams(max_new_tokens=8, ignore_eos=True, stop=[stop, NEVER],
                                    include_stop_str_in_output=include)  # fmt: skip
            cut = engine.generate([prompt], params)[0]
            j = next(j for j in range(1, 9) if stop in tokenizer.decode(ids + out.token_ids[:j]))
            assert (cut.token_ids, cut.text, cut.finish_reason, cut.stop_reason) == (
                out.token_ids[:j], stop if include else "", "stop", stop
            )  # fmt: skip
        token = out.token_ids[2]
        first = out.token_ids.index(token)
        for include in (False, True):
            params = SamplingParams(max_new_tokens=8, ignore_eos=True, stop_token_ids=[token],
                                    include_stop_str_in_output=include)  # fmt: skip
            cut = engine.generate([prompt], params)[0]
            kept = out.token_ids[: first + include]
            assert cut.token_ids == out.token_ids[: first + 1]
            assert prompt + cut.text == tokenizer.decode(ids + kept)
            assert out.text.startswith(cut.text)
    assert spaced >= 2
    prompt, out = next((p, o) for p, o in zip(SP_PROMPTS, base, strict=True) if o.text[0] == " ")
    capsys.readouterr()
    argv = ["generate", "--target", str(target), "--device", "cpu", "--max-new-tokens", "8",
            "--ignore-eos", "--prompt", prompt]  # fmt: skip
    assert cli.main(argv) == 0
    whole = tokenizer.decode(tokenizer.encode(prompt).ids + out.token_ids)
    assert f"[0] {prompt}{out.text}\n" == f"[0] {whole}\n" in capsys.readouterr().out


# ------------------------------------------------------------------ the CLI


def test_cli_stops_flags_and_lines(base_outputs, tmp_path, capsys):
    params = stop_params(base_outputs)
    prompts = tmp_path / "p.jsonl"
    lines = [{"prompt": p, "stop": sp.stop} for p, sp in zip(PROMPTS, params, strict=True)]
    lines[-1] = {"prompt": PROMPTS[-1]}  # takes the flags' stops
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    flag_stop = base_outputs[-1].text[10:13]
    base = ["generate", "--device", "cpu", "--max-new-tokens", str(MAX_NEW), "--ignore-eos",
            "--algo", "eagle3", "--prompts", str(prompts), "--stop", NEVER,
            "--stop", flag_stop, "--include-stop-str-in-output"]  # fmt: skip
    assert cli.main([*base, "--output", str(tmp_path / "one")]) == 0
    include = [SamplingParams(**{**vars(p), "include_stop_str_in_output": True}) for p in params]
    include[-1] = SamplingParams(
        max_new_tokens=MAX_NEW, ignore_eos=True, stop=[NEVER, flag_stop],
        include_stop_str_in_output=True,
    )  # fmt: skip
    expected = expected_outputs(base_outputs, include)
    assert expected[-1][2] == "stop" and expected[-1][1].endswith(flag_stop)

    def read(path):
        outs = {json.loads(line)["index"]: json.loads(line) for line in open(path)}
        return [(o["token_ids"], o["text"], o["finish_reason"], o["stop_reason"])
                for o in (outs[i] for i in range(len(PROMPTS)))]  # fmt: skip

    assert read(tmp_path / "one") == expected
    two = subprocess.run(
        [sys.executable, "-m", "speculant", *base, "--dp", "2", "--output", str(tmp_path / "dp"),
         "--dist-timeout", "60"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-2000:]
    assert read(tmp_path / "dp") == expected

    capsys.readouterr()
    gen = ["generate", "--device", "cpu", "--prompt", "x"]
    bad = tmp_path / "bad.jsonl"
    for args, line, message in [
        (["--stop", ""], None, "--stop holds an empty string"),
        ([], {"prompt": "x", "stop": 3}, f"{bad}:1: 'stop' must be a string or a list of strings"),
        ([], {"prompt": "x", "stop": ["a", ""]}, f"{bad}:1: 'stop' holds an empty string"),
    ]:
        if line is not None:
            bad.write_text(json.dumps(line) + "\n")
            args = ["generate", "--device", "cpu", "--prompts", str(bad)]
        assert cli.main(gen + args if line is None else args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("speculant: error: ") and message in err[0], err
    bad.write_text(json.dumps({"prompt": "x", "stop": "a"}) + "\n")
    assert cli.main(["accept-rate", "--device", "cpu", "--prompts", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{bad}:1: accept-rate takes no stop" in err, err


@pytest.mark.gpu
@pytest.mark.parametrize("algo, draft", [(None, None), ("eagle3", "eagle3"), ("dflash", "dflash")])
def test_stops_on_cuda_with_graphs_and_overlap(algo, draft):
    """On CUDA (graph replays, the Triton backend, steps launched ahead of the read-back): the
    outputs with stops are the CUDA run without them, cut by the reference."""
    target = speculant.bundled("target")
    plain = Engine(target, device="cuda", max_num_seqs=8)
    base = plain.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    params = stop_params(base)
    spec = {} if algo is None else {"algo": algo, "draft": speculant.bundled(draft)}
    engine = plain if algo is None else Engine(target, device="cuda", max_num_seqs=8, **spec)
    outputs = engine.generate(PROMPTS, params)
    assert rows(outputs) == expected_outputs(base, params)
    assert engine.stats()["steps_ahead"] > 0
