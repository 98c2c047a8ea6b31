"""launch/writer.py: `--output` lines serialised and written by a thread of their own, so a
request's JSON (with `--logprobs`, ~1-3 ms of host time each) stays off the step loop; in the
order requests finish; each flushed as written; every queued line written by `close()`; a
write error raised in the caller as the one-line error naming the flag and the path."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from speculant.errors import SpeculantError
from speculant.launch.writer import OutputWriter


class Out:
    """A finished request as the writer sees it: anything with to_json()."""

    def __init__(self, index: int, seconds: float = 0.0):
        self.index, self.seconds = index, seconds

    def to_json(self) -> dict:
        time.sleep(self.seconds)  # a slow line (json of many log-probabilities)
        return {"index": self.index, "token_ids": [self.index] * 3}


def test_lines_are_serialised_off_the_callers_thread_in_order(tmp_path):
    path = tmp_path / "out.jsonl"
    writer = OutputWriter(str(path))
    start = time.perf_counter()
    for i in (2, 0, 1):
        writer.put(Out(i, seconds=0.2))
    queued = time.perf_counter() - start
    assert queued < 0.15, f"put() took {queued:.3f} s: the line was made on the caller's thread"
    writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["index"] for line in lines] == [2, 0, 1]
    assert lines[0] == Out(2).to_json()


def test_a_line_is_in_the_file_before_the_run_ends(tmp_path):
    path = tmp_path / "out.jsonl"
    writer = OutputWriter(str(path))
    writer.put(Out(7))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (path.exists() and path.read_text()):
        time.sleep(0.01)
    assert json.loads(path.read_text()) == Out(7).to_json()  # flushed, not held to the end
    writer.put(Out(8))
    writer.close()
    assert len(path.read_text().splitlines()) == 2


def test_close_writes_everything_queued(tmp_path):
    """An interrupted run's `finally` closes the writer: nothing finished is lost."""
    path = tmp_path / "out.jsonl"
    writer = OutputWriter(str(path))
    for i in range(50):
        writer.put(Out(i, seconds=0.002))
    writer.close()
    assert [json.loads(line)["index"] for line in path.read_text().splitlines()] == list(range(50))
    OutputWriter(str(tmp_path / "none.jsonl")).close()  # nothing put: no file, no error
    assert not (tmp_path / "none.jsonl").exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_write_error_is_raised_in_the_caller_naming_the_flag_and_path():
    writer = OutputWriter("/dev/full")
    writer.put(Out(0))
    with pytest.raises(SpeculantError, match=r"--output '/dev/full': writing failed \(no space"):
        writer.close()
    writer = OutputWriter("/dev/full")
    writer.put(Out(0))
    deadline = time.monotonic() + 10
    with pytest.raises(SpeculantError, match="writing failed"):  # the next put says it
        while time.monotonic() < deadline:
            writer.put(Out(1))
            time.sleep(0.01)
    with pytest.raises(SpeculantError, match="writing failed"):
        writer.close()
