"""The benchmark scripts README quotes tell the truth: options are honoured or refused in one
line, a configuration that fails or times out is recorded and the rest still runs, the code
measured is the tree named, and the results JSON says where, when and how it was measured."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def bench(name: str):
    """A benchmarks/ script as a module (they import their neighbours by name)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def small_job(tmp_path: Path, *extra: str) -> list[str]:
    return ["--out", str(tmp_path / "out"), "--shape", "small", "--device", "cpu",
            "--requests", "1", *extra]  # fmt: skip


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--configs", "default,defualt"], "defualt"),
        (["--configs", "default", "--tree", ".", "--baseline-configs", "tihgt"], "tihgt"),
        (["--baseline-last"], "--tree"),
        (["--baseline-configs", "default"], "--tree"),
        (["--shared-prefix", "1024"], "--shared-prefix"),  # the small shape's prompts: ~400
    ],
)
def test_workload_refuses_a_bad_option_in_one_line(tmp_path, capsys, extra, named):
    with pytest.raises(SystemExit) as exc:
        bench("workload").main(small_job(tmp_path, *extra))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert not (tmp_path / "out" / "workload.json").exists()  # refused before anything ran


def test_workload_records_a_timeout_and_runs_the_rest(tmp_path):
    # one second: the CLI is still importing torch
    argv = small_job(tmp_path, "--configs", "default,sync", "--timeout", "1")
    assert bench("workload").main(argv) == 1
    report = json.loads((tmp_path / "out" / "workload.json").read_text())
    assert [r["config"] for r in report["runs"]] == ["default", "sync"]
    assert all("timed out after 1 s" in r["error"] for r in report["runs"])
    assert report["command"] and report["date"] and "cores" in report["machine"]


def fake_speculant(folder: Path, main: str) -> Path:
    package = folder / "speculant"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(main)
    return package


def test_workload_measures_this_tree_and_the_baseline_in_one_environment(tmp_path, monkeypatch):
    """An importable `speculant` elsewhere (an editable install, PYTHONPATH) is not what runs
    as this tree; the baseline keeps the rest of PYTHONPATH, as this tree does."""
    summary = "import sys; print('requests=1 prompt_tokens=1 output_tokens=999 time=1.00s', "
    elsewhere = tmp_path / "elsewhere"
    fake_speculant(elsewhere, summary + "file=sys.stderr)\n")
    (elsewhere / "extra_module_the_job_needs.py").write_text("")
    old = fake_speculant(tmp_path / "old", "import extra_module_the_job_needs\n" + summary
                         + "file=sys.stderr)\n")  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", str(elsewhere))
    argv = small_job(tmp_path, "--configs", "default", "--tree", str(old), "--timeout", "120")
    assert bench("workload").main(argv) == 0
    report = json.loads((tmp_path / "out" / "workload.json").read_text())
    runs = {r["config"]: r for r in report["runs"]}
    assert "error" not in runs["baseline_default"], runs["baseline_default"]
    assert runs["baseline_default"]["output_tokens"] == 999  # the old tree ran
    assert runs["default"]["output_tokens"] == report["job_output_tokens"]  # this tree ran


@pytest.mark.parametrize(
    "script, argv, named",
    [
        ("cpu_generate", ["--configs", "plain,eagle-3"], "eagle-3"),
        ("match_accept", ["--drafters", "draftlm"], "draftlm"),
    ],
)
def test_a_bad_name_is_refused_before_anything_runs(monkeypatch, capsys, script, argv, named):
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    main = bench(script).main
    with pytest.raises(SystemExit) as exc:
        main(argv) if script == "match_accept" else main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_every_results_json_says_how_where_and_when_it_was_measured():
    """A script writing a results JSON (an --out or --json option) records its command line,
    date and machine (benchmarks/_common.run_info, through write_rows or not, or inline with
    the GPU's name)."""
    lacking = []
    for script in sorted(BENCHMARKS.glob("*.py")):
        text = script.read_text()
        writes = "json.dump" in text and re.search(r'add_argument\(\s*"--(json|out)"', text)
        inline = all(key in text for key in ('"command"', '"date"')) and (
            "get_device_name" in text or '"gpu"' in text
        )
        recorded = any(f"{helper}(" in text for helper in ("run_info", "run_header", "write_rows"))
        if writes and not (recorded or inline):
            lacking.append(script.name)
    assert not lacking


def test_run_info_names_the_machine():
    info = bench("_common").run_info("cpu", ["--out", "x"])
    assert info["command"].endswith("--out x") and "UTC" in info["date"]
    assert "cores" in info["machine"]


@pytest.mark.parametrize("argv", [["--parts", "8B"], ["--runs-8b", "plain,atuo"]])
def test_adaptive_gpu_refuses_an_unknown_part_or_run(monkeypatch, capsys, argv):
    """A typo ran the bundled part instead (--parts), or nothing (--runs-8b)."""
    monkeypatch.setattr(sys, "argv", ["adaptive_gpu.py", "--json", "x.json", *argv])
    with pytest.raises(SystemExit) as exc:
        bench("adaptive_gpu").main()
    assert exc.value.code == 2 and argv[1].split(",")[-1] in capsys.readouterr().err


def test_workload_reads_the_engine_start_up_memory_lines(llama_dir, caplog):
    """The KV cache line as the engine logs it (a CPU engine) and the GPU-only lines in the
    engine's formats: what workload.py records per run to compare memory across trees."""
    from speculant import Engine

    with caplog.at_level("INFO", logger="speculant"):
        Engine(llama_dir, device="cpu", max_num_seqs=2, max_model_len=64, num_pages=12)
    gpu_lines = (
        "profiled step activations at 8192 tokens: 3.76 GiB (kept out of the KV cache; ...)\n"
        "captured 111 graphs (sizes [1, 2], variants ['greedy'], draft shapes [(3, 3)]) "
        "using 4.57 GiB\n"
        "captured 19 piecewise graphs (tokens [16, 32]) in 1.6 s using 2.92 GiB\n"
        "captured 19 drafter piecewise graphs (tokens [16, 32]) in 0.2 s using 1.09 GiB\n"
    )
    found = bench("workload").startup_memory(caplog.text + gpu_lines)
    kv = re.search(r"KV cache: 12 pages of \d+ tokens \(([\d.]+) MiB\)", caplog.text)
    assert found == {
        "activations_gib": 3.76,
        "kv_cache_gib": round(float(kv.group(1)) / 1024, 2),
        "graphs_gib": {"decode": 4.57, "piecewise": 2.92, "drafter piecewise": 1.09},
    }
