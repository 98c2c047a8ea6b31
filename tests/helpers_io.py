"""What tests of running jobs share: reading a job's output while it runs."""

from __future__ import annotations


def written(path) -> str:
    """What a running job has written to `path` so far ("" before it exists: the CLI's output
    checks create and remove the file once, so it can vanish between an exists() and a read)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""
