"""The measured FP8 path table (issue 24): per GPU name and projection shape (N x K), the
fastest kernels/fp8.py path and its config by row count M, as benchmarks/fp8_sweep.py writes
it and kernels/fp8_tuned.json holds it:

    {"devices": {"NVIDIA H200": {"4096x4096": [
        {"max_m": 1, "path": "splitk", "config": [16, 1024, 4, "atomic"], "us": 9.8}, ...]}}}

Rows are by increasing `max_m` (the M they were measured at); M takes the first row whose
`max_m` holds. A device, a shape, or an M above the last row not in the table: `lookup` gives
None and kernels/fp8.py falls back to its per-M PATH_TABLE."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

TUNED_PATH = Path(__file__).with_name("fp8_tuned.json")
GPU_ONLY = ("scaled_mm",)  # paths the router takes only on CUDA


def load(path: str | Path = TUNED_PATH) -> dict:
    """{device name: {(N, K): [(max_m, path, config), ...] by max_m}}; {} without a file."""
    path = Path(path)
    if not path.exists():
        return {}
    raw = json.loads(path.read_text()).get("devices", {})
    table: dict = {}
    for device, shapes in raw.items():
        for shape, rows in shapes.items():
            n, k = (int(v) for v in shape.split("x"))
            entries = sorted((int(r["max_m"]), r["path"], _frozen(r.get("config"))) for r in rows)
            table.setdefault(device, {})[(n, k)] = entries
    return table


def _frozen(config):
    """A JSON config as the launchers take it: lists to tuples, dicts kept."""
    return tuple(config) if isinstance(config, list) else config


def to_json(rows: dict) -> dict:
    """The JSON document of {device: {(N, K): [(max_m, path, config, us), ...]}}."""
    devices: dict = {}
    for device, shapes in rows.items():
        for (n, k), entries in sorted(shapes.items()):
            devices.setdefault(device, {})[f"{n}x{k}"] = [
                {"max_m": m, "path": path, "config": config, "us": round(us, 2)}
                for m, path, config, us in sorted(entries, key=lambda e: e[0])
            ]
    return {"devices": devices}


@functools.cache
def device_name(device: torch.device) -> str:
    """The table's key for `device`: the CUDA device name, else its type ("cpu")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def lookup(table: dict, device: torch.device, n: int, k: int, m: int):
    """(path, config) of the table's row for (device, N, K, M), or None (see the module doc)."""
    rows = table.get(device_name(device), {}).get((n, k))
    for max_m, path, config in rows or ():
        if m <= max_m:
            if path in GPU_ONLY and device.type != "cuda":
                return None
            return path, config
    return None
