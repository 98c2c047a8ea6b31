"""Per-request statistics in the outputs add up: a request's `decode_time_s` (the decode steps
it took part in) is at most the wall time of the call, with overlapped steps too (an audit found
it ~2x the wall time with overlap: each step was timed from its launch to its read-back, which
covers the step launched before it as well)."""

from __future__ import annotations

import time

import pytest

from speculant import Engine, SamplingParams


@pytest.mark.parametrize("overlap", [True, False])
def test_decode_time_is_within_the_wall_time(llama_dir, overlap):
    engine = Engine(llama_dir, device="cpu", overlap=overlap)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    (out,) = engine.generate([[5, 17, 33]], params)
    wall = time.perf_counter() - start
    decode = out.stats["decode_time_s"]
    assert len(out.token_ids) == 64
    assert 0.5 * wall < decode <= wall, (decode, wall)
