"""DeepEP (the V1 `deep_ep.Buffer` API of the `tokenspeed-deepep` wheel) as a MoE dispatcher, and
the CUDA-graph adapter that keeps its low-latency mode valid across replays.

One `deep_ep.Buffer` per process, created before graph capture and sized for both modes:
low-latency (LL) kernels for decode (fixed [num_local_experts, ep_size * M, H] receive buffers,
capturable) and the normal kernels for prefill (data-dependent sizes, eager only). LL kernels
need parts of their buffer zeroed; the normal kernels dirty it, so a NORMAL -> LOW_LATENCY switch
cleans it. A replayed graph re-runs only the recorded kernels, not the Python that set the mode
and cleaned the buffer, so `DeepEPGraphAdapter.replay()` does both before every replay
(docs/ARCHITECTURE.md, "Graphs": DeepEP low-latency mode). `deep_ep` is imported only when a
buffer is built.
"""

from __future__ import annotations

import enum
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from speculant.comm.moe_dispatch import (
    LIMIT_OPTION,
    ExpertSlots,
    ExpertTokens,
    MoeDispatcher,
    combine_weighted,
    is_capturing,
    pack_by_expert,
)
from speculant.errors import SpeculantError

DEEPEP_WHEEL = "tokenspeed-deepep==1.2.1.post20251110"
# The hidden sizes DeepEP's low-latency kernels are compiled for (SWITCH_HIDDEN in
# csrc/kernels/launch.cuh; some builds add 3072, which is left out to stay on the safe side).
SUPPORTED_HIDDEN_SIZES = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
FP8_BLOCK = 128  # LL dispatch in FP8 carries one float scale per 128 channels


class DispatchMode(enum.Enum):
    NORMAL = "normal"  # prefill: DeepEP's high-throughput kernels
    LOW_LATENCY = "low_latency"  # decode and graphs: the LL kernels


def import_deep_ep():
    try:
        import deep_ep
    except ImportError as exc:
        raise SpeculantError(
            f"--moe-backend deepep needs DeepEP ({exc}); install it with `pip install "
            f"{DEEPEP_WHEEL}` or use --moe-backend all2all"
        ) from exc
    return deep_ep


def deep_ep_installed() -> bool:
    return importlib.util.find_spec("deep_ep") is not None


def check_low_latency_sizes(
    hidden: int, num_experts: int, ep_size: int, max_tokens_per_rank: int, decode_tokens: int
) -> None:
    """The DeepEP LL constraints, checked at start-up with errors that name the fix."""
    if hidden not in SUPPORTED_HIDDEN_SIZES:
        raise SpeculantError(
            f"hidden size {hidden} is not supported by DeepEP's low-latency kernels (supported: "
            f"{', '.join(map(str, SUPPORTED_HIDDEN_SIZES))}); use --moe-backend all2all"
        )
    if num_experts % ep_size:
        raise SpeculantError(
            f"num_experts={num_experts} is not divisible by the {ep_size} DeepEP ranks; run a "
            "world size that divides it"
        )
    if max_tokens_per_rank < decode_tokens:
        raise SpeculantError(
            f"DeepEP num_max_dispatch_tokens_per_rank={max_tokens_per_rank} is below one decode "
            f"step's {decode_tokens} tokens per rank (max_bs * (k + 1)); raise {LIMIT_OPTION} "
            f"to at least {decode_tokens}"
        )


class DeepEPBuffer:
    """One `deep_ep.Buffer` and the dispatch mode it was last used in."""

    def __init__(
        self,
        buffer: Any,
        hidden: int,
        num_experts: int,
        max_tokens_per_rank: int,
        topk_dtype: torch.dtype = torch.int64,
    ):
        self.buffer = buffer  # a deep_ep.Buffer (or a test double with the same methods)
        self.hidden, self.num_experts = hidden, num_experts
        self.max_tokens_per_rank = max_tokens_per_rank
        self.topk_dtype = topk_dtype  # builds may set deep_ep.topk_idx_t to int32
        self.mode = DispatchMode.LOW_LATENCY  # a new buffer starts zeroed

    @classmethod
    def create(
        cls,
        group: Any,
        hidden: int,
        num_experts: int,
        max_tokens_per_rank: int,
        decode_tokens: int = 1,
        normal_mode: bool = True,
    ) -> DeepEPBuffer:
        """Build the buffer on every rank of `group` (a collective): LL RDMA bytes from
        get_low_latency_rdma_size_hint, NVLink bytes for the normal kernels when `normal_mode`."""
        group = group if group is not None else dist.group.WORLD
        world = group.size()
        check_low_latency_sizes(hidden, num_experts, world, max_tokens_per_rank, decode_tokens)
        deep_ep = import_deep_ep()
        # the LL kernels assert NVSHMEM's queue depth >= 2 * (limit + 1); Buffer reads it from the
        # environment (default 1024), so a larger limit raises it before the buffer is built
        depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
        os.environ["NVSHMEM_QP_DEPTH"] = str(max(depth, 2 * (max_tokens_per_rank + 1)))
        buffer_cls = deep_ep.Buffer
        num_rdma_bytes = buffer_cls.get_low_latency_rdma_size_hint(
            max_tokens_per_rank, hidden, world, num_experts
        )
        num_nvl_bytes = 0
        if normal_mode:  # as DeepEP's README sizes it, for bfloat16 tokens
            configs = (buffer_cls.get_dispatch_config(world), buffer_cls.get_combine_config(world))
            hint = [c.get_nvl_buffer_size_hint(hidden * 2, world) for c in configs]
            num_nvl_bytes = max(hint)
        buffer = buffer_cls(
            group,
            num_nvl_bytes=num_nvl_bytes,
            num_rdma_bytes=num_rdma_bytes,
            low_latency_mode=True,
            num_qps_per_rank=num_experts // world,
            allow_nvlink_for_low_latency_mode=True,
        )
        topk_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)  # absent before DeepEP 1.2
        return cls(buffer, hidden, num_experts, max_tokens_per_rank, topk_dtype)

    def set_mode(self, mode: DispatchMode, clean: bool = False) -> None:
        """Switch modes; entering LOW_LATENCY cleans the LL buffer when coming from NORMAL or
        when `clean` asks (once either way)."""
        entering_ll = mode is DispatchMode.LOW_LATENCY
        if entering_ll and (clean or self.mode is DispatchMode.NORMAL):
            self.clean_low_latency_buffer()
        self.mode = mode

    def clean_low_latency_buffer(self) -> None:
        """Zero the LL signalling buffers (a collective kernel: every rank calls it)."""
        self.buffer.clean_low_latency_buffer(
            self.max_tokens_per_rank, self.hidden, self.num_experts
        )


class DeepEPGraphAdapter:
    """The ReplayHook (executor/cuda_graph.py) for DeepEP: capture() puts the buffer in
    low-latency mode; replay() sets it again and cleans the LL buffer before every replay, since
    the Python that did so while capturing does not re-run. `clean_before_replay=False` exists
    only to measure whether the clean is needed (benchmarks/moe_gpu.py)."""

    def __init__(self, ep: DeepEPBuffer, clean_before_replay: bool = True):
        self.ep = ep
        self.clean_before_replay = clean_before_replay

    def capture(self) -> None:
        self.ep.set_mode(DispatchMode.LOW_LATENCY)

    def replay(self) -> None:
        self.ep.set_mode(DispatchMode.LOW_LATENCY, clean=self.clean_before_replay)


@dataclass
class LowLatencyHandle:
    deep_ep_handle: Any
    topk_ids: torch.Tensor  # [T, k] int64
    topk_weights: torch.Tensor  # [T, k] float32


@dataclass
class NormalHandle:
    deep_ep_handle: Any
    slots: ExpertSlots  # the received tokens' choices in this rank's expert buffers


class DeepEPDispatcher(MoeDispatcher):
    """MoeDispatcher over DeepEP. Each forward picks the mode on every rank alike (from the
    largest token count over the EP ranks): LOW_LATENCY when it fits max_tokens_per_rank (and
    always inside graph capture), else NORMAL. LL kernels move bfloat16 (or FP8 with
    `use_fp8`; dequantised here for the torch experts) and combine with float32 weights; the
    experts see the tokens in the model's dtype (a float32 model's tokens travel as bfloat16)."""

    def __init__(
        self, ep: DeepEPBuffer, ep_size: int, ep_rank: int, use_fp8: bool = False, cpu_group=None
    ):
        super().__init__(ep.num_experts, ep_size, ep_rank, ep.max_tokens_per_rank, cpu_group)
        self.ep, self.use_fp8 = ep, use_fp8

    def replay_hooks(self) -> list:
        return [DeepEPGraphAdapter(self.ep)]

    def begin_forward(self, num_tokens: int, tokens_per_rank: list[int] | None = None) -> None:
        limit = self.max_tokens_per_rank
        self.most_tokens = most = self.max_tokens_over_ranks(num_tokens, tokens_per_rank)
        if is_capturing():
            self.check_tokens(most)
            if self.ep.mode is not DispatchMode.LOW_LATENCY:
                raise SpeculantError(
                    "DeepEP is in normal mode inside CUDA-graph capture; register "
                    "DeepEPGraphAdapter on the graph runner's hooks"
                )
            self.num_chunks, self.chunk_tokens = 1, limit
            return
        fits = most <= limit
        self.ep.set_mode(DispatchMode.LOW_LATENCY if fits else DispatchMode.NORMAL)
        self.num_chunks, self.chunk_tokens = 1, limit if fits else max(num_tokens, 1)

    def dispatch(self, hidden, topk_ids, topk_weights):
        x = hidden.to(torch.bfloat16).contiguous()
        ids = topk_ids.to(self.ep.topk_dtype).contiguous()
        weights = topk_weights.float().contiguous()
        if self.ep.mode is DispatchMode.LOW_LATENCY:
            tokens, handle = self._dispatch_low_latency(x, ids, weights)
        else:
            tokens, handle = self._dispatch_normal(x, ids, weights)
        return ExpertTokens(tokens.hidden.to(hidden.dtype), tokens.counts), handle

    def combine(self, expert_out, handle):
        out = expert_out.to(torch.bfloat16).contiguous()
        if isinstance(handle, LowLatencyHandle):
            combined, _, _ = self.ep.buffer.low_latency_combine(
                out,
                handle.topk_ids,
                handle.topk_weights,
                handle.deep_ep_handle,
                async_finish=False,
                return_recv_hook=False,
            )
        else:
            partial = combine_weighted(out, handle.slots)
            combined, _, _ = self.ep.buffer.combine(partial, handle.deep_ep_handle)
        return combined.to(expert_out.dtype)

    def _dispatch_low_latency(self, x, ids, weights):
        self.check_tokens(x.shape[0])
        recv_x, recv_count, handle, _, _ = self.ep.buffer.low_latency_dispatch(
            x,
            ids,
            self.max_tokens_per_rank,
            self.num_experts,
            use_fp8=self.use_fp8,
            async_finish=False,
            return_recv_hook=False,
        )
        if self.use_fp8:  # ([E_l, C, H] e4m3, [E_l, C, H / 128] float32 scales)
            values, scales = recv_x
            scales = scales.float().unsqueeze(-1).expand(*scales.shape, FP8_BLOCK)
            recv_x = (values.float() * scales.reshape(values.shape)).to(torch.bfloat16)
        tokens = ExpertTokens(recv_x, recv_count)
        return tokens, LowLatencyHandle(handle, ids, weights)

    def _dispatch_normal(self, x, ids, weights):
        buffer = self.ep.buffer
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            ids, self.num_experts
        )
        recv_x, recv_ids, recv_weights, _, handle, _ = buffer.dispatch(
            x,
            topk_idx=ids,
            topk_weights=weights,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        # received ids are already local to this rank (-1: another rank's expert)
        tokens, rows, valid = pack_by_expert(
            recv_x, recv_ids, self.num_local_experts, recv_x.shape[0]
        )
        return tokens, NormalHandle(handle, ExpertSlots(rows, valid, recv_weights.float()))
