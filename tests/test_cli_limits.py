"""Flag values past what the run can take, and streams and signals at the edges of a run (an
adversarial audit): each is one `speculant: error:` line naming the value and the fix, exit 2,
before any model loads (a huge --dist-timeout, --threads or --page-size, an empty path, a closed
or full stdout, a 5000-digit number in a --prompts line); Ctrl-C and SIGTERM stop the run with
130 / 143 whenever they come, imports under way included, and a second one during the stop
changes nothing."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from speculant.launch.cli import MAX_DIST_TIMEOUT_S, MAX_PAGE_SIZE, build_parser
from speculant.launch.spawn import Terminated, stop_on_sigterm
from speculant.launch.threads import check_threads, set_cpu_threads, usable_cpus


def run_main(capsys: pytest.CaptureFixture, *args: object):
    """`speculant generate --device cpu ARGS` in this process: (exit status, stderr)."""
    from speculant.launch.cli import main

    try:
        status = main(["generate", "--device", "cpu", *map(str, args)])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    return status, capsys.readouterr().err


def error_line(status: int, err: str) -> str:
    """The one `speculant: error:` line of a run that must have failed with status 2."""
    lines = [line for line in err.splitlines() if line.startswith("speculant: error:")]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert len(lines[0]) < 400, lines[0]  # a 5000-digit value is not printed whole
    return lines[0]


def parsed(*args: str):
    return build_parser().parse_args(["generate", *args])


# ----------------------------------------------------------------------------- --dist-timeout


@pytest.mark.parametrize("value", [10**11, 9223372037, 2**63 - 1, MAX_DIST_TIMEOUT_S + 1])
def test_huge_dist_timeout_is_refused_before_any_rank_starts(capsys, tmp_path, value):
    # tmp_path holds no checkpoint: refused while parsing, before the ranks (or a model)
    line = error_line(*run_main(capsys, "--target", tmp_path, "--tp", 2, "--dist-timeout", value))
    assert f"--dist-timeout: '{value}'" in line and f"1..{MAX_DIST_TIMEOUT_S}" in line


def test_dist_timeout_up_to_the_bound_is_taken():
    assert parsed("--dist-timeout", str(MAX_DIST_TIMEOUT_S)).dist_timeout == MAX_DIST_TIMEOUT_S
    # torch keeps timeouts as C ints of milliseconds: the bound must fit one
    assert MAX_DIST_TIMEOUT_S * 1000 < 2**31


# ---------------------------------------------------------------------------------- --threads


def test_threads_above_the_usable_cpus_are_refused_before_loading(capsys, tmp_path):
    cpus = usable_cpus()
    for value in (10**8, cpus + 1):
        line = error_line(*run_main(capsys, "--target", tmp_path, "--prompt", "x",
                                    "--threads", value))  # fmt: skip
        assert f"--threads {value}" in line and f"--threads 1..{cpus}" in line


def test_threads_up_to_the_usable_cpus_are_taken():
    check_threads(usable_cpus())
    check_threads(None)
    with pytest.raises(ValueError, match=r"--threads 100000000 .*--threads 1\.\."):
        set_cpu_threads(10**8, [])  # accept-rate sets its threads here: refused as well


# ------------------------------------------------------------------------------- --tp / --dp


def _no_ranks(monkeypatch):
    from speculant.launch import spawn

    def started(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(spawn, "launch_cli", started)


@pytest.mark.parametrize("tp", [3, 8, 10**20])
def test_tp_the_target_cannot_split_is_refused_before_any_rank_starts(capsys, monkeypatch, tp):
    # the bundled target: 4 attention heads, 2 KV heads (--tp 10**20 once started ranks until
    # the machine ran out of processes)
    _no_ranks(monkeypatch)
    line = error_line(*run_main(capsys, "--prompt", "x", "--tp", tp))
    assert f"4 attention heads are not divisible by tp={tp}; use --tp 1, 2, 4" in line


def test_tp_the_mlp_cannot_split_is_refused_naming_sizes_that_can(capsys, monkeypatch, tmp_path):
    config = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=4, intermediate_size=6,
                  vocab_size=32)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    _no_ranks(monkeypatch)
    line = error_line(*run_main(capsys, "--target", tmp_path, "--prompt", "x", "--tp", 4))
    assert "intermediate_size 6 is not divisible by tp=4; use --tp 1, 2" in line


def test_more_cpu_ranks_than_the_machine_takes_are_refused(capsys, monkeypatch):
    from speculant.launch.spawn import max_cpu_ranks

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert max_cpu_ranks() == 8
    line = error_line(*run_main(capsys, "--prompt", "x", "--tp", 2, "--dp", 5))
    assert "10 ranks (--tp x --dp) on the CPU" in line and "at most 8; lower --tp/--dp" in line


@pytest.mark.parametrize("flag", ["--prompt", "--stop"])
def test_a_value_that_starts_with_a_dash_is_named_with_the_form_that_takes_it(capsys, flag):
    line = error_line(*run_main(capsys, "--prompt", "def", flag, "-x;y"))
    assert f"argument {flag}: expected one argument ('-x;y' looks like a flag)" in line
    assert f"pass it as {flag}='-x;y'" in line  # (as a shell takes it)
    assert getattr(parsed(f"{flag}=-x;y"), flag[2:]) in ("-x;y", ["-x;y"])  # the form works
    line = error_line(*run_main(capsys, "--prompt", "def", flag, "--"))
    assert f"pass it as {flag}=--" in line  # and that form works too (argparse < 3.13 gave [])
    assert getattr(parsed(f"{flag}=--"), flag[2:]) in ("--", ["--"])
    line = error_line(*run_main(capsys, "--prompt", "def", flag, "-" * 50))  # too long to show
    assert "(50 characters) looks like a flag); join it: " + f"{flag}=VALUE" in line
    line = error_line(*run_main(capsys, "--prompt", "def", "--max-new-tokens"))  # no value
    assert line.endswith("expected one argument (see `speculant generate --help`)")


# -------------------------------------------------------------------------------- --page-size


@pytest.mark.parametrize("value", [10**8, 2**63 - 1, 10**6, MAX_PAGE_SIZE + 1])
def test_huge_page_size_is_refused_naming_the_range(capsys, tmp_path, value):
    line = error_line(*run_main(capsys, "--target", tmp_path, "--prompt", "x",
                                "--page-size", value))  # fmt: skip
    assert f"--page-size: '{value}'" in line and f"1..{MAX_PAGE_SIZE}" in line


def test_page_size_at_the_bound_runs(capsys, llama_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    args = ["--prompt", "def f():", "--max-new-tokens", 4, "--page-size", MAX_PAGE_SIZE]
    status, err = run_main(capsys, "--target", llama_dir, *args, "--output", out)
    assert status == 0, err
    assert len(json.loads(out.read_text())["token_ids"]) == 4


def test_page_sizes_the_tests_and_benchmarks_use_are_within_the_bound():
    root = Path(__file__).resolve().parent.parent
    pattern = re.compile(r"""page_size=(\d+)|["']--page-size["'],\s*["']?(\d+)""")
    sizes = {int(a or b) for folder in ("tests", "benchmarks") for f in (root / folder).rglob(
        "*.py") for a, b in pattern.findall(f.read_text())}  # fmt: skip
    assert sizes and max(sizes) <= MAX_PAGE_SIZE, sizes


# ---------------------------------------------------------------------------------- empty paths


@pytest.mark.parametrize("flag", ["--output", "--target", "--draft", "--prompts"])
def test_empty_path_is_refused(capsys, tmp_path, flag):
    args = [flag, ""] + (["--prompt", "x"] if flag != "--prompts" else [])
    if flag != "--target":
        args += ["--target", tmp_path]
    line = error_line(*run_main(capsys, *args))
    assert f"argument {flag}: the path is empty ('')" in line and "pass " in line


# ------------------------------------------------------------------------------------- stdout


def test_closed_stdout_is_refused_before_loading(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "stdout", None)  # what Python makes of `>&-`
    line = error_line(*run_main(capsys, "--target", tmp_path, "--prompt", "x"))
    assert "stdout is closed" in line and "--output FILE" in line


def test_read_only_stdout_is_refused_before_loading(capsys, monkeypatch, tmp_path):
    with open(os.devnull) as read_only:  # `1</dev/null`
        monkeypatch.setattr(sys, "stdout", read_only)
        line = error_line(*run_main(capsys, "--target", tmp_path, "--prompt", "x"))
    assert "stdout is open for reading only" in line and "--output FILE" in line


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_stdout_dev_full_names_stdout(capsys, monkeypatch, llama_dir):
    full = open("/dev/full", "w")  # `> /dev/full`
    monkeypatch.setattr(sys, "stdout", full)
    try:
        line = error_line(*run_main(capsys, "--target", llama_dir, "--prompt", "x",
                                    "--max-new-tokens", 2))  # fmt: skip
    finally:
        monkeypatch.undo()
        with contextlib.suppress(OSError):  # what the failed write left in the buffer
            full.close()
    assert "writing completions to stdout failed (no space left on device)" in line
    assert "--output FILE" in line


def test_closed_stdout_from_the_shell(tmp_path):
    """`speculant generate >&-`: refused at once (no model loaded), not exit 0 with nothing."""
    cmd = [sys.executable, "-m", "speculant", "generate", "--device", "cpu", "--target",
           str(tmp_path), "--prompt", "x"]  # fmt: skip
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, timeout=60,
                          preexec_fn=lambda: os.close(1))  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "speculant: error: stdout is closed, so the completions printed there would be lost; "
        "pass --output FILE to write them to a file (or run with stdout open)"
    ]


def test_fewer_rows_than_dp_ranks_is_refused_before_any_rank_starts(capsys, tmp_path):
    # tmp_path holds no checkpoint: refused before the ranks start (was: after they loaded it)
    line = error_line(*run_main(capsys, "--target", tmp_path, "--dp", 2, "--max-num-seqs", 1,
                                "--prompt", "x"))  # fmt: skip
    assert "max_num_seqs=1 is less than dp=2; raise --max-num-seqs" in line


# ------------------------------------------------------------------------------------- stderr


@pytest.mark.parametrize("stderr", ["closed", "full", "pipe"])
def test_a_failing_stderr_loses_no_completion(monkeypatch, llama_dir, tmp_path, stderr):
    """stderr holds only diagnostics (log lines, progress, the summary): closed (`2>&-`), on a
    full disk (`2>/dev/full`) or a pipe whose reader left (`2>&1 | head -2`), it stops nothing:
    every completion is written and the run exits 0."""
    from speculant.launch.cli import main

    if stderr == "full" and not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}("}) + "\n" for i in range(4)))
    stream = None  # what Python makes of `2>&-`
    if stderr == "full":
        stream = open("/dev/full", "w")
    elif stderr == "pipe":
        read_end, write_end = os.pipe()
        os.close(read_end)
        stream = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stderr", stream)
    try:
        status = main(["generate", "--device", "cpu", "--target", str(llama_dir), "--prompts",
                       str(prompts), "--max-new-tokens", "4", "--ignore-eos", "--output",
                       str(out)])  # fmt: skip
    finally:
        monkeypatch.undo()
        if stream is not None:
            with contextlib.suppress(OSError):  # what the failed writes left in its buffer
                stream.close()
    assert status == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["index"] for line in lines) == [0, 1, 2, 3]
    assert all(len(line["token_ids"]) == 4 for line in lines)


# ------------------------------------------------------------------ numbers of 4300+ digits


@pytest.mark.parametrize(
    "line",
    [
        '{"prompt_token_ids": [' + "1" * 5000 + "]}",
        '{"prompt": "x", "max_new_tokens": ' + "9" * 5000 + "}",
        '{"prompt": "x", "seed": -' + "9" * 4301 + "}",
    ],
)
def test_prompts_line_with_a_5000_digit_number_names_file_and_line(capsys, tmp_path, line):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n' + line + "\n")
    err = error_line(*run_main(capsys, "--target", tmp_path, "--prompts", prompts))
    assert f"{prompts}:2: the number " in err and "digits" in err and "fix that number" in err


@pytest.mark.parametrize("flag", ["--max-new-tokens", "--seed", "--page-size", "--dist-timeout"])
def test_flag_with_a_5000_digit_number_is_one_short_line(capsys, tmp_path, flag):
    line = error_line(*run_main(capsys, "--target", tmp_path, "--prompt", "x", flag, "9" * 5000))
    assert f"argument {flag}: '9999" in line and "(5000 characters) has too many digits" in line


# ------------------------------------------------------------------------------------ signals


@pytest.fixture
def sigint_handled():
    """SIGINT as in a terminal (a shell running the suite in the background ignores it, and
    stop_on_sigterm leaves an ignored Ctrl-C ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_stop_during_an_import_waits_for_the_import(tmp_path, monkeypatch):
    """Raised inside an import, a stop breaks it (a half-imported numpy: "cannot load module
    more than once") or is swallowed by it: it is raised once the import is done."""
    (tmp_path / "slow_module_for_stop.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(0.1)\n"
        "DONE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    restore = stop_on_sigterm()
    try:
        with pytest.raises(Terminated):
            import slow_module_for_stop  # noqa: F401

            time.sleep(5)  # the stop lands here
        assert sys.modules["slow_module_for_stop"].DONE
    finally:
        restore()
        sys.modules.pop("slow_module_for_stop", None)


def test_a_swallowed_stop_is_raised_again_by_the_next_signal():
    restore = stop_on_sigterm()
    try:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except Terminated:
            pass  # swallowed, as by a library's bare `except:`
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    finally:
        restore()


def test_a_second_ctrl_c_waits_for_the_first_stop(sigint_handled):
    cleaned = False
    restore = stop_on_sigterm()
    try:
        with pytest.raises(KeyboardInterrupt):
            try:
                signal.raise_signal(signal.SIGINT)
                time.sleep(5)
            finally:  # the stop's own work: printing what finished
                signal.raise_signal(signal.SIGINT)  # a second Ctrl-C
                time.sleep(0.01)
                cleaned = True
    finally:
        restore()
    assert cleaned


def _sigcgt(pid: int) -> int:
    """The signals process `pid` catches (a handler is installed), from /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1], 16) for line in status.splitlines()
                 if line.startswith("SigCgt:")), 0)  # fmt: skip


def _long_run(stderr: Path, caught: int = signal.SIGINT) -> subprocess.Popen:
    """The bundled model generating for seconds, SIGINT at its default as in a terminal; once
    it catches `caught`: SIGINT as soon as the interpreter has started (before site and any
    speculant code), SIGTERM once the command's first lines run (before numpy's import)."""
    cmd = [sys.executable, "-m", "speculant", "generate", "--device", "cpu",
           "--max-new-tokens", "2000", "--ignore-eos"]  # fmt: skip
    terminal = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr.open("w"),
                            preexec_fn=terminal)  # fmt: skip
    start = time.time()
    while not _sigcgt(proc.pid) & (1 << (caught - 1)) and time.time() - start < 30:
        assert proc.poll() is None, stderr.read_text()
        time.sleep(0.001)
    return proc


def _ended(proc: subprocess.Popen, stderr: Path) -> tuple[int, str]:
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("the run did not stop within 60 s")
    return proc.returncode, stderr.read_text()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_in_the_first_second_always_ends_the_run(tmp_path, sig):
    """Sent while the command imports numpy and torch (~1.5 s here), the stop still ends the
    run, with the status and last line of a stop, no traceback, every time."""
    expected = (143, "speculant: terminated (SIGTERM)") if sig == signal.SIGTERM else (
        130, "speculant: interrupted")  # fmt: skip
    # seconds after the command's own SIGTERM handler is in place (its first lines, before
    # numpy's import): on a loaded host the interpreter's start alone (site, runpy) can take
    # longer than a delay counted from the process's start, and a signal before any of our code
    # runs ends the process as it would any Python program's (SIGINT: a KeyboardInterrupt
    # traceback from site, exit 1)
    for delay in (0.0, 0.1, 0.2, 0.4, 0.8):
        proc = _long_run(tmp_path / "err.txt", signal.SIGTERM)
        time.sleep(delay)
        proc.send_signal(sig)
        code, err = _ended(proc, tmp_path / "err.txt")
        assert (code, err.strip().splitlines()[-1:]) == (expected[0], [expected[1]]), (delay, err)
        assert "Traceback" not in err, (delay, err)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_two_ctrl_c_during_the_run_end_with_130(tmp_path):
    """Two Ctrl-Cs 1-200 ms apart once the run generates: the second comes while the first
    stop ends the run (or while Python exits): still 130, one last line, no traceback."""
    err_file = tmp_path / "err.txt"
    for gap in (0.001, 0.05, 0.2):
        proc = _long_run(err_file, signal.SIGTERM)
        start = time.time()
        while "engine ready" not in err_file.read_text() and time.time() - start < 60:
            assert proc.poll() is None, err_file.read_text()
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        time.sleep(gap)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        code, err = _ended(proc, err_file)
        assert code == 130 and err.strip().splitlines()[-1] == "speculant: interrupted", (gap, err)
        assert "Traceback" not in err, (gap, err)


@pytest.mark.parametrize(
    "exc, fix",
    [
        (BrokenPipeError(errno.EPIPE, "Broken pipe"), "keep its reader running or pick a file"),
        (OSError(errno.ENOSPC, "No space left on device"), "free space or pick another path"),
        (OSError(errno.EIO, "Input/output error"), "; pick another path"),
    ],
)
def test_a_failed_write_is_one_line_with_the_fix_for_its_cause(exc, fix):
    """An output whose reader went away (a FIFO, a pipe) is not told to free space."""
    from speculant.errors import SpeculantError
    from speculant.launch.paths import write_errors_named

    with pytest.raises(SpeculantError) as info, write_errors_named("out.jsonl", "--output"):
        raise exc
    message = str(info.value)
    assert message.startswith("--output 'out.jsonl': writing failed (") and message.endswith(fix)
    assert "\n" not in message
