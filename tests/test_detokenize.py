"""The output text grown a token at a time for SentencePiece-style tokenizers (executor/
detokenize.py `SentencePieceText`: Llama 2, Mistral, Gemma, T5 layouts) equals the tokenizer's
own decode of the ids so far, at every token: tokenizer.json files in the published layouts
(BPE and Unigram models with byte fallback; `Replace`/`ByteFallback`/`Fuse`/`Strip` and
`Metaspace` decoders; a leading space stripped or kept), fuzzed with byte tokens forming valid
and invalid UTF-8, special tokens (skipped, also inside a run of bytes and first), added tokens
(normalized and not), ids past the vocabulary; decoders it does not replay exactly keep the
window; a long run of bytes that form no character costs time linear in its length. After a
prompt the text is what the output adds to the prompt's decode (vLLM's reading: the first space
of a Llama 2 / Mistral output kept), grown equal to it."""

from __future__ import annotations

import json
import random
import time

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from speculant.executor.detokenize import (
    BYTE_TOKEN,
    INCOMPLETE,
    ByteLevelText,
    SentencePieceText,
    continuation,
    incremental_text,
    prompt_tail,
)
from speculant.executor.stop_strings import StopStrings

CORPUS = [
    "the café serves crème brûlée to naïve guests; they pay in cash",
    "def main(argv):\n    return run(argv)  # done\n\nclass Runner:\n    pass",
    "hello world, hello there, well well; the end of the line",
]
SAMPLES = [  # encoded: characters outside the trained pieces fall back to bytes
    "the café serves 東京 and 北京 🙂🚀 end",
    "  two leading spaces,\ttabs\tand  doubled  spaces ",
    "▁ a literal lower block, ▁▁ twice; — dashes – and “quotes”",
    "hello\n\nworld — naïve 5€ ©",
]
SPECIALS = ["<unk>", "<s>", "</s>"]
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
ODD_PIECES = ["<0xe2>", "<0x+A>", "<0xZZ>", "<0x 1>", "<0x141>"]  # byte or not, as Rust parses

BYTE_FALLBACK, FUSE = {"type": "ByteFallback"}, {"type": "Fuse"}


def seq(*steps) -> dict:
    return {"type": "Sequence", "decoders": list(steps)}


def replace(pattern: str, content: str) -> dict:
    return {"type": "Replace", "pattern": {"String": pattern}, "content": content}


def strip(content: str, start: int, stop: int = 0) -> dict:
    return {"type": "Strip", "content": content, "start": start, "stop": stop}


def metaspace(scheme: str, split: bool = True) -> dict:
    return {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": split}


def added(content: str, id_: int, special: bool, normalized: bool) -> dict:
    return {"id": id_, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": normalized, "special": special}  # fmt: skip


def trained(kind: str) -> Tokenizer:
    """A small SentencePiece-like vocabulary: pieces with '▁' for spaces, no CJK or emoji."""
    tok = Tokenizer(models.BPE() if kind == "BPE" else models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    trainer = (trainers.BpeTrainer(vocab_size=260) if kind == "BPE"
               else trainers.UnigramTrainer(vocab_size=200, unk_token="<unk>",
                                            special_tokens=["<unk>"]))  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def published(kind: str, normalizer, pre_tokenizer, decoder, extra_added=()) -> Tokenizer:
    """A tokenizer.json as Llama 2 / Mistral / Gemma / T5 checkpoints ship it: <unk>, <s>, </s>
    first (added, special), the 256 byte tokens <0x00>..<0xFF>, the trained pieces, pieces that
    look like byte tokens; `extra_added`: (content, special, normalized) added after them."""
    model = json.loads(trained(kind).to_str())["model"]
    pieces = SPECIALS + BYTE_TOKENS
    if kind == "BPE":
        learned = sorted(model["vocab"], key=model["vocab"].get)
        pieces += [p for p in learned + ODD_PIECES if p not in pieces]
        merges = [m if isinstance(m, list) else m.split(" ") for m in model["merges"]]
        model = {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                 "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                 "byte_fallback": True, "ignore_merges": False,
                 "vocab": {p: i for i, p in enumerate(pieces)}, "merges": merges}  # fmt: skip
    else:
        scores = {p: s for p, s in model["vocab"] if p not in pieces}
        scores.update({p: -20.0 for p in ODD_PIECES})
        vocab = [[p, 0.0] for p in pieces] + [[p, s] for p, s in scores.items()]
        model = {"type": "Unigram", "unk_id": 0, "vocab": vocab, "byte_fallback": True}
    size = len(model["vocab"])
    tokens = [added(t, i, True, False) for i, t in enumerate(SPECIALS)]
    tokens += [added(t, size + i, s, n) for i, (t, s, n) in enumerate(extra_added)]
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": tokens,
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": None,
            "decoder": decoder, "model": model}  # fmt: skip
    return Tokenizer.from_str(json.dumps(spec))


LLAMA_DECODER = seq(replace("▁", " "), BYTE_FALLBACK, FUSE, strip(" ", 1))
PREPEND = {
    "type": "Sequence",
    "normalizers": [{"type": "Prepend", "prepend": "▁"}, replace(" ", "▁")],
}
ADDED = [
    ("<think>", False, True),
    ("<|im_start|>", True, False),
    ("▁▁", False, False),
    ("<|tool|>", False, False),
]

LAYOUTS = {
    # Llama 2 / Mistral v0.1 (legacy): the normalizer prepends '▁' (to added tokens that are
    # `normalized` too), the decoder strips the first space
    "llama2": lambda: published("BPE", PREPEND, None, LLAMA_DECODER, ADDED),
    # Mistral v0.3 and newer conversions (legacy=False): a Metaspace pre-tokenizer
    "mistral": lambda: published("BPE", None, metaspace("first", False), LLAMA_DECODER, ADDED),
    # Gemma: spaces replaced, no dummy prefix and no strip
    "gemma": lambda: published(
        "BPE", replace(" ", "▁"), None, seq(replace("▁", " "), BYTE_FALLBACK, FUSE), ADDED
    ),
    # a SentencePiece Unigram model converted from its proto (add_dummy_prefix)
    "unigram": lambda: published("Unigram", None, metaspace("first", False), LLAMA_DECODER, ADDED),
    # SpmConverter's default decoder (T5, XLM-R): Metaspace, byte tokens left as written
    "t5": lambda: published("Unigram", None, metaspace("always"), metaspace("always"), ADDED),
    "metaspace-never": lambda: published(
        "Unigram", None, metaspace("never"), metaspace("never"), ADDED
    ),
    # not published, built of the same steps: per-token steps after ByteFallback, more after Fuse
    "bytes-then-metaspace": lambda: published(
        "BPE",
        None,
        metaspace("first"),
        seq(BYTE_FALLBACK, metaspace("first"), strip(" ", 2)),
        ADDED,
    ),
    "fuse-then-metaspace": lambda: published(
        "BPE",
        None,
        metaspace("first"),
        seq(
            strip("▁", 1),
            BYTE_FALLBACK,
            FUSE,
            metaspace("always"),
            strip(" ", 3),
            replace("a", "▁A"),
        ),
        ADDED,
    ),
}
ROUND_TRIP = ["llama2", "mistral", "gemma", "unigram"]  # decode(encode(text)) == text


def utf8_bytes(tokenizer: Tokenizer, data: bytes) -> list[int]:
    return [tokenizer.token_to_id(f"<0x{b:02X}>") for b in data]


CHARS = "A ▁é—中🙂\n"
NO_UTF8 = [b"\x80", b"\xbf", b"\xc0", b"\xc1", b"\xf5", b"\xff", b"\xe2A", b"\xe2\x80\xe2",
           b"\xed\xa0", b"\xe0\x80", b"\xf4\x90", b"\xf0\x9f\x99 "]  # fmt: skip
CUT_SHORT = [b"\xe2", b"\xe2\x80", b"\xf0\x9f\x99", b"\xc3"]


def byte_run(rng: random.Random) -> bytes:
    """Whole characters; or bytes that are no UTF-8 from the first ones (a stray or overlong
    byte, a surrogate, a character cut short by another) and then any bytes; or a character cut
    short by the run's end. No run both shows characters and then turns out not to be UTF-8:
    the decode would take those characters back, which no text that only grows can."""
    kind = rng.random()
    if kind < 0.5:
        return "".join(rng.choice(CHARS) for _ in range(rng.randrange(1, 4))).encode()
    if kind < 0.85:
        return rng.choice(NO_UTF8) + bytes(rng.randrange(256) for _ in range(rng.randrange(4)))
    return rng.choice(CUT_SHORT)


ODD_RUNS = [["<0xe2>", "<0x80>", "<0x94>"], ["<0x+A>"], ["<0xE2>", "<0x80>", "<0x+A>", "<0x41>"],
            ["<0xZZ>"], ["<0x 1>"], ["<0x141>"]]  # fmt: skip


def fuzzed_ids(tokenizer: Tokenizer, rng: random.Random) -> list[int]:
    """Segments (encoded samples, runs of byte tokens, pieces that look like byte tokens, plain
    pieces, added tokens) each followed by a piece that is no byte token (which ends a run);
    special tokens and ids past the vocabulary (both left out by decode) anywhere, runs of bytes
    and the first place included."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=False)
    extra = list(range(vocab, tokenizer.get_vocab_size()))
    plain = [i for i in range(3, vocab) if not tokenizer.id_to_token(i).startswith("<0x")]
    skipped = [0, 1, 2, tokenizer.token_to_id("<|im_start|>"), tokenizer.get_vocab_size() + 9]
    ids: list[int] = []
    for _ in range(rng.randrange(1, 7)):
        kind = rng.random()
        if kind < 0.2:
            text = rng.choice(SAMPLES)
            a = rng.randrange(len(text))
            segment = tokenizer.encode(text[a : a + rng.randrange(1, 20)]).ids
        elif kind < 0.55:
            segment = utf8_bytes(tokenizer, byte_run(rng))
        elif kind < 0.7:
            segment = [tokenizer.token_to_id(t) for t in rng.choice(ODD_RUNS)]
        else:
            segment = [rng.choice(extra) if rng.random() < 0.4 else rng.choice(plain)
                       for _ in range(rng.randrange(1, 4))]  # fmt: skip
        segment.append(rng.choice(plain))
        ids += segment
    for _ in range(rng.randrange(4)):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(skipped))
    return ids


def check_grows_as_decode(tokenizer, ids):
    """Fed one id at a time, the text (less held-back U+FFFD) is the whole decode of the ids so
    far whenever that decode ends in no U+FFFD (else bytes may still complete a character), and
    holds the decode's text before its trailing U+FFFD always."""
    watcher = StopStrings(tokenizer, ["§never§"])
    for j, token in enumerate(ids, start=1):
        assert watcher.add(token) is None
        whole = tokenizer.decode(ids[:j])
        if whole.endswith(INCOMPLETE):
            assert watcher.text.startswith(whole.rstrip(INCOMPLETE)), (ids[:j], whole)
        else:
            assert watcher.text == whole, (ids[:j], whole, watcher.text)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_text_grows_as_the_whole_decode(layout):
    tokenizer = LAYOUTS[layout]()
    assert isinstance(incremental_text(tokenizer), SentencePieceText)
    rng = random.Random(layout)
    for text in SAMPLES:  # the samples' own ids (characters of 2-4 bytes fall back to bytes)
        ids = tokenizer.encode(text).ids
        if layout in ROUND_TRIP and text[0] != " " and "▁" not in text:
            assert tokenizer.decode(ids) == text
        check_grows_as_decode(tokenizer, ids)
    for _ in range(150):
        check_grows_as_decode(tokenizer, fuzzed_ids(tokenizer, rng))


def split_ids(tokenizer: Tokenizer, rng: random.Random) -> tuple[list[int], list[int]]:
    """A prompt and an output: a sample's ids or fuzzed ids, cut at a random token, but not
    inside a run of byte tokens (the output's bytes would start mid-run: a run that shows
    characters and then turns out no UTF-8, where the text keeps what the decode takes back)."""
    if rng.random() < 0.5:
        ids = tokenizer.encode(rng.choice(SAMPLES)).ids
    else:
        ids = fuzzed_ids(tokenizer, rng) + fuzzed_ids(tokenizer, rng)
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    kind = [None if t in special or tokenizer.id_to_token(t) is None
            else BYTE_TOKEN.fullmatch(tokenizer.id_to_token(t)) is not None
            for t in ids]  # fmt: skip
    cuts = []
    for cut in range(1, len(ids)):
        before = next((k for k in reversed(kind[:cut]) if k is not None), False)
        after = next((k for k in kind[cut:] if k is not None), False)
        if not (before and after):
            cuts.append(cut)
    cut = rng.choice(cuts or [len(ids) - 1])
    return ids[:cut], ids[cut:]


def ends_closed(tokenizer: Tokenizer, prompt: list[int]) -> bool:
    """The prompt's text ends with no character or run of byte tokens open: its last token
    decode keeps is no byte token, its decode ends in no U+FFFD."""
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    kept = [tokenizer.id_to_token(t) for t in prompt if t not in special]
    kept = [t for t in kept if t is not None]
    return (
        bool(kept)
        and not BYTE_TOKEN.fullmatch(kept[-1])
        and not (tokenizer.decode(prompt).endswith(INCOMPLETE))
    )


def output_text(tokenizer: Tokenizer, prompt: list[int], out: list[int]) -> str:
    """The engine's text of output `out` after `prompt` (Engine._output)."""
    return continuation(tokenizer, prompt_tail(tokenizer, prompt), out)


START_FREE = ["gemma", "metaspace-never"]  # no decoder step reads a text's start


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_output_text_continues_the_prompt(layout):
    """The output's text is what it adds to the prompt's text, as vLLM returns it: decode(
    prompt) + text == decode(prompt + output) whenever the prompt's text ends closed (so a
    Llama 2 / Mistral output keeps the space of its first token, which a decode of the output
    alone strips); the text grown a token at a time for stop strings, started after the
    prompt, is that text at every token. Decoders that read no start: decode(output), as
    before. (The output's text was decode(output): 'naïve' after 'the cat'.)"""
    tokenizer = LAYOUTS[layout]()
    rng = random.Random(layout)
    closed = 0
    for _ in range(150):
        prompt, out = split_ids(tokenizer, rng)
        text = output_text(tokenizer, prompt, out)
        if ends_closed(tokenizer, prompt):
            closed += 1
            assert tokenizer.decode(prompt) + text == tokenizer.decode(prompt + out), (prompt, out)
        if layout in START_FREE:
            assert text == tokenizer.decode(out), (prompt, out)
        watcher = StopStrings(tokenizer, ["§never§"], prompt=prompt)
        for j, token in enumerate(out, start=1):
            assert watcher.add(token) is None
            so_far = output_text(tokenizer, prompt, out[:j])  # as check_grows_as_decode
            if so_far.endswith(INCOMPLETE):
                assert watcher.text.startswith(so_far.rstrip(INCOMPLETE)), (prompt, out[:j])
            else:
                assert watcher.text == so_far, (prompt, out[:j], so_far)
    assert closed > 50


@pytest.mark.parametrize("layout", ["mistral", "unigram"])
@pytest.mark.parametrize("chars", ["🙂", "東京", "é🙂"])
def test_a_prompt_of_byte_fallback_characters_keeps_the_outputs_first_space(layout, chars):
    """Mistral v0.3's layout (no '▁' after a special token): a prompt whose text after a special
    token is only byte-fallback characters (emoji, CJK past the vocabulary) gave no tail (a
    byte token never ended one), so the output read as a text's start: 'naïve' for ' naïve'
    (decode(prompt + output) less decode(prompt), vLLM's reading), and the stop string ' na'
    never matched. A whole run of byte tokens ends the text closed; one cut mid-character
    does not (the output's bytes may complete it)."""
    tokenizer = LAYOUTS[layout]()
    special = tokenizer.token_to_id("<|im_start|>")
    raw = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in chars.encode()]
    out = tokenizer.encode("naïve", add_special_tokens=False).ids
    assert tokenizer.id_to_token(out[0]).startswith("▁")
    for prompt in ([special, *raw, special], [1, special, *raw]):
        expected = tokenizer.decode(prompt + out)[len(tokenizer.decode(prompt)) :]
        assert expected.startswith(" na"), expected
        assert output_text(tokenizer, prompt, out) == expected, (prompt, out)
        watcher = StopStrings(tokenizer, [" na"], prompt=prompt)
        assert next(filter(None, map(watcher.add, out)), None) == " na", (prompt, out)
    cut = [special, *raw[:-1]]  # mid-character: no tail ends there
    assert prompt_tail(tokenizer, cut) != cut


@pytest.mark.parametrize("layout", ["llama2", "mistral", "unigram", "t5", "metaspace-never"])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_with_the_first_space_matches_at_the_outputs_start(layout, include):
    """'the cat' then '▁na...': the text is ' na...' (Strip, Metaspace first / always strip
    the first space of a text, not of one that continues a prompt; Metaspace never strips
    none), so the stop string ' na' ends the request at its first token (before: 'na...',
    which does not hold it). The same after special tokens ending the prompt."""
    tokenizer = LAYOUTS[layout]()
    prompt = tokenizer.encode("the cat").ids
    never = layout == "metaspace-never"
    out = tokenizer.encode(" naïve" if never else "naïve", add_special_tokens=False).ids
    assert tokenizer.id_to_token(out[0]).startswith("▁")

    def stop(before, stops):
        watcher = StopStrings(tokenizer, stops, include, prompt=before)
        for token in out:
            if (matched := watcher.add(token)) is not None:
                return matched, watcher.text
        return None

    for before in (prompt, prompt + [2, 1]):
        text = output_text(tokenizer, before, out)
        assert text == " naïve"
        assert tokenizer.decode(before) + text == "the cat naïve"
        assert stop(before, [" na", "ve"]) == (" na", " na" if include else "")
    assert output_text(tokenizer, [1], out) == tokenizer.decode(out)  # only <s>: a text's start
    assert stop([1], [" na"]) == ((" na", " na" if include else "") if never else None)


@pytest.mark.parametrize("layout", ROUND_TRIP)
def test_published_layouts_decode_as_transformers_reads_them(layout, tmp_path):
    """The layouts are read by transformers as by `tokenizers`: its decode (skipping special
    tokens) equals the whole decode the text is checked against; a prompt's decode and the
    output's text after it read as transformers' decode of the two together."""
    transformers = pytest.importorskip("transformers")
    tokenizer = LAYOUTS[layout]()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    rng = random.Random(7)
    for _ in range(40):
        ids = [i for i in fuzzed_ids(tokenizer, rng) if i < tokenizer.get_vocab_size()]
        assert auto.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids), ids
    closed = 0
    for _ in range(40):
        prompt, out = split_ids(tokenizer, rng)
        prompt = [i for i in prompt if i < tokenizer.get_vocab_size()]
        out = [i for i in out if i < tokenizer.get_vocab_size()]
        if prompt and ends_closed(tokenizer, prompt):
            closed += 1
            whole = auto.decode(prompt + out, skip_special_tokens=True)
            head = auto.decode(prompt, skip_special_tokens=True)
            assert head + output_text(tokenizer, prompt, out) == whole, (prompt, out)
    assert closed > 10


def test_first_space_and_added_tokens():
    """Llama 2: the decoder strips the text's first space, also one a byte token <0x20> writes
    or one after special tokens; an added `normalized` token decodes as the normalizer writes
    it ('▁' prepended: a space), one not normalized as written. T5's Metaspace decoder drops
    every '▁' of the first token, a space elsewhere. Each as decode."""
    llama = LAYOUTS["llama2"]()
    think, tool = llama.token_to_id("<think>"), llama.token_to_id("<|tool|>")
    space, the = llama.token_to_id("<0x20>"), llama.token_to_id("▁the")
    cases = [
        ([1, space, the], " the"),
        ([1, 2, the, think, tool], "the <think><|tool|>"),
        ([think, the], "<think> the"),
    ]
    for ids, text in cases:
        assert llama.decode(ids) == text
        check_grows_as_decode(llama, ids)
    t5 = LAYOUTS["t5"]()
    ids = [t5.token_to_id("▁▁"), t5.token_to_id("<0xE2>"), t5.token_to_id("▁▁")]
    assert t5.decode(ids) == "<0xE2>  "
    check_grows_as_decode(t5, ids)


def test_a_run_that_shows_characters_and_then_turns_out_no_utf8_keeps_them():
    """The one place the text is not the decode: a run of byte tokens whose first bytes made
    whole characters, then a byte that makes the run no UTF-8. The decode shows every byte of
    the run as U+FFFD, taking back the characters it showed; the text keeps them, the later
    bytes U+FFFD (stop strings hold no U+FFFD: none is missed)."""
    llama = LAYOUTS["llama2"]()
    ids = utf8_bytes(llama, "A—".encode() + b"\x80") + [llama.token_to_id("▁the")]
    assert llama.decode(ids[:4]) == "A—"
    assert llama.decode(ids) == INCOMPLETE * 5 + " the"
    watcher = StopStrings(llama, ["A—"], include=True)
    assert [watcher.add(t) for t in ids[:4]] == [None, None, None, "A—"]
    watcher = StopStrings(llama, ["§never§"])
    for token in ids:
        watcher.add(token)
    assert watcher.text == "A—" + INCOMPLETE + " the"


@pytest.mark.parametrize(
    "decoder",
    [
        None,  # decode joins tokens with spaces
        seq(replace("▁", " "), BYTE_FALLBACK, strip(" ", 0, 1)),
        {"type": "Replace", "pattern": {"Regex": "▁+"}, "content": " "},
        seq(BYTE_FALLBACK, FUSE, replace("ab", "c")),
        seq(FUSE, BYTE_FALLBACK),
        seq(BYTE_FALLBACK, BYTE_FALLBACK),
        seq(BYTE_FALLBACK, replace("\ufffd", "?")),
        {"type": "WordPiece", "prefix": "##", "cleanup": True},
        seq(
            replace("▁", " "),
            {
                "type": "ByteLevel",
                "add_prefix_space": True,
                "trim_offsets": True,
                "use_regex": True,
            },
        ),
    ],
)
def test_decoders_not_replayed_keep_the_window(decoder):
    """A decoder with a step not replayed exactly (a trailing strip, a regex, a replace that
    could span pieces, ByteFallback after Fuse or twice, a step on U+FFFD, another type) keeps
    the window: its text still follows the decode."""
    tokenizer = published("BPE", None, metaspace("first", False), decoder, ADDED)
    assert incremental_text(tokenizer) is None
    bytes_like = {i for t, i in tokenizer.get_vocab().items() if t.startswith("<0x")}
    rng = random.Random(3)
    for _ in range(10):  # no byte tokens: the window has no answer for runs that are no UTF-8
        ids = [i for i in fuzzed_ids(tokenizer, rng) if i not in bytes_like]
        watcher = StopStrings(tokenizer, ["§never§"])
        for token in ids:
            watcher.add(token)
        assert watcher.text == tokenizer.decode(ids).rstrip(INCOMPLETE)
        prompt = [i for i in fuzzed_ids(tokenizer, rng) if i not in bytes_like]
        watcher = StopStrings(tokenizer, ["§never§"], prompt=prompt)  # the window starts at
        for token in ids:  # the prompt's tail
            watcher.add(token)
        assert watcher.text == output_text(tokenizer, prompt, ids).rstrip(INCOMPLETE)


def test_byte_level_added_token_decodes_as_normalized():
    """Byte-level BPE (`ByteLevelText`) takes its ids' strings from the same table: an added
    token that is `normalized`, under an NFC normalizer, decodes as its normalized form."""
    import speculant

    tokenizer = Tokenizer.from_file(str(speculant.bundled("target") / "tokenizer.json"))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.add_tokens(["cafe\u0301", "x\u00e9y"])
    assert isinstance(incremental_text(tokenizer), ByteLevelText)
    ids = [tokenizer.token_to_id("cafe\u0301"), tokenizer.token_to_id("x\u00e9y")]
    ids = tokenizer.encode("ab").ids + ids + tokenizer.encode(" c").ids
    watcher = StopStrings(tokenizer, ["§never§"])
    for j, token in enumerate(ids, start=1):
        watcher.add(token)
        assert watcher.text == tokenizer.decode(ids[:j]).rstrip(INCOMPLETE), ids[:j]


def test_a_long_run_of_bytes_that_form_no_character_costs_linear_time():
    """8,000 byte tokens <0xE2> (each a character's first byte, none completed: the decode
    shows one U+FFFD each), then text with a stop string: the text is the decode's, found in
    well under a second (re-decoding a window of them took 7-9 s: time growing with the
    square of the run)."""
    llama = LAYOUTS["llama2"]()
    words = [llama.token_to_id(t) for t in ("▁the", "▁end", "▁well")]
    ids = [llama.token_to_id("<0xE2>")] * 8000 + words
    assert llama.decode(ids) == INCOMPLETE * 8000 + " the end well"
    watcher = StopStrings(llama, ["end"])
    started = time.perf_counter()
    taken = next(j for j, token in enumerate(ids, start=1) if watcher.add(token) is not None)
    seconds = time.perf_counter() - started
    assert (taken, watcher.matched, watcher.text) == (8002, "end", INCOMPLETE * 8000 + " the ")
    assert seconds < 1.0, seconds
