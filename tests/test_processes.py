"""Processes as users and schedulers treat them, on the CPU with the bundled 8.4 M-parameter
target: the `speculant: error:` line is the last on stderr even after a progress bar (one
process, and a launcher whose rank 0 dies mid-bar); SIGTERM to one process or to the launcher
stops every rank (exit 143, finished outputs kept, a line saying so) and SIGKILL to the
launcher leaves no rank running and no /tmp/speculant-ranks-* folder; two runs on one
--output, or --output naming the --prompts file (by any spelling, link or symlink), are
refused before any model loads; a rank stopped with SIGSTOP is named as the cause of the
timeout it causes; a rank killed mid-run without --output leaves the completions finished
before it printed.

Every subprocess runs in its own session, is waited for with a timeout and killed at the end."""

from __future__ import annotations

import contextlib
import fcntl
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

from speculant.launch import cli
from speculant.launch.spawn import GRACE_S

TARGET = Path(__file__).resolve().parents[1] / "assets" / "target"
WAIT_S = 60  # the most a job may take to reach the point a test acts at, or to end after it
pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="looks at ranks in /proc")


def write_prompts(path: Path, short: int = 2, long: int = 2) -> Path:
    """`short` requests of 4 tokens first, then `long` ones that run for half a minute."""
    rows = [{"prompt_token_ids": [5 + i, 6, 7], "max_new_tokens": 4} for i in range(short)]
    rows += [{"prompt_token_ids": [9 + i, 10], "max_new_tokens": 900} for i in range(long)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def last_line(text: str) -> str:
    """The last line a terminal shows: a progress bar redraws itself after a carriage return."""
    return re.split(r"[\r\n]+", text.strip())[-1]


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )


def marked(mark: str) -> list[int]:
    """Live processes started with SPECULANT_TEST_MARK=mark in their environment."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and environ(int(entry.name)).get("SPECULANT_TEST_MARK") == mark:
            stat = (entry / "stat").read_text() if (entry / "stat").exists() else ""
            if stat and stat.rsplit(")", 1)[-1].split()[0] != "Z":  # zombies have ended
                found.append(int(entry.name))
    return found


def rank_pid(mark: str, rank: int) -> int:
    """The process of `rank` (RANK in its environment) among the marked ones."""
    for pid in marked(mark):
        env = environ(pid)
        if env.get("RANK") == str(rank) and "speculant.launch.spawn" in Path(
            f"/proc/{pid}/cmdline"
        ).read_bytes().decode(errors="replace"):
            return pid
    raise AssertionError(f"no rank {rank} among {marked(mark)}")


def wait_until(ready, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def count_lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def is_locked(path: Path) -> bool:
    """Whether another process holds the --output lock (cli.output_lock) on `path`."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


class Job:
    """`speculant generate --device cpu --target <bundled> ARGS` in its own session, stderr in
    a file, marked so that its ranks can be found; killed with its whole session at the end."""

    def __init__(self, tmp_path: Path, args: list[str], env: dict | None = None):
        self.mark, self.err_path = uuid.uuid4().hex, tmp_path / "stderr.txt"
        self.out_path = tmp_path / "stdout.txt"  # the completions, without --output
        self.tmpdir = tmp_path / "tmp"  # the launcher's TMPDIR: what it leaves there is seen
        self.tmpdir.mkdir()
        env = {**os.environ, "SPECULANT_TEST_MARK": self.mark, "TMPDIR": str(self.tmpdir),
               "OMP_NUM_THREADS": "1", **(env or {})}  # fmt: skip
        cmd = [sys.executable, "-m", "speculant", "generate", "--device", "cpu",
               "--target", str(TARGET), *args]  # fmt: skip
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=err,
                                         start_new_session=True)  # fmt: skip

    def wait(self, timeout: float = WAIT_S) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {timeout} s: {self.err_path.read_text()}")
        return code, self.err_path.read_text()

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in marked(self.mark):  # ranks that left the session (none should be left)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def job(tmp_path):
    jobs = []

    def start(args: list[str], env: dict | None = None) -> Job:
        jobs.append(Job(tmp_path, args, env))
        return jobs[-1]

    yield start
    for started in jobs:
        started.close()


def tp2_args(tmp_path: Path, *extra: str) -> list[str]:
    prompts = write_prompts(tmp_path / "p.jsonl")
    return ["--tp", "2", "--prompts", str(prompts), "--output", "out.jsonl", "--ignore-eos",
            "--max-num-seqs", "2", "--dist-timeout", "60", *extra]  # fmt: skip


# ------------------------------------------------------------------ the error line is the last


def test_error_line_is_last_after_a_progress_bar(capfd, monkeypatch, tmp_path):
    """An error while the requests bar is open (the output file fails on the second request):
    the bar is closed first, so nothing is drawn after the error line."""
    from speculant.executor.request import RequestOutput

    to_json, calls = RequestOutput.to_json, []

    def disk_full_on_the_second(self):
        calls.append(self.index)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return to_json(self)

    monkeypatch.setattr(RequestOutput, "to_json", disk_full_on_the_second)
    prompts = write_prompts(tmp_path / "p.jsonl", short=3, long=0)
    code = cli.main(["generate", "--device", "cpu", "--target", str(TARGET), "--prompts",
                     str(prompts), "--output", str(tmp_path / "out.jsonl"), "--max-num-seqs",
                     "1"])  # fmt: skip
    err = capfd.readouterr().err
    assert code == 2, err
    assert "requests:" in err, err  # a bar was drawn
    last = last_line(err)
    assert last.startswith("speculant: error: ") and "no space left" in last.lower(), err


@pytest.mark.timeout(120)
def test_launcher_error_line_is_last_when_rank0_dies_mid_bar(job, tmp_path):
    """Rank 0 shares the launcher's terminal: killed while its bar is drawn, it leaves no
    newline, and the launcher's error line still starts a line of its own, the last."""
    started = job(tp2_args(tmp_path))
    wait_until(lambda: count_lines(tmp_path / "out.jsonl") >= 1, "the first output")
    os.kill(rank_pid(started.mark, 0), signal.SIGKILL)
    code, err = started.wait()
    assert code == 1, err
    assert last_line(err).startswith("speculant: error: rank 0 was killed by SIGKILL"), err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["--tp", "--dp"])
def test_a_dead_rank_keeps_the_finished_completions(job, tmp_path, layout):
    """Without --output: rank 1 killed (SIGKILL) once the two short requests have finished
    (under --dp one of them on rank 1, streamed to rank 0 in its step). Rank 0's collective
    fails; it prints their completions, as on Ctrl-C, and the launcher's line naming rank 1 is
    still the last on stderr: exit 1."""
    prompts = write_prompts(tmp_path / "p.jsonl")
    started = job([layout, "2", "--prompts", str(prompts), "--ignore-eos", "--max-num-seqs", "2",
                   "--dist-timeout", "30"], env={"TQDM_MININTERVAL": "0"})  # fmt: skip
    wait_until(lambda: "2/4" in started.err_path.read_text(), "the two short requests", 30)
    time.sleep(0.5)  # rank 1's part of the step's gather has been sent; the long ones run ~30 s
    os.kill(rank_pid(started.mark, 1), signal.SIGKILL)
    code, err = started.wait(30)
    assert code == 1, err
    assert last_line(err).startswith("speculant: error: rank 1 was killed by SIGKILL"), err
    shown = started.out_path.read_text().splitlines()
    assert [line.split()[0] for line in shown] == ["[0]", "[1]"], shown


# ---------------------------------------------------------- killing the launcher (SIGTERM, SIGKILL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killing_the_launcher_stops_every_rank(job, tmp_path, sig):
    """SIGTERM to the launcher's PID alone (kill, a batch scheduler, docker stop) stops every
    rank as Ctrl-C does: exit 143, a line saying so, the finished requests in --output. After
    SIGKILL the ranks stop by themselves (their parent died). Either way no rank keeps writing
    the file and no speculant-ranks-* folder is left in TMPDIR."""
    out = tmp_path / "out.jsonl"
    started = job(tp2_args(tmp_path))
    wait_until(lambda: count_lines(out) >= 2, "the two short requests")
    assert is_locked(out), "rank 0 holds the --output lock while it writes"
    os.kill(started.proc.pid, sig)
    code, err = started.wait()
    if sig == signal.SIGTERM:
        assert code == 143, err
        assert last_line(err) == (
            "speculant: terminated (SIGTERM): every rank stopped; the requests that finished "
            "are in out.jsonl"
        ), err
        assert "Traceback" not in err
    else:
        assert code == -signal.SIGKILL
    wait_until(lambda: not marked(started.mark), "every rank to stop", timeout=20)
    size = out.stat().st_size
    time.sleep(1)
    assert out.stat().st_size == size, "a rank kept writing --output"
    lines = [json.loads(line) for line in out.read_text().splitlines()]  # whole lines only
    assert sorted(line["index"] for line in lines[:2]) == [0, 1]
    assert all(len(line["token_ids"]) == 4 for line in lines[:2])
    assert not list(started.tmpdir.glob("speculant-ranks-*"))
    assert not is_locked(out)


SLOW_RANK = """
import os, time
if os.environ.get("RANK") == os.environ.get("SLOW_RANK") and os.environ.get("SPECULANT_TEST_MARK"):
    time.sleep(30)  # the other rank waits for it in the process-group join
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("slow,group", [("0", False), ("1", True)], ids=["rank1", "rank0"])
def test_sigterm_during_the_join_stops_the_ranks_at_once(job, tmp_path, slow, group):
    """SIGTERM to the launcher (or to the whole job, as a batch system's stop) while a rank
    waits in the process-group join (inside torch's C++, where a Python handler does not run):
    it stops at once, the launcher exits 143 well within its grace period, and no rank aborts on
    its way out (rank 0, which hosts the store, left its join's thread running: "terminate
    called without an active exception" when a CPU rank exited normally)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_RANK)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    started = job(tp2_args(tmp_path), env={"PYTHONPATH": path, "SLOW_RANK": slow})
    wait_until(lambda: any(environ(pid).get("RANK") == "1" for pid in marked(started.mark)),
               "rank 1 to start")  # fmt: skip
    time.sleep(4)  # the other rank has imported torch and waits in the join
    start = time.monotonic()
    if group:  # as a batch system's stop does: every process of the job gets it
        os.killpg(started.proc.pid, signal.SIGTERM)
    else:
        os.kill(started.proc.pid, signal.SIGTERM)
    code, err = started.wait(30)
    took = time.monotonic() - start
    assert code == 143 and last_line(err).startswith("speculant: terminated (SIGTERM)"), err
    assert took < GRACE_S - 1, (took, err)  # was the grace period, then SIGKILL
    assert "terminate called" not in err, err


def _listening(port: int) -> bool:
    """Whether a socket of this host listens on TCP `port` (/proc/net/tcp, state 0A)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


@pytest.mark.timeout(60)
def test_sigterm_as_the_join_starts_ends_every_rank_cleanly(job, tmp_path):
    """SIGTERM to the whole job the moment rank 0 starts the join (creating the store and
    gloo's threads in the join's thread): exit 143, and no rank aborts on its way out (a CPU
    rank exiting normally while that thread ran printed "terminate called without an active
    exception" and died of SIGABRT)."""
    started = job(tp2_args(tmp_path))
    wait_until(lambda: any(environ(pid).get("RANK") == "0" for pid in marked(started.mark)),
               "rank 0 to start")  # fmt: skip
    port = int(environ(rank_pid(started.mark, 0))["MASTER_PORT"])
    deadline = time.monotonic() + 30
    while not _listening(port):  # rank 0 has created the job's store: the join has begun
        assert time.monotonic() < deadline and started.proc.poll() is None, "no join"
        time.sleep(0.002)
    os.killpg(started.proc.pid, signal.SIGTERM)
    code, err = started.wait(30)
    assert code == 143 and "terminate called" not in err, err


@pytest.mark.timeout(60)
def test_sigterm_stops_one_process_as_ctrl_c_does(job, tmp_path):
    """One process: SIGTERM once the short request is written ends the run with 143 and a last
    line saying where the finished requests are; the file holds whole lines only."""
    out = tmp_path / "out.jsonl"
    prompts = write_prompts(tmp_path / "p.jsonl", short=1, long=1)
    started = job(["--prompts", str(prompts), "--output", "out.jsonl", "--ignore-eos",
                   "--max-num-seqs", "1"])  # fmt: skip
    wait_until(lambda: count_lines(out) >= 1, "the short request")
    os.kill(started.proc.pid, signal.SIGTERM)
    code, err = started.wait()
    assert code == 143, err
    assert last_line(err) == (
        "speculant: terminated (SIGTERM); the requests that finished are in out.jsonl"
    ), err
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0]


# ------------------------------------------------------- the output file: one writer, not an input


@pytest.mark.parametrize("layout", [[], ["--tp", "2"]], ids=["one-process", "tp2"])
def test_a_second_run_on_the_same_output_is_refused(tmp_path, capfd, monkeypatch, layout):
    """Another run holds the --output lock (an exclusive flock, as a running job's writer
    does): this run is refused with one line before any model loads or rank starts, and the
    file is untouched."""
    from speculant.launch import spawn

    def never(*args, **kwargs):
        raise AssertionError("a model loaded or a rank started")

    monkeypatch.setattr(cli, "generate_in_rank", never)
    monkeypatch.setattr(spawn.subprocess, "Popen", never)
    out = tmp_path / "out.jsonl"
    out.write_text('{"index": 0}\n')
    with open(out, "a") as first_run:
        fcntl.flock(first_run, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code = cli.main(["generate", "--device", "cpu", "--target", str(TARGET), "--prompt",
                         "def f():", "--output", str(out), *layout])  # fmt: skip
    err = capfd.readouterr().err
    assert code == 2, err
    assert last_line(err) == (
        f"speculant: error: --output {str(out)!r} is being written by another run (it holds "
        "the file's lock); wait for that run to end or pick another path"
    ), err
    assert out.read_text() == '{"index": 0}\n'


def test_a_run_holds_the_output_lock_and_leaves_no_empty_file(tmp_path, capfd, monkeypatch):
    """The one process takes the lock before the model loads and holds it while it generates;
    a run that fails before writing anything removes the file it created."""
    seen = []

    def check_then_fail(*args, **kwargs):
        seen.append(is_locked(tmp_path / "out.jsonl"))
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(cli, "generate_in_rank", check_then_fail)
    code = cli.main(["generate", "--device", "cpu", "--target", str(TARGET), "--prompt",
                     "def f():", "--output", str(tmp_path / "out.jsonl")])  # fmt: skip
    assert code == 2 and seen == [True]
    assert not (tmp_path / "out.jsonl").exists()
    capfd.readouterr()


@pytest.mark.parametrize("spelling", ["same", "dot-slash", "absolute", "symlink", "hardlink"])
def test_output_that_is_the_prompts_file_is_refused(tmp_path, capfd, monkeypatch, spelling):
    """--output naming the --prompts file, by inode whatever the spelling: refused with one
    line before any model loads; the prompts are untouched."""
    monkeypatch.setattr(cli, "generate_in_rank", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.chdir(tmp_path)
    prompts = write_prompts(tmp_path / "p.jsonl", short=1, long=0)
    before = prompts.read_text()
    (tmp_path / "link.jsonl").symlink_to(prompts)
    os.link(prompts, tmp_path / "hard.jsonl")
    output = {"same": "p.jsonl", "dot-slash": "./p.jsonl", "absolute": str(prompts),
              "symlink": "link.jsonl", "hardlink": "hard.jsonl"}[spelling]  # fmt: skip
    code = cli.main(["generate", "--device", "cpu", "--target", str(TARGET), "--prompts",
                     "p.jsonl", "--output", output])  # fmt: skip
    err = capfd.readouterr().err
    assert code == 2, err
    assert last_line(err).startswith(
        f"speculant: error: --output {output!r} is the --prompts file 'p.jsonl'"
    ), err
    assert prompts.read_text() == before


# --------------------------------------------------------------------------- a stopped rank


@pytest.mark.timeout(120)
def test_a_stopped_rank_is_named_as_the_cause(job, tmp_path):
    """SIGSTOP on rank 1 mid-run: rank 0's collective times out (--dist-timeout 8) and the
    launcher names rank 1 (alive, state T, it never reached the collective) as the cause."""
    started = job(tp2_args(tmp_path, "--dist-timeout", "8"))
    wait_until(lambda: count_lines(tmp_path / "out.jsonl") >= 1, "the first output")
    os.kill(rank_pid(started.mark, 1), signal.SIGSTOP)
    code, err = started.wait()
    assert code == 1, err
    last = last_line(err)
    assert last.startswith("speculant: error: rank 1 stopped answering (its process was "), err
    assert "rank 0 exited with status 1 waiting for it" in last, err
    wait_until(lambda: not marked(started.mark), "every rank to end", timeout=20)


@pytest.mark.parametrize("code, hard", [(143, True), (130, True), (1, True), (2, True), (0, False)])
def test_a_stopped_cpu_rank_skips_interpreter_teardown(monkeypatch, code, hard):
    """A CPU rank that ends after a stop (Ctrl-C 130, SIGTERM 143) leaves with os._exit: a stop
    that came while gloo built its groups, or while a peer sat in a collective with it, left C++
    objects whose destruction at interpreter exit aborted the rank (SIGABRT, "terminate called
    without an active exception"; a helper audit). So does one that failed (its groups broken
    by a peer: their teardown outran the launcher's grace period). A CPU rank that succeeded
    exits normally."""
    from speculant.comm import store_call
    from speculant.launch import spawn

    monkeypatch.setattr(store_call, "_ABANDONED", [])  # earlier tests may have given calls up
    calls = []
    monkeypatch.setattr(spawn.os, "_exit", lambda c: calls.append(("hard", c)))
    monkeypatch.setattr(spawn.sys, "exit", lambda c: calls.append(("normal", c)))
    spawn._exit(code, "cpu")
    assert calls[0] == ("hard" if hard else "normal", code)


def test_a_join_that_outlasts_its_bound_is_given_up_on(monkeypatch):
    """interruptible_call with a bound: a call still running past it raises TimeoutError at
    once (the process-group join waited 45-60 s past a 20 s --dist-timeout for a peer that died
    while joining) and counts as abandoned (the rank then ends with os._exit)."""
    import threading

    from speculant.comm import store_call

    monkeypatch.setattr(store_call, "_ABANDONED", [])
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="test-join did not return within 0 s"):
        store_call.interruptible_call(lambda: release.wait(30), "test-join", bound_s=0.4)
    assert time.monotonic() - start < 3 and store_call.calls_abandoned()
    release.set()
    assert store_call.interruptible_call(lambda: 7, "quick", bound_s=5) == 7
