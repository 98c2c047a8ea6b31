"""Stop strings (`SamplingParams.stop`, vLLM's semantics): one request's output text, grown a token
at a time as the scheduler appends tokens, watched for the first stop string.

The text is the output's text as a continuation of the prompt (executor/detokenize.py
`continuation`: decode(tail + output ids) less decode(tail), the tail the prompt's last few
tokens, as vLLM reads it; a SentencePiece-style decoder's first space kept), grown incrementally
as vLLM grows it (for the usual decoders the same as one decode of them all; a request ended by
a stop string returns this text, cut): the window starts at the tail; each token decodes a
window of the last tokens twice (before and after it) and keeps what the new token added,
holding back a trailing U+FFFD (a character whose UTF-8 bytes are split over tokens) until a
later token completes it; the whole characters before it
are searched at once, so a stop string ends the request at the token that completes it even when
that token also starts a split character. A stop string is searched for only where new text
could complete it (the last `len(stop) - 1` characters before the new text, and the new text),
so each token costs two short decodes, not one of the whole output; the text is kept in
pieces, joined when read, so no token copies it (400,000 words of plain text 1.2 s, 8.5 s
when each token copied it: benchmarks/stop_strings.py --tokens 400000).

When a token's text completes a stop string the request ends there ("stop"): the token stays in
the output ids (as in vLLM), any later token of the same verify step is dropped, and the text is
cut before the stop string (or after it, with `include_stop_str_in_output`). Text before the
output (the prompt) is not searched, as in vLLM.

Where the tokenizer's decoder can be replayed token by token (executor/detokenize.py: byte-level
BPE such as GPT-2, Llama 3, Qwen; SentencePiece style with byte fallback such as Llama 2,
Mistral, Gemma) the text grows by each token's own text instead (`incremental_text`): each token
costs its own text, however long a run of bytes that form no character lasts (the window above
re-decodes such a run whole at every token, time growing with its square: 8,000 such tokens of a
byte-level BPE 2.7 s on this project's CPU, 4 ms by their bytes; <0xE2> tokens of a byte-fallback
tokenizer in Llama 2's layout 9.4 s, 0.03 s replayed: benchmarks/stop_strings.py); trailing
U+FFFD are held back alike."""

from __future__ import annotations

from collections.abc import Sequence

from speculant.executor.detokenize import INCOMPLETE, incremental_text, prompt_tail


class StopStrings:
    """The output text of one request so far, and the stop string that ended it, if one did."""

    def __init__(
        self, tokenizer, stops: Sequence[str], include: bool = False, prompt: Sequence[int] = ()
    ):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.include = include
        tail = prompt_tail(tokenizer, prompt) if prompt else []  # the text continues it
        self.ids: list[int] = list(tail)  # the window's: the prompt's tail, the output's ids
        self.parts: list[str] = []  # the text so far (of ids[:read]), in pieces: `text` joins them
        self.keep = max(map(len, self.stops), default=1) - 1  # a stop string's reach back
        self.tail = ""  # the text's last `keep` characters, where a stop string can begin
        self.prefix = 0  # the window decoded for each new token starts here ...
        self.read = len(tail)  # ... and the text of ids[prefix:read] is already read
        self.matched: str | None = None  # the stop string that ended the request
        self.cut: str | None = None  # the text once a stop string ended the request
        self.stream = incremental_text(tokenizer, tail)  # None: the window
        self.held = 0  # U+FFFD the stream wrote at the end, not yet in text

    @property
    def text(self) -> str:
        """The output text so far; once a stop string ended the request, cut there."""
        if self.cut is not None:
            return self.cut
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    def add(self, token: int) -> str | None:
        """Take the next output token; the stop string its text completes, or None."""
        if self.matched is not None:
            raise RuntimeError("a request ended by a stop string took another token")
        if self.stream is not None:
            decoded = self.stream.add(token)
            new = decoded.rstrip(INCOMPLETE)
            if not new:
                self.held += len(decoded)
                return None
            new, self.held = INCOMPLETE * self.held + new, len(decoded) - len(new)
            return self._search(new, commit=True)
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read])
        after = decode(self.ids[self.prefix :])
        ready = not after.endswith(INCOMPLETE)  # else a character is still missing bytes
        new = (after if ready else after.rstrip(INCOMPLETE))[len(before) :]
        if not new:
            return None  # nothing printable yet: wait for the next token
        if ready:  # the window moves on only past whole characters
            self.prefix, self.read = self.read, len(self.ids)
        return self._search(new, commit=ready)

    def _search(self, new: str, commit: bool) -> str | None:
        """The earliest stop string ending in `new`, the text after the text so far (the first
        listed on a tie), which then ends the request: the text cut there. None if there is
        none; then `new` joins the text if `commit`. Only the tail and `new` are searched, and
        the text is joined only at a match, so a token costs its own text, not the output's."""
        window, start = self.tail + new, len(self.tail)
        found = None  # (position in window, stop)
        for stop in self.stops:
            at = window.find(stop, max(0, start - len(stop) + 1))
            if at != -1 and (found is None or at < found[0]):
                found = (at, stop)
        if found is None:
            if commit:
                self.parts.append(new)
                self.tail = window[-self.keep :] if self.keep else ""
            return None
        at, self.matched = found
        text = self.text  # the text before `new`, which ends with the tail
        end = len(text) - start + at + (len(self.matched) if self.include else 0)
        self.cut = (text + new)[:end]
        return self.matched
