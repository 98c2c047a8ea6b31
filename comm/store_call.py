"""Calls to the job's key-value store (a TCPStore) that cannot hold their caller.

A TCPStore client waits for its server's answer without a timeout (add, check, get), so a store
whose host is stopped (SIGSTOP: the kernel still accepts the connection) would block forever:
`bounded_call` runs the call in a daemon thread that is given up on after a bound. And a wait
inside torch's C++ (the rendezvous of `init_process_group`, which waits for every rank) never
returns to Python, so a SIGTERM or Ctrl-C that arrives meanwhile is only recorded: torchrun,
stopping the job after one rank failed, waited its 30 s grace and then killed the others.
`interruptible_call` runs it in a thread while the main thread waits in short joins, where the
stop is raised as anywhere else."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

_ABANDONED: list[str] = []  # the names of calls whose caller went on without their result


def calls_abandoned() -> bool:
    """Whether a call was given up on (a bound passed, or a stop while it waited): the process
    should then end with os._exit. Torch's C++ objects that call made (the store, gloo's
    threads), finished or not, abort the process when interpreter exit tears them down
    ("terminate called without an active exception")."""
    return bool(_ABANDONED)


def _started(call: Callable[[], Any], name: str) -> tuple[threading.Thread, list]:
    """A daemon thread running call(), and the list its (ok, value or exception) lands in."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, call()))
        except BaseException as exc:  # raised again in the caller's thread
            result.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, result


def _value(result: list) -> Any:
    ok, value = result[0]
    if not ok:
        raise value
    return value


def bounded_call(call: Callable[[], Any], timeout_s: float, name: str) -> tuple[bool, Any]:
    """(True, call()) when it returns within `timeout_s`, else (False, None), the thread left
    to itself; an exception it raises is raised here."""
    thread, result = _started(call, name)
    thread.join(timeout_s)
    if not result:
        _ABANDONED.append(name)
        return False, None
    return True, _value(result)


def interruptible_call(
    call: Callable[[], Any], name: str, poll_s: float = 0.2, bound_s: float | None = None
) -> Any:
    """call(), run in a daemon thread so that a signal handler raises in the (main) caller while
    it waits; the thread is left to itself then (the process is on its way out). With
    `bound_s`, a call still running after that long is given up on too: TimeoutError. Off the
    main thread the call runs directly, unbounded (no signal to wait for)."""
    if threading.current_thread() is not threading.main_thread():
        return call()  # signals are handled in the main thread only: nothing to gain
    thread, result = _started(call, name)
    deadline = None if bound_s is None else time.monotonic() + bound_s
    try:
        while thread.is_alive():
            thread.join(poll_s)  # a stop's handler runs between these joins
            if deadline is not None and thread.is_alive() and time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not return within {bound_s:.0f} s")
    except BaseException:
        _ABANDONED.append(name)
        raise
    return _value(result)
