"""Top-k / top-p without a sort (kernels/rank_filter.py, what filtered_probs runs on CUDA): the
tokens it keeps are those the sorted reference (executor/sampling.py `_rank_filter_`) keeps, on
distinct logits and on logits with many ties (bf16), for every mix of top-k, top-p and tokens
already dropped (min-p), checked against an exact float64 cut; a row's cut does not depend on
the rows beside it; on CUDA, filtered_probs takes it."""

from __future__ import annotations

import pytest
import torch
from helpers_triton import DEVICES

from speculant.executor import sampling
from speculant.kernels import rank_filter


def exact_cut(logits, probs, top_k, top_p, margin=1e-5):
    """(keep [R, V] bool, ambiguous [R] bool): the cut in float64, ranked by logit (equal ones
    lower index first); a row is ambiguous where the mass before some rank of its top-k set is
    within `margin` of top_p x the set's mass (float32 sums may fall either side)."""
    rows, vocab = probs.shape
    key = logits.float().masked_fill(probs <= 0, float("-inf"))
    order = key.sort(dim=-1, descending=True, stable=True).indices
    sorted_p = probs.double().gather(-1, order)
    rank = torch.arange(vocab)
    k = top_k.view(rows, 1)
    in_k = (rank < torch.where(k > 0, k, vocab)) & (sorted_p > 0)
    sorted_p = sorted_p * in_k
    total = sorted_p.sum(-1, keepdim=True)
    before = sorted_p.cumsum(-1) - sorted_p
    target = top_p.view(rows, 1).double() * total
    keep_sorted = in_k & ((before < target) | (top_p.view(rows, 1) >= 1) | (rank == 0))
    near = ((before - target).abs() < margin * total) & in_k & (top_p.view(rows, 1) < 1)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return keep, near.any(-1)


def vocab_ties(row):
    """The largest number of equal logits in a row."""
    return int(torch.unique(row.float(), return_counts=True)[1].max())


def cases(seed, rows, vocab, ties):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 6
    if ties:  # bf16 logits of a coarse grid: groups of equal logits, cut inside them
        logits = (logits * 2).round().div(2).to(torch.bfloat16)
    probs = torch.softmax(logits.float(), -1)
    drop = torch.rand(rows, vocab, generator=gen) < 0.3
    drop[: rows // 2] = False  # half the rows keep every token (no min-p)
    probs = probs.masked_fill(drop & (probs < probs.amax(-1, keepdim=True)), 0.0)
    top_k = torch.randint(0, vocab + 50, (rows,), generator=gen)
    top_k[torch.rand(rows, generator=gen) < 0.4] = 0  # top-k off
    top_k[:3] = torch.tensor([1, 2, vocab])
    top_p = torch.rand(rows, generator=gen).clamp(min=0.02)
    top_p[torch.rand(rows, generator=gen) < 0.25] = 1.0  # top-p off
    top_p[3:5] = torch.tensor([1e-6, 0.999])
    return logits, probs, top_k, top_p


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("ties", "bits"), [(False, 4), (True, 4), (False, 2)],
                         ids=["distinct", "ties", "distinct-2bit"])  # fmt: skip
def test_kernel_keeps_the_sorted_cut(device, ties, bits):
    """10 rows of 1,100 tokens in parts of 512 (three a row), assorted top-k / top-p / dropped
    tokens: every unambiguous row keeps exactly the tokens the float64 cut keeps, as the sorted
    reference does, with the kept probabilities untouched; at most a few rows are ambiguous."""
    if bits != rank_filter.BITS and device == "cpu":
        pytest.skip("other digit widths run compiled only (the interpreter takes ~20 s)")
    logits, probs, top_k, top_p = cases(1 if ties else 0, 10, 1100, ties)
    keep, ambiguous = exact_cut(logits, probs, top_k, top_p)
    assert int(ambiguous.sum()) <= 2
    reference = probs.clone()
    sampling._rank_filter_(reference, logits, top_k.view(-1, 1), top_p.view(-1, 1))
    got = probs.clone().to(device)  # .to("cpu") alone is probs itself, cut in place
    rank_filter.rank_filter_(got, logits.to(device), top_k.to(device), top_p.to(device), bits,
                             chunk=512)  # fmt: skip
    got = got.cpu()
    sure = ~ambiguous
    assert torch.equal(reference[sure] > 0, keep[sure])  # the reference is the definition
    assert torch.equal(got[sure] > 0, keep[sure])
    assert torch.equal(got[sure], reference[sure])  # kept entries bit for bit, the rest 0
    # an ambiguous row still keeps a prefix of the ranking, as long as the exact one or longer
    key = logits.float().masked_fill(probs <= 0, float("-inf"))
    order = key.sort(dim=-1, descending=True, stable=True).indices
    for row in torch.nonzero(ambiguous).flatten().tolist():
        kept = (got[row] > 0)[order[row]]
        assert not (kept[1:] & ~kept[:-1]).any()  # no kept rank after a dropped one
        assert abs(int(kept.sum()) - int(keep[row].sum())) <= 2 * vocab_ties(logits[row])


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_cut_edges(device):
    """top-k 1 and a tiny top-p keep the first maximum (the lowest id of equal logits); a top-k
    past the tokens left (even past int32), and top-p 1 with top-k 0, keep every token with
    mass; a one-hot row (greedy) stays one-hot; a top-k cut through a group of equal logits
    keeps its lowest ids; a top-p of 0 in float32 keeps the first maximum."""
    logits = torch.tensor([
        [0.0, 3.0, 1.0, 3.0, 2.0, 3.0, -1.0, 0.5],
        [0.0, 3.0, 1.0, 3.0, 2.0, 3.0, -1.0, 0.5],
        [0.0, 3.0, 1.0, 3.0, 2.0, 3.0, -1.0, 0.5],
        [0.0, 3.0, 1.0, 3.0, 2.0, 3.0, -1.0, 0.5],
        [5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 3.0, 1.0, 3.0, 2.0, 3.0, -1.0, 0.5],
        [0.0, 3.0, 1.0, 3.0, 2.0, 3.0, -1.0, 0.5],
    ])  # fmt: skip
    probs = torch.softmax(logits, -1)
    probs[4] = torch.nn.functional.one_hot(torch.tensor(0), 8).float()
    probs[3, 6] = 0.0  # dropped by min-p
    top_k = torch.tensor([1, 0, 0, 2**32 + 2, 0, 2, 0])  # past int32: not cut as 2
    top_p = torch.tensor([1.0, 1e-7, 1.0, 1.0, 0.5, 1.0, 1e-46])  # 1e-46: 0 in float32
    got = probs.to(device)
    rank_filter.rank_filter_(got, logits.to(device), top_k.to(device), top_p.to(device))
    kept = [torch.nonzero(row).flatten().tolist() for row in got.cpu()]
    assert kept == [[1], [1], list(range(8)), [0, 1, 2, 3, 4, 5, 7], [0], [1, 3], [1]]


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_negative_top_k_is_off(device):
    """A top-k below 1 is off, as the sort takes it, even one below int32's range (-2^32 + 2
    once wrapped to a top-k of 2)."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, 3.0, -1.0, 0.5]] * 3)
    probs = torch.softmax(logits, -1)
    top_k = torch.tensor([-1, -(2**32) + 2, -(2**40)])
    got = probs.clone().to(device)
    rank_filter.rank_filter_(got, logits.to(device), top_k.to(device), torch.ones(3).to(device))
    assert torch.equal(got.cpu(), probs)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_top_p_within_rounding_of_one_keeps_the_top_k_cut(device):
    """top_p 1 - 2^-24 under a top-k cut (distinct logits, and bf16 ties cut by top-k): the
    top-p passes' sum of the top-k set can round below top_p x the set's mass as the top-k
    passes summed it; every row still keeps its top k (the cut once went to an empty digit,
    key 0: every token of the row kept)."""
    gen = torch.Generator().manual_seed(0)
    distinct = torch.randn(4, 512, generator=gen)[:2] * 0.5
    gen = torch.Generator().manual_seed(0)
    ties = (torch.randn(4, 512, generator=gen)[:2] * 3).round().div(2).bfloat16().float()
    logits = torch.cat([distinct, ties])
    probs = torch.softmax(logits, -1)
    top_k = torch.tensor([100, 200, 100, 200])
    top_p = torch.full((4,), 1 - 2**-24)
    keep, _ = exact_cut(logits, probs, top_k, top_p)
    assert keep.sum(-1).tolist() == top_k.tolist()
    got = probs.to(device)
    rank_filter.rank_filter_(got, logits.to(device), top_k.to(device), top_p.to(device),
                             chunk=256)  # fmt: skip
    assert torch.equal(got.cpu() > 0, keep)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_row_alone_equals_row_in_a_batch(device):
    """A row's cut is the same bits alone and among 4 other rows (its parts set by the
    vocabulary, its sums in one order), unlike torch's cumsum on CUDA, whose order follows the
    row count."""
    logits, probs, top_k, top_p = cases(5, 5, 1100, False)
    top_p[:] = torch.linspace(0.3, 0.97, 5)
    batch = probs.clone().to(device)  # probs stays uncut for the rows alone
    rank_filter.rank_filter_(batch, logits.to(device), top_k.to(device), top_p.to(device),
                             chunk=512)  # fmt: skip
    for row in (0, 4):
        one = slice(row, row + 1)
        alone = probs[one].to(device)
        rank_filter.rank_filter_(alone, logits[one].to(device), top_k[one].to(device),
                                 top_p[one].to(device), chunk=512)  # fmt: skip
        assert torch.equal(alone.cpu()[0], batch.cpu()[row])


def test_the_engines_check_input_is_unambiguous():
    """The check the engine runs before taking the kernel on a device (sampling._rank_kernel)
    compares kept sets: its input must have no row whose cut float rounding could move."""
    logits, probs, top_k, top_p = sampling.rank_check_input()
    _, ambiguous = exact_cut(logits, probs, top_k, top_p)
    assert not ambiguous.any()


@pytest.mark.gpu
def test_filtered_probs_on_cuda_takes_the_kernel_and_matches_the_cpu():
    """On CUDA filtered_probs cuts with the kernel (no sort: its check passed) and keeps the
    CPU's tokens on unambiguous rows of a 152k vocabulary, bf16 logits, 64 rows."""
    assert sampling._rank_kernel(torch.device("cuda")) is not None
    assert sampling.RANK_KERNEL_ROWS <= 2
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(64, 152_064, generator=gen) * 4).to(torch.bfloat16)
    temperature = torch.full((64,), 0.8)
    top_k = torch.where(torch.arange(64) % 3 == 0, 50, 0)
    top_p = torch.where(torch.arange(64) % 2 == 0, 0.95, 1.0)
    cpu = sampling.filtered_probs(logits, temperature, top_k, top_p)
    cuda = sampling.filtered_probs(*(t.cuda() for t in (logits, temperature, top_k, top_p)))
    scaled = torch.softmax(logits.float() / 0.8, -1)
    _, ambiguous = exact_cut(logits, scaled, top_k, top_p)
    sure = ~ambiguous
    assert int(sure.sum()) >= 60
    assert torch.equal(cuda.cpu()[sure] > 0, cpu[sure] > 0)
    torch.testing.assert_close(cuda.cpu()[sure], cpu[sure], rtol=1e-5, atol=1e-9)


@pytest.mark.needs("triton")
def test_the_kernel_is_refused_when_it_cuts_otherwise_or_fails(monkeypatch, caplog):
    """executor/sampling.py checks the kernel once per device against the sort before using
    it: one that keeps other tokens, or fails to build, is refused with one warning naming it,
    and the sort cuts (the kernel that passes: the CUDA test above)."""
    check = sampling._rank_kernel.__wrapped__  # uncached: each call checks again
    cpu = torch.device("cpu")
    monkeypatch.setattr(rank_filter, "rank_filter_", lambda probs, *args: probs[:, 1:].zero_())
    assert check(cpu) is None
    assert "top-k / top-p Triton kernel cut other tokens than torch; sorting with torch" in (
        caplog.text
    )

    def broken(*args):
        raise RuntimeError("PTX build failed")

    monkeypatch.setattr(rank_filter, "rank_filter_", broken)
    assert check(cpu) is None
    assert "failed (PTX build failed); sorting with torch" in caplog.text
