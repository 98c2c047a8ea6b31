"""Sampling checks shared by the drafter tests: one prompt prefilled as many seeded sampled rows
(what the drafters drew for each and the q verify reads), and a chi-square of counts against
expected counts."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from speculant.executor.forward_batch import SamplingInfo
from speculant.executor.sampling import FULL


def seeded_prefill(engine, prompt: list[int], n: int, temperature: float, top_k: int, seeds):
    """Prefill `prompt` as n rows seeded `seeds` [n] (top-p 1): (the sampled tokens [n], the
    drafts [n, k], the q each row's drafts were drawn from [n, k, V])."""
    rows = [engine.kv.allocate(16) for _ in range(n)]
    info = SamplingInfo(
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.int64),
        torch.ones(n),
        seeds,
    )
    tokens, drafts = engine.runner.prefill(rows, [prompt] * n, [0] * n, info, FULL)
    return tokens, drafts, engine.runner.draft_probs[torch.tensor(rows)]


def assert_follows(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """A chi-square of observed `counts` against `expected` counts per token, the bins expected
    fewer than 5 times merged into one (so the approximation holds)."""
    order = expected.argsort(descending=True)
    exp_sorted, obs_sorted = expected[order], counts[order]
    keep = exp_sorted >= 5
    exp = torch.cat([exp_sorted[keep], exp_sorted[~keep].sum()[None]])
    obs = torch.cat([obs_sorted[keep], obs_sorted[~keep].sum()[None]])
    assert keep.sum() >= 5
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 0.001
