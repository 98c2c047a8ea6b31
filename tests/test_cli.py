"""The `speculant generate` command, run as a subprocess on tiny CPU checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

OUTPUT_FIELDS = {"index", "token_ids", "text", "finish_reason"}


def run_cli(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m speculant generate ARGS` on the CPU."""
    cmd = [sys.executable, "-m", "speculant", "generate", "--device", "cpu", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str, only_line=True) -> None:
    """Exit 2, no traceback, and a last stderr line `speculant: error:` naming `needles`."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    if only_line:
        assert len(lines) == 1, proc.stderr
    assert lines[-1].startswith("speculant: error:"), proc.stderr
    for needle in needles:
        assert needle in lines[-1], proc.stderr


def test_text_prompt(llama_dir):
    proc = run_cli("--target", llama_dir, "--prompt", "def f(x):", "--max-new-tokens", 8)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("[0] ")
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("requests=1 prompt_tokens=") and "tokens/s=" in summary


def test_jsonl_prompts_write_output_file(llama_dir, tmp_path):
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl",
        [
            {"prompt_token_ids": [5, 6, 7]},
            {"prompt": "import os", "max_new_tokens": 3},
            "",  # blank lines are skipped
            {"prompt_token_ids": [1, 2, 3, 4], "temperature": 0.8, "top_k": 20, "seed": 7},
        ],
    )
    out = tmp_path / "out.jsonl"
    proc = run_cli(
        "--target", llama_dir, "--prompts", prompts, "--output", out,
        "--max-new-tokens", 6, "--ignore-eos",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "[0]" not in proc.stdout  # completions go to the file
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(OUTPUT_FIELDS <= set(line) for line in lines)
    assert all("num_output_tokens" in line.get("stats", line) for line in lines)  # flat or nested
    by_index = {line["index"]: line for line in lines}
    assert sorted(by_index) == [0, 1, 2] and len(lines) == 3
    assert [len(by_index[i]["token_ids"]) for i in range(3)] == [6, 3, 6]
    assert all(line["finish_reason"] == "length" for line in lines)
    assert all(isinstance(line["text"], str) for line in lines)


def test_overlap_flag_gives_the_same_outputs(llama_dir, tmp_path):
    """`--overlap` (the default: launch a step before reading the previous one back) writes the
    same file as `--no-overlap`."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": [5, 6, 7]},
                                                 {"prompt": "import os"}])  # fmt: skip
    files = []
    for flags in (["--no-overlap"], ["--overlap"]):
        files.append(tmp_path / f"out{len(files)}.jsonl")
        proc = run_cli("--target", llama_dir, "--prompts", prompts, "--output", files[-1],
                       "--max-new-tokens", 24, "--ignore-eos", *flags)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    rows = [[json.loads(line)["token_ids"] for line in f.read_text().splitlines()] for f in files]
    assert rows[0] == rows[1] and len(rows[0]) == 2 and len(rows[0][0]) == 24


def test_checkpoint_without_tokenizer_takes_token_ids(qwen2_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": [3, 1, 4, 1, 5]}])
    proc = run_cli("--target", qwen2_dir, "--prompts", prompts, "--max-new-tokens", 4)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("[0] [")  # token ids, as there is no tokenizer


def test_text_prompt_without_tokenizer_is_one_line_error(qwen2_dir):
    proc = run_cli("--target", qwen2_dir, "--prompt", "hello")
    assert_user_error(proc, str(qwen2_dir), "tokenizer", only_line=False)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--target", "/no/such/ckpt", "--prompt", "x"], "/no/such/ckpt"),
        (["--target", "LLAMA", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0"),
        (["--target", "LLAMA", "--prompt", "x", "--capture-sizes", "1,two"], "'1,two'"),
    ],
)
def test_bad_flags_are_one_line_errors(llama_dir, args, needle):
    args = [str(llama_dir) if a == "LLAMA" else a for a in args]
    assert_user_error(run_cli(*args), needle)


def test_malformed_jsonl_line_is_refused_before_loading(tmp_path):
    # The target has no checkpoint in it: the error must come from the prompts file.
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, '{"prompt": "a", '])
    proc = run_cli("--target", tmp_path, "--prompts", prompts)
    assert_user_error(proc, f"{prompts}:2:", "not valid JSON")


# The cases below fail before any model loads, so they run in-process to stay fast.


def run_main(capsys: pytest.CaptureFixture, *args: object) -> tuple[int, str]:
    from speculant.launch.cli import main

    try:
        status = main(["generate", "--device", "cpu", *map(str, args)])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prompt", "x", "--temperature", "-1"], "--temperature -1"),
        (["--prompt", "x", "--top-p", "1.5"], "--top-p 1.5"),
        (["--prompt", "x", "--top-k", "-3"], "--top-k -3"),
        (["--prompt", "x", "--page-size", "0"], "'0'"),
        (["--prompt", "x", "--output", "/no/such/dir/out.jsonl"], "/no/such/dir/out.jsonl"),
        (["--prompts", "/no/such/p.jsonl"], "/no/such/p.jsonl"),
        ([], "--prompt TEXT"),
        (["--prompt", "x", "--sampled-verify", "exact"], "--sampled-verify"),
    ],
)
def test_more_bad_flags(capsys, tmp_path, args, needle):
    status, err = run_main(capsys, "--target", tmp_path, *args)
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("speculant: error:") and needle in err, err


def test_target_and_demo_model_exclude_each_other(capsys, tmp_path):
    status, err = run_main(capsys, "--demo-model", "--target", tmp_path, "--prompt", "x")
    assert status == 2 and "--target DIR" in err and "--demo-model" in err, err


@pytest.mark.parametrize(
    "line, needle",
    [
        ("", "has no prompts"),
        ('["a"]', "expected a JSON object"),
        ('{"prompt": "a", "max_tokens": 3}', "'max_tokens'"),
        ('{"prompt": ""}', "non-empty string"),
        ('{"prompt_token_ids": [1, -2]}', "[1, -2]"),
        ('{"prompt_token_ids": [1, true]}', "[1, True]"),
        ('{"prompt": "a", "prompt_token_ids": [1]}', "exactly one"),
        ('{"prompt": "a", "top_p": 0}', "top_p=0"),
        ('{"prompt": "a", "max_new_tokens": 2.5}', "max_new_tokens=2.5"),
    ],
)
def test_malformed_jsonl_lines(capsys, tmp_path, line, needle):
    prompts = write_jsonl(tmp_path / "p.jsonl", [line])
    status, err = run_main(capsys, "--target", tmp_path, "--prompts", prompts)
    assert status == 2
    assert err.count("\n") == 1 and needle in err, err
    if line:
        assert f"{prompts}:1:" in err


def test_demo_model(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    args = ["--demo-model", "--prompt", "def fibonacci(n):", "--max-new-tokens", 8]
    proc = run_cli(*args, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("[0] ")
    assert (tmp_path / "speculant" / "demo-model" / "model.safetensors").is_file()


def test_demo_checkpoint_is_reproducible_and_loads_in_transformers(tmp_path):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from speculant.launch.demo import EOS_TOKEN, build_demo_model

    first, second = build_demo_model(tmp_path / "a"), build_demo_model(tmp_path / "b")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    tokenizer = Tokenizer.from_file(str(first / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(first)
    assert model.config.vocab_size == tokenizer.get_vocab_size()
    assert model.config.eos_token_id == tokenizer.token_to_id(EOS_TOKEN)
    ids = tokenizer.encode("def fibonacci(n):").ids
    assert tokenizer.decode(ids) == "def fibonacci(n):"
    with torch.no_grad():
        assert model(torch.tensor([ids])).logits.shape == (1, len(ids), len(tokenizer.get_vocab()))


def test_sampled_verify_match_gives_the_plain_runs_seeded_output(tmp_path):
    """`--sampled-verify match` with the bundled EAGLE-3 head: seeded sampled output equals the
    plain run's, request for request, through the CLI."""
    from speculant import bundled

    prompts = write_jsonl(
        tmp_path / "prompts.jsonl",
        [{"prompt": "def fib(n):", "seed": 3}, {"prompt": "import numpy as np", "seed": 4}],
    )
    common = ["--target", bundled("target"), "--prompts", prompts, "--temperature", "0.8",
              "--max-new-tokens", 24, "--ignore-eos"]  # fmt: skip
    runs = {}
    for name, extra in (
        ("plain", []),
        ("match", ["--algo", "eagle3", "--draft", bundled("eagle3"), "--sampled-verify", "match"]),
    ):
        out = tmp_path / f"{name}.jsonl"
        proc = run_cli(*common, *extra, "--output", out)
        assert proc.returncode == 0, proc.stderr
        rows = [json.loads(line) for line in out.read_text().splitlines()]  # as they finish
        runs[name] = [r["token_ids"] for r in sorted(rows, key=lambda r: r["index"])]
    assert runs["match"] == runs["plain"] and len(runs["plain"]) == 2
