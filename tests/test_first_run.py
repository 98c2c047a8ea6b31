"""A newcomer's first hour (issue 19): the summary's acceptance, CPU threads, accept-rate's plot
and compare mode, the default run's prompt and output, `speculant.bundled` and the README's
Python example, `--help` (defaults, examples, no torch import), and the run's noise."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import save_file

import speculant
from speculant.executor.request import RequestOutput
from speculant.launch import accept_rate, threads
from speculant.launch.cli import (
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PROMPT,
    PromptSpec,
    build_parser,
    default_max_num_seqs,
    main,
    report_outputs,
    summary_line,
)

README = Path(__file__).resolve().parent.parent / "README.md"


def output(index, steps, accept_len=None, per_position=(), text="x", prompt=(1, 2)):
    stats = {
        "num_verify_steps": steps,
        "accept_len": accept_len,
        "per_position_acceptance": list(per_position),
    }
    return RequestOutput(index, list(prompt), [7] * 4, text, "length", stats)


# ------------------------------------------------------------------- 2: the summary line


def test_summary_counts_the_requests_that_verified():
    """A request that finished at prefill has no acceptance; the others still report theirs,
    weighted by verify steps."""
    outs = [
        output(0, 0),  # finished at prefill
        output(1, 2, 3.0, [1.0, 1.0]),
        output(2, 6, 1.0, [0.0, 0.0]),
    ]
    line = summary_line(outs, 1.0)
    assert "accept_len=1.50" in line  # (3 * 2 + 1 * 6) / 8
    assert "per_position=0.25,0.25" in line
    assert "accept_len" not in summary_line([output(0, 0)], 1.0)
    # rows drafted / not: with --speculation auto only (a plain run's rows are all plain)
    assert "plain_rows" not in line and "drafted_rows=8 plain_rows=" in summary_line(
        outs, 1.0, True
    )


def test_summary_of_the_bundled_small_prompt_set_reports_acceptance(capsys):
    prompts = speculant.ASSETS / "prompts" / "heldout_prompts_small.jsonl"
    assert main(["generate", "--prompts", str(prompts), "--max-new-tokens", "8"]) == 0
    summary = capsys.readouterr().err.strip().splitlines()
    assert any("accept_len=" in line and "per_position=" in line for line in summary), summary


# ----------------------------------------------------------------------- 3: CPU threads


def test_threads_follow_model_size_and_free_cores():
    small, large = 10_000_000, 8_000_000_000
    assert threads.choose_num_threads(small, cores=16, load=0.0) == 1
    assert threads.choose_num_threads(120_000_000, cores=16, load=0.0) == 2
    assert threads.choose_num_threads(large, cores=16, load=0.0) == 16
    assert threads.choose_num_threads(large, cores=16, load=12.3) == 4  # the busy cores left out
    assert threads.choose_num_threads(large, cores=2, load=5.0) == 1  # never below one
    assert threads.choose_num_threads(large, cores=16, load=0.0, ranks=4) == 4  # shared by ranks
    assert threads.choose_num_threads(None, cores=8, load=2.0) == 6  # size unknown: free cores


def test_checkpoint_params_read_from_headers(tmp_path):
    import numpy as np

    tensors = {"a": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.float16)}
    save_file(tensors, tmp_path / "m.safetensors")
    save_file({"c": np.zeros((2, 2), np.float32)}, tmp_path / "n.safetensors")
    assert threads.checkpoint_params(tmp_path) == 12 + 5 + 4
    assert threads.checkpoint_params(tmp_path / "none") is None
    bundled = threads.checkpoint_params(speculant.bundled("target"))
    assert 8_000_000 < bundled < 9_000_000  # the 8.4 M-parameter model
    odd = tmp_path / "odd"  # a header that is valid JSON but not an object is skipped
    odd.mkdir()
    body = b"[1, 2]"
    (odd / "x.safetensors").write_bytes(len(body).to_bytes(8, "little") + body)
    assert threads.checkpoint_params(odd) is None


def test_threads_flag_and_omp_env_override_the_choice(monkeypatch):
    import torch

    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    monkeypatch.setattr(threads, "free_cores", lambda: (64, 0.0))
    monkeypatch.setattr(threads, "usable_cpus", lambda: 64)  # --threads is checked against it
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    target = str(speculant.bundled("target"))
    threads.set_cpu_threads(None, [target, str(speculant.bundled("eagle3"))])
    threads.set_cpu_threads(3, [target])
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    threads.set_cpu_threads(None, [target])  # left as torch read it
    threads.set_cpu_threads(2, [target])  # the flag still wins
    assert chosen == [1, 3, 2]
    args = build_parser().parse_args(["generate", "--threads", "4"])
    assert args.threads == 4
    assert build_parser().parse_args(["accept-rate", "--threads", "2"]).threads == 2


# ------------------------------------------------------ 4: accept-rate --plot and --compare


def report(algo, k, length, rates):
    return {
        "algo": algo,
        "num_draft_tokens": k,
        "num_prompts": 8,
        "max_new_tokens": 16,
        "temperature": 0.0,
        "acceptance_length": length,
        "per_position_acceptance": rates,
    }


def test_plot_without_matplotlib_fails_before_any_model_loads(monkeypatch, capsys, tmp_path):
    real = accept_rate.importlib.util.find_spec
    monkeypatch.setattr(
        accept_rate.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the --plot check")

    monkeypatch.setattr(accept_rate, "measure_in_rank", no_model)
    for argv in (
        ["accept-rate", "--device", "cpu", "--plot", str(tmp_path / "r.png")],
        ["accept-rate", "--compare", str(README), "--plot", str(tmp_path / "c.png")],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("speculant: error:") == 1 and "needs matplotlib" in err, err
        assert "speculant[plot]" in err


def kept_figures(monkeypatch) -> list:
    """Figures the plot functions close, kept open to look at."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: list = []
    monkeypatch.setattr(plt, "close", figures.append)
    return figures


@pytest.mark.needs("matplotlib")
def test_plot_shows_positions_values_and_baseline(monkeypatch, tmp_path):
    figures = kept_figures(monkeypatch)
    run = report("eagle3", 3, 2.5, [0.8, 0.5, 0.2])
    current = accept_rate.AcceptReport(**run, target="t", draft="d", lossless=True)
    accept_rate.plot(current, str(tmp_path / "r.png"), report("eagle3", 3, 2.0, [0.7, 0.3, 0.1]))
    assert (tmp_path / "r.png").stat().st_size > 0
    ax = figures[0].axes[0]
    assert list(ax.get_xticks()) == [1, 2, 3]  # integer draft positions
    assert [t.get_text() for t in ax.texts] == ["0.80", "0.50", "0.20"]  # values on the bars
    (baseline,) = ax.get_lines()
    assert list(baseline.get_ydata()) == [0.7, 0.3, 0.1]
    legend = sorted(t.get_text() for t in ax.get_legend().get_texts())
    assert legend == ["baseline: accept_len 2.00", "this run: accept_len 2.50"]


def write_reports(tmp_path) -> tuple[Path, Path]:
    r1, r2 = tmp_path / "eagle3.json", tmp_path / "dflash.json"
    r1.write_text(json.dumps(report("eagle3", 2, 2.1, [0.7, 0.4])))
    r2.write_text(json.dumps(report("dflash", 3, 2.3, [0.8, 0.3, 0.2])))
    return r1, r2


def test_compare_prints_reports_side_by_side(capsys, tmp_path):
    r1, r2 = write_reports(tmp_path)
    assert main(["accept-rate", "--compare", str(r1), str(r2)]) == 0
    out = capsys.readouterr().out
    assert "| metric | eagle3 k=2 | dflash k=3 |" in out
    assert "| acceptance_length | 2.1000 | 2.3000 |" in out
    assert "| per_position_acceptance[2] | - | 0.2000 |" in out
    assert main(["accept-rate", "--compare", str(r1), str(tmp_path / "nope.json")]) == 2


@pytest.mark.needs("matplotlib")
def test_compare_plot_draws_one_curve_per_report(monkeypatch, tmp_path):
    figures = kept_figures(monkeypatch)
    reports = [(p.stem, json.loads(p.read_text())) for p in write_reports(tmp_path)]
    accept_rate.plot_compare(reports, str(tmp_path / "c.png"))
    ax = figures[0].axes[0]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[0.7, 0.4], [0.8, 0.3, 0.2]]
    assert list(ax.get_xticks()) == [1, 2, 3]
    assert [t.get_text() for t in ax.texts] == ["0.70", "0.40", "0.80", "0.30", "0.20"]


@pytest.mark.needs("matplotlib")
@pytest.mark.timeout(120)
def test_plot_leaks_no_matplotlib_log_line(tmp_path):
    """A fresh matplotlib cache logs `generated new fontManager` at INFO; the CLI keeps it out."""
    r1, r2 = write_reports(tmp_path)
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")}
    proc = subprocess.run(
        [sys.executable, "-m", "speculant", "accept-rate", "--compare", str(r1), str(r2),
         "--plot", str(tmp_path / "c.png")],
        capture_output=True, text=True, env=env, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "c.png").is_file() and (tmp_path / "mpl").is_dir()
    assert "fontManager" not in proc.stderr and proc.stderr == "", proc.stderr


# ------------------------------------------------------ 5: the default prompt and output


def test_default_prompt_is_the_readme_one():
    assert DEFAULT_PROMPT == "def fibonacci(n):"
    assert f"(`{DEFAULT_PROMPT}`)" in README.read_text()


def test_output_shows_prompt_then_completion(capsys):
    args = build_parser().parse_args(["generate"])
    args.bundled_run, args.bundled_draft, args.algo = True, True, "eagle3"
    outs = [
        output(0, 4, 2.5, [0.9, 0.6, 0.0], text="\n    return n"),
        output(1, 1, 1.0, [0, 0, 0], text="!"),
    ]
    specs = [PromptSpec("def f(n):"), PromptSpec([1, 2])]
    report_outputs(args, outs, 1.0, sys.stdout, sys.stderr, specs=specs)
    out, err = capsys.readouterr()
    assert out == "[0] def f(n):\n    return n\n[1] !\n"  # a token-id prompt shows no text
    assert "the bundled EAGLE-3 head drafts 3 tokens a step" in err
    assert "accepted 1.20 of them on average" in err and "emitted 2.20 tokens" in err
    # two requests' 5 verify steps shared the target's forwards: not 5 forwards
    assert "each of 5 verify rows emitted" in err and "forwards" not in err


def test_default_run_prints_the_program_and_what_the_drafter_did(capsys, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="speculant")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # 3: the CLI chooses
    assert main(["generate", "--device", "cpu", "--max-new-tokens", "12"]) == 0
    assert any(
        r.getMessage().startswith("CPU threads: 1 (10.8 M parameters") for r in caplog.records
    )
    out, err = capsys.readouterr()
    assert out.startswith(f"[0] {DEFAULT_PROMPT}") and len(out) > len(DEFAULT_PROMPT) + 8
    assert "the bundled EAGLE-3 head drafts 3 tokens a step" in err
    assert re.search(r"so each of its \d+ forwards emitted", err)  # one request: its forwards
    assert "requests:" not in err  # no progress bar for one request
    # 9: one request, one slot: a small KV cache, not 64 full-length requests' 512 MiB
    (kv,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert "max_num_seqs=1 " in kv and float(re.search(r"\(([\d.]+) MiB\)", kv)[1]) < 16, kv


def test_max_num_seqs_defaults_to_the_requests_of_one_process():
    assert default_max_num_seqs(1, None) == 1
    assert default_max_num_seqs(200, None) == DEFAULT_MAX_NUM_SEQS["cpu"]
    assert default_max_num_seqs(1, [1, 2, 8]) == 8  # explicit capture sizes still fit
    assert build_parser().parse_args(["generate"]).max_num_seqs is None


# ------------------------------------------------- 6: bundled models and the Python API


@pytest.mark.parametrize(
    "name, folder",
    [("target", "target"), ("eagle3", "eagle3"), ("dflash", "dflash"), ("draft_lm", "draft_lm"),
     ("draft-model", "draft_lm")],
)  # fmt: skip
def test_bundled_names_the_installed_folders(name, folder):
    path = speculant.bundled(name)
    assert path == speculant.ASSETS / folder and (path / "config.json").is_file()


def test_bundled_unknown_name_is_one_line_error():
    with pytest.raises(speculant.SpeculantError, match="no bundled model 'eagle'; use one of"):
        speculant.bundled("eagle")


@pytest.mark.timeout(120)
def test_readme_python_example_runs():
    """The README's Python API example, as written, with speculative decoding."""
    text = README.read_text()
    section = text[text.index("## Python API") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "speculant.bundled(" in code and 'algo="eagle3"' in code
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=110,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "def fibonacci(n):" in proc.stdout
    # the statistics it prints are the ones its comment shows (within 0.05: another CPU's
    # float rounding may move a greedy token)
    shown = re.search(r'per_position_acceptance"\]\)  # ([\d.]+) \[([\d., ]+)\]', code)
    accept_len, rates = proc.stdout.splitlines()[-1].split(" ", 1)
    printed = [float(accept_len)] + [float(r) for r in rates.strip("[]").split(",")]
    expected = [float(shown.group(1))] + [float(r) for r in shown.group(2).split(",")]
    assert len(printed) == len(expected), proc.stdout
    assert all(abs(a - b) <= 0.05 for a, b in zip(printed, expected, strict=True)), expected
    for option in ("page_size", "max_num_seqs", "num_draft_tokens", "attention_backend", "overlap"):
        assert f"`{option}`" in section, option


# ---------------------------------------------------------------------------- 8: --help


def help_text(*argv) -> str:
    proc = subprocess.run(
        [sys.executable, "-c",
         "import sys\nfrom speculant.launch.cli import main\n"
         "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         "print('TORCH', 'torch' in sys.modules)", *argv],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["accept-rate", "--help"]])
def test_help_imports_no_torch(argv):
    out = help_text(*argv)
    assert out.rstrip().endswith("TORCH False"), out


def test_generate_help_shows_defaults_and_examples(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # unwrap
    for flag, default in [
        ("--max-new-tokens N", "64"),
        ("--page-size N", "16"),
        (
            "--max-num-seqs N",
            f"{DEFAULT_MAX_NUM_SEQS['cuda']} on a GPU, {DEFAULT_MAX_NUM_SEQS['cpu']} on the CPU",
        ),
        ("--temperature T", "0.0"),
        ("--dtype {auto,float32,bfloat16,float16}", "auto"),
        ("--dist-timeout S", "300"),
    ]:
        assert re.search(re.escape(flag) + r" [^-]*\(default: " + re.escape(default), out), flag
    assert "--num-draft-tokens K tokens drafted per step (default: 3;" in out
    # the decode graphs' default sizes as executor/cuda_graph.py lists them (up to 512)
    from speculant.executor.cuda_graph import DEFAULT_SIZES

    sizes = re.search(r"--capture-sizes 1,2,4,8 [^(]*\(default: ([\d, .]+), at most", out)
    assert sizes, "--capture-sizes: the default sizes are not listed"
    named = [int(n) for n in re.findall(r"\d+", sizes[1])]
    assert set(named) <= set(DEFAULT_SIZES) and named[-1] == max(DEFAULT_SIZES), sizes[1]
    assert "--algo {eagle3,draft-model,dflash} drafter kind (default: plain decoding;" in out
    assert "examples: speculant generate " in out
    assert "(default: None)" not in out and "(default: False)" not in out


def test_accept_rate_help_shows_the_algo_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["accept-rate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "drafter kind (default: eagle3)" in out
    assert "--compare" in out and "examples:" in out


# ------------------------------------------------------------------------------ 9: noise


def test_accept_rate_names_its_bars_and_logs_the_kv_cache_once(capsys, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="speculant")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "import"]))
    argv = ["--device", "cpu", "--prompts", str(prompts), "--max-new-tokens", "6"]
    assert main(["accept-rate", *argv]) == 0
    err = capsys.readouterr().err
    assert "speculative: 100%" in err and "plain reference: 100%" in err
    assert err.index("speculative:") < err.index("plain reference:")
    kv = [r for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert len(kv) == 1


def test_checkout_root_on_sys_path_does_not_shadow_distributions():
    """`python -m ...` from the checkout puts its root (the package folder) on sys.path, where
    `kernels/` and `comm/` would shadow the distributions of those names (Hugging Face's
    `kernels`, which transformers 5.25 imports when installed: an ImportError from our folder).
    Importing speculant takes the folder off sys.path; then neither name resolves into it."""
    root = Path(speculant.__file__).resolve().parent
    code = (  # ours: the folder <root>/<name> (a venv inside the checkout holds the others)
        "import importlib.util, os, sys\n"
        "def ours(name):\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    origin = (spec and spec.origin) or ''\n"
        "    return os.path.dirname(origin) == os.path.join(sys.argv[1], name)\n"
        "assert ours('kernels')\n"
        "import speculant\n"
        "for name in ('kernels', 'comm'):\n"
        "    assert not ours(name), name\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root)], cwd=root, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_drafter_of_ones_own_with_the_bundled_target_is_not_called_bundled(capsys, tmp_path):
    """No --target but a --draft of one's own: the summary does not credit the bundled head
    (an audit found "the bundled EAGLE-3 head drafts ..." for the user's drafter)."""
    import shutil

    from speculant import ASSETS

    draft = tmp_path / "head"
    shutil.copytree(ASSETS / "eagle3", draft)
    assert (
        main(["generate", "--device", "cpu", "--max-new-tokens", "12", "--draft", str(draft)]) == 0
    )
    err = capsys.readouterr().err
    assert "the bundled" not in err and "accept_len=" in err, err
