"""A --prompts that is a stream (a pipe on /dev/stdin, a FIFO, the shell's `<(...)`) can be read
once. The spawn launcher (`--tp 2`, `--dp 2`) reads it in its checks and hands rank 0 a private
copy (an unnamed file, /dev/fd/N at the end of the ranks' command line): the completions equal
one process's (accept-rate's report too, with a --baseline from a FIFO), and a bad line is
named by the launcher, as one process names it. Under torchrun, rank 0 alone reads the inputs:
a pipe on stdin works as it is, and a `<(...)`, which torchrun does not pass on to its ranks,
is reopened through the agent's descriptor. Regular files keep the ranks' command line
unchanged.

Every subprocess has a timeout and every collective a --dist-timeout."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers_eagle import write_random_eagle3
from test_launchers import read_tokens, run

from speculant.errors import SpeculantError
from speculant.launch import cli, paths
from speculant.launch.spawn import rank_inputs

pytestmark = pytest.mark.skipif(not Path("/dev/fd").is_dir(), reason="needs /dev/fd")

TIMEOUT_S = 120  # each launcher subprocess is killed after this
ROWS = [
    {"prompt": "def f(x):"},
    {"prompt_token_ids": [5, 6, 7, 8, 9]},
    {"prompt": "import", "temperature": 0.8, "top_p": 0.9, "seed": 5},  # seeded sampling
]
TEXT = "".join(json.dumps(row) + "\n" for row in ROWS)
TEXT_PLAIN = "".join(json.dumps(row) + "\n" for row in ROWS[:2])  # no per-line settings


@pytest.fixture(scope="module")
def flags(llama_dir) -> list[str]:
    return [
        "generate", "--device", "cpu", "--target", str(llama_dir), "--max-new-tokens", "6",
        "--ignore-eos", "--max-num-seqs", "4", "--max-model-len", "64", "--page-size", "4",
        "--dist-timeout", "30",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def expected(flags, tmp_path_factory) -> dict[int, list[int]]:
    """One process, from a regular file."""
    tmp = tmp_path_factory.mktemp("piped")
    (tmp / "prompts.jsonl").write_text(TEXT)
    out = tmp / "out.jsonl"
    assert cli.main([*flags, "--prompts", str(tmp / "prompts.jsonl"), "--output", str(out)]) == 0
    tokens = read_tokens(out)
    assert sorted(tokens) == [0, 1, 2] and all(len(t) == 6 for t in tokens.values())
    return tokens


@contextlib.contextmanager
def fifo_fed(path: Path, text: str):
    """A FIFO at `path` that a thread writes `text` into once a reader opens it."""
    os.mkfifo(path)

    def feed() -> None:
        with open(path, "w") as fifo:
            fifo.write(text)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        yield str(path)
    finally:
        if writer.is_alive():  # nothing opened it: release the writer
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(5)


def speculant(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "speculant", *args], timeout=TIMEOUT_S, **kwargs)


@pytest.mark.parametrize("source", ["stdin", "fifo"])
@pytest.mark.parametrize("layout", [["--dp", "2"], ["--tp", "2"]], ids=["dp2", "tp2"])
def test_spawn_reads_a_stream_once(flags, expected, tmp_path, source, layout):
    out = tmp_path / "out.jsonl"
    args = [*flags, *layout, "--output", str(out)]
    if source == "stdin":
        proc = speculant([*args, "--prompts", "/dev/stdin"], input=TEXT)
    else:
        with fifo_fed(tmp_path / "prompts.fifo", TEXT) as fifo:
            proc = speculant([*args, "--prompts", fifo], stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert read_tokens(out) == expected


def test_spawn_reads_a_process_substitution(flags, expected, tmp_path):
    """`--prompts <(...)`: /dev/fd/63 of the launcher, which no rank has."""
    (tmp_path / "prompts.jsonl").write_text(TEXT)
    out = tmp_path / "out.jsonl"
    cmd = shlex.join([sys.executable, "-m", "speculant", *flags, "--dp", "2", "--output", str(out)])
    script = f"{cmd} --prompts <(cat {shlex.quote(str(tmp_path / 'prompts.jsonl'))})"
    proc = run(["bash", "-c", script], timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert read_tokens(out) == expected


def test_spawn_names_a_bad_piped_line(flags):
    """The launcher reads the stream in its checks: the line is named before any rank starts."""
    proc = speculant([*flags, "--dp", "2", "--prompts", "/dev/stdin"], input=TEXT + "\n{oops\n")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "speculant: error: /dev/stdin:5: not valid JSON (Expecting property name enclosed in "
        "double quotes); write one object per line"
    )


def test_spawn_accept_rate_reads_streams_once(llama_dir, tmp_path):
    """accept-rate --dp 2: the prompts on stdin and the --baseline from a FIFO, which the
    launcher reads in its checks and rank 0 reads again to report, give one process's report."""
    eagle = tmp_path / "eagle3"
    write_random_eagle3(eagle, llama_dir, draft_vocab=200, num_kv_heads=1, seed=3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(TEXT_PLAIN)
    args = ["accept-rate", "--device", "cpu", "--target", str(llama_dir), "--draft", str(eagle),
            "--num-draft-tokens", "2", "--max-new-tokens", "6", "--dist-timeout", "30"]  # fmt: skip
    single, baseline = tmp_path / "single.json", tmp_path / "baseline.json"
    assert cli.main([*args, "--prompts", str(prompts), "--report", str(single),
                     "--write-baseline", str(baseline)]) == 0  # fmt: skip
    report = tmp_path / "dp2.json"
    with fifo_fed(tmp_path / "baseline.fifo", baseline.read_text()) as fifo:
        proc = speculant([*args, "--dp", "2", "--prompts", "/dev/stdin", "--baseline", fifo,
                          "--report", str(report)], input=TEXT_PLAIN)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got, want = json.loads(report.read_text()), json.loads(single.read_text())
    for key in ("acceptance_length", "per_position_acceptance", "lossless", "num_prompts"):
        assert got[key] == want[key], key


def torchrun_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "-m", "speculant.launch.torchrun", *args]  # fmt: skip


@pytest.mark.parametrize("source", ["stdin", "process-substitution"])
def test_torchrun_reads_a_stream_on_rank_0(flags, expected, tmp_path, source):
    out = tmp_path / "out.jsonl"
    args = [*flags, "--dp", "2", "--output", str(out)]
    if source == "stdin":
        proc = run(torchrun_cmd([*args, "--prompts", "/dev/stdin"]), timeout=TIMEOUT_S, input=TEXT)
    else:
        (tmp_path / "prompts.jsonl").write_text(TEXT)
        cmd = shlex.join(torchrun_cmd(args))
        script = f"{cmd} --prompts <(cat {shlex.quote(str(tmp_path / 'prompts.jsonl'))})"
        proc = run(["bash", "-c", script], timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert read_tokens(out) == expected


# ------------------------------------------------------------------ the pieces, in-process


def test_a_regular_file_keeps_the_command_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(TEXT)
    argv = ["generate", "--dp", "2", "--prompts", str(prompts)]
    assert paths.read_input(str(prompts)) == TEXT.encode()
    assert rank_inputs(argv) == (argv, [])


def test_a_stream_reaches_the_ranks_as_a_private_copy():
    read, write = os.pipe()
    os.write(write, TEXT.encode())
    os.close(write)
    path = f"/dev/fd/{read}"
    try:
        assert paths.read_input(path) == TEXT.encode()
        argv, copies = rank_inputs(["accept-rate", "--prompts", path, "--dp", "2"])
    finally:
        os.close(read)
    assert len(copies) == 1 and argv[-2:] == ["--prompts", f"/dev/fd/{copies[0].fileno()}"]
    assert Path(argv[-1]).read_bytes() == TEXT.encode()  # what a rank reads: a regular file
    assert cli.build_parser().parse_args(argv).prompts == argv[-1]  # the last --prompts counts
    copies[0].close()


def test_the_ranks_messages_name_the_users_path(monkeypatch, tmp_path):
    """A rank reads a streamed --baseline from its private copy, /dev/fd/N; what it says about
    the baseline afterwards (a k only the run shows) names what the user gave."""
    from speculant.launch import accept_rate
    from speculant.launch.spawn import shown_paths

    baseline = json.dumps({"algo": "eagle3", "num_draft_tokens": 3, "num_prompts": 1,
                           "max_new_tokens": 8, "temperature": 0.0, "acceptance_length": 1.4,
                           "per_position_acceptance": [0.3, 0.1, 0.0]})  # fmt: skip
    read, write = os.pipe()
    os.write(write, baseline.encode())
    os.close(write)
    given = ["accept-rate", "--baseline", f"/dev/fd/{read}", "--dp", "2"]
    try:
        paths.read_input(given[2])
        argv, copies = rank_inputs(given)
    finally:
        os.close(read)
    try:
        shown = shown_paths(given, argv)
        assert shown == {argv[-1]: given[2]}
        monkeypatch.setenv(paths.SHOWN_PATHS_ENV, json.dumps(shown))
        assert paths.shown_path(argv[-1]) == given[2] and paths.shown_path("x") == "x"
        prompts = tmp_path / "p.jsonl"
        prompts.write_text('{"prompt_token_ids": [5, 6]}\n')
        args = cli.build_parser().parse_args(
            [*argv, "--prompts", str(prompts), "--max-new-tokens", "8"]
        )
        job = accept_rate.prepare_accept(args)  # rank 0 reads the copy
        assert job.baseline["num_draft_tokens"] == 3 and args.baseline == given[2]
        with pytest.raises(SpeculantError, match=f"baseline {given[2]} was measured with"):
            accept_rate.check_run_shape(job.baseline, {"num_draft_tokens": 4}, args.baseline)
    finally:
        for copy in copies:
            copy.close()


def test_a_stream_not_kept_is_refused():
    read, write = os.pipe()
    try:
        with pytest.raises(SpeculantError) as caught:
            rank_inputs(["generate", "--prompts", f"/dev/fd/{read}"])
    finally:
        os.close(read)
        os.close(write)
    assert str(caught.value) == (
        f"--prompts '/dev/fd/{read}' is a pipe, which this launcher has read and its ranks "
        "cannot read again; write the prompts to a file and pass that"
    )


def test_a_rank_reopens_its_parents_descriptor():
    """What torchrun's rank 0 does with a `<(...)` its agent holds and did not pass on."""
    read, write = os.pipe()
    os.write(write, TEXT.encode())
    os.close(write)
    child = (
        "import sys; from pathlib import Path; from speculant.launch import paths; "
        f"paths.adopt_parent_descriptor('/dev/fd/{read}', '--prompts'); "
        f"sys.stdout.write(Path('/dev/fd/{read}').read_text())"
    )
    try:  # close_fds: the child does not inherit `read`, as a torchrun rank does not
        proc = run([sys.executable, "-c", child], timeout=60, stdin=subprocess.DEVNULL)
    finally:
        os.close(read)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == TEXT
