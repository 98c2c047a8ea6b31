"""`speculant accept-rate`: report fields, losslessness check, baseline comparison and its exit
codes, on tiny random checkpoints (the bundled models have their own regression test)."""

from __future__ import annotations

import json

import pytest
from helpers_eagle import write_random_eagle3

from speculant.launch.cli import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("accept")
    write_random_eagle3(root / "eagle", llama_dir, draft_vocab=200)
    prompts = root / "prompts.jsonl"
    rows = [{"prompt_token_ids": [5 + i, 17, 33 + 2 * i, 9]} for i in range(5)]
    rows.append({"prompt": "def add(a, b):"})
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, prompts


def accept_rate(capsys, *args) -> tuple[int, str, str]:
    try:
        status = main(["accept-rate", "--device", "cpu", *map(str, args)])
    except SystemExit as exc:
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


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
