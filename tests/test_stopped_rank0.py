"""A rank stopped (SIGSTOP) mid-run fails a spawn job in bounded time, rank 0 included: `speculant
generate --tp 2 --device cpu --dist-timeout 5` (gloo, the bundled target), one rank stopped once
the two short requests have finished. The job exits 1 within about --dist-timeout + the failed
rank's report (launch/spawn.REPORT_S) + the grace period, its last line names the stopped rank,
no rank process is left, and the finished completions are printed, each once.

Rank 0 hosts the job's TCPStore: a TCPStore client waits for its server's answers without a
timeout, so rank 1, reporting its timed-out collective through the store of a stopped rank 0,
used to wait forever, and the launcher with it (launch/spawn.report_failure now gives the report
up after REPORT_S; the launcher also ends a job whose rank has been stopped that long with no
rank failed, `_supervise(stopped_s=...)`, tested here with plain processes).

The ranks are found by SPECULANT_TEST_MARK in their environment (as in test_processes.py); every
job runs in its own session, is waited for with a timeout and killed at the end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from test_processes import environ  # the /proc reading the process tests use

from speculant.launch import spawn

TARGET = Path(__file__).resolve().parents[1] / "assets" / "target"
WAIT_S = 45  # the most a job may take to reach the point the test acts at
DIST_TIMEOUT_S = 5
END_S = 40  # the most the job may take to end after the stop (~ 5 + 7 + 5 s, with slack)
SHORT = [{"prompt_token_ids": [5, 6, 7], "max_new_tokens": 4},
         {"prompt_token_ids": [5, 8, 7], "max_new_tokens": 4}]  # fmt: skip
LONG = [{"prompt_token_ids": [9 + i, 10], "max_new_tokens": 900} for i in range(2)]  # ~30 s
pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks in /proc")


def state(pid: int) -> str:
    """The process's state letter from /proc ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return ""


def marked(mark: str) -> list[int]:
    """Live processes (zombies have ended) started with SPECULANT_TEST_MARK=mark."""
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit()
        and environ(int(entry.name)).get("SPECULANT_TEST_MARK") == mark
        and state(int(entry.name)) not in ("", "Z", "X")
    ]


def rank_pid(mark: str, rank: int) -> int | None:
    """The spawn rank `rank` of the job marked `mark`, or None (not started yet)."""
    for pid in marked(mark):
        if environ(pid).get("RANK") == str(rank):
            with contextlib.suppress(OSError):
                if b"speculant.launch.spawn" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
    return None


def wait_for(ready, what: str, deadline: float):
    while not (value := ready()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def spooled(pid: int) -> int:
    """How many records rank 0 (`pid`) has written to its launcher's completion spool (the
    file descriptor SPOOL_ENV names in its environment): one per finished request, until it
    prints them."""
    fd = environ(pid)[spawn.SPOOL_ENV].split(":")[0]
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/fd/{fd}").read_bytes().count(b"\n")
    return 0


def last_line(text: str) -> str:
    """The last line a terminal shows: a progress bar redraws itself after a carriage return."""
    return re.split(r"[\r\n]+", text.strip())[-1]


@pytest.fixture
def job(tmp_path):
    """`speculant generate --device cpu --target <bundled> --tp 2 --dist-timeout 5` on SHORT and
    LONG, without --output, in its own session: (process, mark, stdout path, stderr path)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in SHORT + LONG))
    mark = uuid.uuid4().hex
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    env = {**os.environ, "SPECULANT_TEST_MARK": mark, "OMP_NUM_THREADS": "1",
           "TQDM_MININTERVAL": "0"}  # fmt: skip
    cmd = [sys.executable, "-m", "speculant", "generate", "--device", "cpu", "--target",
           str(TARGET), "--tp", "2", "--prompts", str(prompts), "--ignore-eos",
           "--max-num-seqs", "2", "--dist-timeout", str(DIST_TIMEOUT_S)]  # fmt: skip
    with open(out, "w") as out_file, open(err, "w") as err_file:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out_file, stderr=err_file,
                                start_new_session=True)  # fmt: skip
    try:
        yield proc, mark, out, err
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in marked(mark):  # ranks that left the session (none should be left)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stopped", [0, 1])
def test_a_stopped_rank_ends_the_job_in_bounded_time(job, stopped):
    """Rank 0 (the store's host) or rank 1 stopped once the short requests have finished: exit
    1 within END_S of the stop, the last line names it, no rank is left, and the two finished
    completions are printed once each (rank 1 stopped: by rank 0; rank 0 stopped: by the
    launcher, from its spool)."""
    proc, mark, out, err = job
    deadline = time.monotonic() + WAIT_S
    pids = {r: wait_for(lambda r=r: rank_pid(mark, r), f"rank {r}", deadline) for r in (0, 1)}
    wait_for(lambda: spooled(pids[0]) >= len(SHORT), "the short requests to finish", deadline)
    os.kill(pids[stopped], signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        code = proc.wait(END_S)
    except subprocess.TimeoutExpired:
        states = {r: state(pid) for r, pid in pids.items()}
        pytest.fail(f"the job did not end within {END_S} s of the stop (ranks {states}): "
                    f"{err.read_text()}")  # fmt: skip
    took = time.monotonic() - stopped_at
    text = err.read_text()
    assert code == 1, text
    assert last_line(text).startswith(
        f"speculant: error: rank {stopped} stopped answering (its process was stopped, state T"
    ), text
    assert not marked(mark), f"ranks left: {marked(mark)}"
    assert all(state(pid) == "" for pid in pids.values())
    printed = re.findall(r"^\[(\d+)\] ", out.read_text(), re.M)
    assert printed == ["0", "1"], out.read_text()
    print(f"rank {stopped} stopped: the job ended {took:.1f} s later")


# ------------------------------------------------------------------- the parts, without a model


def test_the_report_is_given_up_when_the_store_does_not_answer(monkeypatch):
    """A store whose host is stopped accepts the connection (the kernel does) and never answers:
    report_failure gives up after REPORT_S and names no one, instead of waiting forever."""
    monkeypatch.setattr(spawn, "REPORT_S", 1.0)
    with socket.socket() as server:  # listens, never accepts: as a stopped process's socket
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        started = time.monotonic()
        cause = spawn.report_failure(RuntimeError("Timed out waiting 5000ms for recv operation"))
        took = time.monotonic() - started
    # closing the server resets the pending connection: the abandoned report ends too
    for thread in threading.enumerate():
        if thread.name == "speculant-roll-call":
            thread.join(10)
    assert cause is None
    assert 0.9 < took < 3.0, took


def _rank(rank: int, seconds: float = 60) -> spawn._Rank:
    proc = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
    return spawn._Rank(rank, spawn._Proc(proc))


def test_a_rank_stopped_with_no_rank_failed_is_the_failure():
    """No rank fails (the other is stuck outside any collective): the rank stopped for
    `stopped_s` seconds is killed and named, and the stuck one killed after the grace period."""
    ranks = [_rank(0), _rank(1)]
    try:
        os.kill(ranks[0].process.handle.pid, signal.SIGSTOP)
        started = time.monotonic()
        line = spawn._supervise(ranks, None, grace_s=1.0, stopped_s=1.0)
        took = time.monotonic() - started
    finally:
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                r.process.kill()
            r.process.join(5)
    assert line is not None and line.startswith("rank 0 stopped answering (its process was "), line
    assert "and was killed after 1 s stopped; rank(s) 1 did not exit within 1 s" in line, line
    assert 1.5 < took < 6, took
    assert [r.process.exitcode for r in ranks] == [-signal.SIGKILL, -signal.SIGKILL]


def test_a_launcher_stopped_with_its_ranks_does_not_count_the_pause():
    """Ctrl-Z stops the launcher with its ranks: a rank seen stopped before and after a pause
    of the launcher itself has not been seen stopped for that long (the count starts again)."""
    ranks = [_rank(0, seconds=3)]
    os.kill(ranks[0].process.handle.pid, signal.SIGSTOP)
    polls = [0]

    def pause_once() -> None:  # the launcher's second poll comes 2 s after its first
        polls[0] += 1
        if polls[0] == 2:
            time.sleep(2.0)
        if polls[0] == 12:  # ~0.5 s of polls after the pause: the rank goes on, and ends
            os.kill(ranks[0].process.handle.pid, signal.SIGCONT)

    try:
        line = spawn._supervise(ranks, None, grace_s=1.0, on_poll=pause_once, stopped_s=1.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            ranks[0].process.kill()
        ranks[0].process.join(5)
    assert line is None, line


def test_dist_timeout_is_read_from_the_command_line():
    assert spawn.dist_timeout(["generate", "--tp", "2", "--dist-timeout", "5"]) == 5
    assert spawn.dist_timeout(["generate", "--dist-timeout=7"]) == 7
    assert spawn.dist_timeout(["generate", "--tp", "2"]) == spawn.DEFAULT_DIST_TIMEOUT_S


def _exits(rank: int, seconds: float, code: int) -> spawn._Rank:
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; time.sleep({seconds}); sys.exit({code})"]
    )
    return spawn._Rank(rank, spawn._Proc(proc))


def test_ranks_ending_one_after_another_are_not_killed_as_stuck():
    """Ranks see a failure one after another (a rank blocked in a collective with one that is
    reporting sees it when that one exits): each rank gets the grace period from the last exit,
    so a cascade ending within it of each exit is named by its cause alone; a rank still running
    the grace period after the last exit is killed and named."""
    ranks = [_exits(0, 0.2, 1), _exits(1, 2.5, 1), _exits(2, 4.8, 1)]
    line = spawn._supervise(ranks, None, grace_s=3.0)
    assert line == "rank 0 exited with status 1", line
    ranks = [_exits(0, 0.2, 1), _exits(1, 1.0, 1), _exits(2, 60, 0)]
    started = time.monotonic()
    line = spawn._supervise(ranks, None, grace_s=2.0)
    assert line.endswith("rank(s) 2 did not exit within 2 s after that and were killed"), line
    assert time.monotonic() - started < 10
