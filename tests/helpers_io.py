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
