"""The engine's option space on the CPU (bundled models). A seeded random sweep of option
combinations (drafter and k, fixed / auto / forced switching, overlap, request rows, a token
budget near one verify row, page sizes, pools that force preemption, eager padding and
piecewise padding, capture sizes and their cap, stop tokens, prompts of length 1 and across page
and chunk boundaries, duplicates) whose greedy output must equal a roomy plain engine's, token
for token and finish reason for reason, every request at its index. Option values the Python
API must refuse with one SpeculantError line naming the option (the CLI's argparse refused them;
`Engine(...)` crashed with a TypeError, ran with a silently replaced value, or allocated until
the process was killed), alone and on top of random valid combinations, and the CLI's one-line
errors for the same values."""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest
import torch

from speculant import Engine, SamplingParams, SpeculantError, bundled
from speculant.executor.speculation import AUTO, DraftLengthChooser, DraftShape, StepCosts

TARGET = bundled("target")
DRAFTS = {
    "eagle3": str(bundled("eagle3")),
    "dflash": str(bundled("dflash")),
    "draft-model": str(bundled("draft_lm")),
}
MAX_MODEL_LEN = 72
# frequent tokens of the bundled code model, so stop tokens end requests mid-step
STOPS = [200, 15, 13, 64, 4, 461, 498, 270, 309]


class RandomChooser(DraftLengthChooser):
    """Adaptive speculation forced to a seeded random choice of k, 0 or a rest every step."""

    def __init__(self, k: int, seed: int):
        super().__init__(k, AUTO, StepCosts({(DraftShape(k, k), 1): 1.0}))
        self.rng = random.Random(seed)

    def _choose(self, request_indices, bs, proposes=True):
        drafts = self.rng.choice([0, self.k, self.k, "rest"])
        if drafts == "rest":
            self.rest_steps += 1
            self.rests_now = True
            return 0
        return drafts


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as the CLI picks for the bundled models: a second thread waits for
    a busy core on a shared 2-core machine (README, CPU threads) and made this file 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def plain(one_thread):
    return Engine(TARGET, device="cpu", max_num_seqs=64, max_model_len=MAX_MODEL_LEN, page_size=16,
                  overlap=False)  # fmt: skip


@pytest.fixture(scope="module")
def corpus(plain):
    import json

    lines = (TARGET.parent / "prompts" / "heldout_prompts_small.jsonl").read_text().splitlines()
    return [plain.tokenizer.encode(json.loads(line)["prompt"]).ids for line in lines[:16]]


def draw_job(rng: random.Random, corpus):
    """Prompts (code, so drafts are accepted; lengths 1 .. near the limit; duplicates) and
    greedy params (max_new_tokens 1 .. past the limit, stop tokens, eos on or off)."""
    prompts = []
    for _ in range(rng.choice([1, 3, 5, 8])):
        n = rng.choice([1, 2, rng.randint(3, 40), MAX_MODEL_LEN - rng.randint(1, 4)])
        doc = rng.choice(corpus)
        start = rng.randrange(0, max(1, len(doc) - n))
        prompts.append(doc[start : start + n] if len(doc) >= n else [5] * n)
    if len(prompts) > 1 and rng.random() < 0.5:
        prompts[-1] = list(prompts[0])
    params = [
        SamplingParams(
            max_new_tokens=rng.choice([1, 2, 7, 20, 10000]),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=tuple(rng.sample(STOPS, 2)) if rng.random() < 0.5 else (),
        )
        for _ in prompts
    ]
    return prompts, params


def draw_engine(rng: random.Random, prompts, params) -> tuple[dict, str]:
    """Engine options for a job, and how its steps choose drafts (fixed, auto, forced)."""
    algo = rng.choice(sorted(DRAFTS))
    k = rng.randint(1, 7)
    T = k + 1
    page_size = rng.choice([1, 2, 3, 4, 16])
    reach = max(
        len(p) + min(sp.max_new_tokens, MAX_MODEL_LEN - len(p)) + 2 * T
        for p, sp in zip(prompts, params, strict=True)
    )
    fewest = 1 + math.ceil(reach / page_size)  # the largest request alone: preemption
    mode = rng.choice(["fixed", "auto", "forced"])
    options = dict(
        device="cpu", algo=algo, draft=DRAFTS[algo], num_draft_tokens=k,
        max_model_len=MAX_MODEL_LEN, page_size=page_size,
        max_num_seqs=rng.choice([1, 2, 3, 5, 8]),
        max_num_batched_tokens=rng.choice([T, T + 1, 2 * T + 1, 16, 64]),
        num_pages=rng.choice([fewest, fewest + 1, 2 * fewest]),
        overlap=rng.random() < 0.6, eager_padding=rng.random() < 0.5,
        speculation="fixed" if mode == "fixed" else "auto",
    )  # fmt: skip
    if mode != "fixed":
        options["catch_up_depth"] = rng.choice([0, 1, 3, 8])
    if rng.random() < 0.5:
        options.update(piecewise=True, eager_padding=True, piecewise_sizes=[8, 16, 32])
    elif rng.random() < 0.3:
        options["piecewise_sizes"] = []  # none
    # graph options (the CPU captures none, but their checks run): sizes within max_num_seqs,
    # a cap at or above the smallest
    if rng.random() < 0.5:
        sizes = rng.sample(range(1, options["max_num_seqs"] + 1), rng.randint(1, 2))
        options["capture_sizes"] = sizes if rng.random() < 0.5 else tuple(sizes)
        if rng.random() < 0.5:
            options["max_capture_size"] = min(sizes) + rng.randint(0, 3)
    options.update(
        disable_graph_padding=rng.random() < 0.3, enforce_eager=rng.random() < 0.3,
        sampled_verify=rng.choice(["rejection", "match"]), seed=rng.choice([0, -7, 2**63 - 1]),
        kv_cache_memory_fraction=rng.choice([0.5, 0.85, 1]),
    )  # fmt: skip
    return options, mode


@pytest.mark.parametrize("case", range(8))
def test_random_option_combination_greedy_equals_plain(plain, corpus, case):
    rng = random.Random(1000 + case)
    prompts, params = draw_job(rng, corpus)
    options, mode = draw_engine(rng, prompts, params)
    engine = Engine(TARGET, **options)
    if mode == "forced":
        engine.chooser = RandomChooser(engine.chooser.k, seed=case)
    outs = engine.generate(prompts, params)
    expected = plain.generate(prompts, params)
    assert [o.index for o in outs] == list(range(len(prompts)))
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected], (options, mode)
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in expected]
    kv = engine.kv
    assert sorted(kv.free_pages) == list(range(1, kv.num_pages))
    assert not kv.req_to_page.any() and not kv.cache_lens.any()
    # a second job on the same engine (rows, pages, drafter state and chooser reused)
    again = engine.generate(prompts[::-1], params[::-1])
    assert [o.token_ids for o in again] == [o.token_ids for o in expected][::-1]


# ------------------------------------------------------------------------- option values

# (options, what the one error line must say): each refused by engine_config's check_options, or
# by check_capture_sizes / the scheduler for a combination (other options: a valid EAGLE-3 run)
BAD_OPTIONS = [
    (dict(max_num_seqs=0), r"^max_num_seqs=0 must be an integer >= 1 \(None: the default\)$"),
    (dict(max_num_batched_tokens=-1), r"^max_num_batched_tokens=-1 must be an integer >= 1"),
    (dict(max_model_len=0), r"^max_model_len=0 must be an integer >= 2"),
    (dict(max_model_len=1), r"^max_model_len=1 must be an integer >= 2"),  # no room for output
    (dict(num_pages=-2), r"^num_pages=-2 must be an integer >= 2"),
    # page 0 is reserved: one page holds nothing (was refused only after the model loaded)
    (dict(num_pages=1), r"^num_pages=1 must be an integer >= 2 \(None: the default\)$"),
    (dict(max_capture_size=0), r"^max_capture_size=0 must be an integer >= 1"),
    (dict(moe_max_tokens_per_rank=0), r"^moe_max_tokens_per_rank=0 must be an integer >= 1"),
    (dict(page_size=0), r"^page_size=0 must be an integer >= 1$"),
    (dict(dp=0), r"^dp=0 must be an integer >= 1$"),
    (dict(tp=-1), r"^tp=-1 must be an integer >= 1$"),
    # None is the default only where the default is None
    (dict(page_size=None), r"^page_size=None must be an integer >= 1$"),
    (dict(tp=None), r"^tp=None must be an integer >= 1$"),
    (dict(seed=None), r"^seed=None must be an integer$"),
    (dict(seed=1.5), r"^seed=1\.5 must be an integer$"),
    # a bool is not a size
    (dict(max_num_seqs=True), r"^max_num_seqs=True must be an integer >= 1"),
    (dict(page_size=16.0), r"^page_size=16\.0 must be an integer >= 1"),
    (dict(kv_cache_memory_fraction=float("nan")), r"^kv_cache_memory_fraction=nan must be"),
    (dict(kv_cache_memory_fraction=float("inf")), r"^kv_cache_memory_fraction=inf must be"),
    (dict(kv_cache_memory_fraction=0), r"^kv_cache_memory_fraction=0 must be .*\(0, 1\]$"),
    (dict(kv_cache_memory_fraction=1.5), r"^kv_cache_memory_fraction=1\.5 must be .*\(0, 1\]$"),
    (dict(kv_cache_memory_fraction=True), r"^kv_cache_memory_fraction=True must be"),
    (dict(kv_cache_memory_fraction=None), r"^kv_cache_memory_fraction=None must be"),
    (dict(capture_sizes="1,2"), r"^capture_sizes='1,2' must be a list of integers >= 1"),
    (dict(capture_sizes=4), r"^capture_sizes=4 must be a list"),
    (dict(capture_sizes=[0, 1]), r"^capture_sizes=\[0, 1\] must be a list"),
    (dict(capture_sizes=[1.5]), r"^capture_sizes=\[1\.5\] must be a list"),
    (dict(capture_sizes=[True]), r"^capture_sizes=\[True\] must be a list"),
    (dict(piecewise_sizes=16), r"^piecewise_sizes=16 must be a list .*\[\] for none"),
    (dict(piecewise_sizes=[8.0]), r"^piecewise_sizes=\[8\.0\] must be a list"),
    (dict(piecewise_sizes=[-16]), r"^piecewise_sizes=\[-16\] must be a list"),
    # a truthy string or None is not a switch ("no" turned eager mode on)
    (dict(enforce_eager="no"), r"^enforce_eager='no' must be True or False$"),
    (dict(overlap=None), r"^overlap=None must be True or False$"),
    (dict(eager_padding=1), r"^eager_padding=1 must be True or False$"),
    (dict(piecewise="false"), r"^piecewise='false' must be True or False$"),
    (dict(disable_graph_padding=0), r"^disable_graph_padding=0 must be True or False$"),
    # combinations
    (
        dict(capture_sizes=[2, 4], max_capture_size=1, max_num_seqs=4),
        r"smallest capture size is 2; raise --max-capture-size to at least 2",
    ),
    (dict(capture_sizes=[8], max_num_seqs=4), r"capture size 8 exceeds max_num_seqs"),
    (
        dict(num_draft_tokens=5, max_num_batched_tokens=5),
        r"max_num_batched_tokens=5 is below one verify row's 6 tokens",
    ),
]


def refused(options: dict, match: str) -> str:
    """The one SpeculantError line `Engine(**options)` raises, matching `match`."""
    with pytest.raises(SpeculantError) as info:
        Engine(TARGET, **options)
    line = str(info.value)
    assert "\n" not in line and re.search(match, line), (options, line)
    return line


@pytest.mark.parametrize("options, match", BAD_OPTIONS)
def test_bad_option_values_are_one_clear_error(options, match):
    spec = dict(algo="eagle3", draft=DRAFTS["eagle3"], num_draft_tokens=3)
    refused({"device": "cpu", "max_num_seqs": 4, "max_model_len": 64, **spec, **options}, match)


@pytest.mark.parametrize("case", range(12))
def test_bad_option_on_a_random_combination_is_one_clear_error(corpus, case):
    """A refused value (or combination) on top of random valid options: still the same error,
    never a crash or a run."""
    rng = random.Random(2000 + case)
    prompts, params = draw_job(rng, corpus)
    options, _ = draw_engine(rng, prompts, params)
    bad, match = rng.choice(BAD_OPTIONS)
    if "capture_sizes" in bad or "max_capture_size" in bad:
        options.pop("capture_sizes", None), options.pop("max_capture_size", None)
    refused({**options, **bad}, match)


@pytest.mark.parametrize(
    "sizes",
    [
        dict(capture_sizes=(1, 2), piecewise_sizes=(8,), eager_padding=True),
        dict(capture_sizes=[], piecewise_sizes=[]),  # []: the default capture sizes, no piecewise
        dict(max_capture_size=1, capture_sizes=[1, 3]),
        dict(capture_sizes=[np.int64(2)], max_capture_size=np.int64(2), overlap=np.False_),
    ],
)
def test_valid_sizes_still_run(sizes):
    engine = Engine(TARGET, device="cpu", max_num_seqs=4, max_model_len=64,
                    kv_cache_memory_fraction=1, **sizes)  # fmt: skip
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3))[0]
    assert len(out.token_ids) == 3


# ------------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--max-num-seqs", "0"], "--max-num-seqs: '0' is not a positive integer"),
        (["--max-num-batched-tokens", "-1"], "--max-num-batched-tokens: '-1'"),
        (["--num-pages", "0"], "--num-pages: '0'"),
        (["--max-capture-size", "0"], "--max-capture-size: '0'"),
        (["--page-size", "1.5"], "--page-size: '1.5'"),
        (["--capture-sizes", "0,1"], "--capture-sizes: '0,1'"),
        (["--piecewise-sizes", "0"], "--piecewise-sizes: '0'"),
        (["--kv-cache-memory-fraction", "nan"], "--kv-cache-memory-fraction nan must be in (0, 1]"),
        (["--seed", str(2**64)], f"--seed {2**64} is invalid"),
        # the engine's ranges, refused while parsing: before a model loads or --tp/--dp ranks
        # start (were refused by each rank's Engine, naming its keyword, or after the load)
        (["--max-model-len", "1"], "--max-model-len: '1' is out of range; use >= 2"),
        (["--num-pages", "1"], "--num-pages: '1' is out of range; use >= 2"),
        (["--num-draft-tokens", "17"], "--num-draft-tokens: '17' is out of range; use 0..16"),
        (["--catch-up-depth", "257"], "--catch-up-depth: '257' is out of range; use 0..256"),
        (["--tp", "2", "--num-draft-tokens", "99"], "--num-draft-tokens: '99' is out of range"),
        (
            ["--capture-sizes", "2", "--max-capture-size", "1", "--max-num-seqs", "4"],
            "smallest capture size is 2; raise --max-capture-size to at least 2",
        ),
    ],
)
def test_cli_refuses_the_same_values_in_one_line(capsys, flags, needle):
    from speculant.launch.cli import main

    try:
        status = main(["generate", "--device", "cpu", "--prompt", "x", *flags])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "speculant: error:" in line]
    assert status == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert needle in errors[0] and err.rstrip().endswith(errors[0]), err


def test_cli_piecewise_sizes_none_runs(capsys):
    from speculant.launch.cli import main

    args = ["generate", "--device", "cpu", "--prompt", "x", "--max-new-tokens", "2",
            "--piecewise-sizes", "none"]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
