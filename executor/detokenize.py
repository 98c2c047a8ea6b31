"""A request's output text grown a token at a time, equal to the tokenizer's own `decode` of the
ids so far (skip_special_tokens, as the engine decodes; after a prompt, the text they add to it:
below), for the `tokenizers.Tokenizer` decoders
that can be replayed token by token: each token costs its own text, however long a run of bytes
that form no character lasts (re-decoding a window of recent tokens costs time growing with the
square of such a run). `incremental_text(tokenizer)` gives one stream per request, or None for a
decoder not reproduced exactly (executor/stop_strings.py then re-decodes a window).

`Tokenizer.decode` turns each id into a string (`DecoderTokens`; special tokens and ids with no
token are left out), runs its decoder's steps over the list of strings, and joins the result:

- byte-level BPE (GPT-2, Llama 3, Qwen; a `ByteLevel` decoder): one UTF-8 decode of the tokens'
  bytes, here an incremental UTF-8 decoder fed each token's bytes (`ByteLevelText`);
- SentencePiece style (Llama 2, Mistral, Gemma, T5: `Replace`("▁", " "), `ByteFallback`, `Fuse`,
  `Strip`, `Metaspace`): the steps replayed as stages each token's text flows through
  (`SentencePieceText`). `ByteFallback` joins a run of `<0xXX>` tokens (special tokens between
  them left out) into their UTF-8, or, when the run is no UTF-8, one U+FFFD a byte: a run's
  whole characters go out as their last byte arrives and U+FFFD as soon as the run can no
  longer be UTF-8. The one difference from the whole decode: a run whose whole characters went
  out and that then turns out not to be UTF-8 (a stray byte after them, or the run ending
  mid-character) keeps those characters, where the whole decode shows every byte of the run as
  U+FFFD; no text that only grows can follow that decode, which takes back what it showed.

A stream's `add(token)` returns the text the token adds, U+FFFD included (the caller holds a
trailing one back: a later token may still turn the text before it into a stop string).

An output's text continues its prompt, as vLLM's detokenizer reads it (the prompt's last tokens
as the prefix, only the new text returned): `continuation(tokenizer, tail, ids)` is
decode(tail + ids)[len(decode(tail)):] with `tail = prompt_tail(tokenizer, prompt_ids)`, the
prompt's last few tokens that decode keeps, ending where the text is closed: no byte-level
character and no run of byte-fallback tokens still open, so the output's bytes decode by
themselves and decode(tail) is a prefix of decode(tail + ids). A byte-level BPE's text is thus
decode(ids) as before; a SentencePiece-style one keeps the space of the output's first token,
which a decode of the output alone strips as the start of a text (`Strip`, `Metaspace`), as
vLLM returns ' world' after 'Hello'. A stream made with `incremental_text(tokenizer, tail)`
starts after the tail (the tail fed through it first, its text not returned)."""

from __future__ import annotations

import codecs
import json
import re
import weakref
from functools import partial

INCOMPLETE = "\ufffd"  # decode's stand-in for bytes that are no (whole) character


class DecoderTokens:
    """Token id -> the string `Tokenizer.decode` hands its decoder for it, or None for an id
    decode leaves out (skip_special_tokens): an added token's content (as the tokenizer's
    normalizer writes it when the token is `normalized`: tokenizers >= 0.23,
    `AddedVocabulary::simple_id_to_token`), else the model's token; left out when that string
    is a special token's or the id has none. Computed per id when first asked."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.added = tokenizer.get_added_tokens_decoder()
        self.special = {token.content for token in self.added.values() if token.special}
        self.strings: dict[int, str | None] = {}

    def __call__(self, token: int) -> str | None:
        if token in self.strings:
            return self.strings[token]
        added = self.added.get(token)
        normalizer = self.tokenizer.normalizer
        if token < 0:
            text = None
        elif added is None:
            text = self.tokenizer.id_to_token(token)
        elif added.normalized and normalizer is not None:
            text = normalizer.normalize_str(added.content)
        else:
            text = added.content
        if text in self.special:
            text = None
        self.strings[token] = text
        return text


# ------------------------------------------------------------------ byte-level BPE


def _byte_alphabet() -> dict[str, int]:
    """The byte-level BPE's character for each byte (GPT-2's `bytes_to_unicode`), reversed."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {chr(b): b for b in printable}
    extra = (b for b in range(256) if b not in printable)
    chars.update({chr(256 + n): b for n, b in enumerate(extra)})
    return chars


CHAR_BYTES = _byte_alphabet()


class BytePieces:
    """Token id -> the bytes `tokenizers`' ByteLevel decoder makes of it: a token whose every
    character is in the byte alphabet becomes those bytes, any other token its UTF-8; a token
    decode leaves out none. Computed per id when first asked."""

    def __init__(self, tokens: DecoderTokens):
        self.tokens = tokens
        self.pieces: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        piece = self.pieces.get(token)
        if piece is None:
            text = self.tokens(token)
            if text is None:
                piece = b""
            elif all(c in CHAR_BYTES for c in text):
                piece = bytes(CHAR_BYTES[c] for c in text)
            else:
                piece = text.encode()
            self.pieces[token] = piece
        return piece


class ByteLevelText:
    """One request's text of a byte-level BPE: its tokens' bytes through one UTF-8 decoder."""

    def __init__(self, pieces: BytePieces):
        self.pieces = pieces
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token: int) -> str:
        return self.utf8.decode(self.pieces(token))

    def is_open(self) -> bool:
        """A character's first bytes are still waiting for the rest."""
        return bool(self.utf8.getstate()[0])


# ------------------------------------------------------------------ SentencePiece style
# Each stage takes and returns a list of (new, text): `new` starts a decoder token (the
# decoder's steps work per token), else `text` continues the last one. Before ByteFallback and
# Fuse every item is a whole token.


class Replace:
    """`Replace` of a literal: per token; a pattern of one character also per piece of one."""

    def __init__(self, pattern: str, content: str):
        self.pattern, self.content = pattern, content

    def __call__(self, items):
        return [(new, text.replace(self.pattern, self.content)) for new, text in items]


class Metaspace:
    """`Metaspace`: the replacement character becomes a space, in the first token nothing
    (unless prepend_scheme is "never")."""

    def __init__(self, replacement: str, strip_first: bool):
        self.replacement, self.strip_first = replacement, strip_first
        self.tokens = 0

    def __call__(self, items):
        out = []
        for new, text in items:
            self.tokens += new
            space = "" if self.tokens == 1 and self.strip_first else " "
            out.append((new, text.replace(self.replacement, space)))
        return out


class Strip:
    """`Strip` of up to `start` leading `content` characters of each token (stop 0)."""

    def __init__(self, content: str, start: int):
        self.content, self.start = content, start
        self.left = 0  # how many more the current token may lose

    def __call__(self, items):
        out = []
        for new, text in items:
            if new:
                self.left = self.start
            if self.left:
                cut = min(self.left, len(text) - len(text.lstrip(self.content)))
                text = text[cut:]
                self.left = self.left - cut if not text else 0  # past its first other character
            out.append((new, text))
        return out


class Fuse:
    """`Fuse`: every token joined into one."""

    def __init__(self):
        self.started = False

    def __call__(self, items):
        if not items or self.started:
            return [(False, text) for _, text in items]
        self.started = True
        return [(True, items[0][1])] + [(False, text) for _, text in items[1:]]


BYTE_TOKEN = re.compile(r"<0x(?:[0-9A-Fa-f]{2}|\+[0-9A-Fa-f])>")  # u8::from_str_radix(t[3..5], 16)


class ByteFallback:
    """`ByteFallback`: a run of byte tokens `<0xXX>` (whole tokens) becomes one token of its
    UTF-8, or one U+FFFD token a byte when the run is no UTF-8. A character goes out at its last
    byte; bytes of a character not yet complete wait; once a byte shows the run is no UTF-8, it,
    the waiting bytes and every later byte of the run go out as U+FFFD, as do the waiting bytes
    when the run ends."""

    def __init__(self):
        self.utf8 = codecs.getincrementaldecoder("utf-8")("strict")
        self.waiting = 0  # bytes of the run's next character so far
        self.broken = False  # the run is no UTF-8
        self.started = False  # some of the run's text went out (its token started)

    def __call__(self, items):
        out = []
        for new, text in items:
            if not BYTE_TOKEN.fullmatch(text):
                self._end(out)
                out.append((new, text))
            elif self.broken:
                out.append((True, INCOMPLETE))
            else:
                try:
                    chars = self.utf8.decode(bytes((int(text[3:5], 16),)))
                except UnicodeDecodeError:
                    out += [(True, INCOMPLETE)] * (self.waiting + 1)
                    self.broken, self.waiting = True, 0
                    continue
                if chars:
                    out.append((not self.started, chars))
                    self.started, self.waiting = True, 0
                else:
                    self.waiting += 1
        return out

    def _end(self, out):
        out += [(True, INCOMPLETE)] * self.waiting
        self.utf8.reset()
        self.waiting, self.broken, self.started = 0, False, False


def _steps(config: dict) -> list[dict]:
    """A decoder's steps in order, Sequences opened."""
    if config.get("type") == "Sequence":
        return [step for inner in config["decoders"] for step in _steps(inner)]
    return [config]


def sentencepiece_stages(config: dict) -> list | None:
    """Stage factories replaying a decoder (its JSON), or None when one of its steps is not
    reproduced exactly here: another type, a regex Replace, a Replace of several characters once
    tokens arrive in pieces (after ByteFallback or Fuse), a Strip of trailing characters, a
    ByteFallback after Fuse or a second one, a step that touches U+FFFD (bytes still waiting
    show as U+FFFD in a decode: a step that changed them could change text already out)."""
    stages = []
    whole = True  # tokens arrive whole
    for step in _steps(config):
        kind = step.get("type")
        if kind == "Replace":
            pattern, content = step["pattern"].get("String"), step["content"]
            if not pattern or (len(pattern) > 1 and not whole):
                return None
            stages.append(partial(Replace, pattern, content))
            touched = pattern
        elif kind == "Metaspace":
            scheme, touched = step.get("prepend_scheme"), step["replacement"]
            if scheme not in ("always", "first", "never"):
                return None
            stages.append(partial(Metaspace, touched, scheme != "never"))
        elif kind == "Strip":
            if step["stop"]:
                return None
            touched = step["content"]
            stages.append(partial(Strip, touched, step["start"]))
        elif kind in ("Fuse", "ByteFallback"):
            if kind == "ByteFallback" and not whole:
                return None
            whole, touched = False, ""
            stages.append(Fuse if kind == "Fuse" else ByteFallback)
        else:
            return None
        if INCOMPLETE in touched:
            return None
    return stages


class SentencePieceText:
    """One request's text of a SentencePiece-style tokenizer: each token through the stages."""

    def __init__(self, tokens: DecoderTokens, stages: list):
        self.tokens = tokens
        self.stages = [make() for make in stages]

    def add(self, token: int) -> str:
        text = self.tokens(token)
        if text is None:
            return ""
        items = [(True, text)]
        for stage in self.stages:
            items = stage(items)
        return "".join(text for _, text in items)


# ------------------------------------------------------------------ per tokenizer


class _Decoding:
    """What the streams of one tokenizer share: its id -> string table and how it decodes."""

    def __init__(self, tokenizer):
        self.tokens = DecoderTokens(tokenizer)
        self.bytes = self.stages = None
        if tokenizer.decoder is None:  # decode joins the tokens with spaces
            return
        try:
            config = json.loads(tokenizer.decoder.__getstate__())
        except Exception:  # a custom (Python) decoder
            return
        if config.get("type") == "ByteLevel":
            self.bytes = BytePieces(self.tokens)
        else:
            self.stages = sentencepiece_stages(config)

    def may_close(self, token: int) -> bool:
        """Whether text may end closed after `token` (one decode keeps): no byte token that a
        ByteFallback would join to a next one (each step of a decoder replayed here works per
        token but ByteFallback's, per run of byte tokens, and Fuse, which joins every token),
        no byte-level token ending in a character's first byte."""
        if self.bytes is not None:
            piece = self.bytes(token)
            return not piece or not 0xC2 <= piece[-1] <= 0xF4
        if not BYTE_TOKEN.fullmatch(self.tokens(token)):
            return True
        return self.stages is not None and ByteFallback not in self.stages

    def whole_run(self, prompt: list[int], last: int) -> bool:
        """Whether prompt[last], a byte token of a decoder with ByteFallback, ends a run of byte
        tokens (those decode keeps) that is whole UTF-8: ByteFallback decodes a run at once, so
        text may end closed there (a prompt whose text after a special token is only
        byte-fallback characters, emoji or CJK past the vocabulary, otherwise had no tail, and
        its output read as a text's start: its first space stripped). Runs longer than
        MAX_RUN_CHECKED tokens are not read (False)."""
        if self.stages is None or ByteFallback not in self.stages:
            return False
        run = bytearray()
        for token in reversed(prompt[max(0, last - MAX_RUN_CHECKED) : last + 1]):
            text = self.tokens(token)
            if text is None:  # decode leaves it out: the run goes on past it
                continue
            if not BYTE_TOKEN.fullmatch(text):
                break
            run.append(int(text[3:5], 16))
        else:
            if last >= MAX_RUN_CHECKED:  # the run may start before the tokens read
                return False
        try:
            bytes(reversed(run)).decode("utf-8")
        except UnicodeDecodeError:
            return False
        return bool(run)

    def closes(self, tokenizer, tail: list[int], last: int) -> bool:
        """Whether the text of `tail`, whose last token decode keeps is `last` (`may_close`),
        ends closed: a byte-level BPE's bytes with no character's first bytes waiting (an ASCII
        byte last, or the tail's bytes through the UTF-8 decoder), a decoder replayed here
        (no run of byte tokens is open), another decoder's decode ending in no U+FFFD."""
        if self.bytes is not None:
            piece = self.bytes(last)
            return not piece or piece[-1] < 0x80 or not self.stream(tail).is_open()
        if self.stages is not None:
            return True
        return not tokenizer.decode(tail).endswith(INCOMPLETE)

    def stream(self, tail=()) -> ByteLevelText | SentencePieceText | None:
        if self.bytes is not None:
            stream = ByteLevelText(self.bytes)
        elif self.stages is not None:
            stream = SentencePieceText(self.tokens, self.stages)
        else:
            return None
        for token in tail:
            stream.add(token)
        return stream


_DECODINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _decoding(tokenizer) -> _Decoding | None:
    """What is read of a `tokenizers.Tokenizer` once (per tokenizer); None for another kind."""
    if not type(tokenizer).__module__.startswith("tokenizers"):
        return None
    try:
        decoding = _DECODINGS.get(tokenizer)
        if decoding is None:
            decoding = _DECODINGS[tokenizer] = _Decoding(tokenizer)
    except TypeError:  # no weak reference to it
        decoding = _Decoding(tokenizer)
    return decoding


def incremental_text(tokenizer, tail=()) -> ByteLevelText | SentencePieceText | None:
    """A new stream of output text for one request when `tokenizer` is a `tokenizers.Tokenizer`
    whose decoder is replayed here, else None; it continues `tail` (`prompt_tail`)."""
    decoding = _decoding(tokenizer)
    return None if decoding is None else decoding.stream(tail)


TAIL = 4  # the prompt tokens decode keeps that an output's text continues (vLLM reads 4-5)
MAX_RUN_CHECKED = 256  # byte tokens read back to tell whether a prompt's last run is whole


def prompt_tail(tokenizer, prompt_ids) -> list[int]:
    """The prompt's last tokens an output's text continues: up to `TAIL` tokens that decode
    keeps (and the special tokens among and after them), ending at the prompt's end, or, while
    the text there is open (a byte-level character's first bytes, a run of byte-fallback
    tokens, a decode ending in U+FFFD), before its last kept token, then the one before, ...;
    [] when no kept token ends the text closed (the output then reads as a text's start).
    A token that leaves the text open costs a dict look-up or a few tokens' text."""
    decoding = _decoding(tokenizer)
    tokens = decoding.tokens if decoding is not None else (lambda token: "")
    prompt = list(prompt_ids)
    end = len(prompt)
    while end:
        last = end - 1  # the last token decode keeps, before `end`
        while last >= 0 and tokens(prompt[last]) is None:
            last -= 1
        if last < 0:
            return []
        if (
            decoding is None
            or decoding.may_close(prompt[last])
            or decoding.whole_run(prompt, last)
        ):
            start, kept = last, 1
            while start and kept < TAIL:
                start -= 1
                kept += tokens(prompt[start]) is not None
            tail = prompt[start:end]
            if decoding is not None:
                if decoding.closes(tokenizer, tail, prompt[last]):
                    return tail
            elif not tokenizer.decode(tail).endswith(INCOMPLETE):
                return tail
        end = last
    return []


def continuation(tokenizer, tail, ids) -> str:
    """The text of output `ids` after the prompt's `tail` (`prompt_tail`): decode(tail + ids)
    less decode(tail) (decode(ids) when the tail is empty, or not a prefix of it)."""
    if not tail:
        return tokenizer.decode(list(ids))
    head, whole = tokenizer.decode(list(tail)), tokenizer.decode([*tail, *ids])
    return whole[len(head) :] if whole.startswith(head) else tokenizer.decode(list(ids))
