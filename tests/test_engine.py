"""Batching, seeded sampling, page accounting and bad input, on the tiny Llama."""

from __future__ import annotations

import time

import pytest
import torch

from speculant import Engine, SamplingParams, SpeculantError


@pytest.fixture(scope="module")
def engine(llama_dir):
    return Engine(llama_dir, device="cpu", max_num_seqs=8, max_model_len=256, page_size=4)


def random_prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def test_mixed_batch_equals_each_alone(engine):
    prompts = random_prompts(engine.model_config.vocab_size, (3, 19, 8, 1, 40), seed=1)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    batched = engine.generate(prompts, params)
    for prompt, out in zip(prompts, batched, strict=True):
        assert engine.generate([prompt], params)[0].token_ids == out.token_ids


def test_seeded_sampling_is_batch_invariant(engine):
    prompts = random_prompts(engine.model_config.vocab_size, (6, 11, 25, 4), seed=2)
    params = [
        SamplingParams(
            max_new_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=100 + i, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    batched = engine.generate(prompts, params)
    alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    # a different seed gives a different continuation (with near certainty over 20 tokens)
    other = engine.generate(
        [prompts[0]], SamplingParams(max_new_tokens=20, temperature=0.9, seed=999, ignore_eos=True)
    )[0]
    assert other.token_ids != batched[0].token_ids


def test_mixed_greedy_and_sampled_batch(engine):
    prompts = random_prompts(engine.model_config.vocab_size, (5, 9), seed=3)
    greedy = SamplingParams(max_new_tokens=16, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    mixed = engine.generate(prompts, [greedy, sampled])
    assert mixed[0].token_ids == engine.generate([prompts[0]], greedy)[0].token_ids
    assert mixed[1].token_ids == engine.generate([prompts[1]], sampled)[0].token_ids


def test_pages_run_out_requests_wait_and_all_pages_return(llama_dir):
    # 13 usable pages of 4 tokens: each request needs ceil((10 + 20 + 1) / 4) = 8 pages,
    # so only one runs at a time and the others wait.
    engine = Engine(
        llama_dir, device="cpu", max_num_seqs=4, max_model_len=64, page_size=4, num_pages=14
    )
    free_before = len(engine.kv.free_pages)
    prompts = random_prompts(engine.model_config.vocab_size, (10,) * 5, seed=4)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o.index for o in outs] == list(range(5))
    assert all(len(o.token_ids) == 20 for o in outs)
    assert len(engine.kv.free_pages) == free_before
    assert len(engine.kv.free_rows) == 4
    roomy = Engine(llama_dir, device="cpu", max_num_seqs=8, max_model_len=64, page_size=4)
    assert [o.token_ids for o in roomy.generate(prompts, params)] == [o.token_ids for o in outs]


def test_default_pool_holds_a_full_length_request(llama_dir):
    """The pool sized for max_num_seqs rows holds each row's whole reach (max_model_len and
    the last step's lookahead): one request running to the length limit fits it."""
    engine = Engine(llama_dir, device="cpu", max_num_seqs=1, max_model_len=64, page_size=4)
    out = engine.generate([[5] * 10], SamplingParams(max_new_tokens=1000, ignore_eos=True))[0]
    assert (len(out.token_ids), out.finish_reason) == (54, "length")


def test_request_larger_than_pool_is_a_clear_error(llama_dir):
    """A request the pool can never hold names the pages it needs; lowering max_new_tokens is
    suggested only where one output token would fit."""
    engine = Engine(
        llama_dir, device="cpu", max_num_seqs=2, max_model_len=64, page_size=4, num_pages=4
    )
    with pytest.raises(SpeculantError, match="--num-pages .* or lower --max-new-tokens"):
        engine.generate([[5] * 5], SamplingParams(max_new_tokens=20))
    with pytest.raises(SpeculantError, match="--num-pages") as refused:
        engine.generate([[5] * 10], SamplingParams(max_new_tokens=1))
    assert "max-new-tokens" not in str(refused.value)
    assert "the prompt alone with one output token needs 13 positions" in str(refused.value)


def test_stop_tokens_and_length_limit(engine):
    prompt = random_prompts(engine.model_config.vocab_size, (7,), seed=5)[0]
    free = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = engine.generate(
        [prompt], SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,))
    )[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    short = Engine(engine.config.target, device="cpu", max_num_seqs=2, max_model_len=16)
    capped = short.generate([prompt], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    assert len(prompt) + len(capped.token_ids) == 16 and capped.finish_reason == "length"


def test_text_prompt_round_trip(engine):
    out = engine.generate(["def add(a, b):"], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert out[0].text == engine.tokenizer.decode(out[0].token_ids)
    ids = engine.tokenizer.encode("def add(a, b):").ids
    assert (
        engine.generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
        == out[0].token_ids
    )


def test_interrupted_generate_leaves_nothing_behind(engine):
    """A generate that stops part way (an on_output raising, as Ctrl-C in a notebook does)
    leaves no request, page or row behind: the next generate returns its own outputs."""
    free_pages, free_rows = len(engine.kv.free_pages), len(engine.kv.free_rows)
    prompts = random_prompts(engine.model_config.vocab_size, (3, 4, 1), seed=6)
    params = [SamplingParams(max_new_tokens=2, ignore_eos=True)] + [
        SamplingParams(max_new_tokens=60, ignore_eos=True)
    ] * 2

    def stop(out):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, params, on_output=stop)
    assert not engine.scheduler.has_unfinished()
    assert (len(engine.kv.free_pages), len(engine.kv.free_rows)) == (free_pages, free_rows)
    new = random_prompts(engine.model_config.vocab_size, (2, 3), seed=7)
    short = SamplingParams(max_new_tokens=5, ignore_eos=True)
    seen = []
    outs = engine.generate(new, short, on_output=lambda o: seen.append(o.index))
    assert [o.prompt_token_ids for o in outs] == new and sorted(seen) == [0, 1]
    assert [o.token_ids for o in outs] == [engine.generate([p], short)[0].token_ids for p in new]


def test_repeated_jobs_keep_no_per_step_records(engine):
    """An engine that runs job after job (a server) keeps no record that grows with every step:
    the padded decode sizes the DP coordinator records are the last run's alone (a list over
    the engine's life grew by one entry a decode step, for ever)."""
    prompts = random_prompts(engine.model_config.vocab_size, (3, 9, 5), seed=8)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine.generate(prompts, params)
    one_job = len(engine.dp.decode_sizes)
    assert one_job > 0
    for _ in range(3):
        engine.generate(prompts, params)
    assert len(engine.dp.decode_sizes) == one_job


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(prompts=[[]]), "empty"),
        (dict(prompts=[[10**6]]), "outside the vocabulary"),
        (dict(prompts=[[5] * 300]), "max_model_len"),
        (dict(params=SamplingParams(max_new_tokens=0)), "max_new_tokens=0"),
        (dict(params=SamplingParams(top_p=0.0)), "top_p=0.0"),
        (dict(params=SamplingParams(temperature=-1)), "temperature=-1"),
        (dict(prompts=[5]), "prompt 1 is the integer 5"),
        (dict(prompts=[[5, 6.7]]), "token 6.7"),
        (dict(prompts=[[True, 5]]), "token True"),
        (dict(prompts=[{"prompt": "hi"}]), "prompt 1 is of type dict"),
        (dict(params=SamplingParams(max_new_tokens=4, stop_token_ids=5)), r"e\.g\. \[5\]"),
        (dict(params={"max_new_tokens": 4}), "SamplingParams"),
    ],
)
def test_bad_requests_are_refused_up_front(engine, bad, match):
    prompts = [[5, 6, 7]] + bad.get("prompts", [])
    with pytest.raises(SpeculantError, match=match):
        engine.generate(prompts, bad.get("params", SamplingParams(max_new_tokens=4)))
    assert not engine.scheduler.has_unfinished()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(target="/nonexistent/ckpt"), "does not exist"),
        (dict(target=None), "target=None must be the path of a checkpoint directory"),
        (dict(target=""), "target='' must be the path"),
        (dict(target=3), "target=3 must be the path"),
        (dict(dtype="float8"), "dtype 'float8'"),
        (dict(load_format="pt"), "load format 'pt'"),
        (dict(max_model_len=100000), "max_position_embeddings"),
        (dict(capture_sizes=[1, 64], max_num_seqs=8), "capture size 64"),
        (dict(page_size=16.5), "page_size=16.5 must be an integer"),
        (dict(max_num_seqs="8"), "max_num_seqs='8' must be an integer"),
    ],
)
def test_bad_engine_options(llama_dir, kwargs, match):
    kwargs = {"target": llama_dir, "device": "cpu", **kwargs}
    with pytest.raises(SpeculantError, match=match):
        Engine(**kwargs)


def test_checkpoint_errors(tmp_path, llama_dir):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(SpeculantError, match="up_proj|gate_up_proj"):
        Engine(broken, device="cpu")
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(SpeculantError, match="wrong shape"):
        Engine(broken, device="cpu")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SpeculantError, match="corrupt"):
        Engine(broken, device="cpu")
    # a target of pytorch_model.bin alone: named, not "no *.safetensors"
    bins = tmp_path / "bins"
    shutil.copytree(llama_dir, bins)
    torch.save(load_file(bins / "model.safetensors"), bins / "pytorch_model.bin")
    (bins / "model.safetensors").unlink()
    with pytest.raises(SpeculantError, match=r"holds pytorch_model.bin but no \*.safetensors"):
        Engine(bins, device="cpu")
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpeculantError, match="GPT2LMHeadModel"):
        Engine(broken, device="cpu")


@pytest.mark.parametrize("dtype", ["bfloat16", torch.bfloat16])  # a torch dtype, as vLLM takes
def test_dummy_weights_build_in_target_dtype(llama_dir, dtype):
    engine = Engine(llama_dir, device="cpu", dtype=dtype, load_format="dummy")
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_warm_up_leaves_the_engine_as_it_was(llama_dir, tmp_path):
    """The start-up warm-up (run on CUDA with the Triton backend, so prefill kernels compile
    before the first timed request) prefills scratch rows and gives everything back: same free
    pages and rows, zero cache lengths, and generation afterwards equals a fresh engine's."""
    from helpers_eagle import write_random_eagle3

    write_random_eagle3(tmp_path, llama_dir, draft_vocab=300)
    options = dict(algo="eagle3", draft=str(tmp_path), num_draft_tokens=3)
    fresh, warmed = (
        Engine(llama_dir, device="cpu", max_num_seqs=4, max_model_len=128, page_size=4, **options)
        for _ in range(2)
    )
    assert not warmed._compiles_at_first_use()  # CPU: nothing compiles, no warm-up at start
    pages, rows = sorted(warmed.kv.free_pages), sorted(warmed.kv.free_rows)
    warmed.warm_up()
    assert sorted(warmed.kv.free_pages) == pages and sorted(warmed.kv.free_rows) == rows
    assert int(warmed.kv.cache_lens.abs().sum()) == 0
    prompts = random_prompts(256, (5, 30, 1), seed=11)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in warmed.generate(prompts, params)] == [
        o.token_ids for o in fresh.generate(prompts, params)
    ]


# ------------------------------------------------------------------ overlap (one rank)


def overlap_pair(target, **options) -> tuple[Engine, Engine]:
    common = dict(device="cpu", max_num_seqs=4, max_model_len=128, page_size=4, **options)
    return Engine(target, overlap=True, **common), Engine(target, overlap=False, **common)


def outputs_of(engine: Engine, prompts, params) -> list[tuple]:
    outs = engine.generate(prompts, params)
    return [(o.token_ids, o.finish_reason, o.stats["num_verify_steps"]) for o in outs]


def check_overlap(ahead: Engine, synchronous: Engine, prompts, params) -> None:
    """Same tokens, finish reasons and step counts with and without overlap; steps really ran
    ahead; every page returned and no step left in flight."""
    before = ahead.steps_ahead
    assert outputs_of(ahead, prompts, params) == outputs_of(synchronous, prompts, params)
    assert ahead.steps_ahead > before and synchronous.steps_ahead == 0
    assert len(ahead.kv.free_pages) == ahead.kv.num_pages - 1 and ahead._launched is None


def test_overlap_equals_synchronous_steps_plain(llama_dir):
    """Stop tokens that end requests while a step runs ahead (its rows for them are dropped),
    ragged length limits, a seeded sampled request, and more requests than rows."""
    ahead, synchronous = overlap_pair(llama_dir)
    vocab = ahead.model_config.vocab_size
    prompts = random_prompts(vocab, (5, 9, 3, 12, 7, 4), seed=11)
    free = outputs_of(synchronous, prompts[:3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    stops = (free[0][0][21], free[2][0][29])  # first seen late in the run: requests end mid-run
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, stop_token_ids=stops)
              for n in (40, 33, 40)]  # fmt: skip
    check_overlap(ahead, synchronous, prompts[:3], params)
    assert "stop" in [o.finish_reason for o in ahead.generate(prompts[:3], params)]
    mixed = [
        SamplingParams(max_new_tokens=n, ignore_eos=True, stop_token_ids=stops)
        for n in (40, 33, 28, 40, 9, 21)
    ]
    mixed[3] = SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.9, seed=3,
                              ignore_eos=True)  # fmt: skip
    check_overlap(ahead, synchronous, prompts, mixed)
    check_overlap(ahead, synchronous, prompts[:1], mixed[0])  # one request, alone


def test_overlap_equals_synchronous_steps_speculative(llama_dir, tmp_path):
    """EAGLE-3 (k = 3, greedy and sampled drafts) and padded eager batches: the step launched
    ahead takes its input ids (last token, then drafts) from the device."""
    from helpers_eagle import write_random_eagle3

    write_random_eagle3(tmp_path, llama_dir, draft_vocab=300)
    spec = dict(algo="eagle3", draft=str(tmp_path), num_draft_tokens=3, eager_padding=True)
    ahead, synchronous = overlap_pair(llama_dir, **spec)
    prompts = random_prompts(ahead.model_config.vocab_size, (6, 11, 4), seed=12)
    greedy = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (48, 30, 41)]
    check_overlap(ahead, synchronous, prompts, greedy)
    sampled = SamplingParams(max_new_tokens=40, temperature=1.0, seed=9, ignore_eos=True)
    check_overlap(ahead, synchronous, prompts, [greedy[0], sampled, greedy[2]])


def test_overlap_runs_ahead_while_requests_wait_for_rows(llama_dir):
    """With every row taken and none freed by the step in flight, waiting requests are not due
    (admission is by groups of free rows): steps run ahead while they wait, and the outputs
    and step counts are those of synchronous steps."""
    ahead, synchronous = overlap_pair(llama_dir)
    waiting = []
    run_ahead = ahead._run_ahead

    def watched(launched):
        waiting.append(len(ahead.scheduler.waiting))
        return run_ahead(launched)

    ahead._run_ahead = watched
    prompts = random_prompts(ahead.model_config.vocab_size, (5, 9, 3, 12, 7, 4, 8, 6), seed=16)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True)
              for n in (30, 12, 25, 18, 22, 9, 27, 15)]  # fmt: skip
    check_overlap(ahead, synchronous, prompts, params)
    assert max(waiting) > 0


def test_overlap_counts_steps_run_ahead_in_decode_time(llama_dir):
    """stats()'s decode_s holds the steps that ran ahead (most steps of an overlapped job):
    each one slowed by 10 ms, decode_s grows by at least that much."""
    ahead, _ = overlap_pair(llama_dir)
    run_ahead, calls = ahead._run_ahead, []

    def slowed(launched):
        time.sleep(0.01)
        calls.append(launched)
        return run_ahead(launched)

    ahead._run_ahead = slowed
    prompts = random_prompts(ahead.model_config.vocab_size, (5, 9, 3), seed=17)
    ahead.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert len(calls) > 5 and ahead.stats()["decode_s"] >= 0.01 * len(calls)


@pytest.mark.parametrize("drafts", [0, 3])
def test_overlap_runs_ahead_only_within_each_rows_table(llama_dir, tmp_path, drafts):
    """The step launched ahead may carry a request that ends in the step in flight (its row
    dropped when read: same outputs as synchronous steps, every page returned), but never one
    whose two steps could write past its row's table (a request near max_model_len; with
    EAGLE-3 k = 3 the last steps are refused)."""
    spec = {}
    if drafts:
        from helpers_eagle import write_random_eagle3

        write_random_eagle3(tmp_path, llama_dir, draft_vocab=300)
        spec = dict(algo="eagle3", draft=str(tmp_path), num_draft_tokens=drafts)
    ahead, synchronous = overlap_pair(llama_dir, **spec)
    table, seen = ahead.kv.max_tokens_per_req, []
    run_ahead = ahead._run_ahead

    def watched(launched):
        reach = ahead.scheduler.decode_reach
        seen.append([(reach(r, steps=2), r.max_new_tokens - len(r.output_ids))
                     for r in launched.requests])  # fmt: skip
        return run_ahead(launched)

    ahead._run_ahead = watched
    vocab = ahead.model_config.vocab_size
    prompt = random_prompts(vocab, (100,), seed=13)
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)  # capped at max_model_len
    check_overlap(ahead, synchronous, prompt, params)
    short = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 3, 17)]
    check_overlap(ahead, synchronous, random_prompts(vocab, (6, 9, 4), seed=15), short)
    rows = [row for step in seen for row in step]
    assert max(reach for reach, _ in rows) <= table
    # run ahead while a request had fewer tokens left than the two steps could emit
    assert min(left for _, left in rows) <= 2 * ahead.tokens_per_req


def test_overlap_announces_each_steps_sizes_to_the_graphs(llama_dir):
    """Every launch, run ahead or not, carries its sizes in its plan: a replay checks them
    against those its graph was captured with (simulated on the CPU: eager padding stands in for
    replays, with the capture sizes recorded as capture records them on a GPU)."""
    from speculant.executor.cuda_graph import dp_capture_dummies

    engine = Engine(llama_dir, device="cpu", max_num_seqs=4, max_model_len=128, page_size=4,
                    eager_padding=True, overlap=True)  # fmt: skip
    graphs = engine.graphs
    graphs.plans_dispatch = True  # check the sizes as a MoE target's graphs need them checked
    for key in graphs.capture_plan():
        graphs.captured_sizes[key] = dp_capture_dummies(key[1], engine.tokens_per_req, 1)
    prompts = random_prompts(engine.model_config.vocab_size, (5, 8, 3), seed=14)
    engine.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert engine.steps_ahead > 0 and graphs.num_stand_ins >= 19


def test_close_releases_the_models_and_refuses_later_calls(llama_dir, tmp_path):
    """`with Engine(...)` closes it on leaving: the target, drafter and KV pools are released
    (nothing of the engine holds them: their tensors are freed), a later call is one clear
    error, and closing again does nothing."""
    import gc
    import weakref

    from helpers_eagle import write_random_eagle3

    write_random_eagle3(tmp_path, llama_dir)
    eagle_dir = str(tmp_path)
    params = SamplingParams(max_new_tokens=6)
    with Engine(llama_dir, device="cpu", draft=eagle_dir, algo="eagle3") as engine:
        tokens = engine.generate([[5, 6, 7]], params)[0].token_ids
        held = [weakref.ref(engine.model), weakref.ref(engine.drafter), weakref.ref(engine.kv)]
    gc.collect()
    assert [ref() for ref in held] == [None, None, None]
    with pytest.raises(SpeculantError, match="this Engine was closed .*build a new Engine"):
        engine.generate([[5, 6, 7]], params)
    with pytest.raises(SpeculantError, match="was closed"):
        engine.load_weights(llama_dir)
    engine.close()
    again = Engine(llama_dir, device="cpu", draft=eagle_dir, algo="eagle3")
    assert again.generate([[5, 6, 7]], params)[0].token_ids == tokens
