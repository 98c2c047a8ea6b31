"""Log-probabilities of emitted tokens (`SamplingParams.logprobs`, vLLM's `raw_logprobs`): what
a step computes on the device, how the values travel in the step's one packed int64 read-back,
and how the host reads a row of them back.

Layout of one row of `width` positions with n alternatives each: first, per position, the
chosen token's log-probability and the n most likely ones' (float32 bits in int64 columns),
then, per position, those n ids: `width (1 + 2 n)` columns, ahead of the tokens, drafts and
accept_len (model_runner.StepOutput)."""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from speculant.kernels.ops import TORCH_OPS, TorchOps

NEG_INF = float("-inf")


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int, ops: TorchOps = TORCH_OPS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities under the raw logits (log_softmax, no temperature, top-k or top-p:
    vLLM's default `raw_logprobs`): of `tokens` [...] (-1, no token, reads id 0) at logits
    [..., V], and the `num_top` most likely ids and theirs, most likely first (`ops`: the
    backend's, whose `top_logprobs` reads the logits once on the GPU). Returns chosen [...]
    float32, top values [..., num_top] float32, top ids [..., num_top] int64."""
    logits = logits.float()
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    norm, values, ids = ops.top_logprobs(logits.reshape(-1, vocab), num_top)
    chosen = logits.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1) - norm.view(lead)
    return chosen, values.view(*lead, num_top), ids.view(*lead, num_top)


def pack_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int, ops: TorchOps = TORCH_OPS
) -> torch.Tensor:
    """The log-probabilities of `tokens` [bs, T] at logits [bs, T, V] and the `num_top` most
    likely there (`token_logprobs`), as int64 columns [bs, T (1 + 2 num_top)]
    that travel in a step's packed read-back: per position the chosen value and the top values
    (float32 bits), then per position the top ids. `unpack_logprobs` reads a row back."""
    chosen, values, ids = token_logprobs(logits, tokens, num_top, ops)
    floats = torch.cat([chosen.unsqueeze(-1), values], dim=-1).reshape(tokens.shape[0], -1)
    bits = floats.contiguous().view(torch.int32).to(torch.int64)
    return torch.cat([bits, ids.reshape(tokens.shape[0], -1)], dim=1)


def logprob_columns(width: int, num_top: int | None) -> int:
    """Columns `pack_logprobs` gives a row of `width` positions (0 when none are computed)."""
    return 0 if num_top is None else width * (1 + 2 * num_top)


def unpack_logprobs(row: list[int], width: int, num_top: int) -> TokenLogprobs:
    """A host row whose first `logprob_columns(width, num_top)` columns are `pack_logprobs`',
    as read (no copy): the request keeps the columns of the tokens it keeps
    (`KeptLogprobs.add`)."""
    return TokenLogprobs(row, width, num_top)


def widen(packed: torch.Tensor, width: int, full: int, n: int) -> torch.Tensor:
    """`pack_logprobs` columns of `width` positions (n alternatives each) laid out as those of
    `full` positions (the positions past `width` zero), so that every row of an extend step
    reads alike."""
    if width == full:
        return packed
    floats, ids = packed[:, : width * (1 + n)], packed[:, width * (1 + n) :]
    rows = packed.shape[0]
    out = packed.new_zeros((rows, full * (1 + 2 * n)))
    out[:, : width * (1 + n)] = floats
    out[:, full * (1 + n) : full * (1 + n) + width * n] = ids
    return out


@dataclass
class TokenLogprobs:
    """One step's log-probabilities for one row as read back: the first
    `logprob_columns(width, n)` of `columns` (`pack_logprobs`' of `width` positions, n
    alternatives each; the row's other columns follow)."""

    columns: list[int]
    width: int
    n: int  # alternatives computed per position (the engine's max_logprobs)


class KeptLogprobs:
    """A request's log-probabilities as its steps read them back, for the tokens it kept: per
    token the chosen token's value and the n most likely ones' (float32 bits), and those n ids,
    in two flat arrays. A step adds no object per token (a tuple and a row per token, which
    the garbage collector scanned for the rest of the request, were most of the host's cost);
    the entries are decoded when the request's output is made (`entries`)."""

    def __init__(self, n: int):
        self.n = n  # alternatives computed per position (the engine's max_logprobs)
        self.bits = array.array("i")  # per token: the chosen value, then the n most likely
        self.ids = array.array("q")  # per token: the n most likely ids, most likely first

    def add(self, step: TokenLogprobs, count: int) -> None:
        """Keep the values of a step's first `count` positions (the tokens the request kept)."""
        n, columns = step.n, step.columns
        self.bits.fromlist(columns[: count * (1 + n)])
        ids = step.width * (1 + n)
        self.ids.fromlist(columns[ids : ids + count * n])

    def entries(self, tokens: list[int], keep: int) -> list[dict[int, float]]:
        """Per kept token (`tokens`, one each), {the token: its log-probability, then the
        `keep` most likely: theirs} (vLLM's layout; the token not repeated when among them).
        Alternatives of log-probability -inf are left out: the Triton kernel gives a row with
        fewer finite logits than asked id -1 for the rest (no token), the torch reference their
        real ids; either way the same entries. Every value is decoded in one conversion."""
        n = self.n
        if len(self.bits) != len(tokens) * (1 + n):
            raise ValueError(
                f"{len(tokens)} tokens for the log-probabilities of {len(self.bits) // (1 + n)}"
            )
        values = array.array("f", self.bits.tobytes()).tolist()
        ids = self.ids.tolist()
        keep = min(keep, n)
        out = []
        for p, token in enumerate(tokens):
            base, top = p * (1 + n), p * n
            entry = {token: values[base]}
            for j, top_id in enumerate(ids[top : top + keep], base + 1):
                if top_id >= 0 and values[j] != NEG_INF:
                    entry.setdefault(top_id, values[j])
            out.append(entry)
        return out
