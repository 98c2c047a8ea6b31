"""Verify k draft tokens against the target: greedy (longest prefix equal to the target argmax,
then the target's own token) or, for sampled rows, rejection sampling (accept d with probability
min(1, p(d)/q(d)), else resample from norm(max(p - q, 0)); the bonus token comes from p) or,
with `match`, the token plain sampling draws at each position (the same random numbers of the
same seed and position, executor/sampling.py's race): a draft is accepted when it equals it, and
the first that does not is replaced by it. Both are lossless; `match` also makes a seeded
request's output the plain run's whatever was drafted (any k, any mix of drafting and plain
steps; where the verify forward's logits equal the plain step's, as greedy equality needs too),
at the price of accepting a draft only when the drafter drew that very token (drafters race with
the same per-token numbers then, `Drafter.match_samples`). k = 0 is plain sampling."""

from __future__ import annotations

import torch

from speculant.executor.forward_batch import SamplingInfo
from speculant.executor.sampling import (
    GREEDY,
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    argmax,
    filtered_probs,
    race,
    uniform,
)


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    info: SamplingInfo,
    positions: torch.Tensor,
    variant: str,
    match: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [bs, T, V] at input positions [bs, T]; drafts [bs, T-1] are the inputs 1..T-1;
    draft_probs [bs, T-1, V] when drafts were sampled, None when they were argmax (one-hot q).

    Returns out_tokens [bs, T] (accepted drafts, then the corrected or bonus token, then -1) and
    accept_len [bs] (tokens emitted, 1..T)."""
    k = drafts.shape[1]
    target_argmax = argmax(logits)
    accepted = drafts == target_argmax[:, :k]
    candidates = target_argmax
    if variant != GREEDY:
        out_pos = positions + 1  # the position of the token each input predicts
        min_p = None if info.min_p is None else info.min_p[:, None]
        p = filtered_probs(
            logits, info.temperature[:, None], info.top_k[:, None], info.top_p[:, None], min_p,
            variant,
        )  # fmt: skip
        if match:  # what plain sampling draws at each position decides, not the drafts
            sampled = race(p, info.seed[:, None], out_pos, STREAM_SAMPLE)
            sampled_accepted = drafts == sampled[:, :k]
        else:
            sampled, sampled_accepted = _rejection(p, drafts, draft_probs, info, out_pos)
        greedy_row = info.is_greedy[:, None]
        accepted = torch.where(greedy_row, accepted, sampled_accepted)
        candidates = torch.where(greedy_row, target_argmax, sampled)
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # leading run of accepted drafts
    index = torch.arange(k + 1, device=logits.device)
    padded_drafts = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], dim=1)
    out = torch.where(index < num_accepted[:, None], padded_drafts, candidates)
    out = torch.where(index <= num_accepted[:, None], out, torch.full_like(out, -1))
    return out, num_accepted + 1


def _rejection(p, drafts, draft_probs, info, out_pos):
    """Rejection sampling: the candidates [bs, T] (the residual's sample at each draft position,
    p's after the last) and which drafts pass their accept test [bs, k]. Overwrites p."""
    k = drafts.shape[1]
    p_draft = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u_accept = uniform(info.seed[:, None], out_pos[:, 1:], STREAM_ACCEPT)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = p[:, :k].scatter(-1, drafts.unsqueeze(-1), 0.0)
    else:
        q_draft = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        residual = (p[:, :k] - draft_probs).clamp_(min=0.0)
    # If p == q exactly the residual is empty, and a rejection cannot happen; keep p there.
    empty = residual.sum(-1, keepdim=True) <= 0
    torch.where(empty, p[:, :k], residual, out=residual)
    p[:, :k] = residual  # p is read no more: the residuals, then p after the last draft
    del residual
    sampled = race(p, info.seed[:, None], out_pos, STREAM_SAMPLE)
    return sampled, u_accept * q_draft < p_draft
