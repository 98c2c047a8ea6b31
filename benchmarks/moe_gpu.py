"""MoE token movement over N GPUs (2 by default, 4 for issue 12: `--nproc-per-node 4`): DeepEP
low-latency dispatch + combine vs the NCCL all-to-all
dispatcher vs a single-GPU dense reference, on dummy Qwen3-MoE layers, eager and inside CUDA
graphs; and the cost and the necessity of cleaning DeepEP's low-latency buffer before a replay.

    timeout 400 torchrun --standalone --nproc-per-node 2 benchmarks/moe_gpu.py --out $OUT

Run from the repository root (`speculant` is imported from it when it is not installed). The
DeepEP rows need the `tokenspeed-deepep==1.2.1.post20251110` wheel and are skipped without it.
Every rank writes OUT/moe_gpu_rank{r}.json after each phase, so a hang still leaves the phases
done; rank 0 writes the merged OUT/moe_gpu.json and prints a table last. A watchdog ends a phase
that hangs (os._exit(3)); the end is a barrier and os._exit(0), never a process-group teardown.

Per config (hidden 2048 with 128 experts top-8, intermediate 768, the Qwen3-30B-A3B shape; and 8
experts top-2, intermediate 1024) and tokens per rank T (max_tokens_per_rank 128):
  - correctness in bf16: each backend's layer (dispatch, experts, combine) eager and replayed from
    a CUDA graph on fresh inputs equals the reference (LocalDispatcher, every expert on one GPU,
    valid rows only) within a relative error of 2e-2 (DeepEP FP8 dispatch: 8e-2);
  - time per layer inside a graph (CUDA events, median of 50 replays): dispatch + combine alone
    (identity experts; `comm_us`) and the whole layer (`layer_us`), DeepEP with the adapter's
    mode reset and clean before each replay, as the engine runs it;
  - DeepEP normal mode (prefill, eager) at T = 128 and 512, and uneven / idle ranks (every rank
    but 0 with 17 or 0 tokens) for all2all and DeepEP low-latency.
DeepEP buffer cleaning (128 experts, T = 64): the clean alone, replay with vs without it, and
whether results change without it: back-to-back replays, replays after eager low-latency layers,
and (last, riskiest) after an eager normal-mode layer with the NORMAL -> LL clean bypassed.
"""

from __future__ import annotations

import os

for _var, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
):
    os.environ[_var] = _value

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

try:
    import speculant  # noqa: F401
except ImportError:  # a plain checkout: expose the repository root as `speculant`
    _link = Path(tempfile.mkdtemp()) / "speculant"
    _link.symlink_to(Path(__file__).resolve().parents[1])
    sys.path.insert(0, str(_link.parent))

from speculant.comm.moe_dispatch import AllToAllDispatcher, LocalDispatcher  # noqa: E402
from speculant.models.loader import default_device_and_dtype  # noqa: E402
from speculant.models.qwen3_moe import Experts  # noqa: E402

CONFIGS = {
    "e128_top8": dict(hidden=2048, experts=128, top_k=8, inter=768),
    "e8_top2": dict(hidden=2048, experts=8, top_k=2, inter=1024),
}
TOKENS = (1, 16, 64, 128)
MAX_TOKENS = 128  # max_tokens_per_rank: DeepEP's num_max_dispatch_tokens_per_rank
TOL, TOL_FP8 = 2e-2, 8e-2
ITERS = 50


class Bench:
    """One rank's state: groups, results so far, the phase watchdog."""

    def __init__(self, out_dir: Path, deadline_s: float):
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        torch.cuda.set_device(local_rank)
        self.device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=self.device, timeout=timedelta(seconds=120))
        self.host = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
        self.out_dir = out_dir
        self.results: dict = {"rows": [], "deepep": {}, "errors": [], "phases_done": []}
        self.end_at = time.monotonic() + deadline_s
        self.timer: threading.Timer | None = None

    def save(self) -> None:
        path = self.out_dir / f"moe_gpu_rank{self.rank}.json"
        path.write_text(json.dumps(self.results, indent=1, default=str))

    def phase(self, name: str, fn, limit_s: float = 120.0) -> None:
        """Run one phase under a watchdog; record its error instead of stopping the run."""
        left = self.end_at - time.monotonic()
        if left < 10:
            self.results["errors"].append(f"{name}: skipped, out of time")
            return
        self.timer = threading.Timer(min(limit_s, left), self._hung, args=(name,))
        self.timer.daemon = True
        self.timer.start()
        try:
            fn()
            self.results["phases_done"].append(name)
        except Exception:
            self.results["errors"].append(f"{name}: {traceback.format_exc(limit=4)}")
        finally:
            self.timer.cancel()
            self.save()
        torch.cuda.synchronize()
        dist.barrier(group=self.host)

    def _hung(self, name: str) -> None:
        self.results["errors"].append(f"{name}: timed out (hung); exiting")
        self.save()
        print(f"[rank {self.rank}] phase {name} hung; exiting", flush=True)
        os._exit(3)


# ------------------------------------------------------------------ layers and inputs


def make_experts(cfg: dict, rank: int, world: int, device) -> tuple[Experts, Experts]:
    """(every expert, this rank's experts) with the same weights on every rank."""
    E, H, inter = cfg["experts"], cfg["hidden"], cfg["inter"]
    local = E // world
    with default_device_and_dtype(device, torch.bfloat16):
        full = Experts(E, H, inter, 0, E)
        mine = Experts(E, H, inter, rank * local, local)
    gen = torch.Generator(device=device).manual_seed(1234)
    with torch.no_grad():
        full.gate_up_proj.normal_(0.0, H**-0.5, generator=gen)
        full.down_proj.normal_(0.0, inter**-0.5, generator=gen)
        mine.gate_up_proj.copy_(full.gate_up_proj[rank * local : (rank + 1) * local])
        mine.down_proj.copy_(full.down_proj[rank * local : (rank + 1) * local])
    return full, mine


def make_inputs(cfg: dict, num_tokens: int, seed: int, device):
    """Random bf16 tokens and a softmax top-k routing (renormalised), fresh for every seed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, cfg["hidden"], device=device, generator=gen).bfloat16()
    logits = torch.randn(num_tokens, cfg["experts"], device=device, generator=gen)
    weights, ids = torch.softmax(logits, dim=-1).topk(cfg["top_k"], dim=-1)
    return x, ids, weights / weights.sum(-1, keepdim=True)


def moe_layer(dispatcher, experts, x, ids, weights, identity: bool = False):
    """Dispatch, experts (dense batched matmuls, as inside a graph), combine."""
    tokens, handle = dispatcher.dispatch(x, ids, weights)
    out = tokens.hidden if identity else experts(tokens, dense=True)
    return dispatcher.combine(out, handle)


def rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    if got.shape != expected.shape:
        return float("inf")
    if expected.numel() == 0:
        return 0.0
    diff = (got.float() - expected.float()).norm()
    return (diff / expected.float().norm().clamp_min(1e-6)).item()


def capture(bench: Bench, fn, hooks):
    """Warm up on a side stream, then capture `fn` (hooks' capture() first); returns the graph
    and its static output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            for hook in hooks:
                hook.replay()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    dist.barrier(group=bench.host)
    graph = torch.cuda.CUDAGraph()
    for hook in hooks:
        hook.capture()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        out = fn()
    torch.cuda.synchronize()
    dist.barrier(group=bench.host)
    return graph, out


def time_us(bench: Bench, fn, iters: int = ITERS) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group=bench.host)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def replay_fn(graph, hooks):
    def run():
        for hook in hooks:
            hook.replay()
        graph.replay()

    return run


# ------------------------------------------------------------------ phases


def run_backend(bench, cfg_name, cfg, T, backend, dispatcher, experts, reference, hooks, tol):
    """Eager and graph correctness on fresh inputs, and graph timings, for one backend."""
    dev, seed0 = bench.device, 1000 * T + 17 * bench.rank
    row = {"config": cfg_name, "T": T, "backend": backend}
    eager = []
    for trial in range(2):
        x, ids, w = make_inputs(cfg, T, seed0 + trial, dev)
        for hook in hooks:
            hook.replay()
        eager.append(rel_err(moe_layer(dispatcher, experts, x, ids, w), reference(x, ids, w)))
    x_buf, ids_buf, w_buf = make_inputs(cfg, T, seed0 + 99, dev)
    layer_graph, layer_out = capture(
        bench, lambda: moe_layer(dispatcher, experts, x_buf, ids_buf, w_buf), hooks
    )
    comm_graph, comm_out = capture(
        bench, lambda: moe_layer(dispatcher, experts, x_buf, ids_buf, w_buf, True), hooks
    )
    graph_err, comm_err = [], []
    for trial in range(3):
        x, ids, w = make_inputs(cfg, T, seed0 + 10 + trial, dev)
        x_buf.copy_(x), ids_buf.copy_(ids), w_buf.copy_(w)
        replay_fn(layer_graph, hooks)()
        replay_fn(comm_graph, hooks)()
        torch.cuda.synchronize()
        graph_err.append(rel_err(layer_out, reference(x, ids, w)))
        comm_err.append(rel_err(comm_out, x.float() * w.sum(-1, keepdim=True)))
    row.update(
        eager_err=max(eager),
        graph_err=max(graph_err),
        comm_err=max(comm_err),
        ok=max(eager + graph_err) < tol and max(comm_err) < tol,
        comm_us=time_us(bench, replay_fn(comm_graph, hooks)),
        layer_us=time_us(bench, replay_fn(layer_graph, hooks)),
    )
    bench.results["rows"].append(row)
    del layer_graph, comm_graph


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="folder for the JSON results")
    parser.add_argument("--deadline", type=float, default=370.0, help="seconds for all phases")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(out_dir, args.deadline)
    if bench.world < 2:
        print("run on 2 or more GPUs (torchrun --nproc-per-node N)", file=sys.stderr)
        os._exit(2)
    rank, world, dev = bench.rank, bench.world, bench.device
    bench.results["env"] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "nccl": str(torch.cuda.nccl.version()),
        "command": f"torchrun --nproc-per-node {bench.world} " + " ".join(sys.argv),
    }
    try:
        from importlib.metadata import version

        import deep_ep  # noqa: F401

        bench.results["env"]["deep_ep"] = version("tokenspeed-deepep")
        have_deepep = True
    except Exception as exc:  # ImportError, or metadata of another DeepEP build
        have_deepep = "deep_ep" in sys.modules
        bench.results["env"]["deep_ep"] = "installed" if have_deepep else f"missing ({exc})"

    weights = {name: make_experts(cfg, rank, world, dev) for name, cfg in CONFIGS.items()}

    def reference_for(name):
        local, full = LocalDispatcher(CONFIGS[name]["experts"]), weights[name][0]

        def reference(x, ids, w):
            tokens, handle = local.dispatch(x, ids, w)
            return local.combine(full(tokens, dense=False), handle)

        return reference

    def torch_backends():
        for name, cfg in CONFIGS.items():
            full, mine = weights[name]
            a2a = AllToAllDispatcher(cfg["experts"], world, rank, MAX_TOKENS, cpu_group=bench.host)
            local = LocalDispatcher(cfg["experts"], MAX_TOKENS)
            for T in TOKENS:
                ref = reference_for(name)
                run_backend(bench, name, cfg, T, "local_1gpu", local, full, ref, [], TOL)
                run_backend(bench, name, cfg, T, "all2all", a2a, mine, ref, [], TOL)

    bench.phase("all2all_and_local", torch_backends, limit_s=150)

    eps = {}
    if have_deepep:
        from speculant.comm.deepep import DeepEPBuffer

        def create_buffer():
            # one deep_ep.Buffer (NVSHMEM initialises once per process), sized for 128 experts;
            # the 8-expert config reuses it through its own wrapper (layouts follow num_experts)
            big = DeepEPBuffer.create(None, 2048, 128, MAX_TOKENS, decode_tokens=MAX_TOKENS)
            for name, cfg in CONFIGS.items():
                eps[name] = DeepEPBuffer(
                    big.buffer, cfg["hidden"], cfg["experts"], MAX_TOKENS, big.topk_dtype
                )

        bench.phase("deepep_buffer", create_buffer, limit_s=120)

    def deepep_low_latency():
        from speculant.comm.deepep import DeepEPDispatcher, DispatchMode

        for name, cfg in CONFIGS.items():
            ep, mine = eps[name], weights[name][1]
            ep.set_mode(DispatchMode.LOW_LATENCY, clean=True)  # another config used it last
            for fp8 in (False, True):
                d = DeepEPDispatcher(ep, world, rank, use_fp8=fp8, cpu_group=bench.host)
                for T in TOKENS:
                    backend = "deepep_ll_fp8" if fp8 else "deepep_ll"
                    tol = TOL_FP8 if fp8 else TOL
                    ref = reference_for(name)
                    run_backend(bench, name, cfg, T, backend, d, mine, ref, d.replay_hooks(), tol)

    def deepep_normal_and_uneven():
        from speculant.comm.deepep import DeepEPDispatcher, DispatchMode

        for name, cfg in CONFIGS.items():
            ep, mine = eps[name], weights[name][1]
            d = DeepEPDispatcher(ep, world, rank, cpu_group=bench.host)
            a2a = AllToAllDispatcher(cfg["experts"], world, rank, MAX_TOKENS, cpu_group=bench.host)
            ref = reference_for(name)
            for T in (128, 512):  # normal mode: any T, eager only
                ep.set_mode(DispatchMode.NORMAL)
                x, ids, w = make_inputs(cfg, T, 7000 + T + rank, dev)
                err = rel_err(moe_layer(d, mine, x, ids, w), ref(x, ids, w))
                bench.results["rows"].append(
                    dict(config=name, T=T, backend="deepep_normal", eager_err=err, ok=err < TOL)
                )
            for other in (17, 0):  # rank 1 has fewer tokens, or none (an idle DP rank)
                T = 64 if rank == 0 else other
                x, ids, w = make_inputs(cfg, T, 8000 + other + rank, dev)
                ep.set_mode(DispatchMode.LOW_LATENCY)
                for backend, disp in (("deepep_ll", d), ("all2all", a2a)):
                    err = rel_err(moe_layer(disp, mine, x, ids, w), ref(x, ids, w))
                    bench.results["rows"].append(
                        dict(
                            config=name,
                            T=f"64/{other}",
                            backend=f"{backend}_uneven",
                            eager_err=err,
                            ok=err < TOL,
                        )
                    )

    def clean_cost_and_need(bypass: bool):
        """128 experts, T = 64: clean alone; replay with/without; results without it."""
        from speculant.comm.deepep import DeepEPDispatcher, DeepEPGraphAdapter, DispatchMode

        name, T = "e128_top8", 64
        cfg, ep, mine = CONFIGS[name], eps[name], weights[name][1]
        d = DeepEPDispatcher(ep, world, rank, cpu_group=bench.host)
        ref = reference_for(name)
        x_buf, ids_buf, w_buf = make_inputs(cfg, T, 9000 + rank, dev)
        with_clean, without = DeepEPGraphAdapter(ep), DeepEPGraphAdapter(ep, False)
        graph, out = capture(bench, lambda: moe_layer(d, mine, x_buf, ids_buf, w_buf), [with_clean])
        report = bench.results["deepep"]

        def check(tag: str, trials: int, between=None):
            bad, worst = 0, 0.0
            for trial in range(trials):
                if between is not None:
                    between(trial)
                x, ids, w = make_inputs(cfg, T, 9100 + 31 * trial + rank, dev)
                x_buf.copy_(x), ids_buf.copy_(ids), w_buf.copy_(w)
                replay_fn(graph, [without])()
                err = rel_err(out, ref(x, ids, w))
                bad, worst = bad + (err >= TOL), max(worst, err)
            report[tag] = {"trials": trials, "wrong": bad, "worst_err": worst}
            bench.save()

        if not bypass:
            report["clean_us"] = time_us(bench, ep.clean_low_latency_buffer)
            report["replay_with_clean_us"] = time_us(bench, replay_fn(graph, [with_clean]))
            report["replay_without_clean_us"] = time_us(bench, replay_fn(graph, [without]))
            check("no_clean_back_to_back", 20)

            def eager_ll(trial):  # an eager low-latency layer (a decode step too big for graphs)
                x, ids, w = make_inputs(cfg, 32, 9500 + trial + rank, dev)
                moe_layer(d, mine, x, ids, w)

            check("no_clean_after_eager_ll", 10, eager_ll)
            return

        def eager_normal_then_bypass(trial):  # a prefill in normal mode, then no clean at all
            ep.set_mode(DispatchMode.NORMAL)
            x, ids, w = make_inputs(cfg, 200, 9700 + trial + rank, dev)
            moe_layer(d, mine, x, ids, w)
            ep.mode = DispatchMode.LOW_LATENCY  # skips the NORMAL -> LL clean on purpose

        check("no_clean_after_normal_mode", 5, eager_normal_then_bypass)

    if eps:
        bench.phase("deepep_low_latency", deepep_low_latency, limit_s=150)
        bench.phase("deepep_normal_and_uneven", deepep_normal_and_uneven, limit_s=60)
        bench.phase("deepep_clean", lambda: clean_cost_and_need(False), limit_s=60)
        bench.phase("deepep_clean_bypass", lambda: clean_cost_and_need(True), limit_s=45)

    gathered = [None] * world
    dist.all_gather_object(gathered, bench.results, group=bench.host)
    if rank == 0:
        merged = merge(gathered)
        (out_dir / "moe_gpu.json").write_text(json.dumps(merged, indent=1, default=str))
        print_table(merged)
    sys.stdout.flush()
    dist.barrier(group=bench.host)
    os._exit(0)


def merge(per_rank: list[dict]) -> dict:
    """Worst error and slowest time over the ranks, per row."""
    merged = {
        "env": per_rank[0].get("env"),
        "errors": {r: res["errors"] for r, res in enumerate(per_rank) if res["errors"]},
        "rows": [],
        "deepep": per_rank[0]["deepep"],
        "deepep_per_rank": [res["deepep"] for res in per_rank],
    }
    for rows in zip(*(res["rows"] for res in per_rank), strict=False):
        row = dict(rows[0])
        for key in ("eager_err", "graph_err", "comm_err", "comm_us", "layer_us"):
            if key in row:
                row[key] = max(r[key] for r in rows)
        row["ok"] = all(r["ok"] for r in rows)
        merged["rows"].append(row)
    return merged


def print_table(merged: dict) -> None:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    print(f"\nMoE dispatch on {len(merged['deepep_per_rank'])} GPUs ({merged['env']})")
    print("| config | T/rank | backend | ok | eager err | graph err | comm us | layer us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in merged["rows"]:
        print(
            f"| {r['config']} | {r['T']} | {r['backend']} | {'yes' if r['ok'] else 'NO'} | "
            f"{fmt(r.get('eager_err'), '.1e')} | {fmt(r.get('graph_err'), '.1e')} | "
            f"{fmt(r.get('comm_us'), '.1f')} | {fmt(r.get('layer_us'), '.1f')} |"
        )
    for key, value in merged["deepep"].items():
        print(f"deepep {key}: {value}")
    for rank, errors in merged["errors"].items():
        for error in errors:
            print(f"rank {rank} error: {error.strip().splitlines()[-1]}")


if __name__ == "__main__":
    sys.exit(main())
