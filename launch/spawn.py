"""The local launcher: start one process per rank on this node (one per GPU, or CPU processes with
gloo), and watch them. `speculant generate --tp N --dp M` re-runs itself in N*M ranks through
`launch_cli`; tests and benchmarks run a function in every rank through `run_ranks`.

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, as torchrun would set
them. A run never hangs on a bad rank: collectives time out (`--dist-timeout`), and once any
rank fails, ranks that have not exited `grace_s` seconds later are killed and named. GPU ranks
end with `os._exit` after flushing: destroying NCCL groups after graph capture has hung."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from speculant.errors import SpeculantError

GRACE_S = 5.0  # how long the other ranks get to exit after one fails
SETTLE_S = 0.5  # how long to look for the real cause once a rank has failed


class RankFailure(RuntimeError):
    """A rank failed (exited non-zero, was killed, or was stuck); the message names it."""


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


def fault_point(rank: int) -> None:
    """SPECULANT_TEST_KILL_RANK=r makes rank r kill itself (SIGKILL) here, once its engine is
    built: how the launcher tests fail one rank mid-run under torchrun and Ray, where the test
    cannot reach the rank's process."""
    if os.environ.get("SPECULANT_TEST_KILL_RANK") == str(rank):
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def check_devices(device: str, world_size: int) -> None:
    """One GPU per rank: enough GPUs must be visible."""
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


def _exit(code: int, device: str) -> None:
    """End a rank: flushed, and without process-group destructors on GPUs (they have hung
    after NCCL graph capture); CPU ranks exit normally so multiprocessing cleans up."""
    sys.stdout.flush()
    sys.stderr.flush()
    if device.startswith("cuda"):
        os._exit(code)
    sys.exit(code)


def _function_rank(rank, world_size, port, device, fn, args, result_path) -> None:
    """Body of a `run_ranks` process: run fn(*args), pickle ("ok", result) or the error."""
    _enter_rank(rank, world_size, port, device)
    try:
        status, code = ("ok", fn(*args)), 0
    except BaseException as exc:  # reported to the parent, which names the rank
        traceback.print_exc()
        summary = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        status, code = ("error", summary), 1
    with open(result_path, "wb") as f:
        pickle.dump(status, f)
    _exit(code, device)


def cli_rank_main(argv: Sequence[str]) -> None:
    """One rank of `speculant ARGV` (`python -m speculant.launch.spawn ARGV` with the rank's
    environment): the command itself, then a bounded exit."""
    from speculant.launch.cli import main

    try:
        code = main(list(argv))
    except KeyboardInterrupt:
        code = 130
    except BaseException as exc:  # a peer's death or a timeout: one line, as user errors are
        if "--debug" in argv:
            traceback.print_exc()
        line = f"speculant: error: rank {os.environ.get('RANK')}: {type(exc).__name__}: {exc}"
        print(line.strip().splitlines()[0], file=sys.stderr)
        code = 1
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

    def kill(self) -> None:
        self.handle.kill()

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
    log_path: Path | None = None

    def last_line(self) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return lines[-1].removeprefix("speculant: error: ") if lines else ""


def _blame(code: int) -> int:
    """How likely an exit code is the cause rather than a consequence: killed from outside
    (SIGKILL, SIGTERM, ...) first, a self-abort (SIGABRT, as gloo does on a lost peer) next, an
    error exit last."""
    if code < 0:
        return 1 if -code == signal.SIGABRT else 0
    return 2


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _supervise(ranks: list[_Rank], timeout_s: float | None, grace_s: float) -> str | None:
    """Wait for every rank; None when all exited 0, else one line naming the first failure and
    any rank that was still running `grace_s` later (killed as stuck)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failure, stuck_since, first_seen = None, None, None
    while True:
        alive = [r for r in ranks if r.process.exitcode is None]
        failed = [r for r in ranks if r.process.exitcode not in (None, 0)]
        if failed and first_seen is None:
            first_seen = time.monotonic()
        # Name the cause only after a short settle: a killed rank's peers abort on the broken
        # connection within moments, sometimes before the killed rank is seen to have exited.
        settled = first_seen is not None and (not alive or time.monotonic() - first_seen > SETTLE_S)
        if failure is None and settled:
            failure = min(failed, key=lambda r: (_blame(r.process.exitcode), r.rank))
            stuck_since = time.monotonic()
        if not alive:
            break
        now = time.monotonic()
        if failure is not None and now - stuck_since > grace_s:
            break
        if failure is None and deadline is not None and now > deadline:
            break
        time.sleep(0.05)
    stuck = [r for r in ranks if r.process.exitcode is None]
    for r in stuck:
        r.process.kill()
    for r in ranks:
        r.process.join(timeout=10)
    if failure is None and not stuck:
        return None
    if failure is None:
        names = ", ".join(str(r.rank) for r in stuck)
        return f"rank(s) {names} did not finish within {timeout_s:.0f} s and were killed"
    line = f"rank {failure.rank} {_describe(failure.process.exitcode)}"
    if failure.process.exitcode > 0 and failure.last_line():  # its error line
        line += f": {failure.last_line()}"
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
    rank still running after `timeout_s`."""
    check_devices(device, world_size)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="speculant-ranks-") as tmp:
        paths = [Path(tmp) / f"rank{r}.pkl" for r in range(world_size)]

        def rank_args(rank: int) -> tuple:
            return (rank, world_size, port, device, fn, tuple(args), str(paths[rank]))

        processes = _start(_function_rank, world_size, rank_args)
        ranks = [_Rank(r, p) for r, p in enumerate(processes)]
        failure = _supervise(ranks, timeout_s, grace_s)
        results = []
        for rank, path in enumerate(paths):
            status = pickle.loads(path.read_bytes()) if path.is_file() else ("missing",)
            if status[0] == "error" and failure is not None and f"rank {rank} " in failure:
                failure += f" ({status[1]})"
            results.append(status[1] if status[0] == "ok" else None)
        if failure is not None:
            raise RankFailure(failure)
        return results


def launch_cli(argv: Sequence[str], world_size: int, device: str, stderr: TextIO) -> int:
    """Run `speculant ARGV` as `world_size` local ranks and return the job's exit status: 0 when
    every rank succeeded, rank 0's status when it alone reported (a user error prints one line
    there), else 1 with one line naming the failed and the stuck ranks."""
    check_devices(device, world_size)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="speculant-ranks-") as tmp:
        logs = [Path(tmp) / f"rank{r}.log" for r in range(world_size)]

        ranks = []
        try:
            for rank in range(world_size):
                env = {**os.environ, **rank_env(rank, world_size, port)}
                env.update(SPECULANT_RANK_DEVICE=device, NCCL_NVLS_ENABLE="0")
                if device == "cpu":  # share the cores instead of oversubscribing them
                    env.setdefault(
                        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size))
                    )
                cmd = [sys.executable, "-m", "speculant.launch.spawn", *argv]
                if rank == 0:  # rank 0 keeps this terminal: it writes the outputs
                    handle = subprocess.Popen(cmd, env=env)
                else:
                    with open(logs[rank], "wb") as log:
                        handle = subprocess.Popen(
                            cmd, env=env, stdout=subprocess.DEVNULL, stderr=log
                        )
                ranks.append(_Rank(rank, _Proc(handle), logs[rank] if rank > 0 else None))
        except BaseException:
            for r in ranks:
                r.process.kill()
            raise
        try:
            failure = _supervise(ranks, None, GRACE_S)
        except KeyboardInterrupt:
            for r in ranks:
                r.process.kill()
            print("speculant: interrupted", file=stderr)
            return 130
        if failure is None:
            return 0
        codes = [r.process.exitcode for r in ranks]
        if codes[0] == 2 and all(c in (0, 2) for c in codes):
            return 2  # a user error: rank 0 printed it as one line already
        print(f"speculant: error: {failure}", file=stderr)
        return 1


if __name__ == "__main__":
    cli_rank_main(sys.argv[1:])
