"""Property tests (hypothesis, bounded examples): over random batch compositions, prompt lengths,
arrival order, page sizes, drafters and k, greedy speculative output equals plain greedy output,
every KV page returns to the pool, and seeded sampling gives the same tokens whatever the batch.
Small pools and max_num_seqs force requests to wait for pages and slots."""

from __future__ import annotations

import math

import pytest
from helpers_dflash import write_random_dflash
from helpers_eagle import write_random_eagle3
from helpers_workload import prompt_of, run_with_arrivals, workload_strategy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speculant import Engine, SamplingParams

MAX_PROMPT, MAX_NEW, MAX_K = 30, 14, 4
SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,  # the same examples in every run: CI stays reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("props")
    write_random_eagle3(root / "eagle3", llama_dir, draft_vocab=200, seed=5)
    write_random_dflash(root / "dflash", llama_dir, block_size=MAX_K + 1, target_layer_ids=[0, 1])
    return {"eagle3": root / "eagle3", "dflash": root / "dflash"}


_engines: dict[tuple, Engine] = {}


def engine_for(llama_dir, drafts, algo, k, page_size) -> Engine:
    """Engines are cached per configuration (building one per example would dominate)."""
    key = (algo, k, page_size)
    if key not in _engines:
        per_request = MAX_PROMPT + MAX_NEW + MAX_K + 1
        spec = {} if algo is None else dict(algo=algo, draft=str(drafts[algo]), num_draft_tokens=k)
        _engines[key] = Engine(
            str(llama_dir),
            device="cpu",
            max_num_seqs=3,
            max_model_len=per_request,
            page_size=page_size,
            # room for about two requests at a time: later ones wait for pages
            num_pages=1 + math.ceil(2.2 * per_request / page_size),
            eager_padding=True,
            **spec,
        )
    return _engines[key]


workloads = workload_strategy(MAX_PROMPT, MAX_NEW, max_arrival=6)


@SETTINGS
@given(
    workload=workloads,
    algo=st.sampled_from(["eagle3", "dflash"]),
    k=st.integers(1, MAX_K),
    page_size=st.sampled_from([1, 4, 16]),
)
def test_greedy_speculative_equals_plain_and_pages_return(
    llama_dir, drafts, workload, algo, k, page_size
):
    prompts = [prompt_of(n, s) for n, _, _, s in workload]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for _, m, _, _ in workload]
    arrivals = [a for _, _, a, _ in workload]
    plain = engine_for(llama_dir, drafts, None, 0, page_size)
    spec = engine_for(llama_dir, drafts, algo, k, page_size)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert run_with_arrivals(spec, prompts, params, arrivals) == expected
    for engine in (plain, spec):
        assert len(engine.kv.free_pages) == engine.kv.num_pages - 1  # page 0 is the dummy page
        assert not engine.scheduler.has_unfinished()


@SETTINGS
@given(
    workload=workloads,
    target_index=st.integers(0, 5),
    algo=st.sampled_from(["eagle3", "dflash"]),
    k=st.integers(1, MAX_K),
    temperature=st.sampled_from([0.7, 1.0, 1.3]),
)
def test_seeded_sampling_is_the_same_whatever_the_batch(
    llama_dir, drafts, workload, target_index, algo, k, temperature
):
    """A seeded sampled request emits the same tokens alone and inside any batch, arriving at
    any step (its random numbers depend on its seed and positions only)."""
    spec = engine_for(llama_dir, drafts, algo, k, 4)
    prompts = [prompt_of(n, s) for n, _, _, s in workload]
    params = [
        SamplingParams(
            max_new_tokens=m, temperature=temperature, top_p=0.9, seed=s, ignore_eos=True
        )
        for _, m, _, s in workload
    ]
    i = target_index % len(prompts)
    alone = spec.generate([prompts[i]], [params[i]])[0].token_ids
    together = run_with_arrivals(spec, prompts, params, [a for _, _, a, _ in workload])
    assert together[i] == alone
