"""A call to the job's key-value store (a TCPStore) that cannot hold its caller: a TCPStore
client waits for its server's answer without a timeout (add, check, get), so a store whose host
is stopped (SIGSTOP: the kernel still accepts the connection) would block forever. The call runs
in a daemon thread that is given up on after a bound."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def bounded_call(call: Callable[[], Any], timeout_s: float, name: str) -> tuple[bool, Any]:
    """(True, call()) when it returns within `timeout_s`, else (False, None), the thread left
    to itself; an exception it raises is raised here."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, call()))
        except BaseException as exc:  # raised again in the caller's thread
            result.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        return False, None
    ok, value = result[0]
    if not ok:
        raise value
    return True, value
