"""The torchrun and Ray launchers on the CPU (gloo): torchrun `--standalone` with 2 and 4
processes and the Ray driver with 2 and 4 actors give the single-process output; `ray job
submit` runs the driver end to end against a head this test starts (with token auth, Ray 2.60's
recommended mode); a rank that dies mid-run (SPECULANT_TEST_KILL_RANK, launch/spawn.py
`fault_point`) fails the torchrun job and the Ray job with a line naming it, in bounded time,
with no process, actor or placement group left behind. Two torchrun agents on this host form a
real `--nnodes 2` job over a c10d rendezvous (TP spanning the nodes, warned; DP across them),
equal to one process, and a node whose agent is killed fails the job with rank 0's line naming
it. The Ray driver refuses a placement the cluster can never hold at once, an --output
another run holds, and an address nothing answers at; killed by SIGTERM (exit 143) or SIGKILL
it leaves no actor running; stopped by Ctrl-C or SIGTERM it keeps what a DP rank finished in
the step of the stop (the ranks stop at a step boundary) and a batch its drain had taken; without
--output it prints, as one process does, every completion, or those finished before Ctrl-C,
SIGTERM or a killed actor; its --help (no Ray needed) shows --ray-address.

Every subprocess has a timeout and every collective `--dist-timeout`. The Ray tests skip when
Ray is not installed (`pip install 'speculant[ray]'`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from helpers_eagle import write_random_eagle3
from helpers_io import written

from speculant.launch import cli
from speculant.launch.spawn import free_port

RUN_TIMEOUT_S = 180  # every launcher subprocess is killed after this
KILL_BOUND_S = 60  # a run with a dead rank must end within this
RAY_OBJECT_STORE = 100 * 2**20


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, llama_dir):
    path = tmp_path_factory.mktemp("eagle3_launch")
    write_random_eagle3(path, llama_dir, draft_vocab=200, num_kv_heads=1, seed=3)
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    rows = [
        {"prompt": "def f(x):"},
        {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]},
        {"prompt": "import", "temperature": 0.8, "top_p": 0.9, "seed": 5},  # seeded sampling
        {"prompt_token_ids": [40, 41]},
    ]
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def flags(llama_dir, eagle_dir, prompts_file) -> list[str]:
    """`generate` flags every launcher runs: EAGLE-3 k=3 on the tiny Llama."""
    return [
        "--device", "cpu", "--target", str(llama_dir), "--draft", str(eagle_dir),
        "--algo", "eagle3", "--num-draft-tokens", "3", "--prompts", str(prompts_file),
        "--max-new-tokens", "12", "--ignore-eos", "--max-num-seqs", "8",
        "--max-model-len", "160", "--page-size", "4", "--dist-timeout", "60",
    ]  # fmt: skip


def read_tokens(path: Path) -> dict[int, list[int]]:
    """Output lines by request index (lines come in the order requests finish; each once)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    indices = [line["index"] for line in lines]
    assert sorted(indices) == list(range(len(lines))), indices
    return {line["index"]: line["token_ids"] for line in lines}


@pytest.fixture(scope="module")
def expected(flags, tmp_path_factory) -> dict[int, list[int]]:
    """The single-process output."""
    out = tmp_path_factory.mktemp("single") / "out.jsonl"
    assert cli.main(["generate", *flags, "--output", str(out)]) == 0
    tokens = read_tokens(out)
    assert sorted(tokens) == [0, 1, 2, 3] and all(len(t) == 12 for t in tokens.values())
    return tokens


def run(cmd: list[str], env: dict | None = None, timeout: float = RUN_TIMEOUT_S, **kwargs):
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, **kwargs
    )  # a hung launcher fails the test with TimeoutExpired (and is killed)


def marked_processes(mark: str) -> list[int]:
    """Processes whose environment holds SPECULANT_TEST_MARK=mark (a job's ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"SPECULANT_TEST_MARK={mark}".encode() in env:
                found.append(int(entry.name))
    return found


# ---------------------------------------------------------------------------------- torchrun


def torchrun(nproc: int, args: list[str], env: dict | None = None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), "-m", "speculant.launch.torchrun", *args]  # fmt: skip
    return run(cmd, env=env)


@pytest.mark.parametrize("tp,dp", [(2, 1), (2, 2)])
def test_torchrun_standalone_equals_one_process(flags, expected, tmp_path, tp, dp):
    out = tmp_path / "out.jsonl"
    proc = torchrun(tp * dp, ["generate", *flags, "--tp", str(tp), "--dp", str(dp),
                              "--output", str(out)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert read_tokens(out) == expected
    summaries = [line for line in proc.stderr.splitlines() if line.startswith("requests=")]
    assert len(summaries) == 1 and summaries[0].startswith("requests=4 ")  # rank 0 reports
    # rank 0's own scheduler under DP, said so (its preemptions are not the job's)
    scheduler = [line for line in proc.stderr.splitlines() if line.startswith("scheduler")]
    assert len(scheduler) == 1, proc.stderr
    assert scheduler[0].startswith("scheduler: " if dp == 1 else f"scheduler (DP rank 0 of {dp}): ")


NOISY_RANK = """import os, sys, threading, time
if os.environ.get("RANK") == "1":  # once the rank runs the job (the engine imported)
    def noise():
        while "speculant.executor.engine" not in sys.modules:
            time.sleep(0.02)
        print("NOISE on rank 1's stdout", flush=True)
    threading.Thread(target=noise, daemon=True).start()
"""


def test_torchrun_stdout_holds_only_rank0s_completions(flags, tmp_path):
    """Every torchrun rank writes to the job's stdout, where rank 0 prints the completions
    (no --output): what another rank prints there (a library's print, NCCL_DEBUG lines) goes to
    its stderr."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NOISY_RANK)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    proc = torchrun(2, ["generate", *flags, "--tp", "2"], env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "NOISE on rank 1" in proc.stderr and "NOISE" not in proc.stdout, proc.stdout
    shown = sorted(line.split()[0] for line in proc.stdout.splitlines() if line.startswith("["))
    assert shown == ["[0]", "[1]", "[2]", "[3]"], proc.stdout


def test_torchrun_prompt_error_is_rank0s_line_alone(flags, tmp_path):
    """A prompt every rank refuses (ids past the vocabulary, line 3): rank 0's line names the
    --prompts FILE:LINE; the other ranks print none of their own ("prompt 1 has ..."). torchrun
    itself then ends with its failure summary, exit 1 (its agent's, for any failed rank)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [5, 6]}\n\n{"prompt_token_ids": [5, 99999]}\n')
    args = list(flags)
    args[args.index("--prompts") + 1] = str(prompts)
    proc = torchrun(2, ["generate", *args, "--tp", "2"])
    lines = [line for line in proc.stderr.splitlines() if "speculant: error:" in line]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert f"{prompts}:3: the prompt has token id 99999 outside the vocabulary" in lines[0]
    # torchrun's summary names it too (the rank's error file), not a link to its documentation
    cause = f"traceback : {prompts}:3: the prompt has token id 99999"
    assert cause in proc.stderr and "Root Cause" in proc.stderr, proc.stderr[-3000:]


def test_torchrun_user_error_of_one_rank_is_said_by_it(flags):
    """A user error that rank 1 alone meets once the groups are up (a shard only its node cannot
    read): local rank 1, which leaves the errors every rank meets to local rank 0, says it,
    naming itself, as local rank 0 reported another failure; rank 0's line names rank 1 as the
    cause, not as a rank that stopped answering."""
    env = {**os.environ, "SPECULANT_TEST_FAIL_RANK": "1:user"}
    proc = torchrun(2, ["generate", *flags, "--dp", "2"], env=env)
    lines = [x for x in proc.stderr.splitlines() if "speculant: error:" in x]
    assert proc.returncode != 0, proc.stderr[-3000:]
    said = "speculant: error: rank 1: rank 1's test failure (SPECULANT_TEST_FAIL_RANK)"
    assert said in lines, proc.stderr[-3000:]
    cause = "speculant: error: rank 0: rank 1 (torchrun node 0) failed first (SpeculantError: "
    assert any(x.startswith(cause) for x in lines), proc.stderr[-3000:]


@pytest.mark.parametrize(
    "bad,line",
    [
        (["--max-new-tokens", "abc"], "argument --max-new-tokens: 'abc' is not an integer"),
        (["--max-model-len", "100000"], "max_model_len=100000 exceeds the model's"),
        (["--target", "/nonexistent"], "--target '/nonexistent' is not a directory"),
    ],
    ids=["parse", "check", "checkpoint"],
)
def test_torchrun_flag_error_is_one_line(flags, bad, line):
    """A bad flag or checkpoint, which every rank refuses alike: one `speculant: error:` line
    (was one per rank), and torchrun's summary names it."""
    proc = torchrun(2, ["generate", *flags, "--tp", "2", *bad])
    lines = [x for x in proc.stderr.splitlines() if "speculant: error:" in x]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert line in lines[0] and f"traceback : {line}" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "bad", [["--demo-model", "--max-new-tokens", "abc"], ["--target", "/nonexistent"]]
)
@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_a_torchrun_rank_that_does_not_print_the_error_waits_for_the_one_that_does(
    monkeypatch, capsys, bad, local_rank
):
    """Every rank refuses a bad flag alike and only local rank 0 prints it: a rank 1 that
    exited first had torchrun stop rank 0 before its line (CI saw no line under load). The
    others now hold their exit until torchrun stops them; local rank 0 does not wait."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    held, sleep = [], time.sleep
    monkeypatch.setattr(
        time, "sleep", lambda s: held.append(s) if s == cli.USER_ERROR_HOLD_S else sleep(s)
    )
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = cli.main(["generate", "--prompt", "x", "--device", "cpu", *bad])
    except SystemExit as exc:  # argparse's exit
        code = exc.code
    finally:
        signal.signal(signal.SIGTERM, previous)
    printed = "speculant: error:" in capsys.readouterr().err
    expected = ([], True) if local_rank == "0" else ([cli.USER_ERROR_HOLD_S], False)
    assert (code, held, printed) == (2, *expected)


SLOW_RANK0 = """
import os, time
if os.environ.get("RANK") == "0":
    time.sleep(6)  # the other rank is in the join (waiting for rank 0) when rank 0 fails
"""


def test_torchrun_rank0_error_before_the_join_ends_the_job_at_once(flags, tmp_path):
    """Rank 0 refuses its --output before the ranks join; the other rank waits in the join
    (inside torch's C++, where a Python signal handler does not run) when torchrun sends it
    SIGTERM: it stops at once (was: torchrun's 30 s grace, then SIGKILL)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_RANK0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    start = time.monotonic()
    proc = torchrun(2, ["generate", *flags, "--dp", "2", "--output", str(tmp_path / "no" / "o")],
                    env=env)  # fmt: skip
    took = time.monotonic() - start
    errors = [line for line in proc.stderr.splitlines() if line.startswith("speculant: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "directory does not exist" in errors[0] and "SIGKILL" not in proc.stderr, proc.stderr
    assert "terminate called" not in proc.stderr, proc.stderr  # the join thread left running
    assert took < 25, took  # 6 s of rank 0's sleep; torchrun's grace alone is 30 s


def test_torchrun_world_must_match_tp_dp(flags):
    proc = torchrun(2, ["generate", *flags, "--tp", "2", "--dp", "2"])
    assert proc.returncode != 0
    assert "torchrun started WORLD_SIZE=2 processes but --tp 2 x --dp 2 = 4" in proc.stderr
    proc = run([sys.executable, "-m", "speculant.launch.torchrun", "generate", "--tp", "2"])
    assert proc.returncode == 2 and "RANK is not set: start this module under torchrun" in (
        proc.stderr
    )


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="checks for stray ranks in /proc")
def test_torchrun_fails_when_a_rank_dies(flags):
    mark = uuid.uuid4().hex
    env = {**os.environ, "SPECULANT_TEST_KILL_RANK": "1", "SPECULANT_TEST_MARK": mark}
    start = time.monotonic()
    proc = torchrun(2, ["generate", *flags, "--tp", "2", "--dist-timeout", "20"], env=env)
    assert time.monotonic() - start < KILL_BOUND_S
    assert proc.returncode != 0
    # torchrun's summary names the dead rank: `rank : 1 (local_rank: 1)`, `exitcode : -9`.
    err = " ".join(proc.stderr.split())
    assert "rank : 1 (local_rank: 1) exitcode : -9" in err, proc.stderr
    assert "requests=" not in proc.stderr
    assert marked_processes(mark) == []


def patch_engine_step(wrap: str, rank: str | None = None) -> str:
    """A sitecustomize.py that, as speculant.executor.engine is first imported (in rank `rank`
    alone when given), replaces Engine.step with `wrap(step)`: `wrap` is that function's source,
    defined at the file's top level."""
    only = f' or os.environ.get("RANK") != "{rank}"' if rank is not None else ""
    return f"""import importlib.abc, importlib.util, os, sys, time
{wrap}
class _PatchStep(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "speculant.executor.engine"{only}:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module
        def patched(module):
            exec_module(module)
            module.Engine.step = wrap(module.Engine.step)
        spec.loader.exec_module = patched
        return spec
sys.meta_path.insert(0, _PatchStep())
"""


SLOW_STEPS = patch_engine_step("""
def wrap(step):  # every Engine.step sleeps 1 s (and says so)
    def slow(self):
        open(os.environ["STEP_MARK"], "a").close()
        time.sleep(1.0)
        return step(self)
    return slow
""")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="checks for stray ranks in /proc")
def test_torchrun_of_the_speculant_command_runs_ranks_as_the_module_does(flags, expected, tmp_path):
    """`torchrun ... -m speculant generate` (the command itself, not the launch module) runs
    each rank as `-m speculant.launch.torchrun` does: output equal to one process, and ranks
    that end with their agent (under --tp they were left running, still writing --output, when
    it was killed; under --dp they failed with tracebacks once the agent's store was gone)."""

    def command(out: Path, *more: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "speculant", "generate", *flags, "--tp", "2",
                "--output", str(out), *more]  # fmt: skip

    proc = run(command(tmp_path / "out.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_tokens(tmp_path / "out.jsonl") == expected
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_STEPS)
    mark, stepping = uuid.uuid4().hex, tmp_path / "stepping"
    env = {**os.environ, "SPECULANT_TEST_MARK": mark, "STEP_MARK": str(stepping),
           "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH"))
                                         if p)}  # fmt: skip
    out = tmp_path / "killed.jsonl"
    long = ("--max-new-tokens", "100")  # 100 steps of a second: far from done when killed
    agent = subprocess.Popen(command(out, *long), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not stepping.exists():  # the ranks run their first step (a second each)
            assert time.monotonic() < deadline and agent.poll() is None
            time.sleep(0.2)
        assert len([p for p in marked_processes(mark) if p != agent.pid]) == 2  # both ranks
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
        deadline = time.monotonic() + 8
        while marked_processes(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marked_processes(mark) == [], "ranks outlived their torchrun agent"
    finally:
        for pid in marked_processes(mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def accept_args(llama_dir, eagle_dir, tmp_path_factory) -> list[str]:
    # accept-rate refuses per-line settings: its prompts are prompts_file's without them
    rows = [{"prompt": "def f(x):"}, {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]},
            {"prompt": "import"}, {"prompt_token_ids": [40, 41]}]  # fmt: skip
    prompts = tmp_path_factory.mktemp("accept_prompts") / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return ["accept-rate", "--device", "cpu", "--target", str(llama_dir), "--draft",
            str(eagle_dir), "--prompts", str(prompts), "--num-draft-tokens", "2",
            "--max-new-tokens", "8", "--dist-timeout", "60"]  # fmt: skip


@pytest.fixture(scope="module")
def accept_expected(accept_args, tmp_path_factory) -> dict:
    """The single-process accept-rate report."""
    report = tmp_path_factory.mktemp("accept") / "single.json"
    assert cli.main([*accept_args, "--report", str(report)]) == 0
    return json.loads(report.read_text())


def assert_same_report(report: Path, expected: dict) -> None:
    got = json.loads(report.read_text())
    for key in ("acceptance_length", "per_position_acceptance", "lossless", "num_verify_steps"):
        assert got[key] == expected[key], key
    assert got["num_prompts"] == 4


def test_torchrun_accept_rate_equals_one_process(accept_args, accept_expected, tmp_path):
    """accept-rate under torchrun: rank 0 reports what one process reports."""
    report = tmp_path / "dp2.json"
    proc = torchrun(2, [*accept_args, "--dp", "2", "--report", str(report)])
    assert proc.returncode == 0, proc.stderr
    assert_same_report(report, accept_expected)


# ------------------------------------------------------------- torchrun over two "nodes"

NODE_BOUND_S = 60  # a two-node torchrun job (or its failure) ends within this


class TwoNodes:
    """Two torchrun agents on this host forming one job of `--nnodes 2` over a c10d rendezvous
    at 127.0.0.1:PORT, as two machines would: node 0 hosts the rendezvous store (is_host=1) and,
    started first (lower pid), joins as group rank 0. Each agent runs in its own session, its
    stderr in a file; both are killed at the end."""

    def __init__(
        self, tmp_path: Path, nproc: int, args: list[str], env: dict | None = None,
        node_args: tuple[list[str], list[str]] = ([], []),
    ):  # fmt: skip
        port, run_id = free_port(), uuid.uuid4().hex[:8]
        self.mark = uuid.uuid4().hex
        env = {**os.environ, "SPECULANT_TEST_MARK": self.mark, **(env or {})}
        self.agents, self.logs = [], []
        for node in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   f"127.0.0.1:{port}", "--rdzv-id", run_id, "--rdzv-conf",
                   f"is_host={int(node == 0)}", "-m", "speculant.launch.torchrun",
                   *args, *node_args[node]]  # fmt: skip
            self.logs.append(tmp_path / f"node{node}.err")
            with open(self.logs[-1], "w") as err:
                agent = subprocess.Popen(
                    cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
                )
            self.agents.append(agent)
            time.sleep(0.5 if node == 0 else 0)  # node 0 binds the store first

    def wait(self, timeout: float = NODE_BOUND_S) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [agent.wait(max(1.0, deadline - time.monotonic())) for agent in self.agents]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the two-node job did not end within {timeout} s: {self.stderr(0)}")

    def stderr(self, node: int) -> str:
        return self.logs[node].read_text()

    def close(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)
        for pid in marked_processes(self.mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def two_nodes(tmp_path):
    started = []

    def start(nproc: int, args: list[str], env: dict | None = None, node_args=([], [])):
        started.append(TwoNodes(tmp_path, nproc, args, env, node_args))
        return started[-1]

    yield start
    for job in started:
        job.close()


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "nproc,tp,dp,warned",
    [(1, 2, 1, True), (2, 2, 2, False)],
    ids=["tp2-spans-the-nodes", "dp2-across-the-nodes-tp2-within"],
)
def test_torchrun_two_nodes_equal_one_process(
    two_nodes, flags, expected, tmp_path, nproc, tp, dp, warned
):
    """--nnodes 2 with a c10d rendezvous: a TP group spanning the nodes (rank 0 warns), or DP
    across them with each TP group on one node (no warning); the outputs equal one process."""
    out = tmp_path / "out.jsonl"
    job = two_nodes(nproc, ["generate", *flags, "--tp", str(tp), "--dp", str(dp),
                            "--output", str(out)])  # fmt: skip
    codes = job.wait()
    err = job.stderr(0) + job.stderr(1)
    assert codes == [0, 0], err
    assert read_tokens(out) == expected
    assert ("some TP groups span nodes" in err) == warned, err
    assert len([line for line in err.splitlines() if line.startswith("requests=4 ")]) == 1


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "node0,node1,line",
    [
        (["--tp", "2"], ["--dp", "2"], "--tp is 1 on rank 1 but 2 on rank 0"),
        (["--tp", "2", "--seed", "1"], ["--tp", "2", "--seed", "2"], "--seed is 2 on rank 1"),
    ],
    ids=["tp-vs-dp", "seed"],
)
def test_torchrun_nodes_started_with_other_flags_fail_naming_the_flag(
    two_nodes, flags, tmp_path, node0, node1, line
):
    """Nodes started with other flags (the same world size): another --tp/--dp split made other
    groups and hung until --dist-timeout; another --seed made the TP ranks sample other tokens
    and abort in a collective. Every rank compares its flags with rank 0's on joining."""
    out = tmp_path / "out.jsonl"
    args = ["generate", *flags, "--output", str(out), "--temperature", "1"]
    job = two_nodes(1, args, node_args=(node0, node1))
    start = time.monotonic()
    codes = job.wait(45)
    err = job.stderr(0) + job.stderr(1)
    assert codes == [1, 1] and time.monotonic() - start < 45, err
    assert f"speculant: error: {line}" in job.stderr(0), err
    assert "start every rank of the job with the same flags" in job.stderr(1), err
    assert not out.exists()


@pytest.mark.timeout(150)
def test_torchrun_node_killed_fails_the_job_naming_it(two_nodes, llama_dir, tmp_path):
    """SIGKILL to node 1's agent mid-run: its rank ends by itself (its parent died), rank 0's
    collective fails and its line names rank 1 on node 1; node 0's agent fails the job."""
    rows = [{"prompt_token_ids": [5, 6], "max_new_tokens": 4}]
    rows += [{"prompt_token_ids": [8 + i, 9], "max_new_tokens": 480} for i in range(2)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    job = two_nodes(1, ["generate", "--device", "cpu", "--target", str(llama_dir), "--tp", "2",
                        "--prompts", str(prompts), "--output", str(out), "--ignore-eos",
                        "--max-num-seqs", "1", "--dist-timeout", "30"])  # fmt: skip
    deadline = time.monotonic() + NODE_BOUND_S
    while not written(out).endswith("\n"):
        assert time.monotonic() < deadline, job.stderr(0) + job.stderr(1)
        time.sleep(0.1)
    start = time.monotonic()
    os.kill(job.agents[1].pid, signal.SIGKILL)
    code = job.agents[0].wait(NODE_BOUND_S)
    assert time.monotonic() - start < NODE_BOUND_S
    err = job.stderr(0)
    assert code != 0, err
    assert "speculant: error: rank 0: rank 1 (torchrun node 1) stopped answering" in err, err
    deadline = time.monotonic() + 20
    while marked_processes(job.mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marked_processes(job.mark) == [], "a rank outlived its node's agent"
    assert json.loads(out.read_text().splitlines()[0])["index"] == 0


# --------------------------------------------------------------------------------------- Ray


def test_ray_ranks_are_numbered_node_by_node(monkeypatch):
    """PACK may interleave bundles over nodes: ranks go node by node, so TP groups (consecutive
    ranks) share a node; each GPU actor sees its node's job GPUs in rank order, LOCAL_RANK
    indexing its own; MASTER_ADDR is rank 0's node."""
    from speculant.launch.ray import _Place, rank_envs, rank_order

    monkeypatch.delenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("SPECULANT_TEST_KILL_RANK", "9")  # SPECULANT_* reach the actors
    places = [_Place("10.0.0.1", "a", ["3"]), _Place("10.0.0.2", "b", ["0"]),
              _Place("10.0.0.1", "a", ["5"]), _Place("10.0.0.2", "b", ["1"])]  # fmt: skip
    order = rank_order(places)
    assert order == [0, 2, 1, 3]
    envs = rank_envs(places, order, 29555, "cuda")
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,5", "3,5", "0,1", "0,1"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"]) for e in envs} == {
        ("10.0.0.1", "29555", "4")
    }
    assert all(e["SPECULANT_TEST_KILL_RANK"] == "9" for e in envs)
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
    envs = rank_envs(places, order, 29555, "cuda")
    assert [e["LOCAL_RANK"] for e in envs] == ["3", "5", "0", "1"]
    assert not any("CUDA_VISIBLE_DEVICES" in e for e in envs)
    cpu = rank_envs(places, order, 29555, "cpu")
    assert [e["LOCAL_RANK"] for e in cpu] == ["0", "1", "0", "1"]
    assert not any("CUDA_VISIBLE_DEVICES" in e for e in cpu)


def ray_command() -> str:
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.is_file() else shutil.which("ray") or "ray"


def driver_after_two_short_outputs(llama_dir: Path, tmp_path: Path, out: Path):
    """The Ray driver (`--dp 2`, each DP rank a 4-token then a 480-token request) started in a
    thread, returned once both short outputs are in `out`: (the thread, its {"code": status}
    when it ends)."""
    import threading

    from speculant.launch.ray import main

    rows = [{"prompt_token_ids": [5 + i, 6], "max_new_tokens": 4} for i in range(2)]
    rows += [{"prompt_token_ids": [8 + i, 9], "max_new_tokens": 480} for i in range(2)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["generate", "--device", "cpu", "--target", str(llama_dir), "--dp", "2",
            "--prompts", str(prompts), "--output", str(out), "--ignore-eos",
            "--max-num-seqs", "2", "--dist-timeout", "20"]  # fmt: skip
    result: dict = {}
    driver = threading.Thread(target=lambda: result.update(code=main(args)), daemon=True)
    driver.start()
    deadline = time.monotonic() + KILL_BOUND_S
    while not written(out).count("\n") >= 2:
        assert driver.is_alive() and time.monotonic() < deadline, "short outputs not streamed"
        time.sleep(0.05)
    return driver, result


@pytest.mark.needs("ray")
class TestRayDriver:
    """The driver in this process, on a local cluster of 4 logical CPUs started here (torn down
    before the `ray job submit` test starts its own head)."""

    @pytest.fixture(scope="class")
    @classmethod
    def ray(cls):
        ray = pytest.importorskip("ray")
        saved = os.environ.get("RAY_AUTH_MODE")
        os.environ["RAY_AUTH_MODE"] = "disabled"  # a private local cluster; writes no token
        ray.init(
            address="local",  # a new cluster, even where another one runs on this machine
            num_cpus=4,
            include_dashboard=False,
            object_store_memory=RAY_OBJECT_STORE,
            configure_logging=False,
        )
        try:
            yield ray
        finally:
            ray.shutdown()
            if saved is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = saved

    @staticmethod
    def assert_nothing_left(ray) -> None:
        """Every bundle back (no actor holds one, the placement group is gone) and no actor
        process alive, within a few seconds."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            free = ray.available_resources().get("CPU", 0) == 4
            pgs = [p for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"]
            if free and not pgs and not actor_processes():
                return
            time.sleep(0.2)
        raise AssertionError(f"left running: {ray.available_resources()}, {actor_processes()}")

    @pytest.mark.parametrize("tp,dp", [(2, 1), (2, 2)])
    def test_ray_driver_equals_one_process(
        self, ray, flags, expected, tmp_path, capsys, caplog, tp, dp
    ):
        from speculant.launch.ray import main

        caplog.set_level(logging.INFO, logger="speculant")
        out = tmp_path / "out.jsonl"
        assert main(["generate", *flags, "--tp", str(tp), "--dp", str(dp),
                     "--output", str(out)]) == 0  # fmt: skip
        assert read_tokens(out) == expected
        assert f"{tp * dp} rank(s) on 1 node(s) (STRICT_PACK)" in caplog.text
        assert "requests=4 " in capsys.readouterr().err
        self.assert_nothing_left(ray)

    def test_ray_driver_accept_rate(self, ray, accept_args, accept_expected, tmp_path):
        from speculant.launch.ray import main

        report = tmp_path / "dp2.json"
        assert main([*accept_args, "--dp", "2", "--report", str(report)]) == 0
        assert_same_report(report, accept_expected)
        self.assert_nothing_left(ray)

    def test_ray_driver_fails_when_a_rank_dies(self, ray, flags, capsys, monkeypatch):
        from speculant.launch.ray import main

        monkeypatch.setenv("SPECULANT_TEST_KILL_RANK", "1")  # forwarded to the actors
        start = time.monotonic()
        code = main(["generate", *flags, "--tp", "2", "--dp", "2", "--dist-timeout", "20"])
        assert time.monotonic() - start < KILL_BOUND_S
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert code == 1, err
        assert last.startswith("speculant: error: rank 1 died: its Ray actor's process"), err
        assert "requests=" not in err
        self.assert_nothing_left(ray)

    def test_ray_driver_keeps_finished_outputs_when_a_rank_dies(
        self, ray, llama_dir, tmp_path, capsys
    ):
        """--dp 2, each DP rank a short then a long request: once both short ones are in the
        file, an actor is killed; the driver fails naming a rank and the file keeps them."""
        out = tmp_path / "out.jsonl"
        driver, result = driver_after_two_short_outputs(llama_dir, tmp_path, out)
        os.kill(actor_processes()[-1], signal.SIGKILL)
        driver.join(timeout=KILL_BOUND_S)
        assert not driver.is_alive()
        err = capsys.readouterr().err
        assert result["code"] == 1, err
        assert "died" in err.strip().splitlines()[-1], err
        kept = [json.loads(line) for line in out.read_text().splitlines()]
        assert sorted(line["index"] for line in kept[:2]) == [0, 1]
        assert all(len(line["token_ids"]) == 4 for line in kept[:2])
        self.assert_nothing_left(ray)

    def test_ray_driver_names_a_lost_output_queue(self, ray, llama_dir, tmp_path, capsys):
        """The queue actor that carries rank 0's outputs to the driver is killed mid-run (Ray's
        out-of-memory killer did so): one line naming it and what was kept (was: a traceback),
        exit 1, the outputs that arrived before it in the file, nothing left running."""
        out = tmp_path / "out.jsonl"
        driver, result = driver_after_two_short_outputs(llama_dir, tmp_path, out)
        queues = actor_processes(title=b"ray::_QueueActor")
        assert len(queues) == 1, queues
        os.kill(queues[0], signal.SIGKILL)
        driver.join(timeout=KILL_BOUND_S)
        assert not driver.is_alive()
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert result["code"] == 1, err
        assert last.startswith("speculant: error: the Ray actor that carries rank 0's finished "
                               "outputs to this driver died (")  # fmt: skip
        assert f"the 2 finished before it are in {out}" in last, last
        assert "Traceback" not in err, err
        kept = [json.loads(line) for line in out.read_text().splitlines()]
        assert sorted(line["index"] for line in kept) == [0, 1]
        self.assert_nothing_left(ray)

    def test_ray_driver_refuses_a_placement_the_cluster_cannot_hold(self, ray, flags, capsys):
        """--tp 4 --dp 2 on the 4-CPU cluster: 8 bundles can never be placed; one line at once
        (not after --dist-timeout) naming what the cluster has and how to give it more."""
        from speculant.launch.ray import main

        start = time.monotonic()
        assert main(["generate", *flags, "--tp", "4", "--dp", "2", "--dist-timeout", "120"]) == 2
        assert time.monotonic() - start < 15
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("speculant: error: Ray cannot place 8 bundles of {'CPU': 1}"), last
        assert "the cluster has 4 CPUs in all" in last and "--num-cpus N" in last, last
        self.assert_nothing_left(ray)

    def test_ray_driver_refuses_an_output_another_run_writes(self, ray, flags, tmp_path, capsys):
        """The driver writes --output: it takes the file's lock before any actor starts, so a
        second run on the same file is refused with one line."""
        import fcntl

        from speculant.launch.ray import main

        out = tmp_path / "out.jsonl"
        out.write_text("")
        with open(out, "a") as first_run:
            fcntl.flock(first_run, fcntl.LOCK_EX | fcntl.LOCK_NB)
            assert main(["generate", *flags, "--tp", "2", "--output", str(out)]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert "is being written by another run" in last, last
        self.assert_nothing_left(ray)

    def test_ray_driver_prints_completions_as_one_process_does(self, ray, flags, capsys):
        """Without --output the driver prints `[index] prompt+completion` in input order, as
        one process does (text prompts shown), also with 4 prompts over 3 DP ranks."""
        from speculant.launch.ray import main

        assert cli.main(["generate", *flags]) == 0
        alone = capsys.readouterr().out
        assert main(["generate", *flags, "--dp", "3"]) == 0
        assert capsys.readouterr().out == alone
        self.assert_nothing_left(ray)

    def test_ray_driver_ignores_a_rank_in_its_environment(
        self, ray, flags, expected, tmp_path, monkeypatch
    ):
        """A RANK left in the driver's environment (a launcher's, a PyTorchJob pod's) does not
        make the driver read no prompts: the driver is no rank."""
        from speculant.launch.ray import main

        monkeypatch.setenv("RANK", "1")
        out = tmp_path / "out.jsonl"
        assert main(["generate", *flags, "--tp", "2", "--output", str(out)]) == 0
        assert read_tokens(out) == expected
        self.assert_nothing_left(ray)

    @pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
    def test_ray_driver_names_output_when_writing_fails(self, ray, flags, capsys):
        """--output /dev/full: one line naming --output and the path, exit 2, and every actor
        and the placement group are gone all the same."""
        from speculant.launch.ray import main

        assert main(["generate", *flags, "--tp", "2", "--output", "/dev/full"]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("speculant: error: --output '/dev/full': writing failed"), last
        self.assert_nothing_left(ray)

    def test_ray_driver_user_error_is_one_line(self, ray, flags, tmp_path, capsys):
        """A prompt too long for the context fails on every rank: status 2, one line."""
        from speculant.launch.ray import main

        long_prompt = tmp_path / "long.jsonl"
        long_prompt.write_text(json.dumps({"prompt_token_ids": [5] * 400}) + "\n")
        args = [*flags, "--tp", "2", "--prompts", str(long_prompt)]
        assert main(["generate", *args]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("speculant: error: ") and "rank" not in last, last
        assert f"{long_prompt}:1: the prompt has 400 tokens" in last, last  # whichever rank
        self.assert_nothing_left(ray)


@pytest.mark.parametrize("output", [True, False], ids=["output", "printed"])
def test_ray_driver_keeps_the_batch_a_stop_interrupts_its_drain(tmp_path, output):
    """A Ctrl-C reaching the driver while it took a batch of outputs off rank 0's queue (the
    queue's actor had given them up, the file not yet written) lost the whole batch (seen: 68 of
    163 finished requests missing after a random Ctrl-C under --dp 2): the stop now waits until
    the batch is written (or kept for printing), then raises."""
    from speculant.launch.ray import _Finished

    class Queue:  # what the driver sees of the Ray queue
        def __init__(self, items: list):
            self.items = items

        def qsize(self) -> int:
            return len(self.items)

        def get_nowait_batch(self, size: int) -> list:
            batch, self.items = self.items[:size], self.items[size:]
            signal.raise_signal(signal.SIGINT)  # Ctrl-C once the queue gave them up
            return batch

    class Output:
        def __init__(self, index: int):
            self.index, self.key = index, (index, 0)

        def json_line(self) -> str:
            return json.dumps({"index": self.index}) + "\n"

    out = tmp_path / "out.jsonl"
    finished = _Finished.__new__(_Finished)  # no Ray: its queue is the one above
    finished.path = str(out) if output else None
    finished.file, finished.kept, finished.written = None, [], 0
    finished.queue = Queue([Output(i) for i in range(3)])
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            finished.drain()
    finally:
        signal.signal(signal.SIGINT, handler)
        if finished.file is not None:
            finished.file.close()
    if output:
        lines = [json.loads(line)["index"] for line in out.read_text().splitlines()]
        assert lines == [0, 1, 2] and finished.written == 3
    else:
        assert [o.index for o in finished.kept] == [0, 1, 2]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


@pytest.mark.needs("ray")
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="checks for stray actors in /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killing_the_ray_driver_stops_every_actor(llama_dir, tmp_path, sig):
    """`python -m speculant.launch.ray generate --tp 2` (its own local cluster), its stderr a
    file: once the short requests are written, SIGTERM (`ray job stop`, a scheduler) stops it as
    Ctrl-C does (exit 143, a line saying so, the last), and SIGKILL takes its actors with it;
    the finished outputs stay in the file and no Ray colour code is in the log."""
    rows = [{"prompt_token_ids": [5 + i, 6], "max_new_tokens": 4} for i in range(2)]
    rows += [{"prompt_token_ids": [8 + i, 9], "max_new_tokens": 480} for i in range(2)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, log = tmp_path / "out.jsonl", tmp_path / "driver.err"
    cmd = [sys.executable, "-m", "speculant.launch.ray", "generate", "--device", "cpu",
           "--target", str(llama_dir), "--tp", "2", "--prompts", str(prompts), "--output",
           str(out), "--ignore-eos", "--max-num-seqs", "2", "--dist-timeout", "60"]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # a private local cluster
    env.pop("RAY_ADDRESS", None)
    with open(log, "w") as err:
        driver = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
    actors: list[int] = []
    try:
        deadline = time.monotonic() + 120  # Ray's start-up included
        while not written(out).count("\n") >= 2:
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        actors = actor_processes(driver.pid)
        assert len(actors) == 2, actors
        os.kill(driver.pid, sig)
        code = driver.wait(KILL_BOUND_S)
        err = log.read_text()
        if sig == signal.SIGTERM:
            assert code == 143, err
            assert err.strip().splitlines()[-1] == (
                "speculant: terminated (SIGTERM): every rank stopped; the requests that "
                f"finished are in {out}"
            ), err
        else:
            assert code == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in actors) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in actors), "an actor outlived its driver"
        kept = [json.loads(line) for line in out.read_text().splitlines()]
        assert sorted(line["index"] for line in kept[:2]) == [0, 1]
        assert "(RankWorker pid=" in err and "\x1b[" not in err, err
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(10)
        for pid in actors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def reaped(driver: subprocess.Popen):
    """On the way out the driver's process group is killed and the driver reaped (a test that
    failed midway leaves nothing running)."""
    try:
        yield driver
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(10)


def ray_driver(args: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
    """`python -m speculant.launch.ray ARGS` on its own local cluster, in its own session."""
    base = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # a private local cluster
    base.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "speculant.launch.ray", *args]
    return subprocess.Popen(cmd, env={**base, **(env or {})}, start_new_session=True, **kwargs)


@pytest.mark.needs("ray")
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the actors in /proc")
# SIGTERM (`ray job stop`) takes the SIGINT path (Terminated, a BaseException): not repeated here
@pytest.mark.parametrize("stop", ["SIGINT", "actor-killed"])
def test_ray_driver_prints_finished_completions_when_stopped(llama_dir, tmp_path, stop):
    """Without --output (--dp 2, two short requests, then many long ones): Ctrl-C, SIGTERM or a
    rank's actor killed once the short ones have finished; the driver prints their completions
    (as one process does) before its last line: exit 130, 143 or 1."""
    rows = [{"prompt_token_ids": [5 + i, 6], "max_new_tokens": 4} for i in range(2)]
    # ~40 s of long ones when nothing stops them: the ranks' "engine ready" reaches the driver's
    # stderr through Ray's log forwarding, seconds late on a loaded machine (with 24, a job slowed
    # to 23 s had ended before the signal came)
    rows += [{"prompt_token_ids": [8 + i % 90, 9], "max_new_tokens": 480} for i in range(96)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, log = tmp_path / "driver.out", tmp_path / "driver.err"
    args = ["generate", "--device", "cpu", "--target", str(llama_dir), "--dp", "2",
            "--prompts", str(prompts), "--ignore-eos", "--max-num-seqs", "2",
            "--dist-timeout", "30"]  # fmt: skip
    with open(out, "w") as stdout, open(log, "w") as stderr:
        driver = ray_driver(args, stdout=stdout, stderr=stderr)
    with reaped(driver):
        deadline = time.monotonic() + 120  # Ray's start-up included
        while "engine ready" not in log.read_text():
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        time.sleep(3)  # the short requests finish in a few steps; the long ones take ~10 s
        if stop == "actor-killed":
            os.kill(actor_processes(driver.pid)[-1], signal.SIGKILL)
        else:
            os.kill(driver.pid, getattr(signal, stop))
        code = driver.wait(KILL_BOUND_S)
    err = log.read_text().strip().splitlines()
    assert code == {"SIGINT": 130, "SIGTERM": 143, "actor-killed": 1}[stop], err[-5:]
    assert err[-1].startswith(("speculant: interrupted", "speculant: terminated",
                               "speculant: error: rank")), err[-5:]  # fmt: skip
    shown = [line.split()[0] for line in out.read_text().splitlines() if line.startswith("[")]
    assert shown[:2] == ["[0]", "[1]"], out.read_text()


PAUSED_RANK = patch_engine_step("""
def wrap(step):  # rank 1's first step that finishes requests writes their indices, sleeps 3 s
    def paused(self):
        done = step(self)
        if done and not os.path.exists(os.environ["PAUSE_MARK"]):
            with open(os.environ["PAUSE_MARK"], "w") as mark:
                mark.write(" ".join(str(r.prompt_index) for r in done))
            time.sleep(3.0)
        return done
    return paused
""", rank="1")


@pytest.mark.needs("ray")
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the actors in /proc")
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_ray_driver_stopped_keeps_what_a_rank_finished_before_its_gather(llama_dir, tmp_path, stop):
    """--dp 2, each DP rank a 4-token then a 480-token request: DP rank 1 finishes its short
    one and pauses 3 s before that step's gather to rank 0, and the driver gets Ctrl-C (SIGTERM)
    in the pause. It killed the actors at once, losing that request (and rank 0's of the same
    step, gathered with it): now it asks the ranks to stop, they stop at the step boundary after
    rank 0 queued the step's outputs, and both short requests are in --output; exit 130 (143),
    the stopped line last, no actor left."""
    rows = [{"prompt_token_ids": [5 + i, 6], "max_new_tokens": 4} for i in range(2)]
    rows += [{"prompt_token_ids": [8 + i, 9], "max_new_tokens": 480} for i in range(2)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    site, mark = tmp_path / "site", tmp_path / "paused"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PAUSED_RANK)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    out, log = tmp_path / "out.jsonl", tmp_path / "driver.err"
    args = ["generate", "--device", "cpu", "--target", str(llama_dir), "--dp", "2",
            "--prompts", str(prompts), "--output", str(out), "--ignore-eos",
            "--max-num-seqs", "2", "--dist-timeout", "30"]  # fmt: skip
    with open(log, "w") as stderr:
        driver = ray_driver(args, {"PYTHONPATH": path, "PAUSE_MARK": str(mark)},
                            stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
    actors: list[int] = []
    with reaped(driver):
        deadline = time.monotonic() + 120  # Ray's start-up included
        while not mark.exists():
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        actors = actor_processes(driver.pid)
        os.kill(driver.pid, getattr(signal, stop))
        code = driver.wait(KILL_BOUND_S)
    err = log.read_text().strip().splitlines()
    how = {"SIGINT": "interrupted", "SIGTERM": "terminated (SIGTERM)"}[stop]
    assert code == {"SIGINT": 130, "SIGTERM": 143}[stop], err[-5:]
    assert err[-1] == (f"speculant: {how}: every rank stopped; the requests that finished are "
                       f"in {out}"), err[-5:]  # fmt: skip
    paused = {int(i) for i in mark.read_text().split()}
    kept = [json.loads(line) for line in written(out).splitlines()]
    assert paused and paused <= {line["index"] for line in kept}, (paused, kept)
    assert sorted(line["index"] for line in kept) == [0, 1], kept  # the step's short ones, once
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in actors) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert actors and not any(alive(pid) for pid in actors), "an actor outlived its driver"


NOISY_WORKERS = """import sys, threading, time
if sys.argv and "default_worker" in sys.argv[0]:  # a Ray worker (an actor's process)
    def noise():
        while True:
            time.sleep(0.3)
            print("NOISE on a Ray worker's stdout", flush=True)
    threading.Thread(target=noise, daemon=True).start()
"""


@pytest.mark.needs("ray")
@pytest.mark.timeout(180)
def test_ray_driver_stdout_holds_only_the_completions_on_a_one_core_local_cluster(flags, tmp_path):
    """What an actor prints on its stdout (a library's print, NCCL_DEBUG lines) reaches the
    driver through Ray's log streaming: it goes to the driver's stderr, and stdout (completions
    without --output, piped on by the user) holds the completions alone (was: mixed in). The
    machine here has fewer cores than ranks (1): the driver's own cluster still takes --tp 2 CPU
    ranks without --device, as `speculant generate --tp 2` does (it counts at least one CPU a
    rank)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NOISY_WORKERS)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    one_core = (
        "import multiprocessing, os, sys; multiprocessing.cpu_count = os.cpu_count = lambda: 1; "
        "from speculant.launch.ray import main; sys.exit(main(sys.argv[1:]))"
    )
    args = ["generate", *[f for f in flags if f not in ("--device", "cpu")], "--tp", "2"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "CUDA_VISIBLE_DEVICES": "",
           "RAY_USE_MULTIPROCESSING_CPU_COUNT": "1", "PYTHONPATH": path}  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    driver = subprocess.Popen([sys.executable, "-c", one_core, *args], env=env,
                              start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    with reaped(driver):
        out, err = driver.communicate(timeout=150)
    assert driver.returncode == 0, err[-2000:]
    assert "NOISE" in err, err[-2000:]  # the workers did print
    assert "NOISE" not in out and "RankWorker" not in out, out
    shown = sorted(line.split()[0] for line in out.splitlines() if line.startswith("["))
    assert shown == ["[0]", "[1]", "[2]", "[3]"], out


@pytest.mark.needs("ray")
@pytest.mark.parametrize("how", ["flag", "RAY_ADDRESS"])
def test_ray_driver_refuses_an_address_nothing_answers_at(flags, how):
    """A cluster address nothing listens at (a typo, a head that is gone): one line naming it,
    exit 2, within seconds (ray.init would retry it for many minutes)."""
    address = f"127.0.0.1:{free_port()}"
    args = ["generate", *flags, "--tp", "2"]
    if how == "flag":
        driver = ray_driver(["--ray-address", address, *args], stderr=subprocess.PIPE, text=True)
    else:
        driver = ray_driver(args, {"RAY_ADDRESS": address}, stderr=subprocess.PIPE, text=True)
    with reaped(driver):
        _, err = driver.communicate(timeout=60)
    assert driver.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculant: error: "), err
    assert address in lines[0] and "ray start --head" in lines[0], lines[0]


@pytest.mark.needs("ray")
def test_ray_driver_bad_outer_flag_is_one_line(capsys):
    """`--ray-address` without a value: one `speculant: error:` line, exit 2, as any bad flag."""
    from speculant.launch.ray import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--ray-address"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("speculant: error: argument --ray-address"), lines


def actor_processes(root: int | None = None, title: bytes = b"ray::RankWorker") -> list[int]:
    """Live launcher actor processes (process title `ray::RankWorker...`, or `title`)
    descending from `root` (default: this process, whose local cluster runs them): other Ray
    clusters on the machine do not count."""
    root = os.getpid() if root is None else root
    parents, actors = {}, []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
                if (entry / "cmdline").read_bytes().startswith(title):
                    actors.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == root:
                return True
        return False

    return [pid for pid in actors if descends(pid)]


@pytest.mark.needs("ray")
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="checks for stray actors in /proc")
def test_ray_job_submit(flags, expected, prompts_file, tmp_path):
    """`ray job submit --working-dir . -- python -m speculant.launch.ray generate ...` against a
    head started here with token auth (RAY_AUTH_MODE=token and one RAY_AUTH_TOKEN for the
    head, the submitter and so the job): the outputs equal one process; then a job whose rank 1
    dies fails, and its log names the rank."""
    pytest.importorskip("ray")
    if importlib_missing("aiohttp"):
        pytest.skip("`ray job submit` needs the dashboard: pip install 'ray[default]'")
    workdir = tmp_path / "job"
    workdir.mkdir()
    shutil.copy(prompts_file, workdir / "prompts.jsonl")
    out = tmp_path / "out.jsonl"
    port, dashboard = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    # every port the head's agents listen on is a free one: their defaults (the dashboard
    # agent's 52365, the client server's 10001) are taken by a cluster another test worker runs
    # at the same time, and a job agent that cannot bind never comes up ("No available agent")
    agent_ports = [(flag, str(free_port())) for flag in (
        "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
        "--metrics-export-port", "--ray-client-server-port")]  # fmt: skip
    head = [ray_command(), "start", "--head", "--block", "--port", str(port), "--dashboard-port",
            str(dashboard), "--num-cpus", "4", "--object-store-memory", str(RAY_OBJECT_STORE),
            "--disable-usage-stats", *(x for pair in agent_ports for x in pair)]  # fmt: skip
    submit = [ray_command(), "job", "submit", "--address", f"http://127.0.0.1:{dashboard}",
              "--working-dir", str(workdir), "--"]  # fmt: skip
    driver = [sys.executable, "-m", "speculant.launch.ray", "generate"]
    job_flags = [*flags[: flags.index("--prompts")], "--prompts", "prompts.jsonl",
                 *flags[flags.index("--prompts") + 2 :]]  # fmt: skip
    # two ranks a job (each loads torch and the model; --tp 2 x --dp 2 through the driver:
    # TestRayDriver): the job of --dp 2 gathers every rank's outputs, the killed one is --tp 2
    with ray_head(head, env) as head_process:
        ok = submit_job([*submit, *driver, *job_flags, "--dp", "2", "--output", str(out)], env)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "2 rank(s) on 1 node(s) (STRICT_PACK)" in ok.stdout + ok.stderr
        assert read_tokens(out) == expected

        start = time.monotonic()
        killed = [*submit, "env", "SPECULANT_TEST_KILL_RANK=1", *driver, *job_flags]
        failed = submit_job([*killed, "--tp", "2", "--dist-timeout", "20"], env)
        assert time.monotonic() - start < KILL_BOUND_S + 30  # with the job's own start-up
        log = failed.stdout + failed.stderr
        assert failed.returncode != 0, log
        assert "speculant: error: rank 1 died" in log, log
        assert re.search(r"Job '\w+' failed", log), log
        deadline = time.monotonic() + 20
        while actor_processes(head_process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert actor_processes(head_process.pid) == []


def submit_job(cmd: list[str], env: dict, within_s: float = 90):
    """`ray job submit ...`, tried again while the head's job agent is not yet up (the
    dashboard answers "No available agent to submit job, please try again later" for a while
    after `ray start --head` prints that it is up, longer on a loaded machine; no job ran)."""
    deadline = time.monotonic() + within_s
    while True:
        done = run(cmd, env=env)
        if "No available agent to submit job" not in done.stdout + done.stderr:
            return done
        assert time.monotonic() < deadline, done.stdout + done.stderr
        time.sleep(1)


@contextlib.contextmanager
def ray_head(cmd: list[str], env: dict):
    """A head node for the test: `ray start --head --block` in its own session, up within 120 s,
    stopped after by SIGINT (which takes down this head's processes only, where `ray stop`
    would stop every Ray cluster on the machine), `ray stop --force` if that fails."""
    head = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(head.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("block forever" in line for line in lines):
            assert head.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        yield head
    finally:
        head.send_signal(signal.SIGINT)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            run([ray_command(), "stop", "--force"], env=env, timeout=120)
        reader.join(timeout=10)


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["accept-rate", "-h"]])
def test_ray_driver_help_shows_ray_address(capsys, monkeypatch, argv):
    """`python -m speculant.launch.ray --help` (and each command's) is the Ray launcher's: its
    usage and --ray-address, with the command's flags. No Ray needed: --help exits before
    Ray is imported (launch/ray.py imports it only to run a job)."""
    from speculant.launch import ray as ray_launcher

    monkeypatch.setattr(ray_launcher, "_import_ray", lambda: pytest.fail("Ray was imported"))
    with pytest.raises(SystemExit) as exit_info:
        ray_launcher.main(argv)
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # unwrap
    assert out.startswith("usage: python -m speculant.launch.ray "), out[:200]
    assert "--ray-address ADDR the Ray cluster to join" in out and "RAY_ADDRESS" in out, out
    if argv[0] != "--help":
        assert "--tp TP" in out and "--dist-timeout S" in out


@pytest.mark.needs("ray")
@pytest.mark.parametrize(
    "raised, code, line",
    [(SystemExit(15), 143, "speculant: terminated (SIGTERM)"),
     (KeyboardInterrupt(), 130, "speculant: interrupted")],
    ids=["SIGTERM", "Ctrl-C"],
)  # fmt: skip
def test_a_stop_while_ray_init_runs_stops_what_it_started(
    monkeypatch, flags, capsys, raised, code, line
):
    """SIGTERM or Ctrl-C while ray.init starts the driver's local cluster: Ray's SIGTERM
    handler raises SystemExit(15) part way, Ctrl-C KeyboardInterrupt (stands in here: `_connect`
    starts a process, as ray.init starts the raylet and its agents, then raises). The driver
    kills what was started, shuts Ray down and ends as on any stop: one line, exit 143 / 130
    (was: exit 15 with no line, and for both the raylet's agents left running)."""
    pytest.importorskip("ray")
    from speculant.launch import ray as launcher

    started: list[subprocess.Popen] = []
    shut: list[bool] = []

    class NotStarted:
        @staticmethod
        def is_initialized() -> bool:
            return False

        @staticmethod
        def shutdown() -> None:
            shut.append(True)

    def interrupted_init(ray, address, world):
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        raise raised

    monkeypatch.setattr(launcher, "_import_ray", lambda: NotStarted)
    monkeypatch.setattr(launcher, "_connect", interrupted_init)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        got = launcher.main(["generate", *flags, "--dp", "2"], stop_on_sigterm=True)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert got == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(line), lines
    assert shut == [True]
    assert started[0].wait(10) == -signal.SIGKILL  # killed, not left running
