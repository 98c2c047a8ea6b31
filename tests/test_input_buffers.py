"""The decode step's packed input buffers (executor/input_buffers.py): whatever sequence of
steps fills them (batches growing and shrinking, padded rows, rows holding fewer drafts than the
step's width), the device packs hold exactly the layout written afresh from every row."""

import random

import pytest
import torch

from speculant.executor.input_buffers import InputBuffers


def reference(buffers: InputBuffers, rows, input_ids, temperature, top_k, top_p, seed, padded_bs,
              sentinel_row, min_p=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The two packs written afresh, field by field over every row: live rows, padded rows on
    the sentinel row (greedy, token 0), the rest zero (top_p one; min_p zero, also where none
    is given)."""
    n, T, live = buffers.max_bs, buffers.tokens_per_req, len(rows)
    pad, rest = padded_bs - live, n - padded_bs
    ints = [*rows, *[sentinel_row] * pad, *[0] * rest]
    ints += [*top_k, *[0] * (pad + rest)]
    ints += [*seed, *[0] * (pad + rest)]
    for ids in input_ids:  # a row holding fewer drafts than T - 1: zeros after
        ints += ids[:T] + [0] * (T - len(ids))
    ints += [0] * (T * (pad + rest))
    floats = [*temperature, *[0.0] * (pad + rest), *top_p, *[1.0] * (pad + rest)]
    floats += [*(min_p or [0.0] * live), *[0.0] * (pad + rest)]
    return torch.tensor(ints, dtype=torch.int64), torch.tensor(floats, dtype=torch.float32)


@pytest.mark.parametrize("tokens_per_req", [1, 4, 8])
def test_every_fill_leaves_the_reference_layout(tokens_per_req):
    rng = random.Random(tokens_per_req)
    max_bs, sentinel = 16, 99
    buffers = InputBuffers(max_bs, tokens_per_req, "cpu")
    sizes = [1, 2, 4, 8, 16]
    for _ in range(200):
        padded = rng.choice(sizes)
        live = rng.randint(0, padded)
        rows = rng.sample(range(64), live)
        ids = [[rng.randrange(1000) for _ in range(rng.randint(1, tokens_per_req))]
               for _ in range(live)]  # fmt: skip
        temperature = [rng.choice([0.0, 0.7, 1.0]) for _ in range(live)]
        top_k = [rng.choice([0, 20]) for _ in range(live)]
        top_p = [rng.choice([1.0, 0.9]) for _ in range(live)]
        seed = [rng.randrange(1 << 30) for _ in range(live)]
        min_p = rng.choice([None, [rng.choice([0.0, 0.05, 0.5]) for _ in range(live)]])
        args = (rows, ids, temperature, top_k, top_p, seed, padded, sentinel, min_p)
        buffers.fill(*args)
        ints, floats = reference(buffers, *args)
        assert torch.equal(buffers._ints, ints)
        assert torch.equal(buffers._floats, floats)
        assert buffers.input_ids[:live].tolist() == [
            row[:tokens_per_req] + [0] * (tokens_per_req - len(row)) for row in ids
        ]
