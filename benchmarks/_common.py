"""What the two-rank GPU benchmarks (moe_engine_gpu.py, parallel_gpu.py) share: NVLink multicast
off, their first options, the run header, random prompts, and starting the ranks on checkpoints
in a temporary folder then collecting the report rank 0 wrote; and what every results JSON
records of the machine it ran on. torch loads inside the functions, so a script can turn
multicast off before anything imports it."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

MULTICAST_OFF = (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
)


def nvlink_multicast_off() -> None:
    """No NVLink multicast in NCCL, symmetric memory or NVSHMEM (shared/GPU.md), unless the
    environment says otherwise; call before torch is imported."""
    for name, value in MULTICAST_OFF:
        os.environ.setdefault(name, value)


def machine(device: str) -> str:
    """The machine a run measured, for its results JSON, without touching the GPU (a CUDA
    context in the parent would shrink the KV pool its child processes size from free memory):
    the GPUs as nvidia-smi names them on CUDA, else the CPU's model and core count."""
    gpu = ""
    if device.startswith("cuda"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                 "--format=csv,noheader"]  # fmt: skip
        try:
            gpus = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            gpus = ""
        if gpus.strip():
            return "; ".join(line.strip() for line in gpus.splitlines() if line.strip())
        gpu = "GPU not named (no nvidia-smi), "
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"{gpu}{cpu}, {os.cpu_count()} cores"


def cuda_median_ms(fn: Callable, *args, iters: int, warmup: int = 3) -> float:
    """The median over `iters` calls of fn(*args) on the current CUDA stream, in ms, each
    timed by CUDA events and synchronised, after `warmup` untimed calls."""
    import statistics

    import torch

    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_info(device: str, argv: list[str] | None = None) -> dict:
    """What every results JSON starts with: the command line (`argv` when main() was given
    one), the date (UTC) and the machine."""
    args = sys.argv[1:] if argv is None else argv
    return {
        "command": " ".join(["python", sys.argv[0], *args]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(device),
    }


def write_rows(out: str | None, name: str, rows: list[dict], argv: list[str] | None) -> None:
    """A CUDA benchmark's rows into OUT/name (when --out was given), after run_info."""
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(
            json.dumps({**run_info("cuda", argv), "rows": rows}, indent=1)
        )


def rank_parser(doc: str, json_name: str, quick_help: str) -> argparse.ArgumentParser:
    """A parser with the options every two-rank benchmark takes first: --out, --device, --quick."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", required=True, help=f"folder for {json_name}")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


def parse_rank_args(
    parser: argparse.ArgumentParser, argv: list[str] | None, cpu_iters: int
) -> argparse.Namespace:
    """Parse; on the CPU (a check of the script) time at most `cpu_iters` iterations."""
    args = parser.parse_args(argv)
    if args.device == "cpu":
        args.iters = min(args.iters, cpu_iters)
    return args


def prompts_of(lengths, seed: int, vocab: int) -> list[list[int]]:
    """Random prompts of the given lengths (ids from 3: no special tokens)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def run_header(cuda: bool, **after_gpu) -> dict:
    """The command line, date, torch version, GPU name, `after_gpu` and NCCL version of a run."""
    import torch

    return {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        **after_gpu,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
    }


def run_and_collect(
    rank_main: Callable,
    args: argparse.Namespace,
    json_name: str,
    write_checkpoints: Callable[[Path], tuple[str, str]],
    world: int,
) -> dict:
    """Run `rank_main(args, target, head)` on `world` ranks, on the checkpoints
    `write_checkpoints` puts in a temporary folder, within `args.budget_s`. Returns the report
    rank 0 wrote to `args.out/json_name` with `wall_s` and `error` (a rank's failure) added,
    written back, after printing where it is and the error."""
    from speculant.launch.spawn import RankFailure, run_ranks

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / json_name
    path.unlink(missing_ok=True)  # never report an older run's results
    start, error = time.perf_counter(), None
    prefix = json_name.removesuffix(".json").replace("_", "-") + "-"
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        target, head = write_checkpoints(Path(tmp))
        try:
            run_ranks(
                rank_main,
                world,
                (args, target, head),
                device=args.device,
                timeout_s=args.budget_s - (time.perf_counter() - start),
            )
        except RankFailure as exc:
            error = str(exc)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(wall_s=time.perf_counter() - start, error=error)
    path.write_text(json.dumps(data, indent=2, default=str))
    print(f"\nwall {data['wall_s']:.0f} s; results in {path}")
    if error:
        print(f"error: {error}")
    return data
