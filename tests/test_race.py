"""The sampler's exponential race (executor/sampling.py `race`, kernels/race.py): draws follow
the distribution, are keyed by target token id (a drafter's draw over its own vocabulary order
meets the target's token for token), move with a logit's last-bit noise only at near-ties, and
the Triton kernel (interpreted on the CPU, compiled on CUDA) draws what the torch reference
draws."""

from __future__ import annotations

import pytest
import torch
from helpers_triton import DEVICES

from speculant.executor.sampling import _key, exponential_of_hash, race, uniform
from speculant.kernels import runtime


def test_race_draws_follow_the_distribution():
    """20,000 seeded draws of one 8-token distribution (zeros included): the frequencies fit p
    (chi-square, 7 degrees of freedom, p-value ~1e-4 bound), and a zero-mass token is never
    drawn."""
    p = torch.tensor([0.30, 0.0, 0.05, 0.20, 0.01, 0.14, 0.0, 0.30])
    n = 20_000
    drawn = race(p.expand(n, 8), torch.arange(n) * 7919 + 11, torch.full((n,), 5), 1)
    counts = torch.bincount(drawn, minlength=8).double()
    assert counts[p == 0].sum() == 0
    expected = p.double() * n
    kept = p > 0
    chi2 = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
    assert chi2 < 27.0, (chi2, counts.tolist())  # df 5: P(chi2 > 27) ~ 6e-5


def test_exponentials_resolve_the_small_values_rare_tokens_win_by():
    """A token of probability x relative to the best wins about when its E < x: over both ends
    of the 32-bit hash range (where small E can come from), the count of E below x is x 2^32
    within Poisson noise for x 1e-9 .. 1e-6 (a float32 uniform near 1 resolves 2^-24 ~ 6e-8:
    none below 1e-8), every E is finite and > 0, and E matches float64 -log(1 - w)."""
    ends = torch.cat([torch.arange(0, 1 << 20), torch.arange((1 << 32) - (1 << 20), 1 << 32)])
    e = exponential_of_hash(ends)
    assert torch.isfinite(e).all() and (e > 0).all()
    for x in (1e-9, 1e-8, 1e-7, 1e-6):
        expected = x * 2**32
        assert abs(int((e < x).sum()) - expected) <= 4 * expected**0.5 + 1, x
    w = (ends.double() + 0.5) / 2**32
    exact = -torch.log1p(-w).clamp(max=-torch.log1p(torch.tensor(-(1 - 2**-24))).item())
    small = w < 0.5
    torch.testing.assert_close(e[small].double(), exact[small], rtol=2e-6, atol=0)


def test_race_is_keyed_by_token_id():
    """A distribution laid out in another vocabulary order (a drafter's own) races with the
    target's numbers when given each index's target id: the same target token for every seed
    (what `--sampled-verify match` accepts by); without the ids the draws mostly differ."""
    gen = torch.Generator().manual_seed(3)
    n, vocab = 500, 300
    p = torch.softmax(torch.randn(n, vocab, generator=gen), -1)
    order = torch.randperm(vocab, generator=gen)  # index j of the drafter's vocab is token order[j]
    seed, pos = torch.arange(n) + 100, torch.full((n,), 9)
    target = race(p, seed, pos, 1)
    drafter = order[race(p[:, order], seed, pos, 1, order)]
    assert torch.equal(drafter, target)
    assert (order[race(p[:, order], seed, pos, 1)] == target).float().mean() < 0.2


def test_race_moves_only_at_near_ties_under_last_bit_noise():
    """Logits with 1e-6 relative noise (a batch shape's last-bit change): the race's draws stay
    (at most 1 of 1,000 rows at a 32k vocabulary), where the inverse-CDF sampler it replaced
    moved 8 (it is reimplemented here as the contrast)."""
    gen = torch.Generator().manual_seed(0)
    n, vocab = 1000, 32768
    moved_race = moved_cdf = 0
    for start in range(0, n, 250):
        logits = torch.randn(250, vocab, generator=gen) * 3
        noisy = logits * (1 + 1e-6 * torch.randn(250, vocab, generator=gen))
        p, q = torch.softmax(logits, -1), torch.softmax(noisy, -1)
        seed, pos = torch.arange(start, start + 250), torch.full((250,), 17)
        moved_race += (race(p, seed, pos, 1) != race(q, seed, pos, 1)).sum().item()
        u = uniform(seed, pos, 1)
        moved_cdf += (inverse_cdf(p, u) != inverse_cdf(q, u)).sum().item()
    assert moved_race <= 1, (moved_race, moved_cdf)
    assert moved_cdf >= 5, moved_cdf  # the contrast: the noise is large enough to matter


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ids_kind", ["none", "shared", "rows"])
def test_race_kernel_equals_the_torch_reference(device, ids_kind):
    """kernels/race.py draws the reference's index for every row: vocabularies with a partial
    last block, zeros (a top-k cut), ids None / one map / one per row, any split of a row."""
    from speculant.kernels import race as kernel

    gen = torch.Generator().manual_seed(hash(ids_kind) % 1000)
    rows, vocab = (5, 4500) if device == "cpu" else (96, 152_064)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[: rows // 2, vocab // 3 :] = float("-inf")  # rows whose tail has no mass
    probs = torch.softmax(logits, -1)
    seed = torch.randint(0, 2**62, (rows,), generator=gen)
    pos = torch.randint(0, 10_000, (rows,), generator=gen)
    ids = {
        "none": None,
        "shared": torch.randperm(vocab, generator=gen),
        "rows": torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)]),
    }[ids_kind]
    want = race(probs, seed, pos, 2, ids)  # the torch reference on the CPU
    key = _key(seed, pos, 2)
    on = {"device": device}
    moved = lambda t: None if t is None else t.to(**on)  # noqa: E731
    for parts in (1, 2, 3, None):
        got = kernel.race(probs.to(**on), key.to(**on), moved(ids), parts=parts).cpu()
        assert torch.equal(got, want), (parts, (got != want).nonzero().flatten().tolist())
    if device == "cuda":  # executor/sampling.py's race takes the kernel on CUDA, 3-D included
        got = race(probs.view(rows, 1, vocab).cuda(), seed[:, None].cuda(), pos[:, None].cuda(),
                   2, moved(ids if ids is None or ids.dim() == 1 else ids[:, None]))  # fmt: skip
        assert torch.equal(got.view(-1).cpu(), want)


@pytest.mark.needs("triton")
@pytest.mark.skipif(not runtime.INTERPRET, reason="runs the kernel on the CPU: the interpreter")
def test_the_kernel_is_used_only_after_it_draws_what_torch_draws(monkeypatch, caplog):
    """executor/sampling.py checks the kernel once per device against the torch reference
    before using it: a kernel that draws the reference's tokens is taken; one that draws
    others, or fails to build, is refused with one warning and the torch reference samples."""
    from speculant.executor import sampling
    from speculant.kernels import race as kernel

    check = sampling._race_kernel.__wrapped__  # uncached: each call checks again
    cpu = torch.device("cpu")
    assert check(cpu) is kernel.race
    monkeypatch.setattr(kernel, "race", lambda probs, key, ids: probs.argmax(-1))
    assert check(cpu) is None
    assert "drew other tokens than torch" in caplog.text

    def broken(*args):
        raise RuntimeError("PTX build failed")

    monkeypatch.setattr(kernel, "race", broken)
    assert check(cpu) is None
    assert "failed (PTX build failed); sampling with torch" in caplog.text
