"""Requests as the user sees them (SamplingParams, RequestOutput) and as the scheduler tracks
them (Request)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from itertools import chain
from numbers import Integral, Real
from typing import TYPE_CHECKING

import numpy as np

from speculant.errors import SpeculantError, shown
from speculant.executor.stop_strings import StopStrings

if TYPE_CHECKING:
    from speculant.executor.logprobs import KeptLogprobs, TokenLogprobs

# Temperatures below this sample greedily: logits / T overflows float32 long before T reaches 0
# (a subnormal T turns every logit into inf), and so does vLLM (its _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds and top_k travel to the device as int64
FLOAT32_MAX = float(np.finfo(np.float32).max)  # temperatures and top_p travel as float32
MAX_LOGPROBS = 1024  # alternatives per token a request may ask for (each step sorts them out)
MAX_N = 4096  # completions one prompt may ask for


def is_integer(value: object) -> bool:
    """An int (or numpy integer), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_bool(value: object) -> bool:
    """A bool or numpy's (1 and 0 are not)."""
    return isinstance(value, (bool, np.bool_))


def is_number(value: object) -> bool:
    """A finite int or float (or numpy scalar), not a bool: NaN and inf are not numbers here."""
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How to decode one request. temperature 0 is greedy (so is any below GREEDY_TEMPERATURE);
    top_k 0 (or -1, vLLM's older default) and top_p 1 are off."""

    max_new_tokens: int = 64
    # completions of the prompt (vLLM's n): each its own request (own seed: independent samples
    # when sampled), outputs n per prompt, RequestOutput.sample_index 0..n-1
    n: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    # keep only tokens at least min_p times as likely as the most likely (0: off; vLLM's min_p,
    # applied before top-k and top-p as vLLM applies it)
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # text that ends the request where it appears in the output (a string or a list of them);
    # the output text stops before it, or after it with include_stop_str_in_output (which also
    # keeps the text of a stop token or EOS that ended it)
    stop: tuple[str, ...] | str | None = ()
    include_stop_str_in_output: bool = False
    # per output token its log-probability under the target (log_softmax of the raw logits,
    # before temperature, top-k and top-p: vLLM's default "raw_logprobs") and those of the
    # `logprobs` most likely tokens there; None: none kept. The engine computes them only when
    # built with max_logprobs (Engine(max_logprobs=N), --max-logprobs N) at least this large
    logprobs: int | None = None

    def __setattr__(self, name: str, value: object) -> None:
        # a field it lacks (vLLM's max_tokens, min_tokens, penalties) would be kept and ignored
        if name not in self.__dataclass_fields__:
            raise AttributeError(
                f"SamplingParams has no field {name!r}, so it cannot be set; its fields: "
                f"{', '.join(self.__dataclass_fields__)}"
            )
        object.__setattr__(self, name, value)

    def validate(self) -> SamplingParams:
        """Raise on a value that cannot be right, naming it; else the params a request runs
        with: these, or a copy whose temperature below GREEDY_TEMPERATURE is 0 (greedy). The
        caller's object is never changed (one object may serve many prompts and calls)."""
        if not is_integer(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise SpeculantError(
                f"max_new_tokens={self.max_new_tokens!r} must be an integer of at least 1"
            )
        if not is_integer(self.n) or not 1 <= self.n <= MAX_N:
            raise SpeculantError(
                f"n={self.n!r} must be an integer in 1..{MAX_N} (completions of the prompt)"
            )
        if not is_number(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise SpeculantError(
                f"temperature={self.temperature!r} must be a finite number in 0..{FLOAT32_MAX:.4g} "
                "(float32; 0 is greedy)"
            )
        if not is_integer(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            raise SpeculantError(
                f"top_k={self.top_k!r} must be an integer in 0..{INT64_MAX} (0 or -1 turns it "
                "off, as in vLLM)"
            )
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise SpeculantError(f"top_p={self.top_p!r} must be in (0, 1] (1 turns it off)")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise SpeculantError(f"min_p={self.min_p!r} must be in [0, 1] (0 turns it off)")
        if self.seed is not None and not (
            is_integer(self.seed) and INT64_MIN <= self.seed <= INT64_MAX
        ):
            raise SpeculantError(
                f"seed={self.seed!r} must be an integer in {INT64_MIN}..{INT64_MAX} (int64)"
            )
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (list, tuple, set, frozenset)):
            raise SpeculantError(
                f"stop_token_ids={stops!r} must be a list of token ids, e.g. [{stops!r}]"
                if is_integer(stops)
                else f"stop_token_ids={stops!r} must be a list of token ids"
            )
        if any(not is_integer(t) or not 0 <= t <= INT64_MAX for t in stops):
            raise SpeculantError(f"stop_token_ids={self.stop_token_ids!r} must be token ids >= 0")
        if not is_bool(self.ignore_eos):
            raise SpeculantError(f"ignore_eos={self.ignore_eos!r} must be True or False")
        if problem := stop_problem(self.stop):
            raise SpeculantError(f"stop={shown(self.stop)} {problem}")
        if not is_bool(self.include_stop_str_in_output):
            raise SpeculantError(
                f"include_stop_str_in_output={self.include_stop_str_in_output!r} must be True or "
                "False"
            )
        if self.logprobs is not None and not (
            is_integer(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise SpeculantError(
                f"logprobs={self.logprobs!r} must be None or an integer in 0..{MAX_LOGPROBS} (the "
                "alternatives kept per token; 0: the chosen token's log-probability alone)"
            )
        changes = {}
        if self.top_k == -1:  # vLLM's older "off"
            changes["top_k"] = 0
        if 0 < self.temperature < GREEDY_TEMPERATURE:
            changes["temperature"] = 0.0
        if not isinstance(self.stop, tuple):  # None, one string or a list: a tuple of them
            stop = () if self.stop is None else self.stop
            changes["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        return dataclasses.replace(self, **changes) if changes else self


def stop_problem(stop: object) -> str | None:
    """What is wrong with a `stop` value (None, a string or a list of non-empty strings of
    valid Unicode), None when nothing is: SamplingParams and the CLI's --stop / "stop" share
    it."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)):
        return "must be a string or a list of strings"
    for text in stops:
        if not isinstance(text, str):
            return f"holds {shown(text)} ({type(text).__name__}); stop strings are strings"
        if not text:
            return "holds an empty string, which would end every request at once; remove it"
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (
                f"holds {shown(text)}, whose character {exc.start} is a lone surrogate (not "
                "valid Unicode); fix the text"
            )
        if "\ufffd" in text:
            return (
                f"holds {shown(text)} with U+FFFD, the character a decode writes for bytes that "
                "are not yet (or never) a whole character, so it cannot be matched reliably; "
                "remove that character"
            )
    return None


@dataclass
class RequestOutput:
    """A finished request: its tokens, text (when a tokenizer exists) and statistics."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (EOS, a stop token or a stop string) or "length"
    stats: dict = field(default_factory=dict)
    # the stop string or stop token id that ended it; None for EOS and "length" (as vLLM)
    stop_reason: str | int | None = None
    # with SamplingParams.logprobs: per output token {token id: log-probability}, the chosen
    # token first, then the `logprobs` most likely in order (vLLM's layout; the chosen one is
    # not repeated when it is among them), and their sum over the chosen tokens
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    sample_index: int = 0  # which of the prompt's n completions (SamplingParams.n)
    n: int = 1  # the prompt's completions

    @property
    def key(self) -> tuple[int, int]:
        """(index, sample_index): one completion's place among a call's outputs."""
        return self.index, self.sample_index

    def _head(self) -> dict:
        """The line's first fields (`to_json`), before the log-probabilities and stats."""
        return {
            "index": self.index,
            **({"sample_index": self.sample_index} if self.n > 1 else {}),
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }

    def to_json(self) -> dict:
        line = self._head()
        if self.logprobs is not None:  # JSON keys are strings: pairs keep the ids integers
            line["logprobs"] = [[[t, lp] for t, lp in step.items()] for step in self.logprobs]
            line["cumulative_logprob"] = self.cumulative_logprob
        return {**line, **self.stats}

    def json_line(self) -> str:
        """Its --output line: `json.dumps(self.to_json()) + "\n"`, the same text, with the
        log-probabilities written by `logprobs_json` (no list per [id, value] pair) between
        the head's and the stats' json.dumps."""
        head = self._head()
        if self.logprobs is None or any(
            key in head or key in ("logprobs", "cumulative_logprob") for key in self.stats
        ):  # (a stat named like a field would take its place: to_json's merge)
            return json.dumps(self.to_json()) + "\n"
        stats = json.dumps(self.stats)[1:] if self.stats else "}"
        return (
            f'{json.dumps(head)[:-1]}, "logprobs": {logprobs_json(self.logprobs)}, '
            f'"cumulative_logprob": {json.dumps(self.cumulative_logprob)}'
            f"{', ' if self.stats else ''}{stats}\n"
        )


def logprobs_json(entries: list[dict[int, float]]) -> str:
    """`json.dumps` of an output line's "logprobs" (`RequestOutput.to_json`: per token its
    [id, value] pairs in the entry's order) as one %-format of every id and value, no list per
    pair: the same text when ids are ints and values floats (%d and %r write them as json.dumps
    does, but the infinities and NaN, renamed after: no other number's text has an "n")."""
    pairs = {m: "[" + ", ".join(["[%d, %r]"] * m) + "]" for m in set(map(len, entries))}
    template = "[" + ", ".join([pairs[len(entry)] for entry in entries]) + "]"
    text = template % tuple(chain.from_iterable(chain.from_iterable(map(dict.items, entries))))
    if "n" in text:
        text = text.replace("inf", "Infinity").replace("nan", "NaN")
    return text


@dataclass(eq=False)  # identity: the scheduler's list lookups must not compare token lists
class Request:
    """Scheduler-side state of one request (one completion of a prompt)."""

    index: int  # unique in a generate call (its place among the completions of every prompt)
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new_tokens: int  # after capping at max_model_len
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    row: int = -1  # request-pool row in req_to_page
    next_input: list[int] = field(default_factory=list)  # last token, then the drafts
    finish_reason: str | None = None
    num_verify_steps: int = 0
    num_plain_steps: int = 0  # decode steps without drafts to verify (adaptive speculation)
    emitted_in_verify: int = 0
    decode_seconds: float = 0.0  # wall time of the decode steps (verify + draft) it took part in
    accepted_per_position: list[int] = field(default_factory=list)
    num_computed: int = 0  # context positions in the KV cache (prefilled so far, this residency)
    num_cached: int = 0  # of them, positions taken from the prefix cache at admission
    # a chunk of this residency ran while the drafter rested (its drafter K/V unwritten): its
    # pages are not offered to the prefix cache
    drafter_gap: bool = False
    num_preemptions: int = 0
    stop_text: StopStrings | None = None  # the output text, watched for params.stop
    stop_reason: str | int | None = None  # the stop string or stop_token_ids entry that ended it
    # with params.logprobs: the output tokens' values as their steps read them back
    # (RequestOutput.logprobs decodes them when the request ends)
    logprobs: KeptLogprobs | None = None
    prompt_index: int = -1  # the prompt's place in the call (-1: index)
    sample_index: int = 0  # which of its params.n completions
    # the first completion of the same prompt in this run (Engine.run; None: this is it): once
    # that one has prefilled the prompt, this one takes the prompt's whole pages from it
    # (scheduler.py)
    first_completion: Request | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.prompt_index < 0:
            self.prompt_index = self.index

    @property
    def context(self) -> list[int]:
        """What a (re)admitted request prefills: the prompt, then all but its newest output
        token (the newest is the next step's input)."""
        return self.prompt_ids + self.output_ids[:-1]

    @property
    def is_decoding(self) -> bool:
        """Its whole context is cached: it verifies (or decodes) each step."""
        return bool(self.next_input)

    def record_verify(self, emitted: int) -> None:
        """Count one verify step that emitted `emitted` tokens the request kept (accepted drafts
        + 1, less any past max_new_tokens or a stop token)."""
        self.num_verify_steps += 1
        self.emitted_in_verify += emitted
        for position in range(emitted - 1):
            self.accepted_per_position[position] += 1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def append(self, tokens: list[int], logprobs: TokenLogprobs | None = None) -> None:
        """Add emitted tokens, stopping at a stop token, a stop string or the length limit (in
        that order, as vLLM checks them); tokens after the one that ended it are dropped.
        `logprobs`: the step's log-probabilities of these tokens' positions, kept for the
        tokens kept when the request keeps logprobs."""
        before = len(self.output_ids)
        for token in tokens:
            self.output_ids.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
                if token in self.params.stop_token_ids:  # EOS itself is no stop reason
                    self.stop_reason = token
                break
            if self.stop_text is not None and (stop := self.stop_text.add(token)) is not None:
                self.finish_reason, self.stop_reason = "stop", stop
                break
            if len(self.output_ids) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.logprobs is not None:
            self.logprobs.add(logprobs, len(self.output_ids) - before)
