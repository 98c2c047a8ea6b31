"""Outputs that would destroy an input of the run: `--output` (and accept-rate's --report,
--write-baseline, --plot) naming a file of the --target or --draft checkpoint (config.json, a
weights shard, a tokenizer file, a link to one) or a new `*.safetensors` the next load would
read are refused before any model loads, one line, exit 2, the checkpoint unchanged (an audit
found `--output DIR/model.safetensors` overwrote the weights, exit 0). A JSONL output beside the
model is no harm and runs."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from speculant.launch.cli import main


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def run(capsys, *args: object) -> tuple[int, str]:
    try:
        status = main([*map(str, args)])
    except SystemExit as exc:
        status = exc.code
    return status, capsys.readouterr().err


@pytest.fixture
def target(tmp_path, llama_dir) -> Path:
    copy = tmp_path / "target"
    shutil.copytree(llama_dir, copy)
    return copy


@pytest.mark.parametrize(
    "name", ["config.json", "model.safetensors", "tokenizer.json", "extra.safetensors", "link"]
)
def test_an_output_into_the_target_checkpoint_is_refused(capsys, tmp_path, target, name):
    before = digest(target)
    output = target / name
    if name == "link":  # a hard link elsewhere to the checkpoint's config.json
        output = tmp_path / "out.jsonl"
        output.hardlink_to(target / "config.json")
    status, err = run(capsys, "generate", "--device", "cpu", "--target", target, "--prompt",
                      "hi", "--max-new-tokens", 2, "--output", output)  # fmt: skip
    assert status == 2, err
    lines = [line for line in err.splitlines() if line.startswith("speculant: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"--output '{output}' would write into the --target checkpoint" in lines[0], lines
    assert "pick a path outside it" in lines[0]
    assert digest(target) == before and not (target / "extra.safetensors").exists()


def test_a_jsonl_output_beside_the_model_runs(capsys, target):
    output = target / "out.jsonl"
    status, err = run(capsys, "generate", "--device", "cpu", "--target", target, "--prompt",
                      "hi", "--max-new-tokens", 2, "--output", output)  # fmt: skip
    assert status == 0, err
    assert len(output.read_text().splitlines()) == 1
    status, err = run(capsys, "generate", "--device", "cpu", "--target", target, "--prompt",
                      "hi", "--max-new-tokens", 2, "--output", output)  # fmt: skip
    assert status == 0, err  # written again: an earlier output is no checkpoint file


@pytest.mark.parametrize("flag", ["--report", "--write-baseline", "--plot"])
def test_accept_rate_outputs_into_a_checkpoint_are_refused(capsys, tmp_path, target, flag):
    from helpers_eagle import write_random_eagle3

    draft = tmp_path / "eagle"
    write_random_eagle3(draft, target, draft_vocab=200)
    before = digest(draft)
    name = "config.json" if flag != "--plot" else "model.safetensors"
    status, err = run(capsys, "accept-rate", "--device", "cpu", "--target", target, "--draft",
                      draft, "--max-new-tokens", 4, flag, draft / name)  # fmt: skip
    assert status == 2, err
    assert err.count("speculant: error:") == 1 and "Traceback" not in err, err
    assert f"{flag} '{draft / name}' would write into the --draft checkpoint" in err, err
    assert digest(draft) == before


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_output_waits_for_its_reader_and_says_so(tmp_path, llama_dir):
    """--output naming a FIFO nobody reads yet: one warning that the run waits for its reader
    (it blocked in silence), then the lines reach the reader once it comes."""
    fifo, log = tmp_path / "out.fifo", tmp_path / "err.txt"
    os.mkfifo(fifo)
    cmd = [sys.executable, "-m", "speculant", "generate", "--device", "cpu",
           "--target", str(llama_dir), "--prompt", "hi", "--max-new-tokens", "3",
           "--output", str(fifo)]  # fmt: skip
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 90
        while "FIFO" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert "is a FIFO that no process reads yet: waiting for its reader" in log.read_text()
        lines = fifo.read_text().splitlines()
        assert proc.wait(60) == 0, log.read_text()
    finally:
        proc.kill()
    assert [json.loads(line)["index"] for line in lines] == [0]
