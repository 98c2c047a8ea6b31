"""The graph wrapper: one CUDA graph per (sampler variant, padded batch size, draft shape) for
the whole decode step, replayed for every batch up to the largest captured size
(docs/ARCHITECTURE.md, "Graphs"). Without CUDA, or with --enforce-eager, the same step runs
eagerly; `eager_padding` pads eager batches exactly as replay would, so padding is testable on
the CPU."""

from __future__ import annotations

import bisect
import gc
import logging
import time
from functools import partial
from typing import Protocol

import torch
from tqdm import tqdm

from speculant.comm.groups import ParallelContext
from speculant.config import GraphConfig
from speculant.errors import SpeculantError
from speculant.executor.bucket_graphs import release_cached
from speculant.executor.model_runner import ModelRunner, StepOutput
from speculant.executor.sampling import GREEDY
from speculant.executor.speculation import PLAIN, DraftShape
from speculant.executor.step_plan import DPStepSizes

log = logging.getLogger("speculant")

# every decode batch up to 512 replays a graph (padded to the next size)
DEFAULT_SIZES = (
    [1, 2, 4] + list(range(8, 161, 8)) + list(range(176, 257, 16)) + list(range(288, 513, 32))
)
NO_PADDING_SIZES = list(range(1, 33)) + [64, 96, 128, 160]
WARMUP_RUNS = 3
GraphKey = tuple[str, int, DraftShape]  # (sampler variant, padded batch size, draft shape)
# the pseudo-variant of the deferred drafter catch-up's graphs (executor/catch_up.py), one per size
CATCH_UP = "catch-up"
# the suffix of a sampler variant whose plain (0, 0) graph runs with the drafter at rest (no
# drafter work at all: the plain engine's step), captured when steps can rest (`auto`)
RESTING = "+rest"


def capture_sizes(cfg: GraphConfig, max_num_seqs: int, dp: int = 1) -> list[int]:
    """Batch sizes to capture: the configured or default list, capped at max_num_seqs // dp (adding
    cap-1 and cap when the list exceeds it), clamped to max_capture_size."""
    cap = max(max_num_seqs // max(dp, 1), 1)
    if cfg.capture_sizes:
        sizes = sorted(set(cfg.capture_sizes))
    else:
        sizes = list(NO_PADDING_SIZES if cfg.disable_padding else DEFAULT_SIZES)
    if max(sizes) > cap:
        sizes = sorted(set(sizes + [cap - 1, cap]))
    limit = min(cap, cfg.max_capture_size) if cfg.max_capture_size else cap
    return [s for s in sizes if 0 < s <= limit]


def dp_graph_batch_size(tokens_per_rank: list[int], tokens_per_req: int) -> int:
    """Under DP every rank replays the same size: ceil(max tokens over ranks / tokens per req)."""
    return -(-max(tokens_per_rank) // tokens_per_req)


def dp_can_use_graph(
    rank_is_decode_or_idle: list[bool], global_bs: int, sizes: list[int], disable_padding: bool
) -> bool:
    """Graphs replay only when every DP rank is decoding or idle and the size was captured."""
    if not all(rank_is_decode_or_idle) or global_bs == 0:
        return False
    return global_bs in sizes if disable_padding else global_bs <= max(sizes)


def dp_capture_dummies(bs: int, tokens_per_req: int, world_size: int) -> DPStepSizes:
    """Uniform per-rank token counts and batch sizes used while capturing under DP; leaving them
    unset or non-uniform makes the replayed collectives read stale sizes."""
    return DPStepSizes([bs * tokens_per_req] * world_size, [bs] * world_size)


class ReplayHook(Protocol):
    """Code that must run around graphs because Python inside the graph does not re-run
    (the DeepEP adapter resets its low-latency mode here)."""

    def capture(self) -> None: ...

    def replay(self) -> None: ...


class GraphRunner:
    """Dispatches a decode batch to a graph replay (padded) or to the eager step."""

    def __init__(
        self,
        runner: ModelRunner,
        cfg: GraphConfig,
        max_num_seqs: int,
        variants: tuple[str, ...],
        pctx: ParallelContext,
        plans_dispatch: bool = False,
        shapes: list[DraftShape] | None = None,
    ):
        """`plans_dispatch`: the model's forwards hold collectives planned from every rank's
        sizes (a MoE target), which its graphs bake in. `shapes`: the draft shapes steps take
        (executor/speculation.py; default (k, k) only)."""
        self.runner, self.cfg, self.pctx = runner, cfg, pctx
        self.sizes = capture_sizes(cfg, max_num_seqs, pctx.dp_size)
        self.variants = variants
        self.shapes = list(shapes or [runner.full_shape()])
        # steps may rest the drafter (adaptive speculation: several shapes, plain among them):
        # plain graphs without it too
        self.rests = PLAIN in self.shapes and len(self.shapes) > 1
        self.use_graphs = not cfg.enforce_eager and runner.device.type == "cuda"
        self.pad = self.use_graphs or cfg.eager_padding
        self.hooks: list[ReplayHook] = []
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, StepOutput] = {}
        self.graph_memory_bytes = 0
        self.capture_order: list[GraphKey] = []  # (variant, bs, shape) as captured, in order
        # a MoE target's graphs bake in every rank's sizes (its dispatches); a dense one's do not
        self.plans_dispatch = plans_dispatch
        self.captured_sizes: dict[GraphKey, DPStepSizes | None] = {}  # baked into graphs
        self.num_replays = 0  # CUDA graph replays
        self.num_stand_ins = 0  # eager steps at a captured size standing in for a replay
        self.num_catch_up_replays = 0  # replays of the deferred drafter catch-up
        self.num_rest_steps = 0  # plain steps run with the drafter at rest (replayed or eager)

    def capture_plan(self) -> list[GraphKey]:
        """Every (variant, bs, shape) to capture, in capture order: per variant and shape,
        largest size first."""
        sizes = sorted(self.sizes, reverse=True)
        plan = [(v, bs, shape) for v in self.variants for shape in self.shapes for bs in sizes]
        if self.rests:
            plan += [(v + RESTING, bs, PLAIN) for v in self.variants for bs in sizes]
        if self.runner.catch_up is not None:
            plan += [(CATCH_UP, bs, PLAIN) for bs in sizes]
        return plan

    def check_same_plan(self, plan: list[GraphKey]) -> None:
        """Every rank must capture the same list in the same order (the graphs hold collectives
        that must line up); a mismatch is an error on every rank instead of a hang."""
        plans = self.pctx.all_gather_object(plan)
        for rank, other in enumerate(plans):
            if other != plans[0]:
                raise SpeculantError(
                    f"rank {rank} would capture graphs {other} but rank 0 {plans[0]}; give "
                    "every rank the same --max-num-seqs, --capture-sizes and --dp"
                )

    def key(self, variant: str, bs: int, shape: DraftShape | None = None) -> GraphKey:
        return (variant, bs, shape or self.runner.full_shape())

    def graph(self, variant: str, bs: int, shape: DraftShape | None = None):
        """The captured graph of (variant, bs, shape (default (k, k)))."""
        return self.graphs[self.key(variant, bs, shape)]

    def padded_bs(self, bs: int) -> int:
        """The size a batch of bs runs at: the smallest captured size >= bs (exact sizes only with
        padding disabled); bs itself when it runs eagerly unpadded."""
        if not self.pad or self.cfg.disable_padding:
            return bs
        index = bisect.bisect_left(self.sizes, bs)
        return self.sizes[index] if index < len(self.sizes) else bs

    def will_replay(self, padded_bs: int) -> bool:
        return self.use_graphs and padded_bs in self.sizes

    def run(
        self,
        bs: int,
        padded_bs: int,
        variant: str,
        allow_graph: bool = True,
        sizes: DPStepSizes | None = None,
        shape: DraftShape | None = None,
        drafter_rests: bool = False,
        kv_len: int | None = None,
    ) -> StepOutput:
        """Run the step for the first padded_bs rows of the input buffers (already filled);
        `allow_graph=False` forces the eager step (a DP step whose ranks are not uniform).
        `sizes`: every rank's forward this step (the step plan's; a MoE target's dispatch plan,
        which a replayed graph must have been captured with). `shape`: drafts verified and
        proposed (default (k, k)). `drafter_rests`: a plain step with the drafter at rest (its
        own graph, when steps can rest). `kv_len`: the key positions the rows' pages hold, for
        an eager step (a replay attends over its capture's)."""
        shape = shape or self.runner.full_shape()
        rests = drafter_rests and self.rests and shape == PLAIN
        key = (variant + RESTING if rests else variant, padded_bs, shape)
        checked = allow_graph and self.pad and key in self.captured_sizes
        if checked:
            self._check_baked_sizes(key, sizes)  # a replay, or eager padding standing in for one
        if not allow_graph or not self.will_replay(padded_bs):
            self.num_stand_ins += checked
            self.num_rest_steps += rests
            tokens = None if sizes is None else sizes.tokens_per_rank
            out = self.runner.decode_step(padded_bs, variant, tokens, shape, rests, kv_len)
            return out.narrow(bs)
        if key not in self.graphs:
            variants = sorted({v for v, _, _ in self.graphs if v != CATCH_UP})
            variant = variant + RESTING if rests else variant
            shapes = sorted({tuple(s) for _, _, s in self.graphs})
            raise SpeculantError(
                f"no CUDA graph was captured for sampler variant {variant!r} and draft shape "
                f"{tuple(shape)}; captured variants: {variants}, draft shapes: {shapes}"
            )
        for hook in self.hooks:
            hook.replay()
        self.graphs[key].replay()
        self.num_replays += 1
        self.num_rest_steps += rests
        return self.outputs[key].narrow(bs)

    def run_catch_up(self, rows: list[int]) -> None:
        """The deferred drafter catch-up of `rows` (executor/catch_up.py): a graph replay at
        the padded size when one was captured, else eager (padded as replay would be)."""
        runner = self.runner
        padded = self.padded_bs(len(rows))  # rows <= running requests <= the buffer's size
        filled = rows + [runner.kv.sentinel_row] * (padded - len(rows))
        runner.catch_up.rows[:padded].copy_(torch.tensor(filled, dtype=torch.int64))
        key = (CATCH_UP, padded, PLAIN)
        if self.will_replay(padded) and key in self.graphs:
            self.graphs[key].replay()
            self.num_catch_up_replays += 1
        else:
            runner.flush_catch_up(padded)

    def measure_costs(self, repeats: int = 5) -> dict[tuple[DraftShape, int], float]:
        """Seconds of one decode step per (shape, size) on this machine, for adaptive
        speculation: every captured graph replayed (greedy rows on the sentinel row), or on the
        CPU the eager step at the smallest and largest size. Every rank runs the same list
        (the steps hold collectives)."""
        sizes = self.sizes if self.use_graphs else sorted({self.sizes[0], self.sizes[-1]})
        runner, table = self.runner, {}
        sentinel = runner.kv.sentinel_row
        for shape in self.shapes:
            for bs in sizes:
                runner.buffers.fill([], [], [], [], [], [], bs, sentinel)
                dummies = dp_capture_dummies(bs, shape.tokens_per_req, self.pctx.world_size)
                step = partial(self.run, bs, bs, GREEDY, True, dummies, shape)
                table[(shape, bs)] = self._median_seconds(step, repeats)
        catch_up = runner.catch_up
        if catch_up is not None and PLAIN in self.shapes and catch_up.depth:
            for bs in sizes:  # a plain step's share of the catch-up that follows `depth` of them
                flush = self._median_seconds(partial(self.run_catch_up, [sentinel] * bs), repeats)
                table[(PLAIN, bs)] += flush / catch_up.depth
        return table

    def _median_seconds(self, fn, repeats: int) -> float:
        timings = []
        for _ in range(repeats + 1):  # the first run is a warm-up
            if self.use_graphs:
                torch.cuda.synchronize(self.runner.device)
            start = time.perf_counter()
            fn()
            if self.use_graphs:
                torch.cuda.synchronize(self.runner.device)
            timings.append(time.perf_counter() - start)
        return sorted(timings[1:])[repeats // 2]  # the median

    def _check_baked_sizes(self, key: GraphKey, sizes: DPStepSizes | None) -> None:
        """A MoE target's replayed graph runs with the per-rank sizes it was captured with (its
        collectives' shapes): they must be this step's, or the ranks would exchange mismatched
        buffers. A dense target's graphs hold no cross-DP collective: any sizes do."""
        baked = self.captured_sizes[key]
        if self.plans_dispatch and baked != sizes:
            raise RuntimeError(
                f"graph {key} was captured with per-rank sizes {baked} but this step's ranks run "
                f"{sizes}; capture must use the uniform dummies of dp_capture_dummies "
                "and every DP rank must run the step's uniform size"
            )

    def _capture_sizes(self, key: GraphKey) -> DPStepSizes:
        """Every rank captures size bs: uniform dummy token counts and batch sizes, recorded as
        what the graph bakes in."""
        _, bs, shape = key
        sizes = dp_capture_dummies(bs, shape.tokens_per_req, self.pctx.world_size)
        self.captured_sizes[key] = sizes
        return sizes

    def capture(self) -> None:
        """Capture every (variant, size), largest size first, into one shared memory pool. With
        several ranks and no graphs (CPU, --enforce-eager) the same lockstep runs each step once
        eagerly, so the capture protocol is exercised there too."""
        items = self.capture_plan()
        if self.pctx.world_size > 1:
            self.check_same_plan(items)
        if not self.use_graphs:
            if self.pctx.world_size > 1:
                for key in items:
                    self._lockstep_eager(key)
            return
        device = self.runner.device
        release_cached(device)
        reserved_before = torch.cuda.memory_reserved(device)
        bar = tqdm(items, disable=self.pctx.rank != 0, desc="capturing CUDA graphs")
        stream, pool = torch.cuda.Stream(device), None
        gc.collect()
        gc.freeze()
        try:
            for key in bar:
                variant, bs, shape = key
                free = torch.cuda.mem_get_info(device)[0] / 2**30
                bar.set_description(
                    f"capturing bs={bs} variant={variant} drafts={shape.verify}/{shape.draft} "
                    f"free={free:.1f} GiB"
                )
                pool = self._capture_one(key, stream, pool)
                self.capture_order.append(key)
        finally:
            gc.unfreeze()
        release_cached(device)  # the warm-ups' blocks: the graphs' pool is what stays
        self.graph_memory_bytes = torch.cuda.memory_reserved(device) - reserved_before
        if self.pctx.rank == 0:
            log.info(
                "captured %d graphs (sizes %s, variants %s, draft shapes %s%s) using %.2f GiB",
                len(items),
                self.sizes,
                list(self.variants),
                [tuple(s) for s in self.shapes],
                ", resting plain graphs" if self.rests else "",
                self.graph_memory_bytes / 2**30,
            )

    def clear(self) -> None:
        """Release every graph and its outputs, and so the memory pool (Engine.clear_graphs);
        steps run eagerly (padded as before) until graphs are enabled and captured again."""
        self.graphs.clear()
        self.outputs.clear()
        self.captured_sizes.clear()
        self.capture_order.clear()
        self.graph_memory_bytes = 0
        self.use_graphs = False

    def _lockstep_eager(self, key: GraphKey) -> None:
        """What capture does for one size, minus the graph: uniform dummy rows, barriers."""
        variant, bs, shape = key
        self.runner.buffers.fill([], [], [], [], [], [], bs, self.runner.kv.sentinel_row)
        sizes = self._capture_sizes(key)
        self.pctx.barrier()
        self._step_of(key, sizes.tokens_per_rank)()
        self.pctx.barrier()
        self.capture_order.append(key)

    def _step_of(self, key: GraphKey, tokens: list[int] | None):
        """What the graph of `key` runs: a decode step, or the catch-up of bs rows (its row
        buffer set to the sentinel first, so warm-ups and capture touch no live row)."""
        variant, bs, shape = key
        if variant == CATCH_UP:
            self.runner.catch_up.rows.fill_(self.runner.kv.sentinel_row)
            return lambda: self.runner.flush_catch_up(bs)
        if variant.endswith(RESTING):
            base = variant.removesuffix(RESTING)
            return lambda: self.runner.decode_step(bs, base, tokens, shape, drafter_rests=True)
        return lambda: self.runner.decode_step(bs, variant, tokens, shape)

    def _capture_one(self, key: GraphKey, stream, pool):
        runner = self.runner
        variant, bs, shape = key
        runner.buffers.fill([], [], [], [], [], [], bs, runner.kv.sentinel_row)
        step = self._step_of(key, self._capture_sizes(key).tokens_per_rank)
        torch.cuda.synchronize()
        self.pctx.barrier()
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                step()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        for hook in self.hooks:
            hook.capture()
        try:
            with torch.cuda.graph(
                graph, pool=pool, stream=stream, capture_error_mode="thread_local"
            ):
                out = step()
        except torch.OutOfMemoryError as exc:
            raise SpeculantError(
                f"out of GPU memory capturing the CUDA graph for batch size {bs}; "
                "lower --max-capture-size or --kv-cache-memory-fraction"
            ) from exc
        torch.cuda.synchronize()
        self.pctx.barrier()
        self.graphs[key] = graph
        self.outputs[key] = out
        return graph.pool()
