"""Without --output, nothing rank 0 of a spawn job finished is lost with rank 0: `speculant
generate --tp 2` on the CPU (gloo, the bundled target), rank 0 SIGKILLed once the two short
requests have finished: the launcher prints their completions (launch/spawn.CompletionSpool),
each once and as a run that ends prints them, before its last line naming rank 0, and exits 1.
Ctrl-C there: rank 0 prints them and the launcher none again (exit 130). A run that ends prints
each completion once.

The ranks are found by SPECULANT_TEST_MARK in their environment (as in test_processes.py); every
job runs in its own session, is waited for with a timeout and killed at the end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from test_processes import environ  # the /proc reading the process tests use

from speculant.launch.spawn import SPOOL_ENV

TARGET = Path(__file__).resolve().parents[1] / "assets" / "target"
WAIT_S = 45  # the most a job may take to reach the point a test acts at, or to end after it
SHORT = [{"prompt": "def f(x):", "max_new_tokens": 4},  # a text prompt: printed with its prompt
         {"prompt_token_ids": [5, 6, 7], "max_new_tokens": 4}]  # fmt: skip
LONG = [{"prompt_token_ids": [9 + i, 10], "max_new_tokens": 900} for i in range(2)]  # ~30 s
pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks in /proc")


def rank_pid(mark: str, rank: int) -> int:
    """The spawn rank `rank` of the job marked `mark`."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            env = environ(int(entry.name))
            if env.get("SPECULANT_TEST_MARK") == mark and env.get("RANK") == str(rank):
                with contextlib.suppress(OSError):
                    if b"speculant.launch.spawn" in (entry / "cmdline").read_bytes():
                        return int(entry.name)
    raise AssertionError(f"no rank {rank} in job {mark}")


def wait_spooled(pid: int, count: int, deadline: float) -> None:
    """Wait until rank 0 (`pid`) has spooled `count` completions to its launcher: the bar counts
    a request in the step it finishes, before rank 0 takes its output. The spool is the file
    descriptor SPOOL_ENV names in rank 0's environment; without one (a launcher that keeps no
    spool), a second's wait instead: a step takes a few milliseconds."""
    spool = environ(pid).get(SPOOL_ENV)
    if spool is None:
        time.sleep(1)
        return
    path = Path(f"/proc/{pid}/fd/{spool.split(':')[0]}")
    while path.read_bytes().count(b"\n") < count:
        assert time.monotonic() < deadline, f"rank 0 did not spool {count} completions"
        time.sleep(0.02)


def last_line(text: str) -> str:
    """The last line a terminal shows: a progress bar redraws itself after a carriage return."""
    return re.split(r"[\r\n]+", text.strip())[-1]


class Job:
    """`speculant generate --device cpu --target <bundled> --tp 2 --prompts P` in its own
    session, stdout and stderr in files; killed with its whole session at the end."""

    def __init__(self, tmp_path: Path, rows: list[dict]):
        prompts = tmp_path / "p.jsonl"
        prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
        self.mark = uuid.uuid4().hex
        self.out, self.err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        env = {**os.environ, "SPECULANT_TEST_MARK": self.mark, "OMP_NUM_THREADS": "1",
               "TQDM_MININTERVAL": "0"}  # fmt: skip
        cmd = [sys.executable, "-m", "speculant", "generate", "--device", "cpu", "--target",
               str(TARGET), "--tp", "2", "--prompts", str(prompts), "--ignore-eos",
               "--max-num-seqs", "2", "--dist-timeout", "5"]  # fmt: skip
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=err,
                                         start_new_session=True)  # fmt: skip

    def wait(self, timeout: float = WAIT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {timeout} s: {self.err.read_text()}")

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def job(tmp_path):
    jobs = []

    def start(rows: list[dict]) -> Job:
        jobs.append(Job(tmp_path, rows))
        return jobs[-1]

    yield start
    for started in jobs:
        started.close()


def completions(text: str) -> list[str]:
    """The printed completions, one string each (a completion may span lines)."""
    return re.split(r"\n(?=\[\d+\] )", text.rstrip("\n")) if text.strip() else []


@pytest.fixture(scope="module")
def normal_run(tmp_path_factory) -> tuple[int, str, str]:
    """The short requests alone, in a run that ends: (exit status, stdout, stderr)."""
    started = Job(tmp_path_factory.mktemp("normal"), SHORT)
    try:
        code = started.wait()
    finally:
        started.close()
    return code, started.out.read_text(), started.err.read_text()


@pytest.fixture(scope="module")
def expected(normal_run) -> list[str]:
    """What a run that ends prints for the short requests."""
    return completions(normal_run[1])


@pytest.mark.timeout(60)
def test_a_run_that_ends_prints_each_completion_once(normal_run):
    code, out, err = normal_run
    assert code == 0, err
    assert last_line(err).startswith("requests=2 "), err
    shown = completions(out)
    assert [line.split()[0] for line in shown] == ["[0]", "[1]"], out  # each once, in order
    assert shown[0].startswith("[0] def f(x):") and len(shown[0]) > len("[0] def f(x):"), out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["SIGKILL", "Ctrl-C"])
def test_rank0_killed_keeps_its_finished_completions(job, expected, how):
    """Once both short requests have finished (rank 0's bar shows 2/4 and it has spooled both:
    under --tp rank 0 finishes every request), rank 0 is SIGKILLed: the launcher prints both
    completions, each once, before its last line naming rank 0 (exit 1). Ctrl-C (SIGINT to the
    whole foreground group, as a terminal sends it) instead: rank 0 prints them itself, and the
    launcher, which stops it, prints none of them again (exit 130)."""
    started = job(SHORT + LONG)
    deadline = time.monotonic() + WAIT_S
    while "2/4" not in started.err.read_text():
        assert started.proc.poll() is None, started.err.read_text()
        assert time.monotonic() < deadline, "the short requests did not finish"
        time.sleep(0.05)
    rank0 = rank_pid(started.mark, 0)
    wait_spooled(rank0, 2, deadline)
    if how == "SIGKILL":
        os.kill(rank0, signal.SIGKILL)
    else:
        os.killpg(started.proc.pid, signal.SIGINT)
    code = started.wait()
    err = started.err.read_text()
    if how == "SIGKILL":
        assert code == 1, err
        assert last_line(err).startswith("speculant: error: rank 0 was killed by SIGKILL"), err
    else:
        assert code == 130, err
        assert last_line(err) == "speculant: interrupted: every rank stopped", err
    assert completions(started.out.read_text()) == expected, err


def test_the_spool_prints_what_rank0_did_not_as_rank0_would(monkeypatch):
    """In one process: rank 0's records (one cut short, as by SIGKILL mid-write) and marks; the
    launcher prints, by index and once, the lines not marked printed, escaped as rank 0's
    stdout escapes what it cannot encode (cli.main: errors="backslashreplace")."""
    import io

    from speculant.launch.spawn import CompletionSpool, rank_spool

    def terminal() -> io.TextIOWrapper:
        return io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="backslashreplace")

    launcher_out, rank_out = terminal(), terminal()
    spool = CompletionSpool(launcher_out)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(SPOOL_ENV, spool.env[SPOOL_ENV])
    rank = rank_spool()
    assert rank is not None and SPOOL_ENV not in os.environ  # not passed on to its children
    lines = {(2, 0): "[2] caf\u00e9 \ud800 x", (0, 0): "[0] a\nb", (1, 0): "[1] [5, 6]",
             (3, 1): "[3:1] z", (3, 0): "[3:0] y"}  # fmt: skip
    for key in ((2, 0), (0, 0), (1, 0), (3, 1), (3, 0)):
        rank.add(key, lines[key])
    rank.printed((1, 0))
    os.write(spool.fd, b'{"index": [4, 0], "line": "[4] cut')  # the record rank 0 was killed in
    spool.print_unprinted()
    spool.print_unprinted()  # once: what it printed is not printed again
    for key in ((0, 0), (2, 0), (3, 0), (3, 1)):  # by prompt, then completion
        print(lines[key], file=rank_out)
    launcher_out.flush()
    rank_out.flush()
    assert launcher_out.buffer.getvalue() == rank_out.buffer.getvalue()
    assert b"caf\\xe9 \\ud800 x" in launcher_out.buffer.getvalue()
    spool.close()
