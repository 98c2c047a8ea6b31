"""The Ray launcher: `python -m speculant.launch.ray generate|accept-rate --tp N --dp M ...`.

The process running this module is the driver (no rank: a RANK in its environment is ignored).
It checks the flags and reads the prompts (and an accept-rate baseline) before anything starts,
connects to a Ray cluster (`--ray-address`, else RAY_ADDRESS as set inside `ray job submit`;
`ray.init` then gets no resource arguments, the cluster's own count; an address nothing answers
at within CONNECT_S is refused) or starts a local one (a CPU per rank at least, as spawn's ranks
share the cores), and reserves one placement-group bundle per rank: {"GPU": 1, "CPU": 1}, or
{"CPU": 1} with --device cpu; STRICT_PACK when one node has enough of them, else PACK over
several nodes. One actor per bundle runs one rank: the same per-rank worker as torchrun and
`speculant generate --tp/--dp` (`cli.generate_in_rank`, `accept_rate.measure_in_rank`). Ranks
are numbered node by node (bundle order within a node), so with TP innermost a TP group stays on
one node when each node holds a multiple of tp ranks. torch.distributed starts from rank 0's
node IP and a port found free on that node.

The driver sends rank 0 the prompts, rank 0 spreads them over the DP ranks (executor/dp.py)
and returns every output in input order, and puts each on a Ray queue as its request finishes;
the driver alone writes --output from that queue (an absolute path is safest: a job runs in a
copy of its working dir) or prints the outputs as one process does, then the summary. Without
--output, the completions finished when a run stops (Ctrl-C, SIGTERM) or fails are printed
before its last line. Under `ray job submit` that output is the job's log.

Stops: Ray blocks SIGINT in its workers, so a terminal's Ctrl-C never reaches the actors, and a
rank killed at once loses the requests it finished in the step before that step's gather to rank
0 (and rank 0 what it had not queued yet). On Ctrl-C or SIGTERM the driver asks the ranks to
stop (`StopRequest`, an async actor each rank's `stop_requests` thread waits on): each rank then
gets SIGINT in its main thread, recorded by `Engine.generate` (executor/stops.py), and every rank
stops at the same step boundary after rank 0 queued that step's outputs. The driver drains the
queue while it waits for them (`stop_ranks`, at most GRACE_S seconds) and then tears the job down
as after any run: a rank still running is killed; a second Ctrl-C stops at once.

GPUs: Ray sets CUDA_VISIBLE_DEVICES in each actor to the one GPU of its bundle (there it would
be cuda:0, LOCAL_RANK 0). NCCL's peer-to-peer (CUDA IPC over NVLink) needs the peers' GPUs
visible, so, as Ray Train does, each actor's CUDA_VISIBLE_DEVICES is widened, before CUDA
starts in it, to the GPUs Ray gave this job's ranks on its node, in rank order, and LOCAL_RANK
is its index there: the engine's cuda:LOCAL_RANK (and `torch.cuda.set_device`) is the GPU of
its own bundle, and no other job's GPU becomes visible. With
RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 Ray leaves every GPU visible and LOCAL_RANK is
the GPU id Ray assigned.

Failures: the driver waits on every actor with timeouts. When one fails (its process died, or
it raised: a peer's death or a collective timeout reaches the others within --dist-timeout),
the others get GRACE_S seconds to finish, the rest are killed, and the driver prints one line
naming the failed rank (a dead actor before the ranks that saw it die) and exits 1 (2 for a
user error such as a too-long prompt), after the teardown, so that the line is the last of the
log. Actors and the placement group are removed at exit, on success, failure, Ctrl-C (exit 130)
and SIGTERM (`ray job stop`, exit 143); a local cluster the driver started is shut down. A
driver that dies (SIGKILL included) takes its actors with it: Ray kills the non-detached
actors of a job whose driver is gone. A placement that the cluster's total resources can never
hold is refused at once. Ray's colour codes stay out of logs that are not a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

from speculant.errors import PromptError, SpeculantError
from speculant.executor.stops import DeferredStops
from speculant.launch.paths import open_output, write_errors_named, write_lines
from speculant.launch.spawn import GRACE_S, Terminated, close_progress_bars, stopped_line

log = logging.getLogger("speculant")
POLL_S = 0.5  # how often the driver looks at the actors
CONNECT_S = 10.0  # how long a named cluster's head gets to answer before the driver gives up
WATCH_S = 0.2  # how often a rank's stop watcher looks whether its run has ended


class RankWorker:
    """One rank in a Ray actor (wrapped with `ray.remote` by the driver)."""

    def where(self) -> tuple[str, str, list[str]]:
        """(node IP, node id, GPU ids Ray assigned) of this actor."""
        import ray

        gpu_ids = [str(gpu) for gpu in ray.get_gpu_ids()]
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), gpu_ids

    def free_port(self) -> int:
        """A TCP port free on this node a moment ago (rank 0's: MASTER_PORT)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def run(
        self,
        env: dict[str, str],
        command: str,
        args: argparse.Namespace,
        job: Any,
        outputs_queue: Any = None,
        stop: Any = None,
    ) -> Any:
        """Join the job described by `env` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) and
        run this rank's part of `command`; rank 0 returns what the driver reports, and puts
        each finished request's output on `outputs_queue` (the driver writes or keeps them).
        A stop the driver asks for through `stop` (a StopRequest) reaches this rank as Ctrl-C
        does (`stop_requests`)."""
        os.environ.update(env)
        rank0 = env["RANK"] == "0"
        level = logging.DEBUG if args.debug else logging.INFO if rank0 else logging.WARNING
        logging.basicConfig(level=level, format="speculant: %(message)s")
        if command == "generate":
            from speculant.launch.cli import generate_in_rank

            def on_output(out: Any) -> None:
                outputs_queue.put(out)

            streamed = on_output if outputs_queue is not None and rank0 else None
            with stop_requests(stop):
                outputs, seconds = generate_in_rank(args, job, on_output=streamed, use_tqdm=False)
            return (outputs, seconds) if outputs is not None else None
        from speculant.launch.accept_rate import measure_in_rank

        return measure_in_rank(args, job, use_tqdm=False)


class StopRequest:
    """The driver's request that the ranks stop (an async Ray actor): each rank's `wait` returns
    once the driver calls `set` (Ctrl-C or SIGTERM to the driver)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def set(self) -> None:
        self.event.set()

    async def wait(self) -> bool:
        await self.event.wait()
        return True


@contextlib.contextmanager
def stop_requests(stop: Any) -> Iterator[None]:
    """While the body runs in this actor's main thread, the driver's stop request (`stop`, a
    StopRequest handle) reaches it as SIGINT, as a terminal's Ctrl-C reaches a spawned rank: a
    streaming multi-rank `Engine.generate` records it and every rank stops at the same step
    boundary, after rank 0 queued that step's outputs (executor/stops.py); elsewhere it raises
    KeyboardInterrupt. Ray's workers block SIGINT: it is unblocked in the main thread alone, for
    the body."""
    if stop is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    import ray

    main, done = threading.get_ident(), threading.Event()

    def watch() -> None:
        asked = stop.wait.remote()
        while not done.is_set():
            if ray.wait([asked], timeout=WATCH_S)[0]:
                try:
                    ray.get(asked)
                except Exception:  # the driver (and its StopRequest) is gone: Ray ends us
                    return
                if not done.is_set():
                    signal.pthread_kill(main, signal.SIGINT)
                return

    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    watcher = threading.Thread(target=watch, name="speculant-stop-watcher", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=2 * WATCH_S)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        signal.signal(signal.SIGINT, handler)


@dataclass
class _Place:
    ip: str
    node_id: str
    gpu_ids: list[str]


def rank_order(places: Sequence[_Place]) -> list[int]:
    """Bundle indices in rank order: node by node (nodes in the order their first bundle comes),
    bundle order within a node, so consecutive ranks (a TP group) share a node."""
    nodes = list(dict.fromkeys(p.node_id for p in places))
    return sorted(range(len(places)), key=lambda i: (nodes.index(places[i].node_id), i))


def rank_envs(places: Sequence[_Place], order: Sequence[int], port: int, device: str) -> list:
    """The environment of each rank (in rank order), as torchrun would set it."""
    master = places[order[0]]
    keep_gpus_visible = os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES")
    forwarded = {k: v for k, v in os.environ.items() if k.startswith("SPECULANT_")}
    envs = []
    for rank, index in enumerate(order):
        place = places[index]
        on_node = [i for i in order if places[i].node_id == place.node_id]
        env = {
            **forwarded,
            "RANK": str(rank),
            "WORLD_SIZE": str(len(order)),
            "LOCAL_RANK": str(on_node.index(index)),
            "LOCAL_WORLD_SIZE": str(len(on_node)),
            "MASTER_ADDR": master.ip,
            "MASTER_PORT": str(port),
            "SPECULANT_RANK_DEVICE": device,
            "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),  # shared/GPU.md
        }
        if device.startswith("cuda") and keep_gpus_visible:  # Ray left every GPU visible
            env["LOCAL_RANK"] = place.gpu_ids[0]
        elif device.startswith("cuda"):  # the node's ranks see the node's job GPUs, in rank order
            env["CUDA_VISIBLE_DEVICES"] = ",".join(places[i].gpu_ids[0] for i in on_node)
        envs.append(env)
    return envs


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise SpeculantError(
            "the Ray launcher needs Ray; pip install 'speculant[ray]' (or use torchrun)"
        ) from exc
    return ray


def _cause(exc: BaseException) -> BaseException:
    """The exception an actor raised, unwrapped from Ray's RayTaskError."""
    return getattr(exc, "cause", None) or exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _died_detail(exc: BaseException) -> str:
    """How an actor's process ended, from Ray's ActorDiedError text (one short clause)."""
    text = " ".join(str(exc).split())
    detail = re.search(r"Worker exit detail: (.*?)(?:\.|$)", text)
    if detail:
        return f"its Ray actor's process exited ({detail.group(1).strip()})"
    return text.split(". ")[0] if text else "its Ray actor died"


def check_placeable(total: dict[str, float], bundle: dict[str, float], world: int) -> None:
    """Refuse at once a placement group that the cluster's total resources can never hold
    (rather than waiting --dist-timeout for it)."""
    short = [key for key, need in bundle.items() if total.get(key, 0) < need * world]
    if not short:
        return
    have = " and ".join(f"{total.get(key, 0):g} {key}s" for key in short)
    hint = "; for CPU ranks start the head with `ray start --head --num-cpus N`" if (
        "CPU" in short and "GPU" not in bundle
    ) else ""  # fmt: skip
    raise SpeculantError(
        f"Ray cannot place {world} bundles of {bundle} (--tp x --dp = {world}): the cluster "
        f"has {have} in all; lower --tp/--dp or add nodes{hint}"
    )


class _Job:
    """The placement group and actors of one run, torn down by `close`."""

    def __init__(self, ray: Any):
        self.ray, self.pg, self.actors, self.stop = ray, None, [], None

    def stop_request(self) -> Any:
        """A StopRequest actor for the ranks to wait on (no CPU: the placement group holds every
        CPU the ranks need), removed by `close`."""
        self.stop = self.ray.remote(num_cpus=0)(StopRequest).remote()
        return self.stop

    def place(self, world: int, device: str, timeout_s: float) -> str:
        from ray.util.placement_group import placement_group

        ray = self.ray
        key = "GPU" if device.startswith("cuda") else "CPU"
        bundle = {"GPU": 1, "CPU": 1} if key == "GPU" else {"CPU": 1}
        check_placeable(ray.cluster_resources(), bundle, world)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        per_node = max((n["Resources"].get(key, 0) for n in nodes), default=0)
        strategy = "STRICT_PACK" if per_node >= world else "PACK"
        self.pg = placement_group([bundle] * world, strategy=strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            total = ray.cluster_resources().get(key, 0)
            raise SpeculantError(
                f"Ray could not place {world} bundles of {bundle} ({strategy}) within "
                f"{timeout_s:.0f} s; the cluster has {total:g} {key}s in all and at most "
                f"{per_node:g} on one node: lower --tp/--dp, free resources or add nodes"
            )
        return strategy

    def start(self, world: int, device: str, timeout_s: float) -> list[_Place]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        worker = ray.remote(RankWorker)
        for index in range(world):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index)
            self.actors.append(
                worker.options(
                    num_cpus=1,
                    num_gpus=1 if device.startswith("cuda") else 0,
                    scheduling_strategy=strategy,
                    max_restarts=0,
                ).remote()
            )
        refs = [actor.where.remote() for actor in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            raise SpeculantError(f"Ray actors did not start within {timeout_s:.0f} s")
        places = []
        for index, ref in enumerate(refs):
            try:
                places.append(_Place(*ray.get(ref)))
            except Exception as exc:  # e.g. speculant is not installed on that node
                raise SpeculantError(
                    f"the actor of bundle {index} did not start ({_first_line(_cause(exc))}); "
                    "install speculant (the same version) on every node"
                ) from exc
        return places

    def close(self) -> None:
        """Kill every actor (GPU ranks end without NCCL destructors, as spawn's os._exit) and
        remove the placement group."""
        for actor in [*self.actors, *([self.stop] if self.stop is not None else [])]:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:  # the cluster is gone
                pass
        self.actors, self.pg, self.stop = [], None, None


def supervise(
    ray: Any, refs: dict[Any, int], grace_s: float, on_poll: Callable[[], None] = lambda: None
) -> tuple[dict, list, list[int]]:
    """Wait for every rank's result: ({rank: result}, [(rank, error)] in the order seen, ranks
    still running `grace_s` after the first failure). `on_poll` runs every poll."""
    results, errors, pending = {}, [], list(refs)
    failed_at = None
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
        on_poll()
        for ref in done:
            try:
                results[refs[ref]] = ray.get(ref)
            except Exception as exc:  # the actor raised, or its process died
                errors.append((refs[ref], exc))
                failed_at = failed_at or time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            break
    return results, errors, sorted(refs[ref] for ref in pending)


def stop_ranks(
    ray: Any, stop: Any, refs: Sequence[Any], stop_s: float, on_poll: Callable[[], None]
) -> None:
    """Ask every rank to stop (`stop`, their StopRequest) and wait up to `stop_s` seconds for
    their runs to end, running `on_poll` (the queue's drain) every poll: the ranks stop at one
    step boundary after rank 0 queued that step's outputs, so none they finished is lost. Ranks
    still running are left to the teardown, which kills them; a second Ctrl-C ends the wait."""
    with contextlib.suppress(Exception):  # its actor is gone: the ranks are killed after stop_s
        stop.set.remote()
    pending, deadline = list(refs), time.monotonic() + stop_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(POLL_S, left))
        on_poll()


def failure_line(ray: Any, errors: list, stuck: list[int], grace_s: float) -> tuple[str, bool]:
    """One line naming the failed rank (a dead actor before the ranks that saw it die), and
    whether it is a user error (every failure a SpeculantError or ValueError)."""
    died = [(rank, exc) for rank, exc in errors if isinstance(exc, ray.exceptions.RayActorError)]
    if died:
        rank, exc = min(died, key=lambda item: item[0])
        line = f"rank {rank} died: {_died_detail(exc)}"
    elif errors:
        rank, exc = errors[0]
        cause = _cause(exc)
        line = f"rank {rank} failed: {type(cause).__name__}: {_first_line(cause)}"
    else:
        line = "no rank reported"
    if stuck:
        names = ", ".join(map(str, stuck))
        line += f"; rank(s) {names} did not finish {grace_s:.0f} s after that and were killed"
    user = bool(errors) and not died and not stuck
    user = user and all(isinstance(_cause(e), (SpeculantError, ValueError)) for _, e in errors)
    return line, user


class OutputQueueLost(Exception):
    """The queue actor between rank 0 and the driver died: no more outputs can arrive."""


class _Finished:
    """Rank 0's outputs as requests finish: its actor puts each on a Ray queue that the driver
    drains every poll and once more at the end, writing them to --output, or, without
    --output, keeping them to print those that finished when the run stops or fails."""

    def __init__(self, path: str | None):
        from ray.util.queue import Queue

        self.path, self.file, self.kept, self.written = path, None, [], 0
        # no CPU: the placement group holds every CPU the ranks need
        self.queue = Queue(actor_options={"num_cpus": 0})

    def drain(self) -> None:
        """Write (or keep) what rank 0 queued since the last drain. A Ctrl-C or SIGTERM waits
        until the batch taken off the queue is written (or kept): raised in between, it lost
        them. A write to a pipe or device, which may block, stays interruptible."""
        size = self._from_queue(self.queue.qsize)
        if not size:
            return
        if self.path is not None and self.file is None:  # a FIFO's open waits for a reader
            with write_errors_named(self.path, "--output"):
                self.file = open_output(self.path)
        regular = self.file is None or stat.S_ISREG(os.fstat(self.file.fileno()).st_mode)
        with DeferredStops() if regular else contextlib.nullcontext():
            batch = self._from_queue(lambda: self.queue.get_nowait_batch(size))
            if self.path is None:
                self.kept.extend(batch)
                return
            with write_errors_named(self.path, "--output"):
                write_lines(self.file, (out.json_line() for out in batch))
            self.written += len(batch)

    def _from_queue(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:  # its actor died (killed, Ray's out-of-memory killer)
            where = f"are in {self.path}" if self.path else "are printed above"
            raise OutputQueueLost(
                f"the Ray actor that carries rank 0's finished outputs to this driver died "
                f"({type(exc).__name__}: {_first_line(exc)}); the run cannot deliver more "
                f"outputs, the {len(self.kept) if self.path is None else self.written} "
                f"finished before it {where}"
            ) from None

    def close(self) -> None:
        """Drain the rest and close the file (a write error raises, naming --output); the
        queue's actor is removed in any case."""
        try:
            try:
                self.drain()
            except SpeculantError:
                raise
            except Exception:  # the queue's actor is gone with the cluster: keep what came
                pass
        finally:
            file, self.file = self.file, None
            with contextlib.suppress(Exception):
                self.queue.shutdown()
            if file is not None:
                with write_errors_named(self.path, "--output"):
                    file.close()

    def print_kept(self, stdout: TextIO, specs: list) -> None:
        """Print the completions kept (no --output) of a run that stopped or failed, in input
        order, as one process does: what finished is not lost."""
        if self.kept:
            from speculant.launch.cli import print_completions

            print_completions(sorted(self.kept, key=lambda out: out.key), stdout, specs)
            stdout.flush()


def check_address(address: str, timeout_s: float = CONNECT_S) -> None:
    """Refuse at once a cluster address that nothing answers at (a typo, a head that is gone,
    `auto` reading a stale /tmp/ray/ray_current_cluster), which ray.init would retry for many
    minutes. Ray Client addresses (ray://) are left to ray.init."""
    if "://" in address:
        return
    try:  # HOST:PORT as ray.init reads `address` (`auto`: RAY_ADDRESS, then the last `ray start`)
        from ray._private.services import canonicalize_bootstrap_address_or_die as resolve
    except ImportError:  # another Ray version's internals: ray.init decides
        return
    resolved = address
    try:
        resolved = resolve(address)
        host, _, port = resolved.rpartition(":")
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:  # refused, unknown host, timed out; `auto`: none here
        where = address if resolved == address else f"{address} = {resolved}"
        raise SpeculantError(
            f"no Ray cluster answers at {where} (--ray-address or RAY_ADDRESS): "
            f"{_first_line(exc).rstrip('.')}; start one with `ray start --head`, fix the "
            "address, or unset it to start a local cluster"
        ) from None


def run_driver(
    args: argparse.Namespace,
    address: str | None,
    stdout: TextIO,
    stderr: TextIO,
    stop_on_sigterm: bool = False,
    grace_s: float = GRACE_S,
) -> int:
    """Check and read the inputs, run every rank in a Ray actor, report; the exit status. The
    driver holds the --output lock (cli.output_lock) for the run: it writes the file."""
    from speculant.launch import accept_rate, cli

    # The driver is no rank: a RANK left in its environment (a launcher's, a PyTorchJob pod's)
    # would make it read no prompts. The actors get theirs from rank_envs.
    os.environ.pop("RANK", None)
    if args.command == "generate":
        job: Any = cli._prepare(args)
        empty: Any = []
    else:
        job = accept_rate.prepare_accept(args)
        empty = replace(job, specs=[], baseline=None)
    # What the actors (and Ray itself) print to their stdout reaches the driver's sys.stdout
    # (Ray's log streaming): sent to stderr, so that stdout holds the completions alone.
    with cli.output_lock(args.output if args.command == "generate" else None):
        with contextlib.redirect_stdout(stderr):
            return _drive(args, address, job, empty, stdout, stderr, stop_on_sigterm, grace_s)


def _drive(args, address, job, empty, stdout, stderr, stop_on_sigterm, grace_s) -> int:
    """`run_driver` once the inputs are read and --output is locked."""
    from speculant.launch import accept_rate, cli

    ray = _import_ray()
    connected_here = not ray.is_initialized()
    if connected_here:
        before = _children()
        try:
            _connect(ray, address, args.tp * args.dp)
            if stop_on_sigterm:  # after ray.init, whose handlers exit the process instead
                signal.signal(signal.SIGTERM, _stop_on_sigterm)
        except SystemExit:  # SIGTERM while ray.init ran: its handlers raise SystemExit
            _abandon_start(ray, before, signal.SIGTERM)
            raise Terminated from None
        except KeyboardInterrupt as exc:  # Ctrl-C (or our SIGTERM handler) while ray.init ran
            _abandon_start(ray, before, signal.SIGTERM if isinstance(exc, Terminated) else
                           signal.SIGINT)  # fmt: skip
            raise
    elif stop_on_sigterm:
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    run, finished = _Job(ray), None
    try:
        if args.command == "generate":
            finished = _Finished(args.output)
        result, ending = _run_ranks(args, job, empty, ray, run, finished, grace_s)
    except OutputQueueLost as exc:  # the ranks are stopped; what arrived is kept
        result, ending = None, (f"speculant: error: {exc}", 1)
    except BaseException:  # Ctrl-C, SIGTERM: the finished completions are printed all the same
        _teardown(ray, run, finished, connected_here)
        if finished is not None:
            finished.print_kept(stdout, job)
        raise
    _teardown(ray, run, finished, connected_here)
    if ending is not None:
        if finished is not None:
            finished.print_kept(stdout, job)
        close_progress_bars()
        print(ending[0], file=stderr, flush=True)
        return ending[1]
    if args.command == "generate":
        outputs, seconds = result
        cli.report_outputs(args, outputs, seconds, stdout, stderr, write_file=False, specs=job)
        return 0
    return accept_rate.report_accept(args, job, *result, stdout=stdout, stderr=stderr)


def _connect(ray: Any, address: str | None, world: int) -> None:
    """Join the cluster at `address` (refused at once when nothing answers there), else start a
    local one with a CPU per rank at least (CPU ranks share the cores, as spawn's do)."""
    if address:
        check_address(address)
        ray.init(address=address)  # the cluster's resources; none of ours
    else:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, world), include_dashboard=False)


def _children() -> set[int]:
    """This process's descendants (psutil: Ray's own copy, importable once ray is), or none."""
    try:
        import psutil
    except ImportError:
        return set()
    with contextlib.suppress(psutil.Error):
        return {child.pid for child in psutil.Process().children(recursive=True)}
    return set()


def _abandon_start(ray: Any, before: set[int], stop: signal.Signals) -> None:
    """A SIGTERM or Ctrl-C (`stop`) stopped ray.init part way: shut down what it registered,
    and kill what it had started that Ray did not yet know of (the raylet's agents were left
    running otherwise)."""
    signal.signal(stop, signal.SIG_IGN)  # one teardown: the same signal again waits for it
    started = _children() - before  # before ray.shutdown orphans the raylet's own children
    with contextlib.suppress(Exception):
        ray.shutdown()
    if not started:
        return
    import psutil

    for pid in started:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


def _run_ranks(args, job, empty, ray, run, finished, grace_s) -> tuple[Any, tuple | None]:
    """Place and start the actors, run every rank, wait for them: (rank 0's result, None), or
    (None, (the failure's line, exit status)) when a rank failed."""
    world = args.tp * args.dp
    if args.device is None:
        args.device = "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
    strategy = run.place(world, args.device, args.dist_timeout)
    places = run.start(world, args.device, args.dist_timeout)
    order = rank_order(places)
    port = ray.get(run.actors[order[0]].free_port.remote(), timeout=args.dist_timeout)
    envs = rank_envs(places, order, port, args.device)
    nodes = {places[i].node_id for i in order}
    log.info(
        "ray: %d rank(s) on %d node(s) (%s), rank 0 at %s:%d",
        world, len(nodes), strategy, places[order[0]].ip, port,
    )  # fmt: skip
    _warn_split_tp(places, order, args.tp)
    stop = run.stop_request() if finished is not None else None
    refs = {}  # each rank's result; rank 0 alone gets the inputs and streams its outputs
    for rank, index in enumerate(order):
        inputs = job if rank == 0 else empty
        queue = finished.queue if rank == 0 and finished is not None else None
        ref = run.actors[index].run.remote(envs[rank], args.command, args, inputs, queue, stop)
        refs[ref] = rank
    on_poll = finished.drain if finished is not None else lambda: None
    try:
        results, errors, stuck = supervise(ray, refs, grace_s, on_poll=on_poll)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM: what the ranks finished is drained first
        if stop is not None:
            stop_ranks(ray, stop, list(refs), grace_s, on_poll)
        raise
    if not errors and not stuck:
        return results[0], None
    line, user = failure_line(ray, errors, stuck, grace_s)
    if user:  # every rank checks the same inputs: rank 0's (or the lowest) error, its line named
        cause = _cause(min(errors, key=lambda item: item[0])[1])
        if isinstance(cause, PromptError):
            from speculant.launch.cli import prompt_named

            cause = prompt_named(cause, job if args.command == "generate" else job.specs)
        return None, (f"speculant: error: {_first_line(cause)}", 2)
    return None, (f"speculant: error: {line}", 1)


def _teardown(ray: Any, run: _Job, finished: _Finished | None, connected_here: bool) -> None:
    """Kill the actors, then write (or keep) what finished: nothing reaches the queue after
    its last drain; a cluster the driver started ends last, so that no actor's log line comes
    after the driver's last line."""
    try:
        run.close()
        if finished is not None:
            finished.close()
    finally:
        if connected_here:
            ray.shutdown()


def _warn_split_tp(places: Sequence[_Place], order: Sequence[int], tp: int) -> None:
    for start in range(0, len(order), tp):
        if len({places[i].node_id for i in order[start : start + tp]}) > 1:
            log.warning(
                "ray: the TP group of ranks %d-%d spans nodes; its all-reduces cross the "
                "network (give each node a multiple of tp GPUs)",
                start, start + tp - 1,
            )  # fmt: skip


PROG = "python -m speculant.launch.ray"
DESCRIPTION = (
    "The Ray launcher: runs `speculant generate|accept-rate` with one Ray actor per rank "
    "(--tp N --dp M) on the cluster at --ray-address (else RAY_ADDRESS, else a local cluster it "
    "starts); this driver reads the prompts and writes --output or prints the completions."
)


def _ray_flags(parser: argparse.ArgumentParser) -> None:
    """--ray-address in each --help (parsed by main's outer parser, before or after the
    command: SUPPRESS leaves it out of the command's namespace)."""
    parser.add_argument_group("ray").add_argument(
        "--ray-address",
        metavar="ADDR",
        default=argparse.SUPPRESS,
        help="the Ray cluster to join: HOST:PORT, ray://HOST:PORT or auto (default: "
        "RAY_ADDRESS, as `ray job submit` sets it, else a local cluster started for the job)",
    )


def main(argv: Sequence[str] | None = None, stop_on_sigterm: bool = False) -> int:
    """Entry point: `python -m speculant.launch.ray [--ray-address ADDR] generate|accept-rate
    ...`; returns the exit status. `stop_on_sigterm`: SIGTERM (`ray job stop`) tears the job
    down as Ctrl-C does."""
    from speculant.launch.cli import _Parser, build_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    outer = _Parser(prog=PROG, add_help=False, allow_abbrev=False)
    outer.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS") or None)
    known, rest = outer.parse_known_args(argv)  # --ray-address before or after the command
    parser = build_parser(PROG, DESCRIPTION, launcher_flags=_ray_flags)  # --help shows both
    args = parser.parse_args(rest)  # a bad flag: one line, exit 2
    args.argv = rest
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO, format="speculant: %(message)s"
    )
    if not sys.stderr.isatty():  # a log file (`ray job submit`, a redirect): no colour codes
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if stop_on_sigterm:  # from here; ray.init sets its own for a while (see _drive)
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return run_driver(args, known.ray_address, sys.stdout, sys.stderr, stop_on_sigterm)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated)
        # Our SIGTERM handler ran (it ignores the next one): Ray's wait re-raises it as a plain
        # KeyboardInterrupt.
        ran = stop_on_sigterm and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        close_progress_bars()
        line, code = stopped_line(Terminated() if ran else exc, getattr(args, "output", None), True)
        print(line, file=sys.stderr)
        return code
    except (SpeculantError, ValueError, OSError) as exc:
        if args.debug:
            raise
        close_progress_bars()
        print(f"speculant: error: {exc}".splitlines()[0], file=sys.stderr)
        return 2


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one teardown: a second SIGTERM waits for it
    raise Terminated  # `ray job stop` sends SIGTERM: tear down as on Ctrl-C, exit 143


if __name__ == "__main__":
    sys.exit(main(stop_on_sigterm=True))
