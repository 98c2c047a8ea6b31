"""The measured FP8 path table (issue 24): per GPU name and projection shape (N x K), the
fastest kernels/fp8.py path and its config by row count M, as benchmarks/fp8_sweep.py writes
it and kernels/fp8_tuned.json holds it:

    {"capability": {"NVIDIA H200": [9, 0]},
     "devices": {"NVIDIA H200": {"4096x4096": [
        {"max_m": 1, "path": "splitk", "config": [16, 1024, 4, "atomic"], "us": 9.8}, ...]}}}

Rows are by increasing `max_m` (the M they were measured at); M takes the first row whose
`max_m` holds. The table is measured on a few GPUs and one model's shapes, so `lookup` borrows
where it has no exact row (the configs fit any N and K; only their speed was measured
elsewhere): first this GPU's rows of the exact shape, then this GPU's nearest shape (by
|log2 N/N'| + |log2 K/K'|, among shapes with a row for M), then the same two on the other GPUs
of this GPU's compute capability (an H100 takes an H200's rows). Nothing found (another
architecture, M above every row, `borrow` off): None, and kernels/fp8.py falls back to its
per-M choice."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

TUNED_PATH = Path(__file__).with_name("fp8_tuned.json")
GPU_ONLY = ("scaled_mm",)  # paths the router takes only on CUDA


class Table(dict):
    """{device name: {(N, K): [(max_m, path, config), ...] by max_m}}, with each device's
    compute capability (`capability`: {name: (major, minor)}) and whether `lookup` may borrow
    rows of other shapes and devices (`borrow`). `lookup`'s answers are kept (an eager step asks
    once per projection and layer): after changing rows in place, call `changed()`."""

    def __init__(self, rows=(), capability=None, borrow: bool = True):
        super().__init__(rows)
        self.capability = dict(capability or {})
        self.borrow = borrow
        self.changed()

    def changed(self) -> None:
        """Forget the answers kept for lookups (the rows changed)."""
        self.hits: dict = {}
        self.top_m = max((r[0] for shapes in self.values() for rows in shapes.values()
                          for r in rows), default=0)  # fmt: skip


def load(path: str | Path = TUNED_PATH, borrow: bool = True) -> Table:
    """The table in `path` (an empty one without a file); `borrow` as Table's."""
    path = Path(path)
    if not path.exists():
        return Table(borrow=borrow)
    doc = json.loads(path.read_text())
    table = Table(borrow=borrow)
    for device, shapes in doc.get("devices", {}).items():
        for shape, rows in shapes.items():
            n, k = (int(v) for v in shape.split("x"))
            entries = sorted((int(r["max_m"]), r["path"], _frozen(r.get("config"))) for r in rows)
            table.setdefault(device, {})[(n, k)] = entries
    table.capability = {name: tuple(cc) for name, cc in doc.get("capability", {}).items()}
    table.changed()
    return table


def _frozen(config):
    """A JSON config as the launchers take it: lists to tuples, dicts kept."""
    return tuple(config) if isinstance(config, list) else config


def to_json(rows: dict, capability: dict | None = None) -> dict:
    """The JSON document of {device: {(N, K): [(max_m, path, config, us), ...]}}."""
    devices: dict = {}
    for device, shapes in rows.items():
        for (n, k), entries in sorted(shapes.items()):
            devices.setdefault(device, {})[f"{n}x{k}"] = [
                {"max_m": m, "path": path, "config": config, "us": round(us, 2)}
                for m, path, config, us in sorted(entries, key=lambda e: e[0])
            ]
    doc = {"devices": devices}
    if capability:
        doc["capability"] = {name: list(cc) for name, cc in capability.items()}
    return doc


@functools.cache
def device_name(device: torch.device) -> str:
    """The table's key for `device`: the CUDA device name, else its type ("cpu")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int] | None:
    """`device`'s CUDA compute capability, None off CUDA (or with no GPU to ask)."""
    if device.type != "cuda":
        return None
    try:
        return tuple(torch.cuda.get_device_capability(device))
    except (RuntimeError, AssertionError):  # no driver (the CPU-side compile checks)
        return None


def _row(rows, m: int):
    """(path, config) of the first row of `rows` whose max_m holds for m, else None."""
    for max_m, path, config in rows or ():
        if m <= max_m:
            return path, config
    return None


def _nearest(shapes: dict, n: int, k: int, m: int):
    """The row for m of the shape nearest (N, K) among `shapes` that have one, else None."""
    best = None
    for (sn, sk), rows in sorted(shapes.items()):
        hit = _row(rows, m)
        if hit is not None:
            distance = abs(math.log2(sn / n)) + abs(math.log2(sk / k))
            if best is None or distance < best[0]:
                best = (distance, hit)
    return None if best is None else best[1]


def lookup(table: dict, device: torch.device, n: int, k: int, m: int):
    """(path, config) for (device, N, K, M) as the module doc says, or None."""
    hits = getattr(table, "hits", None)
    if hits is None:  # a plain dict: nothing kept
        return _lookup(table, device, n, k, m)
    key = (device_name(device), device.type, n, k, min(m, table.top_m + 1))  # above every row
    if key not in hits:
        hits[key] = _lookup(table, device, n, k, m)
    return hits[key]


def _lookup(table: dict, device: torch.device, n: int, k: int, m: int):
    name = device_name(device)
    names = [name]
    if getattr(table, "borrow", False):
        capability = getattr(table, "capability", {})
        own = capability.get(name) or device_capability(device)
        if own is not None:
            names += sorted(d for d in table if d != name and capability.get(d) == own)
    hit = None
    for source in names:
        shapes = table.get(source, {})
        hit = _row(shapes.get((n, k)), m)
        if hit is None and getattr(table, "borrow", False):
            hit = _nearest(shapes, n, k, m)
        if hit is not None:
            break
    if hit is None or (hit[0] in GPU_ONLY and device.type != "cuda"):
        return None
    return hit
