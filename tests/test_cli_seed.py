"""`speculant generate --seed S` is the engine seed, as `Engine(seed=S)`: request i samples with a
seed made of S and i (counted over the engine's calls), so repeated prompts give independent
samples and one run repeats exactly;
a --prompts line's own `seed` wins (an audit found --seed given to every request as its own
seed: N copies of one prompt gave N copies of one sample)."""

from __future__ import annotations

import json
from dataclasses import replace

from speculant import Engine, SamplingParams
from speculant.launch.cli import main

PROMPT = [5, 17, 33, 9]


def run(capsys, tmp_path, rows, *flags) -> list[list[int]]:
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    status = main(["generate", "--device", "cpu", "--prompts", str(prompts), "--output",
                   str(out), "--temperature", "1", "--max-new-tokens", "12", "--ignore-eos",
                   *map(str, flags)])  # fmt: skip
    assert status == 0, capsys.readouterr().err
    lines = sorted((json.loads(line) for line in out.read_text().splitlines()),
                   key=lambda line: line["index"])  # fmt: skip
    return [line["token_ids"] for line in lines]


def test_seed_is_the_engine_seed(capsys, tmp_path, llama_dir):
    rows = [{"prompt_token_ids": PROMPT}] * 4
    first = run(capsys, tmp_path, rows, "--target", llama_dir, "--seed", 7)
    assert len({tuple(t) for t in first}) > 1, first  # repeated prompts: their own samples
    assert run(capsys, tmp_path, rows, "--target", llama_dir, "--seed", 7) == first
    assert run(capsys, tmp_path, rows, "--target", llama_dir, "--seed", 8) != first
    engine = Engine(llama_dir, device="cpu", seed=7)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in engine.generate([PROMPT] * 4, params)] == first


def test_a_lines_own_seed_wins(capsys, tmp_path, llama_dir):
    rows = [{"prompt_token_ids": PROMPT, "seed": 3}, {"prompt_token_ids": PROMPT, "seed": 3},
            {"prompt_token_ids": PROMPT}]  # fmt: skip
    first = run(capsys, tmp_path, rows, "--target", llama_dir, "--seed", 7)
    second = run(capsys, tmp_path, rows, "--target", llama_dir, "--seed", 8)
    assert first[0] == first[1] == second[0]  # the same seed 3 whatever --seed
    assert first[2] != second[2]


def test_an_engines_calls_draw_anew_and_a_new_engine_repeats_them(llama_dir):
    """Unseeded requests count on over an engine's generate calls (vLLM's engine seed): a
    second call samples anew (a loop of calls for best-of-n or rollouts got one sample again
    and again), a new engine of the same seed repeats the same calls, and a request's own seed
    repeats in any call."""
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)

    def calls(engine: Engine, params: SamplingParams) -> list[list[list[int]]]:
        return [[o.token_ids for o in engine.generate([PROMPT] * 3, params)] for _ in range(3)]

    first = calls(Engine(llama_dir, device="cpu", seed=7), params)
    samples = [tuple(tokens) for call in first for tokens in call]
    assert len(set(samples)) == len(samples), first  # nine requests, nine draws
    assert calls(Engine(llama_dir, device="cpu", seed=7), params) == first
    seeded = calls(Engine(llama_dir, device="cpu", seed=7), replace(params, seed=3))
    assert all(call == [seeded[0][0]] * 3 for call in seeded)


def test_an_unseeded_request_does_not_share_a_seeded_ones_draws(llama_dir):
    """The default seeds are a hash of the engine seed and the request's place: the unseeded
    request 0 of engine seed 0 drew what a request seeded 0 drew (and engine seed 1's request 0
    what seed 1_000_003 drew), so a batch mixing seeded and unseeded requests got pairs of
    identical samples."""
    engine = Engine(llama_dir, device="cpu", seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    outs = engine.generate([PROMPT] * 3, [params, replace(params, seed=0), replace(params, seed=1)])
    assert len({tuple(o.token_ids) for o in outs}) == 3, [o.token_ids for o in outs]
