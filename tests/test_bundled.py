"""The bundled trained models: the default run, and the accept-rate regression gate on held-out
prompts against baselines committed from real runs (CPU, float32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculant.launch.accept_rate import ASSETS, BUNDLED_DRAFTS, bundled
from speculant.launch.cli import main

DATA = Path(__file__).resolve().parent / "data"


def run(capsys, *args) -> tuple[int, str, str]:
    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_bundled_models_are_in_the_package():
    for name in ["target", *BUNDLED_DRAFTS.values()]:
        folder = bundled(name)
        card = (folder / "README.md").read_text()
        assert "999732d8" in card, f"{name}: the model card names the corpus hash"
        assert sum(f.stat().st_size for f in folder.iterdir()) < 20 * 2**20
    assert sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file()) <= 40 * 2**20
    assert (ASSETS / "prompts" / "heldout_prompts.jsonl").is_file()


def test_default_run_uses_the_bundled_target_and_eagle3(capsys):
    """`speculant generate` with no model arguments: bundled target + EAGLE-3 head, a default
    prompt, the completion on stdout and acceptance stats on stderr."""
    status, out, err = run(capsys, "generate", "--device", "cpu", "--max-new-tokens", "24")
    assert status == 0, err
    assert out.startswith("[0] ") and len(out.strip()) > 8
    summary = err.strip().splitlines()[-1]
    assert "accept_len=" in summary and "tokens/s=" in summary
    assert len(summary.split("per_position=")[1].split(",")) == 3  # k defaults to 3


@pytest.mark.parametrize("algo", ["dflash", "draft-model"])
def test_default_run_with_other_bundled_drafters(capsys, algo, tmp_path):
    out_file = tmp_path / "out.jsonl"
    args = ["generate", "--device", "cpu", "--algo", algo, "--prompt", "import os\n"]
    status, _, err = run(capsys, *args, "--max-new-tokens", 16, "--output", out_file)
    assert status == 0, err
    assert json.loads(out_file.read_text())["num_verify_steps"] > 0


@pytest.mark.parametrize("algo", ["eagle3", "dflash"])
def test_accept_rate_regression_gate(capsys, algo, tmp_path):
    """The release gate: greedy output equals plain greedy output and the acceptance length and
    per-position rates are not below the committed baseline (a real run on this CPU path)."""
    baseline = DATA / f"accept_baseline_{algo}.json"
    status, out, err = run(
        capsys, "accept-rate", "--device", "cpu", "--dtype", "float32", "--algo", algo,
        "--prompts", DATA / "heldout_prompts_small.jsonl", "--max-new-tokens", 32,
        "--baseline", baseline, "--report", tmp_path / "r.json",
    )  # fmt: skip
    assert status == 0, out + err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["lossless"] is True
    # trained drafters: far above what a random drafter reaches (about 1.0)
    assert report["acceptance_length"] > 1.8
