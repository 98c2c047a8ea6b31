"""A stop (Ctrl-C, SIGTERM) in a `generate` over DP ranks that streams its outputs to rank 0, taken
at a step boundary every rank agrees on, so that no finished request is lost with it.

A request that finishes on DP rank 1 exists only there until the step's gather brings it to rank
0, which writes it: a stop raised on any rank between the two (a terminal's Ctrl-C reaches every
rank, each at its own point of the step) lost it. While `DeferredStops` is entered, SIGINT and
SIGTERM are only recorded; every step the ranks exchange what they recorded with the outputs
(ParallelContext.gather_with_flag), and once any rank has one, every rank stops right after
rank 0 has taken that step's outputs: `stop` delivers the signal to the process's own handler
(the CLI's raises KeyboardInterrupt or Terminated; Python's default raises KeyboardInterrupt).
A signal that comes once the process's parent has died (the launcher or torchrun agent gone:
launch/spawn.py `end_with_parent` sends SIGTERM then) is not deferred: the rank stops at once, as
a killed rank, and the others' failed collective names it."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DeferredStops:
    """A context (main thread only; elsewhere it records nothing) during which SIGINT and SIGTERM,
    where their handlers are Python functions, only record the first signal in `pending` (0:
    none). A handler left at SIG_DFL or SIG_IGN (a background job's Ctrl-C) is not changed.
    On exit the handlers are put back and a signal still pending is delivered, unless an
    exception is already leaving the block (it is kept)."""

    def __init__(self) -> None:
        self.pending = 0
        self.saved: dict[int, Any] = {}
        self.parent = 0

    def __enter__(self) -> DeferredStops:
        self.parent = os.getppid()
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                handler = signal.getsignal(sig)
                if callable(handler):
                    self.saved[sig] = handler
                    signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, frame: Any) -> None:
        if os.getppid() != self.parent:  # the launcher died: this rank ends now, not in step
            handler = self.saved.get(signum)
            self._restore()
            if callable(handler):
                handler(signum, frame)
            return
        self.pending = self.pending or signum

    def _restore(self) -> None:
        saved, self.saved = self.saved, {}
        for sig, handler in saved.items():
            signal.signal(sig, handler)

    def stop(self, signum: int) -> None:
        """Put the handlers back and stop with this process's own signal if it got one, else
        with `signum` (another rank's): raised by the handler, or KeyboardInterrupt."""
        signum, self.pending = self.pending or signum, 0
        self._restore()
        if callable(signal.getsignal(signum)):
            signal.raise_signal(signum)  # its handler runs (and raises) before this returns
        raise KeyboardInterrupt

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        # an error on its way out (a collective that failed because a rank died) names the
        # cause: it stays, and a stop recorded meanwhile (the launcher's SIGTERM to the
        # survivors) does not replace it
        if self.pending and exc_type is None:
            self.stop(self.pending)
        self.pending = 0
        self._restore()
