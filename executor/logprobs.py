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
    """A host row's `pack_logprobs` columns (its first `logprob_columns(width, num_top)`), kept
    as read: decoded only when the request's output is made (`decode_entries`), so a step costs the
    host a slice per row, not a decode and a dict per token (that cost the job 9%)."""
    return TokenLogprobs(row[: logprob_columns(width, num_top)], width, num_top)


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
    """One step's log-probabilities for one row as read back (`pack_logprobs` columns of
    `width` positions, n alternatives each), decoded by `decode_entries`."""

    columns: list[int]
    width: int
    n: int  # alternatives computed per position (the engine's max_logprobs)


def decode_entries(
    kept: list[tuple[TokenLogprobs, int]], tokens: list[int], keep: int
) -> list[dict[int, float]]:
    """A request's output log-probabilities: per token (its step's columns and position there,
    `kept`), {the token: its log-probability, then the `keep` most likely: theirs} (vLLM's
    layout; the token not repeated when among them). Every step's floats are decoded in one
    conversion (per token that was most of a request's cost: ~3x)."""
    bits, start = array.array("i"), {}
    for step, _ in kept:
        if id(step) not in start:
            start[id(step)] = len(bits)
            bits.extend(step.columns[: step.width * (1 + step.n)])
    values = array.array("f", bits.tobytes()).tolist()
    out = []
    for (step, position), token in zip(kept, tokens, strict=True):
        n = step.n
        base = start[id(step)] + position * (1 + n)
        ids = step.width * (1 + n) + position * n
        entry = {token: values[base]}
        for j, top in enumerate(step.columns[ids : ids + min(keep, n)]):
            entry.setdefault(top, values[base + 1 + j])
        out.append(entry)
    return out
