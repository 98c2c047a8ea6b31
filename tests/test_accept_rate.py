"""`speculant accept-rate`: report fields, losslessness check, baseline comparison and its exit
codes, on tiny random checkpoints (the bundled models have their own regression test)."""

from __future__ import annotations

import contextlib
import errno
import json
import sys
from pathlib import Path

import pytest
from helpers_eagle import write_random_eagle3
from helpers_io import accept_rate


@pytest.fixture(scope="module")
def setup(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("accept")
    write_random_eagle3(root / "eagle", llama_dir, draft_vocab=200)
    prompts = root / "prompts.jsonl"
    rows = [{"prompt_token_ids": [5 + i, 17, 33 + 2 * i, 9]} for i in range(5)]
    rows.append({"prompt": "def add(a, b):"})
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, prompts


def test_report_and_baseline_roundtrip(capsys, setup, llama_dir, tmp_path):
    root, prompts = setup
    base = [
        "--target", llama_dir, "--draft", root / "eagle", "--algo", "eagle3",
        "--prompts", prompts, "--num-draft-tokens", 3, "--max-new-tokens", 12,
    ]  # fmt: skip
    status, out, err = accept_rate(
        capsys, *base, "--report", tmp_path / "r.json", "--write-baseline", tmp_path / "b.json"
    )
    assert status == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["lossless"] is True and report["mismatched_prompts"] == []
    assert report["num_prompts"] == 6 and report["num_draft_tokens"] == 3
    assert report["algo"] == "eagle3" and report["draft"] == str(root / "eagle")
    assert 1.0 <= report["acceptance_length"] <= 4.0
    assert len(report["per_position_acceptance"]) == 3
    # rates can only fall along the chain: draft i+1 is accepted only after draft i
    rates = report["per_position_acceptance"]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    assert "| acceptance_length |" in out and "lossless=True" in err
    assert json.loads((tmp_path / "b.json").read_text()) == report

    # the same run against its own baseline passes; a better baseline makes it fail with exit 1
    status, out, err = accept_rate(capsys, *base, "--baseline", tmp_path / "b.json")
    assert status == 0 and "REGRESSED" not in out, err
    better = dict(report, acceptance_length=report["acceptance_length"] * 1.2 + 0.1)
    (tmp_path / "better.json").write_text(json.dumps(better))
    status, out, err = accept_rate(capsys, *base, "--baseline", tmp_path / "better.json")
    assert status == 1
    assert "| acceptance_length |" in out and "REGRESSED" in out
    assert "regressed beyond rtol=0.05" in err
    # within --rtol it passes
    status, _, err = accept_rate(
        capsys, *base, "--baseline", tmp_path / "better.json", "--rtol", "0.5"
    )
    assert status == 0, err


def test_target_as_its_own_draft_model_accepts_everything(capsys, setup, llama_dir, tmp_path):
    _, prompts = setup
    status, _, err = accept_rate(
        capsys, "--target", llama_dir, "--draft", llama_dir, "--algo", "draft-model",
        "--prompts", prompts, "--num-draft-tokens", 4, "--max-new-tokens", 11,
        "--report", tmp_path / "r.json",
    )  # fmt: skip
    assert status == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["acceptance_length"] == 5.0
    assert report["per_position_acceptance"] == [1.0] * 4
    assert report["lossless"] is True


def test_sampled_run_reports_no_lossless_verdict(capsys, setup, llama_dir, tmp_path):
    root, prompts = setup
    status, _, err = accept_rate(
        capsys, "--target", llama_dir, "--draft", root / "eagle", "--prompts", prompts,
        "--temperature", 1.0, "--max-new-tokens", 8, "--report", tmp_path / "r.json",
    )  # fmt: skip
    assert status == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["lossless"] is None


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--max-new-tokens", "1"], "--max-new-tokens 1"),
        (["--rtol", "1.5"], "--rtol 1.5"),
        (["--max-num-seqs", "0"], "--max-num-seqs 0"),
        (["--dist-timeout", "-1"], "--dist-timeout -1"),
        (["--dist-timeout", "100000000000"], "--dist-timeout 100000000000 is too large"),
        (["--report", ""], "--report is an empty path"),
        (["--temperature", "1e39"], "--temperature 1e+39 must be a finite number in 0..3.403e+38"),
        (["--baseline", "/no/such.json"], "/no/such.json"),
        (["--draft", "/no/such/dir"], "/no/such/dir"),
        (["--num-draft-tokens", "5", "--baseline", "BASELINE"], "num_draft_tokens=3"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, setup, llama_dir, tmp_path, extra, needle):
    root, prompts = setup
    baseline = tmp_path / "b.json"
    baseline.write_text(
        json.dumps(
            {
                "algo": "eagle3",
                "num_draft_tokens": 3,
                "num_prompts": 6,
                "max_new_tokens": 8,
                "temperature": 0.0,
                "acceptance_length": 1.5,
                "per_position_acceptance": [0.3, 0.1, 0.0],
            }
        )
    )
    extra = [str(baseline) if x == "BASELINE" else x for x in extra]
    args = ["--target", llama_dir, "--draft", root / "eagle", "--prompts", prompts]
    status, _, err = accept_rate(capsys, *args, "--max-new-tokens", 8, *extra)
    assert status == 2
    assert err.count("speculant: error:") == 1 and needle in err, err
    assert "Traceback" not in err


@pytest.mark.timeout(240)
def test_tp2_and_dp2_report_what_one_rank_reports(capsys, setup, llama_dir, tmp_path):
    """`--tp 2` and `--dp 2` start their ranks; rank 0 reports the same acceptance as one rank."""
    root, prompts = setup
    base = [
        "--target", llama_dir, "--draft", root / "eagle", "--prompts", prompts,
        "--num-draft-tokens", 3, "--max-new-tokens", 10, "--dist-timeout", 60,
    ]  # fmt: skip
    reports = {}
    for name, extra in (("one", []), ("tp2", ["--tp", 2]), ("dp2", ["--dp", 2])):
        status, _, err = accept_rate(capsys, *base, *extra, "--report", tmp_path / f"{name}.json")
        assert status == 0, err
        reports[name] = json.loads((tmp_path / f"{name}.json").read_text())
    for name in ("tp2", "dp2"):
        assert reports[name]["lossless"] is True
        for key in ("acceptance_length", "per_position_acceptance", "num_verify_steps"):
            assert reports[name][key] == pytest.approx(reports["one"][key]), (name, key)


@pytest.mark.timeout(240)
def test_a_regression_under_dp2_exits_1_with_the_verdict_last(capfd, setup, llama_dir, tmp_path):
    """A FAIL verdict under `--dp 2` is rank 0's own result, not a failed rank: exit 1 with the
    FAIL line last, and no launcher line saying rank 0 failed (its ranks all ran to the end)."""
    root, prompts = setup
    base = [
        "--target", llama_dir, "--draft", root / "eagle", "--prompts", prompts,
        "--num-draft-tokens", 3, "--max-new-tokens", 10, "--dist-timeout", 60,
    ]  # fmt: skip
    status, _, err = accept_rate(capfd, *base, "--report", tmp_path / "r.json")
    assert status == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    better = dict(report, acceptance_length=report["acceptance_length"] * 1.2 + 0.1)
    (tmp_path / "better.json").write_text(json.dumps(better))
    status, out, err = accept_rate(capfd, *base, "--dp", 2, "--baseline", tmp_path / "better.json")
    assert status == 1, err
    assert "REGRESSED" in out
    last = err.strip().splitlines()[-1]
    assert last.startswith("speculant: FAIL: 1 metric(s) regressed beyond rtol=0.05"), err
    assert "exited with status" not in err and "speculant: error:" not in err, err


# ------------------------- inputs refused before any model loads; files after the verdict


def no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before the inputs were checked")


BASELINE = {
    "algo": "eagle3",
    "num_draft_tokens": 3,
    "num_prompts": 6,
    "max_new_tokens": 8,
    "temperature": 0.0,
    "acceptance_length": 1.4,
    "per_position_acceptance": [0.3, 0.1, 0.0],
}


@pytest.mark.parametrize("flag", ["--baseline", "--compare"])
@pytest.mark.parametrize(
    "change, needle",
    [
        ({"algo": None}, "lacks the field 'algo'"),
        ({"per_position_acceptance": None}, "lacks the field 'per_position_acceptance'"),
        ({"acceptance_length": "2.0"}, "field 'acceptance_length' is \"2.0\""),
        ({"num_draft_tokens": True}, "field 'num_draft_tokens' is true"),
        ({"per_position_acceptance": [0.3, "x", 0.0]}, "field 'per_position_acceptance'"),
        ({"per_position_acceptance": [0.3, 0.1]}, "holds 2 rate(s) but 'num_draft_tokens' is 3"),
    ],
)
def test_report_file_fields_are_checked_when_read(
    monkeypatch, capsys, setup, llama_dir, tmp_path, flag, change, needle
):
    """A --baseline or --compare file without a field, or with one of the wrong type or length,
    is one line naming the file, the field and the fix, before any model loads (was a KeyError,
    a TypeError or a zip() error, for --baseline after the whole run)."""
    from speculant.launch import accept_rate as module

    monkeypatch.setattr(module, "measure_in_rank", no_model)
    root, prompts = setup
    bad = {k: v for k, v in {**BASELINE, **change}.items() if v is not None}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    if flag == "--baseline":
        args = ["--target", llama_dir, "--draft", root / "eagle", "--prompts", prompts]
        status, _, err = accept_rate(capsys, *args, "--max-new-tokens", 8, "--baseline", path)
        fix = "--write-baseline"
    else:
        good = tmp_path / "good.json"
        good.write_text(json.dumps(BASELINE))
        status, _, err = accept_rate(capsys, "--compare", good, path)
        fix = "--report"
    assert status == 2, err
    assert err.count("speculant: error:") == 1 and "Traceback" not in err, err
    assert f"{flag} {str(path)!r}" in err and needle in err and fix in err, err


def test_compare_needs_only_the_fields_it_shows(capsys, tmp_path):
    """--compare reads algo, k and the rates: a report without the run settings still compares."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps({k: BASELINE[k] for k in ("algo", "num_draft_tokens",
                                "acceptance_length", "per_position_acceptance")}))  # fmt: skip
    status, out, err = accept_rate(capsys, "--compare", path)
    assert status == 0, err
    assert "| acceptance_length | 1.4000 |" in out


@pytest.mark.parametrize("key, value", [("max_new_tokens", 4), ("temperature", 0.7),
                                        ("seed", 3), ("top_k", 5), ("top_p", 0.9)])  # fmt: skip
def test_per_line_settings_in_prompts_are_refused(
    monkeypatch, capsys, llama_dir, tmp_path, key, value
):
    """accept-rate runs every prompt with its flags: a --prompts line setting its own is refused
    naming the line and the key (it used to be read and then silently ignored)."""
    from speculant.launch import accept_rate as module

    monkeypatch.setattr(module, "measure_in_rank", no_model)
    prompts = tmp_path / "p.jsonl"
    lines = [{"prompt_token_ids": [5, 6]}, None, {"prompt_token_ids": [7, 8], key: value}]
    prompts.write_text("".join(("" if r is None else json.dumps(r)) + "\n" for r in lines))
    status, _, err = accept_rate(
        capsys, "--target", llama_dir, "--draft", llama_dir, "--algo", "draft-model",
        "--prompts", prompts,
    )  # fmt: skip
    assert status == 2, err
    assert err.count("speculant: error:") == 1, err
    assert f"{prompts}:3: accept-rate takes" in err and repr(key) in err, err
    flag = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "seed": "--seed"}
    assert flag.get(key, "full distribution") in err


def test_plot_extension_is_checked_before_any_model_loads(monkeypatch, capsys, tmp_path):
    from speculant.launch import accept_rate as module

    monkeypatch.setattr(module, "measure_in_rank", no_model)
    path = tmp_path / "r.xyz"
    status, _, err = accept_rate(capsys, "--plot", path)
    assert status == 2, err
    assert err.count("speculant: error:") == 1 and f"--plot {str(path)!r}" in err, err
    assert ".png, .pdf, .svg" in err and "'.xyz'" in err
    good = tmp_path / "good.json"
    good.write_text(json.dumps(BASELINE))
    status, out, err = accept_rate(capsys, "--compare", good, "--plot", tmp_path / "c.gif")
    assert status == 2 and "'.gif'" in err and out == "", err


@pytest.mark.needs("matplotlib")
def test_plot_without_extension_writes_exactly_that_path_as_png(capsys, tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(BASELINE))
    status, _, err = accept_rate(capsys, "--compare", good, "--plot", tmp_path / "chart")
    assert status == 0, err
    assert (tmp_path / "chart").read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "chart.png").exists()


def fake_measure(rates: list[float], lossless: bool = True):
    """measure_in_rank without models: every prompt ran 4 verify steps at `rates`."""
    from types import SimpleNamespace

    def measure(args, job, use_tqdm=True):
        length = 1 + sum(rates)
        stats = {"num_verify_steps": 4, "accept_len": length, "per_position_acceptance": rates}
        outputs = [SimpleNamespace(token_ids=[1, 2, 3], stats=stats) for _ in job.specs]
        plain = [SimpleNamespace(token_ids=[1, 2, 3 if lossless else 4]) for _ in job.specs]
        return outputs, plain, 0.1

    return measure


def gated_run(monkeypatch, capsys, setup, llama_dir, tmp_path, measure, *extra):
    """accept-rate against BASELINE with `measure` standing in for the model run (`extra`:
    more flags); (exit status, stdout, stderr)."""
    from speculant.launch import accept_rate as module

    monkeypatch.setattr(module, "measure_in_rank", measure)
    root, prompts = setup
    baseline = tmp_path / "b.json"
    baseline.write_text(json.dumps(BASELINE))
    return accept_rate(
        capsys, "--target", llama_dir, "--draft", root / "eagle", "--prompts", prompts,
        "--max-new-tokens", 8, "--baseline", baseline, *extra,
    )  # fmt: skip


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize(
    "rates, lossless, status",
    [
        ([0.3, 0.1, 0.0], True, 2),  # the run passed: the failed write is exit 2
        ([0.1, 0.0, 0.0], True, 1),  # a regression stays exit 1
        ([0.3, 0.1, 0.0], False, 1),  # so does a lossless failure
    ],
)
def test_a_failed_write_keeps_the_table_and_the_verdict(
    monkeypatch, capsys, setup, llama_dir, tmp_path, rates, lossless, status
):
    """The table and the verdict come before the files; a write that fails (/dev/full) is one
    line naming the flag and the path, and a FAIL is still exit 1."""
    got, out, err = gated_run(
        monkeypatch, capsys, setup, llama_dir, tmp_path, fake_measure(rates, lossless),
        "--report", "/dev/full", "--write-baseline", tmp_path / "new.json",
    )  # fmt: skip
    assert got == status, err
    assert "| acceptance_length |" in out and "accept_len=" in err
    assert err.count("speculant: error:") == 1 and "Traceback" not in err, err
    assert "speculant: error: --report '/dev/full': writing failed (no space left" in err
    assert err.rstrip().endswith("pick another path")  # the verdict came before it
    assert ("regressed beyond" in err) == (rates[0] < 0.3)
    assert ("differs from plain" in err) == (not lossless)
    written = json.loads((tmp_path / "new.json").read_text())  # the other file is written
    assert written["per_position_acceptance"] == pytest.approx(rates)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_failing_stdout_still_writes_the_report(monkeypatch, capsys, setup, llama_dir, tmp_path):
    """The table cannot be printed (`> /dev/full`, a closed pipe): the verdict and the files
    still come, then one line naming stdout and exit 2."""
    full = open("/dev/full", "w")
    monkeypatch.setattr(sys, "stdout", full)
    report = tmp_path / "r.json"
    try:
        status, _, err = gated_run(monkeypatch, capsys, setup, llama_dir, tmp_path,
                                   fake_measure([0.3, 0.1, 0.0]), "--report", report)  # fmt: skip
    finally:
        monkeypatch.undo()
        with contextlib.suppress(OSError):  # what the failed write left in its buffer
            full.close()
    assert status == 2 and "accept_len=" in err, err
    assert "speculant: error: printing the table to stdout failed (no space left" in err
    assert json.loads(report.read_text())["per_position_acceptance"] == pytest.approx([0.3, 0.1, 0])


def test_a_write_failing_part_way_leaves_the_old_baseline_whole(
    monkeypatch, capsys, setup, llama_dir, tmp_path
):
    """--write-baseline over the gate's baseline on a disk that fills half way: one line naming
    the flag, exit 2, and the old baseline still whole (the next gate reads it), no temporary
    file left beside it."""
    keep = tmp_path / "keep" / "baseline.json"
    keep.parent.mkdir()
    keep.write_text(json.dumps(BASELINE) + "\n")
    before = keep.read_bytes()

    def cut(self, text, *args, **kwargs):  # writes half the text, then the disk is full
        with open(self, "w") as file:
            file.write(text[: len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    measure = fake_measure([0.3, 0.1, 0.0])

    def measured(*args, **kwargs):  # the baseline was read; the run's files fail
        monkeypatch.setattr(Path, "write_text", cut)
        return measure(*args, **kwargs)

    status, out, err = gated_run(monkeypatch, capsys, setup, llama_dir, tmp_path, measured,
                                 "--write-baseline", keep)  # fmt: skip
    assert status == 2 and "| acceptance_length |" in out, err
    assert f"speculant: error: --write-baseline '{keep}': writing failed (no space left" in err
    assert keep.read_bytes() == before
    assert [p.name for p in keep.parent.iterdir()] == ["baseline.json"]


@pytest.mark.needs("matplotlib")
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_failed_plot_names_the_flag_after_a_fail_verdict(
    monkeypatch, capsys, setup, llama_dir, tmp_path
):
    status, out, err = gated_run(
        monkeypatch, capsys, setup, llama_dir, tmp_path, fake_measure([0.1, 0.0, 0.0]),
        "--plot", "/dev/full",
    )  # fmt: skip
    assert status == 1, err
    assert "REGRESSED" in out and "regressed beyond" in err
    assert "speculant: error: --plot '/dev/full': writing failed" in err, err


# ------------------------------- outputs that are inputs, k known late, flags --compare ignores


@pytest.mark.parametrize(
    "output, other",
    [
        ("--report", "--prompts"),
        ("--write-baseline", "--prompts"),  # through a symlink
        ("--plot", "--baseline"),  # through a hard link
        ("--write-baseline", "--report"),  # neither written yet, spelled differently
        ("--plot", "--report"),
        ("--plot", "--compare"),
    ],
)
def test_an_output_that_is_an_input_or_another_output_is_refused(
    monkeypatch, capsys, setup, llama_dir, tmp_path, output, other
):
    """An output path that is an input's file (links and other spellings count) or another
    output's is one line naming both flags, exit 2, before any model loads; the input is left
    as it was (the report used to overwrite a --prompts file, rc 0)."""
    from speculant.launch import accept_rate as module

    monkeypatch.setattr(module, "measure_in_rank", no_model)
    monkeypatch.chdir(tmp_path)
    root, prompts = setup
    inputs = {"--prompts": tmp_path / "p.png", "--baseline": tmp_path / "b.png"}
    inputs["--prompts"].write_bytes(prompts.read_bytes())
    inputs["--baseline"].write_text(json.dumps({**BASELINE, "max_new_tokens": 4}))
    before = {flag: path.read_bytes() for flag, path in inputs.items()}
    if other == "--compare":
        flags = ["--compare", inputs["--baseline"], "--plot", inputs["--baseline"]]
    else:
        paths = {"--prompts": "p.png", "--baseline": "b.png", "--report": "./out.png"}
        if output == "--write-baseline" and other == "--prompts":
            (tmp_path / "link.png").symlink_to("p.png")
            paths[output] = "link.png"
        elif output == "--plot" and other == "--baseline":
            (tmp_path / "hard.png").hardlink_to("b.png")
            paths[output] = "hard.png"
        else:
            paths[output] = paths[other].removeprefix("./")
        flags = [
            "--target", llama_dir, "--draft", root / "eagle", "--max-new-tokens", 4,
            *[x for flag, path in paths.items() for x in (flag, path)],
        ]  # fmt: skip
    status, out, err = accept_rate(capsys, *flags)
    assert status == 2, err
    assert err.count("speculant: error:") == 1 and "Traceback" not in err, err
    assert f"speculant: error: {output} " in err and f"is the {other} file" in err, err
    assert f"pick another {output}" in err and out == ""
    assert {flag: path.read_bytes() for flag, path in inputs.items()} == before
    assert not (tmp_path / "out.png").exists()


def baseline_with_k(path: Path, k: int, algo: str = "eagle3") -> Path:
    path.write_text(json.dumps({**BASELINE, "algo": algo, "num_draft_tokens": k,
                                "per_position_acceptance": [0.2] * k}))  # fmt: skip
    return path


@pytest.mark.parametrize("algo, baseline_k, run_k", [("eagle3", 4, 3), ("dflash", 3, 7)])
def test_a_baseline_of_another_k_is_refused_before_any_model_loads(
    monkeypatch, capsys, setup, llama_dir, tmp_path, algo, baseline_k, run_k
):
    """k left to the drafter's default (EAGLE-3: 3; DFLASH: its block - 1, the bundled one's
    config) is read from the config files and checked against the baseline before any model
    loads (was: after both runs, with their results thrown away)."""
    from speculant.launch import accept_rate as module

    monkeypatch.setattr(module, "measure_in_rank", no_model)
    root, prompts = setup
    where = ["--target", llama_dir, "--draft", root / "eagle"] if algo == "eagle3" else []
    baseline = baseline_with_k(tmp_path / "b.json", baseline_k, algo)
    status, out, err = accept_rate(
        capsys, *where, "--algo", algo, "--prompts", prompts, "--max-new-tokens", 8,
        "--baseline", baseline, "--report", tmp_path / "r.json",
    )  # fmt: skip
    assert status == 2, err
    assert err.count("speculant: error:") == 1 and "Traceback" not in err, err
    assert f"num_draft_tokens={baseline_k}, this run has {run_k};" in err, err


def test_the_k_the_engine_resolved_is_checked_before_generating(
    monkeypatch, capsys, setup, llama_dir, tmp_path
):
    """Should the k read before loading differ from the one the Engine resolves, the Engine's
    is checked against the baseline once it is built, before anything is generated."""
    from speculant.launch import accept_rate as module

    def no_generate(*args, **kwargs):
        raise AssertionError("generated before the engine's k was checked")

    monkeypatch.setattr(module, "draft_tokens", lambda args, draft: 4)
    monkeypatch.setattr(module, "_generate", no_generate)
    root, prompts = setup
    status, _, err = accept_rate(
        capsys, "--target", llama_dir, "--draft", root / "eagle", "--prompts", prompts,
        "--max-new-tokens", 8, "--baseline", baseline_with_k(tmp_path / "b.json", 4),
    )  # fmt: skip
    assert status == 2, err
    assert err.count("speculant: error:") == 1 and "num_draft_tokens=4, this run has 3" in err


def test_a_baseline_of_another_dtype_is_refused_before_generating(
    monkeypatch, capsys, setup, llama_dir, tmp_path
):
    """A baseline records the dtype its engines ran in (`--dtype auto` resolved: float32 on a
    CPU); a run in another precision is refused once the engine is built, before anything is
    generated, naming both; the same dtype is compared (a baseline without the field too)."""
    from speculant.launch import accept_rate as module

    root, prompts = setup
    flags = ["--target", llama_dir, "--draft", root / "eagle", "--prompts", prompts,
             "--max-new-tokens", 4]  # fmt: skip
    status, _, err = accept_rate(capsys, *flags, "--write-baseline", tmp_path / "b.json")
    assert status == 0, err
    written = json.loads((tmp_path / "b.json").read_text())
    assert written["dtype"] == "float32"  # auto on a CPU
    status, _, err = accept_rate(capsys, *flags, "--baseline", tmp_path / "b.json")
    assert status == 0 and "speculant: error:" not in err, err  # the same dtype compares

    def no_generate(*args, **kwargs):
        raise AssertionError("generated before the engine's dtype was checked")

    monkeypatch.setattr(module, "_generate", no_generate)
    status, _, err = accept_rate(capsys, *flags, "--dtype", "bfloat16", "--baseline",
                                 tmp_path / "b.json")  # fmt: skip
    assert status == 2, err
    assert err.count("speculant: error:") == 1 and "Traceback" not in err, err
    assert "measured with dtype='float32', this run has 'bfloat16'" in err, err


@pytest.mark.parametrize("lossless, status", [(True, 2), (False, 1)])
def test_a_baseline_found_of_another_k_after_the_run_keeps_the_run(
    monkeypatch, capsys, setup, llama_dir, tmp_path, lossless, status
):
    """A mismatch only the run shows (here a run that measured 4 positions against a k=3
    baseline) still prints the table and writes --report before the error line: exit 2, or 1
    on a lossless FAIL (the run's results used to be thrown away)."""
    got, out, err = gated_run(
        monkeypatch, capsys, setup, llama_dir, tmp_path, fake_measure([0.5, 0.3, 0.1, 0.0],
        lossless), "--report", tmp_path / "r.json", "--write-baseline", tmp_path / "new.json",
    )  # fmt: skip
    assert got == status, err
    assert "| per_position_acceptance[3] | 0.0000 | - |" in out and "REGRESSED" not in out
    assert err.count("speculant: error:") == 1 and "Traceback" not in err, err
    assert "measured with num_draft_tokens=3, this run has 4" in err, err
    assert ("differs from plain" in err) == (not lossless)
    for name in ("r.json", "new.json"):
        report = json.loads((tmp_path / name).read_text())
        assert report["per_position_acceptance"] == pytest.approx([0.5, 0.3, 0.1, 0.0])


def test_compare_refuses_the_flags_it_does_not_use(capsys, tmp_path):
    """--compare runs no model: --prompts, --baseline, --tp and the like given with it are one
    line naming them, exit 2 (they used to be ignored, rc 0); --plot and --debug are used."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps(BASELINE))
    status, out, err = accept_rate(
        capsys, "--compare", path, "--prompts", "/nonexistent", "--baseline", "/nonexistent",
        "--tp", 99,
    )  # fmt: skip
    assert status == 2 and out == "", err
    assert err.count("speculant: error:") == 1, err
    assert "does not use --prompts, --baseline, --tp; drop them" in err, err
    status, out, err = accept_rate(capsys, "--compare", path, "--temperature", "nan")
    assert status == 2 and "does not use --temperature; drop it" in err, err
    status, out, err = accept_rate(capsys, "--compare", path, "--debug")
    assert status == 0 and "| acceptance_length | 1.4000 |" in out, err


@pytest.mark.parametrize(
    "fields, flags, needle",
    [
        ({"speculation": "auto"}, [], "measured with speculation='auto', this run has 'fixed'"),
        ({}, ["--speculation", "auto"], "measured with speculation='fixed', this run has 'auto'"),
        ({"temperature": 0.7, "seed": 0}, ["--temperature", 0.7, "--seed", 3],
         "measured with seed=0, this run has 3"),
        ({"temperature": 0.7}, ["--temperature", 0.7], "lacks 'seed'"),
    ],
)  # fmt: skip
def test_a_baseline_of_another_speculation_mode_or_sampling_seed_is_refused(
    monkeypatch, capsys, setup, llama_dir, tmp_path, fields, flags, needle
):
    """--speculation auto measures other rates than fixed k, and a sampled run's rates depend
    on its seeds: a baseline of another mode or seed is refused before any model loads (both
    used to be compared silently). A baseline without `speculation` was written when every run
    was fixed."""
    from speculant.launch import accept_rate as module

    monkeypatch.setattr(module, "measure_in_rank", no_model)
    root, prompts = setup
    baseline = tmp_path / "b.json"
    baseline.write_text(json.dumps({**BASELINE, **fields}))
    status, out, err = accept_rate(
        capsys, "--target", llama_dir, "--draft", root / "eagle", "--prompts", prompts,
        "--max-new-tokens", 8, "--baseline", baseline, *flags,
    )  # fmt: skip
    assert status == 2, err
    assert err.count("speculant: error:") == 1 and "Traceback" not in err, err
    assert needle in err and out == "", err


def test_a_baseline_of_other_prompts_is_refused_and_its_own_are_compared(
    monkeypatch, capsys, setup, llama_dir, tmp_path
):
    """A report records a fingerprint of its prompts; a baseline measured on other prompts (as
    many) is refused before any model loads (it used to be compared: a false REGRESSED), one of
    the same prompts is compared, and one written before the field existed is compared too."""
    from speculant.launch import accept_rate as module
    from speculant.launch.cli import read_prompts_file

    root, prompts = setup
    ours = module.prompts_fingerprint(read_prompts_file(str(prompts)))
    other = prompts.read_text().splitlines()[::-1]  # the same lines, another order
    assert module.prompts_fingerprint(read_prompts_file(_lines(tmp_path, other))) != ours
    base = ["--target", llama_dir, "--draft", root / "eagle", "--prompts", prompts,
            "--max-new-tokens", 8, "--baseline", tmp_path / "b.json"]  # fmt: skip
    monkeypatch.setattr(module, "measure_in_rank", no_model)
    (tmp_path / "b.json").write_text(json.dumps({**BASELINE, "prompts_sha256": "ab" * 32}))
    status, out, err = accept_rate(capsys, *base)
    assert status == 2 and out == "" and err.count("speculant: error:") == 1, err
    assert "was measured on other prompts (sha256 abababababab..." in err, err
    monkeypatch.setattr(module, "measure_in_rank", fake_measure([0.3, 0.1, 0.0]))
    for fields in ({"prompts_sha256": ours}, {}):
        (tmp_path / "b.json").write_text(json.dumps({**BASELINE, **fields}))
        status, out, err = accept_rate(capsys, *base, "--report", tmp_path / "r.json")
        assert status == 0 and "| acceptance_length |" in out, err
        assert json.loads((tmp_path / "r.json").read_text())["prompts_sha256"] == ours


def _lines(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "other.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_sampled_baseline_of_the_same_seed_is_compared(
    monkeypatch, capsys, setup, llama_dir, tmp_path
):
    """The same seed (and a greedy run whatever the baseline's seed) is compared, and the
    report records the seed it ran with."""
    sampled = {**BASELINE, "temperature": 0.7, "seed": 5}
    (tmp_path / "b.json").write_text(json.dumps(sampled))
    from speculant.launch import accept_rate as module

    monkeypatch.setattr(module, "measure_in_rank", fake_measure([0.3, 0.1, 0.0]))
    root, prompts = setup
    status, out, err = accept_rate(
        capsys, "--target", llama_dir, "--draft", root / "eagle", "--prompts", prompts,
        "--max-new-tokens", 8, "--temperature", 0.7, "--seed", 5, "--baseline",
        tmp_path / "b.json", "--report", tmp_path / "r.json",
    )  # fmt: skip
    assert status == 0, err
    assert "| acceptance_length |" in out and "REGRESSED" not in out
    assert json.loads((tmp_path / "r.json").read_text())["seed"] == 5
    greedy = {**BASELINE, "seed": 9}
    (tmp_path / "g.json").write_text(json.dumps(greedy))
    status, _, err = accept_rate(
        capsys, "--target", llama_dir, "--draft", root / "eagle", "--prompts", prompts,
        "--max-new-tokens", 8, "--baseline", tmp_path / "g.json",
    )  # fmt: skip
    assert status == 0, err
