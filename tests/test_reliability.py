"""What a user meets when things go wrong, end to end through the CLI: every mistake in the
README's table is one `speculant: error:` line naming the value and the fix, exit status 2, no
traceback; Ctrl-C stops every rank with status 130 and keeps the outputs already written.
(Rank deaths under spawn, torchrun and Ray: tests/test_parallel.py and tests/test_launchers.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers_dflash import write_random_dflash
from helpers_eagle import write_random_eagle3
from helpers_io import written


@pytest.fixture(scope="module")
def broken(tmp_path_factory, llama_dir) -> dict[str, Path]:
    """Checkpoints and drafters that are wrong in one way each."""
    root = tmp_path_factory.mktemp("broken")

    def copy(name: str) -> Path:
        shutil.copytree(llama_dir, root / name)
        return root / name

    truncated = copy("truncated") / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:4096])
    config = json.loads((llama_dir / "config.json").read_text())
    (copy("arch") / "config.json").write_text(
        json.dumps({**config, "architectures": ["GPT2LMHeadModel"]})
    )
    (copy("shape") / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    write_random_eagle3(root / "eagle_wide", llama_dir, hidden=64, seed=1)  # fine
    write_random_eagle3(
        root / "eagle_ids", llama_dir, aux_ids=[0, 1, 7], config_overrides={}, seed=2
    )
    (copy("notok") / "tokenizer.json").unlink()
    write_random_dflash(root / "dflash_ids", llama_dir, target_layer_ids=[0, 5])
    write_random_dflash(root / "dflash_vocab", llama_dir, mask_token_id=100000)
    return {"root": root, **{p.name: p for p in root.iterdir()}}


CASES = [  # (what, args, text the one-line error must contain)
    ("missing checkpoint", ["--target", "/no/such/dir"], "/no/such/dir"),
    ("truncated safetensors", ["--target", "{truncated}"], "corrupt or truncated"),
    ("unknown architecture", ["--target", "{arch}"], "GPT2LMHeadModel"),
    ("wrong tensor shapes", ["--target", "{shape}"], "wrong shape"),
    (
        "EAGLE-3 aux layer out of range",
        ["--algo", "eagle3", "--draft", "{eagle_ids}"],
        "out of range",
    ),
    (
        "DFLASH layer ids out of range",
        ["--algo", "dflash", "--draft", "{dflash_ids}"],
        "target_layer_ids=[0, 5]",
    ),
    ("DFLASH mask outside vocab", ["--algo", "dflash", "--draft", "{dflash_vocab}"], "100000"),
    ("drafter of another kind", ["--algo", "dflash", "--draft", "{eagle_wide}"], "not a DFLASH"),
    ("prompt longer than the context", ["--max-model-len", "32", "--prompt", "x " * 200], "32"),
    ("max_new_tokens <= 0", ["--max-new-tokens", "0"], "--max-new-tokens 0"),
    ("k above the supported 16", ["--algo", "eagle3", "--draft", "{eagle_wide}",
                                  "--num-draft-tokens", "40"], "'40' is out of range"),
    ("capture size above max_num_seqs", ["--capture-sizes", "1,64", "--max-num-seqs", "8"], "64"),
    ("tp does not divide the heads", ["--tp", "3"], "tp=3"),
    ("text prompt, no tokenizer, 2 ranks", ["--target", "{notok}", "--tp", "2"], "tokenizer"),
    ("MoE flags on a dense target", ["--moe-backend", "deepep"], "dense"),
]  # fmt: skip


@pytest.mark.parametrize("what, args, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2(capfd, llama_dir, broken, what, args, needle):
    from speculant.launch.cli import main

    args = [a.format(**{k: str(v) for k, v in broken.items()}) for a in args]
    if "--target" not in args:
        args = ["--target", str(llama_dir), *args]
    if "--prompt" not in args:
        args += ["--prompt", "def f():"]
    try:
        status = main(["generate", "--device", "cpu", "--max-model-len", "128", *args])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    err = capfd.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert err and err[-1].startswith("speculant: error:") and needle in err[-1], (what, err)
    assert not any("Traceback" in line for line in err)


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    """The CLI in its own process group, with Ctrl-C's SIGINT handled as in a terminal: a
    shell that runs the suite in the background ignores SIGINT, and exec keeps an ignored
    signal ignored (a handled one starts at its default), so the parent handles it meanwhile."""
    cmd = [sys.executable, "-m", "speculant", "generate", "--device", "cpu", *args]
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt(proc: subprocess.Popen, ready, timeout: float = 60) -> tuple[int, str]:
    """Wait for `ready()`, send SIGINT to the whole process group (a terminal's Ctrl-C), and
    return the exit status and stderr; the job must end within 30 s."""
    start = time.time()
    while not ready() and proc.poll() is None and time.time() - start < timeout:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the job did not stop within 30 s of Ctrl-C")
    return proc.returncode, err


def _left_running(marker: str) -> str:
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout


@pytest.mark.timeout(120)
def test_ctrl_c_keeps_finished_outputs(llama_dir, tmp_path):
    """One short and two long requests: after the short one is written, Ctrl-C ends the run
    with 130 and the file holds the finished request's complete line."""
    rows = [{"prompt_token_ids": [5, 6, 7], "max_new_tokens": 4}]
    rows += [{"prompt_token_ids": [8 + i, 9], "max_new_tokens": 400} for i in range(2)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    args = ["--target", str(llama_dir), "--prompts", "p.jsonl", "--output", "out.jsonl"]
    proc = _start([*args, "--ignore-eos", "--max-num-seqs", "1"], tmp_path)
    status, err = _interrupt(proc, lambda: written(out).endswith("\n"))
    assert status == 130, err
    assert "speculant: interrupted" in err and "Traceback" not in err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines and lines[0]["index"] == 0 and len(lines[0]["token_ids"]) == 4


@pytest.mark.timeout(120)
def test_ctrl_c_without_output_prints_finished_completions(llama_dir, tmp_path):
    """Without --output completions print at the end; Ctrl-C once the short request finished
    still prints the finished ones (`[0] ...` first), not the unfinished, and exits with 130."""
    rows = [{"prompt_token_ids": [5, 6, 7], "max_new_tokens": 4}]
    rows += [{"prompt_token_ids": [8 + i, 9], "max_new_tokens": 400} for i in range(20)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--target", str(llama_dir), "--prompts", "p.jsonl", "--ignore-eos"]
    proc = _start([*args, "--max-num-seqs", "1"], tmp_path)
    err: list[str] = []

    def drain() -> None:  # the progress bar redraws with \r: read raw chunks
        while chunk := os.read(proc.stderr.fileno(), 4096):
            err.append(chunk.decode(errors="replace"))

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    start = time.time()
    done = re.compile(r" [1-9][0-9]*/21 ")  # the bar shows a finished request
    while not done.search("".join(err)) and proc.poll() is None and time.time() - start < 60:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out = proc.stdout.read()
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the run did not stop within 30 s of Ctrl-C")
    reader.join(timeout=5)
    assert proc.returncode == 130, "".join(err)
    lines = out.splitlines()
    assert lines and lines[0].startswith("[0] ") and len(lines) < 21, out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--dp", "2"]], ids=["tp2", "dp2"])
def test_ctrl_c_stops_every_rank_and_keeps_finished_outputs(llama_dir, tmp_path, layout):
    """Two short and two long requests (under --dp 2 each DP rank gets one of each): once both
    short ones are written, Ctrl-C ends the job with 130, the file holds both, and no rank is
    left running. Outputs reach rank 0's file in the step they finish, on any DP rank."""
    rows = [{"prompt_token_ids": [5 + i, 6, 7], "max_new_tokens": 4} for i in range(2)]
    rows += [{"prompt_token_ids": [8 + i, 9], "max_new_tokens": 400} for i in range(2)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, marker = tmp_path / "out.jsonl", str(tmp_path / "p.jsonl")
    args = ["--target", str(llama_dir), "--prompts", marker, "--output", "out.jsonl", *layout]
    args += ["--ignore-eos", "--max-num-seqs", "2", "--dist-timeout", "60"]
    proc = _start(args, tmp_path)

    def both_short_written() -> bool:
        return written(out).count("\n") >= 2

    status, err = _interrupt(proc, both_short_written)
    assert status == 130, err
    assert "Traceback" not in err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["index"] for line in lines[:2]) == [0, 1]
    assert all(len(line["token_ids"]) == 4 for line in lines[:2])
    deadline = time.time() + 10
    while _left_running(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert not _left_running(marker), "a rank outlived Ctrl-C"
