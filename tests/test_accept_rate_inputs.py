"""`speculant accept-rate` inputs that used to crash, be silently ignored or be refused with the
wrong fix: report files JSON cannot read, output paths pathlib reads differently from the
writer, --rtol without --baseline, prompts that fill the context. Each is one line naming the
flag (or the prompt) and the fix, exit 2 (exit 1 is the CI gate's regression verdict)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
from helpers_io import accept_rate

REPORT = {
    "algo": "eagle3",
    "num_draft_tokens": 3,
    "num_prompts": 64,
    "max_new_tokens": 64,
    "temperature": 0.0,
    "acceptance_length": 1.4,
    "per_position_acceptance": [0.3, 0.1, 0.0],
}


def error_line(status: int, out: str, err: str) -> str:
    """The one error line of a bad-input run (exit 2, no traceback, no table)."""
    assert status == 2 and out == "", err
    assert err.count("speculant: error:") == 1 and "Traceback" not in err, err
    return next(line for line in err.splitlines() if line.startswith("speculant: error:"))


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a model loads: these inputs must be refused before."""
    from speculant.launch import accept_rate as module

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(module, "measure_in_rank", refuse)


def report_file(path, text: str):
    path.write_text(text)
    return path


# ------------------------------------------------- --baseline / --compare files JSON cannot read


@pytest.mark.parametrize("flag", ["--baseline", "--compare"])
def test_a_deeply_nested_report_file_is_one_line(capsys, tmp_path, no_model, flag):
    """Was a RecursionError traceback, exit 1: the CI gate's regression status."""
    path = report_file(tmp_path / "deep.json", "[" * 100_000 + "]" * 100_000)
    line = error_line(*accept_rate(capsys, flag, path))
    assert f"{flag} {str(path)!r} holds JSON nested too deeply" in line, line
    assert ("--report" if flag == "--compare" else "--write-baseline") in line


def test_a_report_nested_just_readable_is_one_line_at_every_depth(capsys, tmp_path, no_model):
    """Around the depth json reads, a value it read can be too deep to show in the message
    refusing it: every depth there is one line, exit 2."""
    limit = sys.getrecursionlimit()
    path = tmp_path / "b.json"
    for depth in range(limit - 160, limit + 5):
        nested = "[" * depth + "]" * depth
        text = json.dumps(REPORT).replace("[0.3, 0.1, 0.0]", nested)
        error_line(*accept_rate(capsys, "--baseline", report_file(path, text)))


@pytest.mark.parametrize("flag", ["--baseline", "--compare"])
def test_a_number_of_too_many_digits_names_the_flag_and_file(capsys, tmp_path, no_model, flag):
    """Was Python's "Exceeds the limit (4300 digits) for integer string conversion", naming
    neither the flag nor the file."""
    text = json.dumps({**REPORT, "seed": 0}).replace('"seed": 0', '"seed": ' + "9" * 5000)
    path = report_file(tmp_path / "long.json", text)
    line = error_line(*accept_rate(capsys, flag, path))
    assert f"{flag} {str(path)!r}: the number" in line, line
    assert f"more than {sys.get_int_max_str_digits()} digits" in line
    assert "(5000 characters)" in line and "Exceeds the limit" not in line


@pytest.mark.parametrize(
    "flag",
    ["--num-draft-tokens", "--max-new-tokens", "--seed", "--max-num-seqs", "--threads", "--tp",
     "--dp", "--dist-timeout"],
)  # fmt: skip
def test_a_flag_of_too_many_digits_is_one_short_line(capsys, no_model, flag):
    """Was argparse's "invalid int value: '999...'", the 5000 digits printed whole in the one
    line: read as `generate` reads its integer flags."""
    line = error_line(*accept_rate(capsys, flag, "9" * 5000))
    assert len(line) < 400 and f"argument {flag}: '9999" in line, line
    assert "(5000 characters) has too many digits" in line


@pytest.mark.parametrize("extra", [[], ["--tp", "2"]])
def test_more_draft_tokens_than_the_engine_drafts_is_refused_before_loading(
    capsys, no_model, extra
):
    """Was the engine's `num_draft_tokens=17 must be in 0..16` once torch had loaded (and,
    with --tp/--dp, in every rank the launcher had started)."""
    line = error_line(*accept_rate(capsys, "--num-draft-tokens", 17, *extra))
    assert "--num-draft-tokens 17 is more than the engine drafts; use 1..16" in line, line


# ------------------------------------------------------------------------------ output paths


@pytest.mark.parametrize("compare", [False, True])
def test_a_plot_path_ending_in_a_slash_is_refused_before_loading(
    capsys, tmp_path, no_model, compare
):
    """pathlib drops the trailing '/', so the checks passed and the write, given the path as
    typed, failed after both models ran."""
    good = report_file(tmp_path / "good.json", json.dumps(REPORT))
    plot = f"{tmp_path}/x.png/"
    args = ["--compare", good] if compare else []
    line = error_line(*accept_rate(capsys, *args, "--plot", plot))
    assert f"--plot {plot!r} ends in '/'" in line, line
    assert f"drop the trailing '/' ({str(tmp_path / 'x.png')!r})" in line
    assert not (tmp_path / "x.png").exists()
    line = error_line(*accept_rate(capsys, *args, "--plot", f"{tmp_path}/x.png/."))
    assert "ends in '.', which names a directory" in line and "'out.png'" in line, line


@pytest.mark.parametrize(
    "flag, example",
    [("--plot", "out.png"), ("--report", "report.json"), ("--write-baseline", "baseline.json")],
)
def test_a_directory_output_suggests_a_name_the_flag_takes(
    capsys, tmp_path, no_model, flag, example
):
    """--plot DIR suggested DIR/out.jsonl, which --plot refuses (no such image format)."""
    line = error_line(*accept_rate(capsys, flag, tmp_path))
    assert f"{flag} {str(tmp_path)!r} is a directory" in line, line
    assert f"such as {str(tmp_path / example)!r}" in line and "out.jsonl" not in line


# ------------------------------------------------------------------------------------- --rtol


@pytest.mark.parametrize("given", [["--rtol", "0.1"], ["--rtol=0.1"], ["--rtol", "0.05"]])
def test_rtol_without_a_baseline_is_refused(capsys, tmp_path, no_model, given):
    """--rtol only sets how far below --baseline a metric may fall: without one it was
    silently ignored (exit 0), even when given its default value."""
    line = error_line(*accept_rate(capsys, *given, "--report", tmp_path / "r.json"))
    assert f"--rtol {float(given[-1].split('=')[-1])}" in line, line
    assert "--baseline" in line and "drop --rtol" in line


# ------------------------------------------------------------- prompts that fill the context


def test_prompts_that_fill_the_context_name_it_not_max_new_tokens(capsys, tmp_path, llama_dir):
    """A prompt one token short of the context (the engine's max_model_len: the model's
    max_position_embeddings, at most DEFAULT_MAX_MODEL_LEN) gets one output token, at prefill:
    no verify step can run. The message said to raise --max-new-tokens, which cannot help; it
    names the prompt, its length and the context."""
    from speculant.executor.build import DEFAULT_MAX_MODEL_LEN

    config = json.loads((llama_dir / "config.json").read_text())
    context = min(config["max_position_embeddings"], DEFAULT_MAX_MODEL_LEN)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [7] * (context - 1)}) + "\n")
    line = error_line(*accept_rate(
        capsys, "--target", llama_dir, "--draft", llama_dir, "--algo", "draft-model",
        "--num-draft-tokens", 2, "--prompts", prompts, "--max-new-tokens", 8,
    ))  # fmt: skip
    assert f"the longest prompt ({prompts}:1) has {context - 1} tokens" in line, line
    assert f"context holds {context} (max_model_len)" in line
    assert f"at most {context - 2} tokens" in line
    assert "--max-new-tokens" not in line


def test_auto_speculation_that_never_drafted_says_so(monkeypatch, capsys, tmp_path, llama_dir):
    """--speculation auto may decode every step without drafts: no request finished at
    prefill, and more --max-new-tokens is not the fix either."""
    from speculant.launch import accept_rate as module

    def measure(args, job, use_tqdm=True):
        stats = {"num_verify_steps": 0, "num_plain_steps": 7}
        outputs = [SimpleNamespace(prompt_token_ids=[5, 6], token_ids=[1] * 8, stats=stats)]
        return outputs * len(job.specs), None, 0.1

    monkeypatch.setattr(module, "measure_in_rank", measure)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6]}) + "\n")
    line = error_line(*accept_rate(
        capsys, "--target", llama_dir, "--draft", llama_dir, "--algo", "draft-model",
        "--prompts", prompts, "--speculation", "auto", "--temperature", 0.5,
    ))  # fmt: skip
    assert "--speculation auto decoded every step without drafts" in line, line
    assert "--speculation fixed" in line and "--max-new-tokens" not in line
