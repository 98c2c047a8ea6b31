"""The `ParallelContext`: which DP group and TP rank this process is, passed explicitly to every
layer (there are no module-level process groups).

Ranks form a (dp, tp) mesh with TP innermost: global rank = dp_rank * tp + tp_rank, so at tp=2
ranks 0 and 1 form the first TP group; the EP group is every rank (a MoE target's experts are
split over all of them). Device collectives (TP all-reduce and all-gather, expert dispatch) run on
NCCL on GPUs and gloo on CPUs; host-side objects (requests, outputs, the per-step DP batch
exchange, barriers) always go over gloo groups. Every group has a bounded timeout, so a dead or
stuck rank makes the others fail instead of hanging."""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from speculant.comm.store_call import interruptible_call
from speculant.errors import SpeculantError

DEFAULT_TIMEOUT_S = 300.0
JOIN_BOUND_FACTOR, JOIN_BOUND_MARGIN_S = 1.5, 15.0  # a join given up on past timeout x 1.5 + 15
MIN_NCCL_FOR_GRAPHS = (2, 9, 6)  # collectives inside CUDA graphs


@dataclass
class ParallelContext:
    """Ranks and groups of one process. TP is innermost: global rank = dp_rank * tp + tp_rank."""

    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    tp_group: Any = None  # device backend, the TP ranks of this DP rank
    dp_group: Any = None  # device backend, the ranks with this tp_rank across DP ranks
    cpu_group: Any = None  # gloo group over all ranks for host-side objects
    dp_cpu_group: Any = None  # gloo twin of dp_group (the per-step DP batch exchange)
    ep_group: Any = None  # device backend, every rank: MoE experts are split over all of them
    local_rank: int = 0  # GPU index on this node
    backend: str = "none"  # device backend: "nccl", "gloo", or "none" for one process
    timeout_s: float = DEFAULT_TIMEOUT_S
    one_shot: Any = None  # comm/all_reduce.OneShotAllReduce for small TP all-reduces, or None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank

    @property
    def ep_size(self) -> int:
        """Expert-parallel ranks: all of them (EP rank = global rank)."""
        return self.world_size

    @classmethod
    def single(cls) -> ParallelContext:
        """One process, no groups."""
        return cls()

    @classmethod
    def from_env(
        cls,
        tp: int,
        dp: int,
        device: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        options: dict[str, Any] | None = None,
    ) -> ParallelContext:
        """Join the job described by RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
        (set by `speculant generate --tp/--dp`, torchrun or a Ray actor); `options` (flag ->
        value) must be rank 0's on every rank (`check_same_options`)."""
        missing = [v for v in ("RANK", "WORLD_SIZE") if v not in os.environ]
        if missing:
            raise SpeculantError(
                f"tp={tp} x dp={dp} needs {tp * dp} processes but {missing[0]} is not set; "
                f"run `speculant generate --tp {tp} --dp {dp}` (it starts them) or torchrun"
            )
        return cls.init(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            tp=tp,
            dp=dp,
            device=device,
            local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("MASTER_PORT", "29500")),
            timeout_s=timeout_s,
            options=options,
        )

    @classmethod
    def init(
        cls,
        rank: int,
        world_size: int,
        tp: int,
        dp: int,
        device: str,
        local_rank: int = 0,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        options: dict[str, Any] | None = None,
    ) -> ParallelContext:
        """Initialise torch.distributed (unless already done) and build the (dp, tp) groups,
        once every rank has the same tp, dp and `options` (`check_same_options`)."""
        check_world(world_size, tp, dp)
        if not 0 <= rank < world_size:
            raise SpeculantError(f"rank {rank} is outside world size {world_size}")
        cuda = str(device).startswith("cuda")
        if cuda:
            check_nccl()
            torch.cuda.set_device(local_rank)
        backend = "nccl" if cuda else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if not dist.is_initialized():

            def join() -> None:  # waits for every rank; a stop meanwhile ends this one
                if cuda:
                    torch.cuda.set_device(local_rank)  # the current device is per thread
                dist.init_process_group(
                    backend=backend,
                    init_method=f"tcp://{master_addr}:{master_port}",
                    rank=rank,
                    world_size=world_size,
                    timeout=timeout,
                )

            # gloo's join has waited 45-60 s past a 20 s timeout for a peer that died while
            # joining (a helper audit): given up on past a bound, as a failed join
            bound = JOIN_BOUND_FACTOR * timeout_s + JOIN_BOUND_MARGIN_S
            try:
                interruptible_call(join, "speculant-join", bound_s=bound)
            except TimeoutError:
                raise RuntimeError(
                    f"the ranks did not all join within {bound:.0f} s (--dist-timeout "
                    f"{timeout_s:g} s and a margin): a rank died or stopped while joining, or "
                    f"cannot reach {master_addr}:{master_port}"
                ) from None
        elif dist.get_world_size() != world_size:
            check_world(dist.get_world_size(), tp, dp)
        # Every rank creates every group, in the same order (new_group is collective): first
        # the host group over all ranks, on which the ranks' flags are compared before any
        # group that depends on them is made
        cpu_group = _my_group([list(range(world_size))], rank, "gloo", timeout)
        check_same_options(cpu_group, {"--tp": tp, "--dp": dp, **(options or {})})
        pctx = cls(
            tp_size=tp,
            tp_rank=rank % tp,
            dp_size=dp,
            dp_rank=rank // tp,
            local_rank=local_rank,
            backend=backend,
            timeout_s=timeout_s,
        )
        tp_ranks = [list(range(d * tp, (d + 1) * tp)) for d in range(dp)]
        dp_ranks = [list(range(t, world_size, tp)) for t in range(tp)]
        pctx.cpu_group = cpu_group
        pctx.tp_group = _my_group(tp_ranks, rank, backend, timeout)
        pctx.dp_group = _my_group(dp_ranks, rank, backend, timeout)
        pctx.dp_cpu_group = (
            pctx.dp_group if backend == "gloo" else _my_group(dp_ranks, rank, "gloo", timeout)
        )
        everyone = [list(range(world_size))]
        pctx.ep_group = (
            pctx.cpu_group if backend == "gloo" else _my_group(everyone, rank, backend, timeout)
        )
        return pctx

    # ------------------------------------------------------------------ device collectives

    def all_reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the TP group (identity at tp=1): small tensors through the one-shot
        kernel into a new tensor when `one_shot` is set, else NCCL (or gloo) in place. Use the
        returned tensor."""
        if self.tp_size > 1:
            if self.one_shot is not None and self.one_shot.fits(x):
                return self.one_shot(x)
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_tp(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate the TP shards of `x` along `dim` (identity at tp=1)."""
        if self.tp_size == 1:
            return x
        # One flat output buffer (no list of outputs): the form that NCCL captures in a graph.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        out = x.new_empty((self.tp_size * x.shape[0], *x.shape[1:]))  # shards along dim 0
        gather(out, x.contiguous(), group=self.tp_group)
        return torch.cat(out.view(self.tp_size, *x.shape).unbind(0), dim=dim)

    # ------------------------------------------------------------------ host-side (gloo)

    def barrier(self) -> None:
        """Wait for every rank (bounded by the group timeout)."""
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def all_gather_dp(self, values: list[int]) -> list[list[int]]:
        """The ints `values` of every DP rank, in DP-rank order (the per-step DP exchange)."""
        if self.dp_size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.dp_size)]
        dist.all_gather(parts, mine, group=self.dp_cpu_group)
        return [p.tolist() for p in parts]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` of global rank `src`, on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """`obj` of every rank, in global-rank order."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """`obj` of every rank on global rank `dst` (None elsewhere)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self.cpu_group)
        return out

    def gather_with_flag(self, obj: Any, flag: int, dst: int = 0) -> tuple[list[Any] | None, int]:
        """`obj` of every rank on global rank `dst` (None elsewhere; a falsy obj arrives as None)
        and, on every rank, the largest of the ranks' `flag`s: one all-gather of two ints a rank,
        then a gather of the pickled objects only when some rank has one."""
        if self.world_size == 1:
            return [obj], flag
        data = pickle.dumps(obj) if obj else b""
        head = torch.tensor([len(data), flag], dtype=torch.int64)
        heads = [torch.empty_like(head) for _ in range(self.world_size)]
        dist.all_gather(heads, head, group=self.cpu_group)
        sizes, top = [int(h[0]) for h in heads], max(int(h[1]) for h in heads)
        if max(sizes) == 0:
            return ([None] * self.world_size if self.rank == dst else None), top
        mine = torch.zeros(max(sizes), dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in sizes] if self.rank == dst else None
        dist.gather(mine, parts, dst=dst, group=self.cpu_group)
        if parts is None:
            return None, top
        return [pickle.loads(p[:n].numpy().tobytes()) if n else None
                for p, n in zip(parts, sizes, strict=True)], top  # fmt: skip

    def store(self) -> Any:
        """The job's key-value store (the default process group's TCPStore or FileStore), or None
        without one (one process, or torch.distributed not initialised). Host-side counters
        that must not wait on other ranks use it (executor/dp.JobProgress): no collective."""
        if self.world_size == 1 or not dist.is_initialized():
            return None
        try:
            return dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):  # a torch without it, or no store
            return None

    def close(self) -> None:
        """Barrier, then tear the gloo groups down. NCCL groups are left to process exit:
        destroying them after CUDA-graph capture has hung (ranks end with `os._exit`)."""
        if self.world_size > 1 and dist.is_initialized():
            self.barrier()
            if self.backend == "gloo":
                dist.destroy_process_group()


def resolve_context(pctx: ParallelContext | None, tp: int, dp: int, device: str) -> ParallelContext:
    """An engine's context: the one given (tp/dp options left at 1 take its sizes), else one
    process when tp * dp == 1, else the job in the environment (`speculant generate --tp/--dp`
    or torchrun)."""
    if pctx is None:
        return (
            ParallelContext.single() if tp * dp == 1 else ParallelContext.from_env(tp, dp, device)
        )
    if (tp, dp) not in ((1, 1), (pctx.tp_size, pctx.dp_size)):
        raise SpeculantError(
            f"tp={tp} x dp={dp} does not match the ParallelContext's tp={pctx.tp_size} x "
            f"dp={pctx.dp_size}; pass one or the other"
        )
    return pctx


def check_same_options(group: Any, options: dict[str, Any]) -> None:
    """Every rank's `options` must be rank 0's: ranks of a torchrun job started with other
    flags (another --tp/--dp split, --num-draft-tokens, --seed, --dtype) would create other
    groups (a hang until --dist-timeout), exchange mismatched tensors (a crash) or sample other
    tokens. Each rank raises the same line, naming the first flag and rank that differ.
    `group`: a gloo group over every rank (None: one rank, nothing to compare)."""
    if group is None:
        return
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, options, group=group)
    for rank, theirs in enumerate(every[1:], start=1):
        for flag, ours in every[0].items():
            if theirs.get(flag) != ours:
                raise SpeculantError(
                    f"{flag} is {theirs.get(flag)!r} on rank {rank} but {ours!r} on rank 0; "
                    "start every rank of the job with the same flags"
                )


def _my_group(rank_lists: list[list[int]], rank: int, backend: str, timeout: timedelta):
    """Create one group per rank list (all ranks call this alike); return the one holding
    `rank`, or None for single-rank groups (nothing to communicate)."""
    mine = None
    for ranks in rank_lists:
        if len(ranks) == 1:
            continue
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            mine = group
    return mine


def check_world(world_size: int, tp: int, dp: int) -> None:
    """A clear error when the number of processes does not match dp x tp."""
    if tp < 1 or dp < 1 or world_size != tp * dp:
        raise SpeculantError(
            f"world size {world_size} != dp {dp} x tp {tp}; launch dp*tp ranks or change --tp/--dp"
        )


def check_nccl() -> None:
    """NCCL collectives inside CUDA graphs need NCCL >= 2.9.6."""
    version = torch.cuda.nccl.version()
    if isinstance(version, int):  # older torch encodes 2.9.6 as 20906 (2.8.4 as 2804)
        v = version
        version = (
            (v // 10000, v // 100 % 100, v % 100)
            if v >= 10000
            else (v // 1000, v // 100 % 10, v % 100)
        )
    if tuple(version[:3]) < MIN_NCCL_FOR_GRAPHS:
        raise SpeculantError(
            f"NCCL {'.'.join(map(str, version))} is too old for collectives inside CUDA graphs "
            "(need >= 2.9.6); install a torch build with a newer NCCL or pass --enforce-eager"
        )
