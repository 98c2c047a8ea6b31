"""Stop strings (`SamplingParams.stop`, vLLM's semantics): one request's output text, grown a token
at a time as the scheduler appends tokens, watched for the first stop string.

The text is the tokenizer's `decode` of the output ids, grown incrementally as vLLM grows it
(for the usual decoders the same as one decode of them all; a request ended by a stop string
returns this text, cut): each token decodes a window of the last tokens twice (before and after
it) and keeps what the new token added, holding back a trailing U+FFFD (a character whose UTF-8
bytes are split over tokens) until a later token completes it; the whole characters before it
are searched at once, so a stop string ends the request at the token that completes it even when
that token also starts a split character. A stop string is searched for only where new text
could complete it (the last `len(stop) - 1` characters before the new text, and the new text),
so each token costs two short decodes, not one of the whole output.

When a token's text completes a stop string the request ends there ("stop"): the token stays in
the output ids (as in vLLM), any later token of the same verify step is dropped, and the text is
cut before the stop string (or after it, with `include_stop_str_in_output`). Text before the
output (the prompt) is not searched, as in vLLM.

A byte-level BPE (`tokenizers`' ByteLevel decoder: GPT-2, Llama 3, Qwen) decodes ids as one
UTF-8 decode of their tokens' bytes, so its text grows by an incremental UTF-8 decoder fed each
token's bytes (`BytePieces`): each token costs its own bytes, however long a run of bytes that
form no character lasts (the window above re-decodes such a run whole at every token, time
growing with its square: 8,000 such tokens 2.7 s on this project's CPU, 4 ms by their bytes);
trailing U+FFFD are held back alike."""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Sequence

INCOMPLETE = "\ufffd"  # decode's stand-in for the bytes of a character not yet complete


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
    character is in the byte alphabet becomes those bytes, any other token its UTF-8; special
    tokens and ids with no token (both skipped by `decode`) none. Computed per id when first
    asked."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self.special = {i for i, token in added.items() if token.special}
        self.pieces: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        piece = self.pieces.get(token)
        if piece is None:
            text = None if token in self.special or token < 0 else self.tokenizer.id_to_token(token)
            if text is None:
                piece = b""
            elif all(c in CHAR_BYTES for c in text):
                piece = bytes(CHAR_BYTES[c] for c in text)
            else:
                piece = text.encode()
            self.pieces[token] = piece
        return piece


_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_pieces(tokenizer) -> BytePieces | None:
    """The tokenizer's `BytePieces` when it is a `tokenizers.Tokenizer` whose decoder is
    ByteLevel (one per tokenizer), else None."""
    if not type(tokenizer).__module__.startswith("tokenizers"):
        return None
    if type(getattr(tokenizer, "decoder", None)).__name__ != "ByteLevel":
        return None
    try:
        pieces = _PIECES.get(tokenizer)
        if pieces is None:
            pieces = _PIECES[tokenizer] = BytePieces(tokenizer)
    except TypeError:  # no weak reference to it
        pieces = BytePieces(tokenizer)
    return pieces


class StopStrings:
    """The output text of one request so far, and the stop string that ended it, if one did."""

    def __init__(self, tokenizer, stops: Sequence[str], include: bool = False):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.include = include
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:read]
        self.prefix = 0  # the window decoded for each new token starts here ...
        self.read = 0  # ... and the text of ids[prefix:read] is already in self.text
        self.matched: str | None = None  # the stop string that ended the request
        self.pieces = byte_pieces(tokenizer)
        if self.pieces is not None:  # a byte-level BPE: its bytes through one UTF-8 decoder
            self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self.held = 0  # decoded U+FFFD at the end, not yet in text

    def add(self, token: int) -> str | None:
        """Take the next output token; the stop string its text completes, or None."""
        if self.matched is not None:
            raise RuntimeError("a request ended by a stop string took another token")
        if self.pieces is not None:
            decoded = self.utf8.decode(self.pieces(token))
            new = decoded.rstrip(INCOMPLETE)
            if not new:
                self.held += len(decoded)
                return None
            new, self.held = INCOMPLETE * self.held + new, len(decoded) - len(new)
            start = len(self.text)
            self.text = text = self.text + new
            return self._search(text, start)
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read])
        after = decode(self.ids[self.prefix :])
        ready = not after.endswith(INCOMPLETE)  # else a character is still missing bytes
        new = (after if ready else after.rstrip(INCOMPLETE))[len(before) :]
        if not new:
            return None  # nothing printable yet: wait for the next token
        start = len(self.text)
        text = self.text + new
        if ready:  # the window moves on only past whole characters
            self.text = text
            self.prefix, self.read = self.read, len(self.ids)
        return self._search(text, start)

    def _search(self, text: str, start: int) -> str | None:
        """The earliest stop string in `text` that ends at or past `start` (the first listed on
        a tie), which then ends the request: text cut there. None if there is none."""
        found = None  # (position, stop)
        for stop in self.stops:
            at = text.find(stop, max(0, start - len(stop) + 1))
            if at != -1 and (found is None or at < found[0]):
                found = (at, stop)
        if found is None:
            return None
        at, self.matched = found
        self.text = text[: at + len(self.matched) if self.include else at]
        return self.matched
