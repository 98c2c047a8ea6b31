"""`--output` lines written by a thread of their own, in the order requests finish.

A finished request's line is JSON of its tokens, text and statistics and, with `--logprobs`,
a [token id, log-probability] list per token: ~1-3 ms of host time each (json.dumps of the
floats is most of it). Written inside the engine's loop, that time sat on the step loop's
critical path whenever the step ahead was not running (a request near its length limit ends
the run-ahead), which is where `--logprobs 5` lost the job 7-9%. The thread takes a line's
serialising and writing off the loop; it runs while the loop waits on the device (torch
releases the GIL there).

Nothing finished is lost: `close()` (in the caller's `finally`, after an interrupt or a failure
too) writes every queued line before it returns. A write error (no space left, /dev/full) is
the one-line error of write_errors_named, raised in the caller at its next `put` or at `close`;
lines after it are not attempted."""

from __future__ import annotations

import json
import queue
import threading
from typing import Any, TextIO

from speculant.launch.paths import open_output, write_errors_named

_DONE = object()


class OutputWriter:
    """One `--output` file: `put` queues a finished request's output (anything with
    `to_json()`), the thread opens the file at the first line (an existing file replaced; a
    FIFO waits for its reader there, not in the step loop), writes and flushes each line."""

    def __init__(self, path: str, flag: str = "--output"):
        self.path, self.flag = path, flag
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._file: TextIO | None = None
        self._thread: threading.Thread | None = None

    def put(self, out: Any) -> None:
        """Queue `out`'s line; raises the error a line before it met."""
        self._raise()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="speculant-output", daemon=True)
            self._thread.start()
        self._queue.put(out)

    def close(self) -> None:
        """Write what is queued, close the file; raises the error a line met."""
        if self._thread is not None:
            self._queue.put(_DONE)
            self._thread.join()
            self._thread = None
        if self._file is not None:
            file, self._file = self._file, None
            try:
                with write_errors_named(self.path, self.flag):  # close flushes the buffer
                    file.close()
            except BaseException as exc:
                self._error = self._error or exc
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (out := self._queue.get()) is not _DONE:
            if self._error is not None:
                continue  # drained unwritten: the caller stops at the error
            try:
                line = json.dumps(out.to_json()) + "\n"
                with write_errors_named(self.path, self.flag):
                    self._file = self._file or open_output(self.path)
                    self._file.write(line)
                    self._file.flush()
            except BaseException as exc:  # given to the caller: put() or close() raise it
                self._error = exc
