"""The local launcher: start one process per rank on this node (one per GPU, or CPU processes with
gloo), and watch them. `speculant generate --tp N --dp M` re-runs itself in N*M ranks through
`launch_cli`; tests and benchmarks run a function in every rank through `run_ranks`.

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, as torchrun would set
them. A run never hangs on a bad rank: collectives time out (`--dist-timeout`), and once any
rank fails, ranks that have not exited `grace_s` seconds later are killed and named (a rank
whose process is stopped, state T, is named as the cause: it stopped answering; one stopped
for --dist-timeout + REPORT_S + GRACE_S with no rank failed is killed and named all the same).
GPU ranks end with `os._exit` after flushing: destroying NCCL groups after graph capture has
hung.

Ranks end with their launcher: SIGTERM to the launcher stops every rank as Ctrl-C does (finished
outputs kept, exit 143), and a rank whose parent dies, SIGKILL included, stops by itself
(`end_with_parent`). Nothing is written to disk for the ranks (their logs are unnamed files).

An input the launcher read that was a stream (`--prompts <(...)`, /dev/stdin, a FIFO: a pipe can
be read once) reaches rank 0 as a private copy of what the launcher read, an unnamed file the
ranks inherit (`rank_inputs`).

Without --output, rank 0 prints the completions (at the end, or when its run stops or fails);
it also appends each one, as it finishes, to the launcher's spool (`CompletionSpool`, an unnamed
file it inherits), and marks each once printed: a rank 0 killed, or still blocked in a
collective when the grace period ends, loses nothing it finished: the launcher prints what rank
0 had not, in its order and format, before its last line."""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TextIO

from speculant.comm.store_call import bounded_call, calls_abandoned
from speculant.errors import SpeculantError
from speculant.launch.paths import SHOWN_PATHS_ENV

DEFAULT_DIST_TIMEOUT_S = 300.0  # --dist-timeout's default (comm/groups.DEFAULT_TIMEOUT_S)
GRACE_S = 5.0  # how long the other ranks get to exit after one fails
SETTLE_S = 0.5  # how long to look for the real cause once a rank has failed
STOP_S = 5.0  # how long ranks get to stop after SIGTERM (Ctrl-C, SIGTERM) before SIGKILL
PARENT_CHECK_S = 1.0  # how often a rank checks that its parent is alive
ROLL_CALL_S = 3.0  # how long a rank whose collective failed waits for its peers to report
REPORT_S = 2 * ROLL_CALL_S + 1.0  # the most a failed rank's report takes (connect, roll call)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCHDOG = "speculant-parent-watchdog"


class RankFailure(RuntimeError):
    """A rank failed (exited non-zero, was killed, or was stuck); the message names it."""


# ------------------------------------------------------------ how a run stops (every launcher)


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a batch scheduler, `docker stop`, `ray job stop`, a dying launcher),
    raised in the main thread where Ctrl-C raises KeyboardInterrupt: the run stops the same way,
    keeping its finished outputs, and exits 143."""


def _stop_exception(signum: int) -> KeyboardInterrupt:
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


@dataclass
class _StopState:
    """The stop signals of the run in progress (`stop_on_sigterm`)."""

    signum: int | None = None  # the first SIGINT / SIGTERM that came: it decides 130 or 143
    armed: bool = False  # raise it (else it is only recorded, for the call that arms)
    raised: bool = False
    handled: bool = False  # it reached the code that ends the run (stopped_line)
    retrying: bool = False  # a re-delivery is scheduled (the stop came during an import)
    imports: int = 0  # importlib frames around the arming call (a main run from an import)


_STOP = _StopState()
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_RETRY_S = 0.01  # how often a stop that came during an import looks again


def _import_frames(frame: Any) -> int:
    """How many of the frames from `frame` outwards are importlib's (0: no import under way)."""
    count = 0
    while frame is not None:
        count += frame.f_code.co_filename.startswith("<frozen importlib.")
        frame = frame.f_back
    return count


def _stop_in_flight() -> bool:
    """Whether the exception being handled here (in an `except` or `finally` on its way out)
    is a stop, or one raised while handling a stop."""
    exc = sys.exc_info()[1]
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__context__
    return False


def _retry_stop(signum: int) -> None:
    """(a timer thread) Send the stop again, to the main thread (a real signal: it interrupts a
    sleep or a wait there, as the first one did), if it still waits."""
    _STOP.retrying = False
    if _STOP.armed and not _STOP.handled and signal.getsignal(signum) is _on_stop_signal:
        signal.pthread_kill(threading.main_thread().ident, signum)


def _on_stop_signal(signum: int, frame: Any) -> None:
    """SIGINT / SIGTERM: record it, and raise it where that is safe (see stop_on_sigterm)."""
    stop = _STOP
    if stop.signum is None:
        stop.signum = signum
    if not stop.armed or stop.handled:
        return  # recorded: raised once armed; or the run is ending already
    if stop.raised and _stop_in_flight():
        return  # one stop: a second signal waits for the first (its outputs are being kept)
    if _import_frames(frame) > stop.imports:  # raised there, an import breaks or swallows it
        if not stop.retrying:
            stop.retrying = True
            timer = threading.Timer(STOP_RETRY_S, _retry_stop, (signum,))
            timer.daemon = True
            timer.start()
        return
    stop.raised = True
    raise _stop_exception(stop.signum)


def stop_on_sigterm(armed: bool = True, pending: Sequence[int] = ()) -> Callable[[], None]:
    """Make SIGTERM and Ctrl-C's SIGINT stop the run: Terminated (exit 143) or KeyboardInterrupt
    (exit 130) raised in the main thread. Returns what restores the previous handlers (a no-op
    outside the main thread, where no handler can be set, and from a call made while they are
    installed already, which only arms them or adds `pending`).

    The stop takes effect whenever it comes. Raised inside an import (torch's, numpy's: ~1.5 s
    of a CPU run's start) it would leave a half-imported module or be swallowed, so there it
    waits for the import to end (looking again every STOP_RETRY_S). Not `armed` (a command's
    start, before the code that handles a stop runs), a signal is only recorded, and so are
    `pending` ones (recorded before this was installed): the call that arms raises the first
    of them. A second signal while the first stop is on its way out waits for it (the outputs
    it keeps are being written); one that comes after that stop was lost (swallowed by the code
    it interrupted) raises it again. Nothing is ever left ignored, except a SIGINT ignored when
    this process started (a background job), which stays so."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    stop, restore = _STOP, None
    if signal.getsignal(signal.SIGTERM) is not _on_stop_signal:  # a new run: install
        stop.__init__()
        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        if previous[signal.SIGINT] is signal.SIG_IGN:
            del previous[signal.SIGINT]
        for sig in previous:
            signal.signal(sig, _on_stop_signal)

        def restore() -> None:
            stop.armed = False
            for sig, handler in previous.items():
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    if pending and stop.signum is None:
        stop.signum = pending[0]
    if armed and not stop.armed:
        stop.imports = _import_frames(sys._getframe(1))
        stop.armed = True
        if stop.signum is not None and not stop.raised:
            stop.raised = True
            raise _stop_exception(stop.signum)
    return restore or (lambda: None)


RUN_STARTED = time.time()  # this process's start: what an --output file written since holds


def stopped_line(exc: KeyboardInterrupt, output: str | None, ranks: bool) -> tuple[str, int]:
    """The last line of a run stopped by Ctrl-C or SIGTERM, and its exit status (130, 143);
    it names the --output file only when this run wrote it (no request finished: the file,
    if any, still holds what it held before). From here on, a further Ctrl-C or SIGTERM waits
    for the run to end (stop_on_sigterm)."""
    _STOP.handled = True
    how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
    line = f"speculant: {how}" + (": every rank stopped" if ranks else "")
    if output:
        try:
            written = os.stat(output).st_mtime >= RUN_STARTED
        except OSError:
            written = False
        if written:
            line += f"; the requests that finished are in {output}"
        else:
            line += f"; no request had finished, so {output} was not written"
    return line, 143 if isinstance(exc, Terminated) else 130


def close_progress_bars() -> None:
    """Close every open tqdm bar (drawn once more, then a newline), so that the line printed
    next is the last on stderr: an open bar redraws itself when it is garbage-collected."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        try:
            bar.close()
        except Exception:  # a bar whose stream is gone
            pass
    sys.stderr.flush()


def end_with_parent() -> None:
    """Make this rank stop when the process that started it (the launcher, torchrun's agent)
    dies, SIGKILL included. The kernel sends SIGTERM at the parent's death (Linux
    PR_SET_PDEATHSIG), which stops the rank as Ctrl-C does; a watchdog thread that sees the
    parent gone (os.getppid() changed: another system, or a parent that died before the prctl)
    sends it too, and ends the rank with os._exit if it is still running STOP_S later (a rank
    blocked in a collective runs no Python signal handler)."""
    if any(thread.name == WATCHDOG for thread in threading.enumerate()):
        return
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the watchdog alone
            pass
    threading.Thread(target=_watch_parent, args=(parent,), name=WATCHDOG, daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(143)


def _is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective that timed out or lost a peer (gloo raises RuntimeError)."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and bool(
        re.search(r"gloo|nccl|timed out|connection (reset|closed)|broken pipe", text, re.I)
    )


def _node_note(ranks: Sequence[int]) -> str:
    """Which torchrun node(s) hold `ranks` (each node holds LOCAL_WORLD_SIZE consecutive ranks),
    as a note for a message; empty outside torchrun."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if not os.environ.get("TORCHELASTIC_RUN_ID") or not local:
        return ""
    nodes = sorted({r // int(local) for r in ranks})
    return f" (torchrun node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))})"


ERROR_PREFIX = "speculant: error: "


def tell_torchrun(line: str) -> None:
    """Under torchrun, a failing rank's one error line (less its prefix) into the error file
    its agent reads (TORCHELASTIC_ERROR_FILE, in torch elastic's layout), so that torchrun's
    failure summary names the cause where it would show a link to its documentation. Nothing
    without torchrun, or when the file cannot be written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    message = line.removeprefix(ERROR_PREFIX)
    info = {"py_callstack": message, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as file:
            json.dump({"message": {"message": message, "extraInfo": info}}, file)
    except OSError:
        pass


FAILURE_FD_ENV = "SPECULANT_FAILURE_FD"


def record_own_failure(line: str) -> None:
    """A rank that failed on its own (a user error, or an exception that was not a collective a
    peer broke): its one line and the time, into the unnamed file its launcher handed it
    (descriptor SPECULANT_FAILURE_FD), so that the launcher names it as the cause rather than
    the ranks that then failed in collectives with it (their exit statuses look alike). Nothing
    outside `launch_cli`'s ranks, or when the file cannot be written."""
    fd = os.environ.get(FAILURE_FD_ENV)
    if not fd or not fd.isdigit():
        return
    with contextlib.suppress(OSError):
        os.pwrite(int(fd), json.dumps({"time": time.time(), "line": line}).encode(), 0)


def report_failure(exc: BaseException) -> str | None:
    """After this rank failed: tell the other ranks through the job's store (the TCPStore at
    MASTER_ADDR:MASTER_PORT that torch.distributed started from) and, when the failure is a
    collective's (a timeout, a lost peer), name its cause: the ranks that failed on their own,
    else those that do not report within ROLL_CALL_S (their process or node is gone, stopped,
    or stuck outside the collective). None when no one is named or the store does not answer
    within REPORT_S (its host, rank 0 or torchrun's rendezvous node, is gone or stopped).

    The report runs in a daemon thread that is given up on after REPORT_S: a TCPStore client
    waits for its server's answers without a timeout (the connection's ping, `check`, `get`),
    so a store whose host is stopped (SIGSTOP: the kernel still accepts the connection) would
    hold this rank, and the launcher waiting for it, forever."""
    try:
        return bounded_call(lambda: _roll_call(exc), REPORT_S, "speculant-roll-call")[1]
    except Exception:  # the report failed: nothing to name (as one that never answered)
        return None


def failure_summary(exc: BaseException) -> str:
    """What a rank reports of its failure to the others (report_failure)."""
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:200]


def _failure_key(rank: int) -> str:
    return f"speculant/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def _store_client() -> Any:
    """A client of the job's store, or None when nothing listens there (the store died with a
    failed join: no client then, whose connect retries print C++ warnings and stack frames on
    the terminal for seconds)."""
    from datetime import timedelta

    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        socket.create_connection((host, port), timeout=ROLL_CALL_S).close()
    except OSError:
        return None
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=ROLL_CALL_S))


def peer_report(rank: int, wait_s: float) -> str | None:
    """What rank `rank` reported of its failure (`report_failure`: its summary, or "collective"),
    waiting up to `wait_s` for it; None when it did not report by then or the store does not
    answer (bounded: see report_failure)."""

    def poll() -> str | None:
        store = _store_client()
        deadline = time.monotonic() + wait_s
        while store is not None:
            if store.check([_failure_key(rank)]):
                return store.get(_failure_key(rank)).decode()
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return None

    try:
        return bounded_call(poll, wait_s + REPORT_S, "speculant-peer-report")[1]
    except Exception:  # the store's host is gone
        return None


def _roll_call(exc: BaseException) -> str | None:
    """`report_failure`'s report, unbounded where the store does not answer."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    collective = _is_collective_failure(exc)
    try:
        store = _store_client()
        if store is None:
            return None
        store.set(_failure_key(rank), "collective" if collective else failure_summary(exc))
        if not collective:  # the cause itself: the others read it
            return None
        peers = [r for r in range(world) if r != rank]
        deadline = time.monotonic() + ROLL_CALL_S
        while time.monotonic() < deadline and not store.check([_failure_key(r) for r in peers]):
            time.sleep(0.1)
        reported = {r: store.get(_failure_key(r)).decode() for r in peers
                    if store.check([_failure_key(r)])}  # fmt: skip
    except Exception:  # the store's host is gone too
        return None
    failed = [(r, text) for r, text in reported.items() if text != "collective"]
    if failed:
        return f"rank {failed[0][0]}{_node_note([failed[0][0]])} failed first ({failed[0][1]})"
    silent = [r for r in peers if r not in reported]
    if not silent:
        return None
    names = ", ".join(map(str, silent))
    return (
        f"rank{'s' if len(silent) > 1 else ''} {names}{_node_note(silent)} stopped answering "
        f"(no report within {ROLL_CALL_S:.0f} s: the process or its node is gone, stopped, "
        "stuck outside the collective, or waiting for this rank in another collective)"
    )


def free_port() -> int:
    """A TCP port that was free a moment ago, for MASTER_PORT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The torchrun-style variables of one rank on this node."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


SPOOL_ENV = "SPECULANT_COMPLETION_SPOOL"  # FD:DEV:INO of the launcher's spool, for rank 0


class CompletionSpool:
    """The completions rank 0 of a `launch_cli` job (without --output) has finished, kept by
    the launcher so that none is lost with rank 0: an unnamed file (nothing is left behind,
    however the launcher ends) whose descriptor rank 0 inherits, with one flushed JSON line per
    completion as it finishes, {"index": [i, j], "line": "[i] ..."} (the line rank 0 prints;
    j: which of prompt i's completions), and {"printed": [i, j]} once rank 0 has printed it.
    After the ranks have ended, the launcher prints the lines not marked printed
    (`print_unprinted`): none after a run that rank 0 finished."""

    def __init__(self, stdout: TextIO) -> None:
        self.stdout, self.shown = stdout, set()  # shown: the indices this printed
        self.file = tempfile.TemporaryFile(prefix="speculant-completions-")
        fd = self.file.fileno()
        info = os.fstat(fd)
        self.fd, self.env = fd, {SPOOL_ENV: f"{fd}:{info.st_dev}:{info.st_ino}"}

    def unprinted(self) -> list[tuple[tuple[int, int], str]]:
        """(key, line) of each completion neither rank 0 nor this printed, by key."""
        data = os.pread(self.fd, os.fstat(self.fd).st_size, 0)
        lines: dict[tuple[int, int], str] = {}
        printed: set[tuple[int, int]] = set()
        for raw in data.split(b"\n")[:-1]:  # the last piece: b"" or a record cut short
            try:
                record = json.loads(raw)
                if "printed" in record:
                    printed.add(_spool_key(record["printed"]))
                else:
                    lines.setdefault(_spool_key(record["index"]), str(record["line"]))
            except (ValueError, KeyError, TypeError):
                continue
        done = printed | self.shown
        return [(i, lines[i]) for i in sorted(lines) if i not in done]

    def print_unprinted(self) -> None:
        """Print, once, every completion rank 0 finished but did not print (it was killed)."""
        try:
            for index, line in self.unprinted():
                self.shown.add(index)
                print(line, file=self.stdout)
            self.stdout.flush()
        except (OSError, ValueError):  # a closed or broken stdout: the last line still comes
            pass

    def close(self) -> None:
        self.file.close()


class RankSpool:
    """Rank 0's end of the launcher's `CompletionSpool`: `add` each completion as it finishes,
    `printed` each once its line is out (flushed). A write that fails (a full disk) empties the
    spool and stops it: the launcher then prints nothing, rather than a line printed already."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def add(self, key: tuple[int, int], line: str) -> None:
        self._write({"index": list(key), "line": line})

    def printed(self, key: tuple[int, int]) -> None:
        self._write({"printed": list(key)})

    def _write(self, record: dict) -> None:
        if self.fd is None:
            return
        data = (json.dumps(record) + "\n").encode()  # ASCII: lone surrogates kept as escapes
        try:
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            self.fd = None


def _spool_key(value: object) -> tuple[int, int]:
    """A spool record's [index, sample index]."""
    index, sample = value  # a ValueError / TypeError for anything else: the record is skipped
    return int(index), int(sample)


def rank_spool() -> RankSpool | None:
    """The launcher's completion spool, in rank 0 of a `launch_cli` job without --output; None
    elsewhere (one process, torchrun, Ray, --output), or if SPOOL_ENV does not name the very
    file the launcher opened (an environment copied from elsewhere)."""
    value = os.environ.pop(SPOOL_ENV, None)  # not for any process this rank starts
    if not value or os.environ.get("RANK", "0") != "0":
        return None
    try:
        fd, dev, ino = (int(part) for part in value.split(":"))
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) != (dev, ino):
            return None
        os.set_inheritable(fd, False)
    except (ValueError, OSError):
        return None
    return RankSpool(fd)


def fault_point(rank: int) -> None:
    """SPECULANT_TEST_KILL_RANK=r makes rank r kill itself (SIGKILL) here, once its engine is
    built: how the launcher tests fail one rank mid-run under torchrun and Ray, where the test
    cannot reach the rank's process. SPECULANT_TEST_FAIL_RANK=r:error (r:user) makes it raise
    a MemoryError (a SpeculantError) here instead: one rank failing on its own while the
    others go on into their next collective."""
    if os.environ.get("SPECULANT_TEST_KILL_RANK") == str(rank):
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    failing, _, kind = os.environ.get("SPECULANT_TEST_FAIL_RANK", "").partition(":")
    if failing == str(rank):
        if kind == "user":
            raise SpeculantError(f"rank {rank}'s test failure (SPECULANT_TEST_FAIL_RANK)")
        raise MemoryError(f"rank {rank}'s test failure (SPECULANT_TEST_FAIL_RANK)")


def max_cpu_ranks() -> int:
    """The most CPU ranks a local launch starts: 4 a core, 8 at least (each rank is a process
    that loads torch and the model; more only wait for cores)."""
    return max(8, 4 * (os.cpu_count() or 1))


def check_devices(device: str, world_size: int) -> None:
    """One GPU per rank: enough GPUs must be visible; on the CPU, no more ranks than
    `max_cpu_ranks`."""
    if device == "cpu" and world_size > max_cpu_ranks():
        raise SpeculantError(
            f"{world_size} ranks (--tp x --dp) on the CPU, and this machine has "
            f"{os.cpu_count()} cores: a local CPU launch starts at most {max_cpu_ranks()}; "
            "lower --tp/--dp"
        )
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count()
        if count < world_size:
            raise SpeculantError(
                f"{world_size} ranks need {world_size} GPUs but {count} are visible; "
                "lower --tp/--dp or pass --device cpu"
            )


def _enter_rank(rank: int, world_size: int, port: int, device: str) -> None:
    os.environ.update(rank_env(rank, world_size, port))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (see shared/GPU.md)
    if device == "cpu":  # share the cores instead of oversubscribing them
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


STOP_CODES = (130, 143)  # a rank stopped by Ctrl-C or SIGTERM (stopped_line's codes)


def _exit(code: int, device: str) -> None:
    """End a rank: flushed, and without process-group destructors on GPUs (they have hung
    after NCCL graph capture), after a store call or join was given up on (tearing down what
    it made aborts: comm.store_call.calls_abandoned), after a stop (Ctrl-C, SIGTERM: one that
    came while gloo was building the groups, or while a peer was in a collective with this
    rank, left C++ objects whose destruction aborted the rank with SIGABRT) or after a failure
    (groups a peer broke: tearing them down and the interpreter's shutdown took longer than the
    launcher's grace period, which then killed the rank and named it as stuck); CPU ranks that
    succeeded exit normally, so multiprocessing cleans up."""
    sys.stdout.flush()
    sys.stderr.flush()
    if device.startswith("cuda") or calls_abandoned() or code != 0:
        os._exit(code)
    # a gloo group left open (a rank function that did not close its context) keeps threads
    # whose destruction at interpreter exit can abort the rank ("terminate called without an
    # active exception"): tear it down locally first
    dist = sys.modules.get("torch.distributed")  # never imported here: an interrupted first
    try:  # `import torch` leaves a half-made torch that a new import raises on
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    sys.exit(code)


def _function_rank(rank, world_size, port, device, fn, args, conn) -> None:
    """Body of a `run_ranks` process: run fn(*args), send ("ok", result) or the error."""
    end_with_parent()
    _enter_rank(rank, world_size, port, device)
    try:
        status, code = ("ok", fn(*args)), 0
    except BaseException as exc:  # reported to the parent, which names the rank
        traceback.print_exc()
        summary = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        own = None if _is_collective_failure(exc) else time.time()  # (see record_own_failure)
        status, code = ("error", summary, own), 1
    try:
        conn.send(status)
    except Exception as exc:  # an unpicklable result
        conn.send(("error", f"the result could not be sent: {exc}"))
        code = 1
    conn.close()
    _exit(code, device)


def cli_rank_main(argv: Sequence[str]) -> None:
    """One rank of `speculant ARGV` (`python -m speculant.launch.spawn ARGV` with the rank's
    environment): the command itself, then a bounded exit. A failure prints one line, naming
    the rank that caused it when the failure was a collective's (`report_failure`)."""
    end_with_parent()
    from speculant.launch.cli import main

    try:
        code = main(list(argv))
    except KeyboardInterrupt:
        code = 130
    except BaseException as exc:  # a peer's death or a timeout: one line, as user errors are
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the report is bounded (REPORT_S)
        close_progress_bars()
        if "--debug" in argv:
            traceback.print_exc()
        try:
            cause = report_failure(exc)
        except BaseException:  # Ctrl-C during the roll call
            cause = None
        line = f"{ERROR_PREFIX}rank {os.environ.get('RANK')}: "
        line += f"{cause}: " if cause else ""
        line = f"{line}{type(exc).__name__}: {exc}".strip().splitlines()[0]
        if not _is_collective_failure(exc):
            record_own_failure(line.removeprefix(ERROR_PREFIX))
        print(line, file=sys.stderr)
        tell_torchrun(line)
        code = 1
    close_progress_bars()
    device = "cuda" if os.environ.get("SPECULANT_RANK_DEVICE", "cpu").startswith("cuda") else "cpu"
    _exit(code, device)


class _Proc:
    """A multiprocessing.Process or a subprocess.Popen behind one interface."""

    def __init__(self, handle: Any):
        self.handle = handle

    @property
    def exitcode(self) -> int | None:
        if isinstance(self.handle, subprocess.Popen):
            return self.handle.poll()
        return self.handle.exitcode

    @property
    def stopped(self) -> bool:
        """Whether the process is stopped (state T: SIGSTOP, or t: a debugger), from /proc."""
        try:
            stat = Path(f"/proc/{self.handle.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")

    def kill(self) -> None:
        self.handle.kill()

    def terminate(self) -> None:
        if self.exitcode is None:
            self.handle.terminate()

    def join(self, timeout: float) -> None:
        if isinstance(self.handle, subprocess.Popen):
            try:
                self.handle.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        else:
            self.handle.join(timeout)


@dataclass
class _Rank:
    rank: int
    process: _Proc
    log: Any = None  # the rank's stderr: an unnamed file (tempfile.TemporaryFile)
    record: Any = None  # the unnamed file where the rank records a failure of its own
    own: tuple[float, str] | None = None  # (when, its line) of a failure of its own

    def own_failure(self) -> tuple[float, str] | None:
        """(when, its line) if the rank failed on its own (`record_own_failure`, or set by
        `run_ranks` from what the rank sent), else None."""
        if self.own is None and self.record is not None and not self.record.closed:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                fd = self.record.fileno()
                record = json.loads(os.pread(fd, os.fstat(fd).st_size, 0).decode())
                self.own = (float(record["time"]), str(record["line"]))
        return self.own

    def last_line(self) -> str:
        if self.log is None:
            return ""
        fd = self.log.fileno()
        text = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
        lines = text.strip().splitlines()
        return lines[-1].removeprefix("speculant: error: ") if lines else ""


def _blame(code: int) -> int:
    """How likely an exit code is the cause rather than a consequence: killed from outside
    (SIGKILL, SIGTERM, ...) first, a self-abort (SIGABRT, as gloo does on a lost peer) next, an
    error exit last."""
    if code < 0:
        return 1 if -code == signal.SIGABRT else 0
    return 2


def _cause(ranks: list[_Rank], failed: list[_Rank]) -> _Rank:
    """The rank that failed the job: the first to fail on its own (its exception or user error,
    not a collective a peer broke: a rank out of memory, a shard only it cannot read), else the
    failed rank most likely killed from outside (`_blame`), the lowest such."""
    own = [(record[0], r.rank, r) for r in ranks if (record := r.own_failure()) is not None]
    if own:
        return min(own, key=lambda entry: entry[:2])[2]
    return min(failed, key=lambda r: (_blame(r.process.exitcode), r.rank))


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _supervise(
    ranks: list[_Rank],
    timeout_s: float | None,
    grace_s: float,
    on_poll: Callable[[], None] = lambda: None,
    stopped_s: float | None = None,
) -> str | None:
    """Wait for every rank; None when all exited 0, else one line naming the cause (a stopped
    rank first: the others failed waiting for it; else the first failure, `_cause`) and any rank
    still running `grace_s` after the last rank that exited (killed as stuck; a stopped rank,
    which cannot exit by itself, is not waited for once the others have ended). A rank seen
    stopped (state T) for `stopped_s` seconds while no rank has failed is the failure itself:
    the others should have failed waiting for it by then (their collectives time out), so they
    are stuck outside any collective, in something that waits on the stopped rank without a
    timeout. `on_poll` runs every poll."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failure, stuck_since, first_seen, stopped = None, None, None, []
    running = len(ranks)  # ranks not yet exited, at the last poll
    stopped_since: dict[int, float] = {}  # rank -> when it was first seen stopped, in a row
    last_poll = time.monotonic()
    while True:
        on_poll()
        alive = [r for r in ranks if r.process.exitcode is None]
        failed = [r for r in ranks if r.process.exitcode not in (None, 0)]
        now = time.monotonic()
        if failed and first_seen is None:
            first_seen = now
        if stopped_s is not None and failure is None:
            if now - last_poll > 1.0:  # this launcher was stopped too (Ctrl-Z) or starved
                stopped_since.clear()
            for r in ranks:
                if r.process.exitcode is None and r.process.stopped:
                    stopped_since.setdefault(r.rank, now)
                else:
                    stopped_since.pop(r.rank, None)
            long_stopped = [r for r in alive if now - stopped_since.get(r.rank, now) > stopped_s]
            if long_stopped and not failed:
                failure, stopped, stuck_since = long_stopped[0], long_stopped, now
                for r in long_stopped:  # killed now: what waits on it may then fail by itself
                    r.process.kill()
        last_poll = now
        # Name the cause only after a short settle: a killed rank's peers abort on the broken
        # connection within moments, sometimes before the killed rank is seen to have exited.
        settled = first_seen is not None and (not alive or now - first_seen > SETTLE_S)
        if failure is None and settled:
            failure = _cause(ranks, failed)
            stopped = [r for r in alive if r.process.stopped]  # never reached the collective
            stuck_since = now
        elif failure is not None and len(alive) < running and failure not in stopped:
            # a rank exited: the grace starts again for the rest. Ranks see a failure one after
            # another (a rank blocked in a collective with one that is reporting its own failure,
            # up to ROLL_CALL_S, sees it only when that one exits): they are ending, not stuck
            stuck_since = now
        running = len(alive)
        if not alive:
            break
        if failure is not None and (
            now - stuck_since > grace_s or all(r.process.stopped for r in alive)
        ):
            break
        if failure is None and deadline is not None and now > deadline:
            break
        time.sleep(0.05)
    stuck = [r for r in ranks if r.process.exitcode is None]
    for r in stuck:
        r.process.kill()
    for r in ranks:
        r.process.join(timeout=10)
    on_poll()
    if failure is None and not stuck:
        return None
    if failure is None:
        names = ", ".join(str(r.rank) for r in stuck)
        return f"rank(s) {names} did not finish within {timeout_s:.0f} s and were killed"
    if stopped:  # the cause: alive, but it never reached the collective the others failed in
        names = ", ".join(str(r.rank) for r in stopped)
        line = (
            f"rank{'s' if len(stopped) > 1 else ''} {names} stopped answering (its process was "
            "stopped, state T: SIGSTOP or a debugger) and was killed"
        )
        if failure in stopped:  # no rank failed: the others were stuck waiting for it
            others = [r for r in stuck if r not in stopped]
            line += f" after {stopped_s:.0f} s stopped"
            if others:
                names = ", ".join(str(r.rank) for r in others)
                line += f"; rank(s) {names} did not exit within {grace_s:.0f} s and were killed"
            return line
        return f"{line}; rank {failure.rank} {_describe(failure.process.exitcode)} waiting for it"
    described = f"rank {failure.rank} {_describe(failure.process.exitcode)}"
    said = failure.own_failure()[1] if failure.own_failure() else failure.last_line()
    if (failure.process.exitcode or 0) > 0 and said:  # its error line
        described += f": {said}"
    line = described
    if stuck:
        names = ", ".join(str(r.rank) for r in stuck)
        line += f"; rank(s) {names} did not exit within {grace_s:.0f} s after that and were killed"
    return line


def _start(target: Callable, world_size: int, rank_args: Callable[[int], tuple]) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")  # no fork: CUDA and gloo state must start fresh
    processes = []
    try:
        for rank in range(world_size):
            process = ctx.Process(target=target, args=rank_args(rank), name=f"speculant-rank{rank}")
            process.start()
            processes.append(_Proc(process))
    except BaseException:
        for process in processes:
            process.kill()
        raise
    return processes


def _stop(ranks: list[_Rank]) -> None:
    """SIGTERM every rank still running (each stops as on Ctrl-C, keeping what it finished),
    then SIGKILL those still running STOP_S later."""
    for r in ranks:
        r.process.terminate()
    deadline = time.monotonic() + STOP_S
    while any(r.process.exitcode is None for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    for r in ranks:
        if r.process.exitcode is None:
            r.process.kill()
        r.process.join(timeout=10)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    device: str = "cpu",
    timeout_s: float | None = None,
    grace_s: float = GRACE_S,
) -> list[Any]:
    """Run `fn(*args)` in `world_size` new processes (rank r on cuda:r for a CUDA device) and
    return their results in rank order. `fn` must be importable (a module-level function) and
    its result picklable. Raises RankFailure naming the rank when one fails, and kills every
    rank still running after `timeout_s`. Results come back through pipes (nothing on disk)."""
    check_devices(device, world_size)
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]  # (receive, send) per rank

    def rank_args(rank: int) -> tuple:
        return (rank, world_size, port, device, fn, tuple(args), pipes[rank][1])

    statuses: dict[int, tuple] = {}

    def receive() -> None:  # a large result blocks its rank until read: read every poll
        for rank, (conn, _) in enumerate(pipes):
            if rank not in statuses and conn.poll():
                try:
                    statuses[rank] = conn.recv()
                except (EOFError, OSError):  # the rank died before sending
                    statuses[rank] = ("missing",)
                status = statuses[rank]
                if status[0] == "error" and status[2] is not None and ranks:
                    ranks[rank].own = (status[2], status[1])

    ranks: list[_Rank] = []
    processes = _start(_function_rank, world_size, rank_args)
    for _, send in pipes:
        send.close()  # the ranks hold theirs: a dead rank's pipe reads EOF
    ranks.extend(_Rank(r, p) for r, p in enumerate(processes))
    try:
        failure = _supervise(ranks, timeout_s, grace_s, on_poll=receive)
    except BaseException:
        _stop(ranks)
        raise
    finally:
        for conn, _ in pipes:
            conn.close()
    results = []
    for rank in range(world_size):
        status = statuses.get(rank, ("missing",))
        named = failure is not None and failure.startswith(f"rank {rank} ")
        if status[0] == "error" and named and status[1] not in failure:
            failure += f" ({status[1]})"
        results.append(status[1] if status[0] == "ok" else None)
    if failure is not None:
        raise RankFailure(failure)
    return results


def dist_timeout(argv: Sequence[str]) -> float:
    """The --dist-timeout of a `speculant generate` command line (its default, 300 s, when it
    has none or one that is not a number: the command itself refuses that)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == "--dist-timeout" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--dist-timeout="):
            value = arg.split("=", 1)[1]
    try:
        return float(value) if value is not None else DEFAULT_DIST_TIMEOUT_S
    except ValueError:
        return DEFAULT_DIST_TIMEOUT_S


def check_output_free(path: str | None) -> None:
    """Refuse an --output file that another run holds locked (cli.output_lock) before any rank
    starts; rank 0 takes the lock itself for the run."""
    if path and Path(path).is_file():
        from speculant.launch.cli import output_lock

        with output_lock(path):
            pass


def remove_if_empty(path: str) -> None:
    """Remove the empty regular file a rank 0 created for --output and could not remove itself
    (killed before any request finished): a run leaves no empty output behind."""
    with contextlib.suppress(OSError):
        info = os.lstat(path)
        if stat.S_ISREG(info.st_mode) and info.st_size == 0:
            os.unlink(path)


INPUT_FLAGS = ("--prompts", "--baseline")  # the input files a job's rank 0 reads


def rank_inputs(argv: Sequence[str]) -> tuple[list[str], list[IO[bytes]]]:
    """The ranks' command line and the files they inherit, for a launcher that has run the
    checks of `speculant ARGV` (and so read its input files). An input that was a stream
    (`<(...)`, /dev/stdin, a FIFO) cannot be read again: the ranks get a private copy of what
    the launcher read (paths.rank_copy), inherited as descriptor N and named by `FLAG
    /dev/fd/N` at the end of the command line (argparse takes the last). Regular files are
    read by rank 0 itself: the command line is unchanged."""
    from speculant.launch.cli import build_parser
    from speculant.launch.paths import rank_copy

    args = build_parser().parse_args(argv)  # parsed already by the launcher: no error here
    ranks_argv, copies = list(argv), []
    try:
        for flag in INPUT_FLAGS:
            path = getattr(args, flag[2:], None)
            if path and (copy := rank_copy(path, flag)) is not None:
                copies.append(copy)
                ranks_argv += [flag, f"/dev/fd/{copy.fileno()}"]
    except BaseException:
        for copy in copies:
            copy.close()
        raise
    return ranks_argv, copies


def shown_paths(given: Sequence[str], ranks_argv: Sequence[str]) -> dict[str, str]:
    """{the ranks' /dev/fd/N: the user's path} for each input `rank_inputs` replaced (the
    `FLAG /dev/fd/N` pairs it appends to the command line)."""
    from speculant.launch.cli import build_parser

    args, added = build_parser().parse_args(given), list(ranks_argv[len(given) :])
    return {
        copy: getattr(args, flag[2:]) for flag, copy in zip(added[::2], added[1::2], strict=True)
    }


def launch_cli(
    argv: Sequence[str],
    world_size: int,
    device: str,
    stderr: TextIO,
    output: str | None = None,
    stdout: TextIO | None = None,
) -> int:
    """Run `speculant ARGV` as `world_size` local ranks and return the job's exit status: 0 when
    every rank succeeded, rank 0's status when it alone reported (a user error, 2, or an
    accept-rate FAIL verdict, 1, prints its line there), 130/143 after Ctrl-C/SIGTERM (every
    rank stopped, a line saying so and where the finished requests are, `output`), else 1 with
    one line naming the failed and stuck ranks.
    With `stdout` (`generate` without `output`), rank 0 prints the completions, those that
    finished before a failure or stop included (cli.run_generate), and spools each as it
    finishes (`CompletionSpool`): any that a killed or stuck rank 0 did not print, this prints
    on `stdout` before the last line. Rank 0 keeps this terminal; the others' stderr goes to
    unnamed files (read for their last line), as do the copies of piped inputs
    (`rank_inputs`), so a launcher killed by SIGKILL leaves nothing behind."""
    check_devices(device, world_size)
    check_output_free(output)
    output_existed = output is not None and os.path.lexists(output)
    port = free_port()
    ranks: list[_Rank] = []
    copies: list[IO[bytes]] = []
    spool = CompletionSpool(stdout) if stdout is not None and not output else None
    try:
        given = list(argv)
        argv, copies = rank_inputs(argv)
        inherited = tuple(copy.fileno() for copy in copies)
        shown = shown_paths(given, argv)
        for rank in range(world_size):
            env = {**os.environ, **rank_env(rank, world_size, port)}
            env[SHOWN_PATHS_ENV] = json.dumps(shown)
            env.update(SPECULANT_RANK_DEVICE=device, NCCL_NVLS_ENABLE="0")
            env.pop(SPOOL_ENV, None)
            record = tempfile.TemporaryFile(prefix=f"speculant-failure{rank}-")
            env[FAILURE_FD_ENV] = str(record.fileno())  # (record_own_failure)
            if device == "cpu":  # share the cores instead of oversubscribing them
                env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
            cmd = [sys.executable, "-m", "speculant.launch.spawn", *argv]
            if rank == 0:  # rank 0 keeps this terminal: it writes the outputs
                fds = inherited + (record.fileno(),) + (() if spool is None else (spool.fd,))
                env.update(spool.env if spool is not None else {})
                process = _Proc(subprocess.Popen(cmd, env=env, pass_fds=fds))
                ranks.append(_Rank(rank, process, record=record))
                continue
            log = tempfile.TemporaryFile(prefix=f"speculant-rank{rank}-")
            handle = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                pass_fds=(*inherited, record.fileno()),
            )
            ranks.append(_Rank(rank, _Proc(handle), log, record))
        # a rank stopped this long while no rank failed: the others are stuck, not waiting
        # in a collective (which would have timed out and been reported by now)
        stopped_s = dist_timeout(argv) + REPORT_S + GRACE_S
        failure = _supervise(ranks, None, GRACE_S, stopped_s=stopped_s)
        if spool is not None:  # none unless rank 0 was killed or stuck
            spool.print_unprinted()
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated)
        _stop(ranks)
        if spool is not None:  # what a rank 0 killed by _stop had not printed
            spool.print_unprinted()
        line, code = stopped_line(exc, output, ranks=True)
        _end_line(ranks, line, stderr)
        return code
    except BaseException:
        _stop(ranks)
        raise
    finally:
        for r in ranks:
            if r.log is not None:
                r.log.close()
            r.own_failure()  # read before its record closes
            if r.record is not None:
                r.record.close()
        for copy in copies:
            copy.close()
        if spool is not None:
            spool.close()
        if output is not None and not output_existed:  # every rank has ended by now
            remove_if_empty(output)
    if failure is None:
        return 0
    codes = [r.process.exitcode for r in ranks]
    if codes[0] == 2 and (all(c in (0, 2) for c in codes) or failure.startswith("rank 0 ")):
        return 2  # a user error (the others, if any, failed waiting for rank 0): its one line
    if codes[0] == 1 and all(c == 0 for c in codes[1:]):
        # every other rank ran to its end: rank 0's status is its own result, which it printed
        # (accept-rate's FAIL verdict, or its error line), not a rank that failed the job
        return 1
    _end_line(ranks, f"speculant: error: {failure}", stderr)
    cause = [r for r in ranks if failure.startswith(f"rank {r.rank} ") and r.own_failure()]
    return 2 if cause and cause[0].process.exitcode == 2 else 1  # a user error of one rank


def _end_line(ranks: list[_Rank], line: str, stderr: TextIO) -> None:
    """Print the launcher's last line, on a line of its own: rank 0 shares this terminal, and
    if it was killed its progress bar may have been left without a newline."""
    code = ranks[0].process.exitcode if ranks else 0
    if code is None or code < 0:
        stderr.write("\n")
    print(line, file=stderr, flush=True)


if __name__ == "__main__":
    cli_rank_main(sys.argv[1:])
