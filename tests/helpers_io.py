"""What tests of running jobs share: reading a job's output while it runs, running accept-rate
in-process."""

from __future__ import annotations


def written(path) -> str:
    """What a running job has written to `path` so far ("" before it exists: the CLI's output
    checks create and remove the file once, so it can vanish between an exists() and a read)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def accept_rate(capsys, *args) -> tuple[int, str, str]:
    """`speculant accept-rate --device cpu ARGS` in this process (no --device with --compare,
    which takes none): (exit status, stdout, stderr)."""
    from speculant.launch.cli import main

    device = [] if "--compare" in args else ["--device", "cpu"]
    try:
        status = main(["accept-rate", *device, *map(str, args)])
    except SystemExit as exc:
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def refused_in_one_line(capsys, tmp_path, cases, key: str) -> None:
    """Each case (flags, a --prompts line or None, message) of `speculant generate --device
    cpu` is refused with exactly one `speculant: error:` line holding the message, exit 2 (the
    flags run with --prompt x, or after --prompts FILE holding the line; FILE is `bad.jsonl`
    under tmp_path, which messages may name); and accept-rate refuses a line setting `key`."""
    import json

    from speculant.launch.cli import main

    bad = tmp_path / "bad.jsonl"
    capsys.readouterr()
    for flags, line, message in cases:
        if line is None:
            argv = ["--prompt", "x", *flags]
        else:
            bad.write_text(json.dumps(line) + "\n")
            argv = ["--prompts", str(bad), *flags]
        try:
            status = main(["generate", "--device", "cpu", *argv])
        except SystemExit as exc:  # argparse's own errors
            status = exc.code
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2, err
        assert len(err) == 1 and err[0].startswith("speculant: error: ") and message in err[0], err
    bad.write_text(json.dumps({"prompt": "x", key: 1}) + "\n")
    assert main(["accept-rate", "--device", "cpu", "--prompts", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{bad}:1: accept-rate takes no {key}" in err, err


def dp2_run(argv: list, out) -> None:
    """`python -m speculant ARGV --dp 2 --algo eagle3 --output OUT` (local ranks), which must
    succeed within 180 s."""
    import subprocess
    import sys

    two = subprocess.run(
        [sys.executable, "-m", "speculant", *argv, "--dp", "2", "--algo", "eagle3",
         "--output", str(out), "--dist-timeout", "60"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-2000:]
