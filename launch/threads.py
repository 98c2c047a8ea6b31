"""Intra-op threads for a CPU run: as many as the model's size can use and the cores are free.

A small model's matmuls are too short to split, and on a busy machine every extra thread waits
for a core: the bundled run generated 5-45x slower with two threads than with one while other
jobs kept a 2-core machine busy (README, CPU threads). So the CLI sets torch's threads to
min(cores free / ranks, one per PARAMS_PER_THREAD parameters); `--threads N` or
OMP_NUM_THREADS choose instead.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from speculant.config import safetensors_headers
from speculant.errors import SpeculantError

log = logging.getLogger("speculant")

PARAMS_PER_THREAD = 50_000_000  # below this a thread's share of a matmul is too short to pay


def checkpoint_params(path: str | Path) -> int | None:
    """Parameters in a checkpoint's *.safetensors files, read from their headers (no weights
    are loaded); None when the folder has none (a dummy-weights run)."""
    total, found = 0, False
    for header in safetensors_headers(path):
        found = True
        total += sum(math.prod(entry.get("shape", ())) for entry in header.values())
    return total if found else None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; all of them where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_threads(requested: int | None) -> None:
    """Refuse a --threads above the CPUs this process may use: beyond them threads only wait
    for a core (3000 ran 100x slower), and OpenMP crashes creating 1e8 of them."""
    cpus = usable_cpus()
    if requested is not None and requested > cpus:
        raise SpeculantError(
            f"--threads {requested} is more than the {cpus} CPU(s) this process may use; pass "
            f"--threads 1..{cpus}, or leave it out to choose by the model's size"
        )


def free_cores() -> tuple[int, float]:
    """Cores this process may run on, and the 1-minute load average (0 where unknown)."""
    cores = usable_cpus()
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return cores, load


def choose_num_threads(num_params: int | None, cores: int, load: float, ranks: int = 1) -> int:
    """Threads for one rank: the cores not busy (cores - load, at least 1) shared by `ranks`
    processes on this machine, at most one per PARAMS_PER_THREAD parameters (all threads when
    the size is unknown)."""
    free = max(1, round(cores - load))
    threads = max(1, free // ranks)
    if num_params is not None:
        threads = min(threads, max(1, num_params // PARAMS_PER_THREAD))
    return threads


def set_cpu_threads(requested: int | None, checkpoints: list[str | None], ranks: int = 1) -> None:
    """Set torch's intra-op threads for a CPU run: `requested` (--threads) if given, else
    OMP_NUM_THREADS's if set (torch read it at start), else `choose_num_threads` for the
    checkpoints' parameters and the free cores."""
    check_threads(requested)  # the CLI checks it before any model loads; accept-rate here
    import torch

    if requested is None and os.environ.get("OMP_NUM_THREADS"):
        return
    if requested is None:
        sizes = [checkpoint_params(c) for c in checkpoints if c]
        num_params = None if None in sizes else sum(sizes)
        cores, load = free_cores()
        requested = choose_num_threads(num_params, cores, load, ranks)
        log.info(
            "CPU threads: %d (%s parameters, %d cores, load %.1f; --threads N to choose)",
            requested,
            "unknown" if num_params is None else f"{num_params / 1e6:.1f} M",
            cores,
            load,
        )
    torch.set_num_threads(requested)
