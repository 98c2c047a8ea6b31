"""The engine: builds one rank's model, KV cache, runner and graph wrapper from an EngineConfig
(the parts in executor/build.py), and runs the step loop (`Engine.step`) that `generate` drives."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from speculant.comm.all_reduce import build_one_shot
from speculant.comm.groups import ParallelContext, resolve_context
from speculant.config import ModelConfig, ParallelConfig, check_rows_for_dp
from speculant.errors import PromptError, SpeculantError, shown
from speculant.executor.attention import PoolAttention, resolve_attention_backend
from speculant.executor.build import (
    DEFAULT_MAX_MODEL_LEN,
    RankSetup,
    build_drafter,
    build_kv_cache,
    build_model,
    check_capture_sizes,
    check_spec,
    engine_config,
    load_tokenizer,
    resolve_device,
    tokenizer_eos_id,
)
from speculant.executor.catch_up import CatchUpBuffers, PendingRows
from speculant.executor.chat import (
    Chat,
    load_chat_template,
    messages_problem,
    render_chat,
    template_kwargs_problem,
)
from speculant.executor.cuda_graph import GraphRunner, capture_sizes
from speculant.executor.detokenize import continuation, prompt_tail
from speculant.executor.dp import (
    DPCoordinator,
    DPShares,
    JobProgress,
    assign_requests,
    request_cost,
)
from speculant.executor.forward_batch import SamplingInfo
from speculant.executor.input_buffers import PendingResults, Readback, ReadResults
from speculant.executor.kv_cache import kv_bytes_per_token, rows_that_fit
from speculant.executor.logprobs import (
    KeptLogprobs,
    TokenLogprobs,
    logprob_columns,
    unpack_logprobs,
)
from speculant.executor.model_runner import ModelRunner, SeqInput, StepOutput
from speculant.executor.piecewise import PiecewiseRunner, uses_piecewise_graphs
from speculant.executor.request import (
    Request,
    RequestOutput,
    SamplingParams,
    is_bool,
    is_integer,
)
from speculant.executor.sampling import FULL, GREEDY, VARIANTS, batch_variant
from speculant.executor.scheduler import Scheduler
from speculant.executor.speculation import (
    PLAIN,
    DraftLengthChooser,
    DraftShape,
    StepCosts,
    shapes_for,
    step_shape,
)
from speculant.executor.step_plan import DPStepSizes, Move, StepPlan
from speculant.executor.stop_strings import StopStrings
from speculant.executor.stops import DeferredStops
from speculant.models.loader import iter_safetensors, load_weights, resolve_dtype

log = logging.getLogger("speculant")

DEFAULT_MAX_NUM_SEQS = {False: 64, True: 512}  # by on_gpu
DEFAULT_BATCHED_TOKENS = {False: 2048, True: 8192}  # by on_gpu


@dataclass
class LaunchedStep:
    """A decode step on the device whose results the host has not applied yet."""

    requests: list[Request]
    padded_bs: int
    results: PendingResults | ReadResults
    start: float  # perf_counter at launch
    sizes: DPStepSizes | None = None
    shape: DraftShape | None = None  # drafts it verifies and proposes


@dataclass
class ScratchRequest:
    """Sampling values for the engine's own scratch forwards (warm-up, memory profile)."""

    params: SamplingParams
    seed: int = 0


class Engine:
    """One rank's speculative-decoding executor. See `generate`."""

    def __init__(self, target: str, *, pctx: ParallelContext | None = None, **options):
        started = time.perf_counter()
        if isinstance(target, os.PathLike):
            target = os.fspath(target)
        if not isinstance(target, str) or not target:
            raise SpeculantError(
                f"target={target!r} must be the path of a checkpoint directory (a str or a Path)"
            )
        cfg = engine_config(target, **options)
        self.config = cfg
        self.device = resolve_device(cfg.device)
        self._owns_groups = pctx is None  # joined the job's process groups itself (close)
        self.pctx = resolve_context(pctx, cfg.parallel.tp, cfg.parallel.dp, self.device)
        cfg.parallel = ParallelConfig(tp=self.pctx.tp_size, dp=self.pctx.dp_size)
        if self.device.startswith("cuda") and self.pctx.world_size > 1:
            self.device = f"cuda:{self.pctx.local_rank}"  # one GPU per rank
        if cfg.load_format not in ("auto", "dummy"):
            raise SpeculantError(
                f"load format {cfg.load_format!r} is not supported; use auto or dummy"
            )
        check_spec(cfg.spec)
        self.model_config = mc = ModelConfig.from_dir(cfg.target)
        self.dtype = resolve_dtype(cfg.dtype, mc.torch_dtype, self.device)
        cache = cfg.cache
        self.max_model_len = cache.max_model_len or min(
            mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN
        )
        if self.max_model_len > mc.max_position_embeddings:
            limit = f"max_position_embeddings={mc.max_position_embeddings}"
            if mc.sliding_window is not None and mc.sliding_window == mc.max_position_embeddings:
                limit = (
                    f"sliding_window={mc.sliding_window} (windowed attention is not supported: "
                    "the context stops at the window)"
                )
            raise SpeculantError(
                f"max_model_len={self.max_model_len} exceeds the model's {limit}; lower "
                "--max-model-len"
            )
        on_gpu = self.device.startswith("cuda")
        if cache.max_num_seqs is None:
            cache.max_num_seqs = max(DEFAULT_MAX_NUM_SEQS[on_gpu], cfg.parallel.dp)
        check_rows_for_dp(cache.max_num_seqs, cfg.parallel.dp)
        self.max_num_seqs = cache.max_num_seqs // cfg.parallel.dp  # per DP rank
        rank0 = self.pctx.tp_rank == 0 and self.pctx.dp_rank == 0
        if cache.max_num_seqs % cfg.parallel.dp and rank0:
            log.warning(
                "max_num_seqs=%d is not a multiple of dp=%d: each DP rank runs %d requests at "
                "once (%d in all); pass a multiple of %d", cache.max_num_seqs, cfg.parallel.dp,
                self.max_num_seqs, self.max_num_seqs * cfg.parallel.dp, cfg.parallel.dp,
            )
        rows = rows_that_fit(
            self.max_num_seqs,
            cache.page_size,
            kv_bytes_per_token(
                mc.num_layers, max(1, mc.num_kv_heads // cfg.parallel.tp), mc.head_dim, self.dtype
            ),
            self._row_bytes(cfg, mc),
            self.device,
            cache.kv_cache_memory_fraction,
            ranks_on_host=1 if on_gpu else cfg.parallel.tp * cfg.parallel.dp,
        )
        rows = min(self.pctx.all_gather_object(rows))  # every rank the same: steps line up
        if rows < self.max_num_seqs:
            self.max_num_seqs, cache.max_num_seqs = rows, rows * cfg.parallel.dp
        check_capture_sizes(cfg)
        self.tokens_per_req = cfg.spec.num_draft_tokens + 1
        # every step computes log-probabilities of its tokens and the n most likely (baked
        # into the graphs); None: none, and a request asking for them is refused
        self.num_logprobs = None
        if cfg.max_logprobs is not None:
            self.num_logprobs = min(cfg.max_logprobs, mc.vocab_size)
        self.max_num_batched_tokens = cache.max_num_batched_tokens or max(
            DEFAULT_BATCHED_TOKENS[on_gpu], self.max_num_seqs * self.tokens_per_req
        )
        self.attention_backend = resolve_attention_backend(cfg.attention_backend, self.device)
        setup = RankSetup(
            cfg, mc, self.pctx, self.device, self.dtype, self.max_model_len, self.max_num_seqs,
            self.tokens_per_req, self.attention_backend,
        )  # fmt: skip
        self.max_positions = setup.max_positions  # the RoPE tables' length (a row's reach)
        self.model = build_model(setup)
        self.pctx.one_shot = build_one_shot(self.pctx, self.dtype, self.device)
        self.tokenizer = load_tokenizer(cfg.target)
        eos = tokenizer_eos_id(cfg.target, self.tokenizer)
        if eos is not None and eos not in mc.eos_token_ids:  # as vLLM stops on it
            mc.eos_token_ids += (eos,)
        # the peak memory of a step at the token budget, profiled on a two-page cache, is kept
        # out of the KV pool: no budget or batch can then run out of memory mid-job
        scratch = build_kv_cache(setup, self.model, num_pages=2)
        self.drafter = build_drafter(setup, self.model, scratch)
        self.activation_bytes, verify_bytes, verify_rows = self._profile_step_memory(scratch)
        # piecewise graphs keep a forward's activations in their own pool: reserve them twice
        piecewise_graphs = uses_piecewise_graphs(
            cfg.graph, self.device, self.attention_backend, mc.is_moe, self.max_num_batched_tokens
        )
        reserved = self.activation_bytes * (2 if piecewise_graphs else 1)
        if not cfg.graph.enforce_eager:  # the decode graphs' pool: its largest graph's step,
            # every row verifying (more rows than the token budget's profiled step: in scale)
            largest = max(capture_sizes(cfg.graph, cache.max_num_seqs, cfg.parallel.dp), default=0)
            reserved += verify_bytes * max(largest, verify_rows) // max(verify_rows, 1)
        reserved += self._catch_up_bytes(cfg)  # kept out of the pool like activations
        reserved += (self.max_num_seqs + 1) * self._row_bytes(cfg, mc)  # allocated after it
        self.kv = build_kv_cache(setup, self.model, reserved_bytes=reserved)
        if self.drafter is not None:
            self.drafter.bind_kv(self.kv)
        del scratch
        self.runner = ModelRunner(
            self.model,
            self.kv,
            self.max_num_seqs,
            cfg.spec.num_draft_tokens,
            self.drafter,
            self.attention_backend,
            self.num_logprobs,
        )
        # adaptive speculation: plain steps record the drafter's inputs, caught up every
        # catch_up_depth steps and before a step that drafts or extends (executor/catch_up.py)
        self.pending = None
        if self._catch_up_bytes(cfg):
            depth = cfg.spec.catch_up_depth
            self.runner.catch_up = CatchUpBuffers(self.drafter, self.kv, self.max_num_seqs, depth)
            self.pending = PendingRows(depth)
        # one rank only: several ranks agree on every step's batch before it runs
        self.overlap = cfg.overlap and self.pctx.world_size == 1
        self.runner.writes_next_inputs = self.overlap  # before capture: the graphs bake it in
        if cfg.spec.sampled_verify == "match":  # likewise
            self.runner.match_samples = True
            if self.drafter is not None:
                self.drafter.match_samples = True
        k, speculation = cfg.spec.num_draft_tokens, cfg.spec.speculation
        self.graphs = GraphRunner(
            self.runner, cfg.graph, cache.max_num_seqs, VARIANTS, self.pctx, mc.is_moe,
            shapes_for(k, speculation),
        )  # fmt: skip
        self.graphs.hooks.extend(self.model.replay_hooks())  # DeepEP's mode reset
        decode_start = time.perf_counter()
        self.graphs.capture()
        self.decode_capture_seconds = time.perf_counter() - decode_start
        self._decode_graphs = self.graphs.use_graphs  # restored by capture_graphs after clear
        costs = None
        if speculation == "auto" and k > 0:  # every rank the same table: the same decisions
            costs = StepCosts.averaged(self.pctx.all_gather_object(self.graphs.measure_costs()))
        if costs is not None:  # one rank: its step cycles refine the table (StepCosts)
            costs.learns = self.pctx.world_size == 1
        self.chooser = DraftLengthChooser(k, speculation, costs)
        # the pure decode step launched by the last step, (shape, size), and those launched by
        # the steps before it, newest last (None: a step that launched none)
        self._cycle: tuple | None = None
        self._cycles_before: deque = deque(maxlen=8)
        self._cycle_start = 0.0  # when the last step started
        self._resting = False  # whether the last step rested the drafter
        self._read_at = 0.0  # when the last overlapped step's results were read (_read)
        self._generating = False  # a generate call under way (no nested one: generate)
        # prompts of earlier calls: a request's default seed counts on from them, so each call
        # draws anew and a new engine of the same seed repeats the same calls (vLLM's seed)
        self._prompts_made = 0
        self.piecewise = PiecewiseRunner(
            self.runner, cfg.graph, self.max_num_batched_tokens, self.max_num_seqs, self.pctx,
            self.attention_backend, mc.is_moe, self.graphs.sizes,
        )  # fmt: skip
        self.runner.piecewise = self.piecewise
        self.piecewise.capture()
        self.dp = DPCoordinator(self.pctx, self.graphs, self.tokens_per_req, mc.is_moe)
        self.scheduler = Scheduler(
            self.kv, self.max_num_seqs, self.tokens_per_req, self.max_num_batched_tokens
        )
        self.num_steps = self.decode_rows = 0  # steps run, and the decode rows summed over them
        self.extend_steps = self.prefill_tokens = 0
        self.step_seconds = {"decode": 0.0, "extend": 0.0}  # host wall time by kind of step
        self.readback = Readback(self.max_num_seqs, self.device)
        self._launched: LaunchedStep | None = None
        self.steps_ahead = 0  # decode steps launched before the previous one was read back
        if self._compiles_at_first_use():
            self.warm_up()
        self.startup_seconds = time.perf_counter() - started
        if self.pctx.rank == 0:
            log.info(
                "engine ready in %.1f s (decode graphs %.1f s, piecewise graphs %.1f s)",
                self.startup_seconds,
                self.decode_capture_seconds,
                self.piecewise.total_capture_seconds,
            )

    @staticmethod
    def _row_bytes(cfg, mc: ModelConfig) -> int:
        """Bytes a request row holds besides its KV pages, allocated for every row up front:
        the q of its drafts over the vocabulary (ModelRunner.draft_probs) with a drafter."""
        k = cfg.spec.num_draft_tokens if cfg.spec.algo is not None else 0
        return k * mc.vocab_size * 4

    def _catch_up_bytes(self, cfg) -> int:
        """Device bytes of the deferred catch-up's buffers (0: none, the drafter catches up in
        every plain step): per request row, depth entries of a token id and a feature row."""
        spec, drafter = cfg.spec, self.drafter
        if not (spec.speculation == "auto" and spec.num_draft_tokens and spec.catch_up_depth):
            return 0
        if drafter is None or drafter.catch_up_width is None:
            return 0
        element = torch.empty((), dtype=drafter.pool_layout[3]).element_size()
        entry = 8 + drafter.catch_up_width * element
        return (self.max_num_seqs + 1) * (spec.catch_up_depth * entry + 8)

    def close(self) -> None:
        """Release what this engine holds: its CUDA graphs and their pools, its KV cache, target
        and drafter (their memory goes back to the process, and on a GPU to the device), and
        the job's process groups when the engine joined them itself (tp * dp > 1 from the
        environment; a ParallelContext passed in stays its owner's). Every rank calls it. A
        later call on the engine is refused with one line; closing again does nothing.
        `with Engine(...) as engine:` closes it on leaving the block."""
        if self.__dict__.get("_closed"):
            return
        self._not_while_generating("close")
        on_gpu = self.device.startswith("cuda")
        if on_gpu:
            torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self.piecewise.clear()
        pctx, owns = self.pctx, self._owns_groups
        kept = ("config", "device", "pctx", "model_config", "_generating")
        for name in [name for name in vars(self) if name not in kept]:
            delattr(self, name)
        self._closed = True
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
        if owns:
            pctx.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        """Only reached for an attribute the engine does not have: after `close`, the parts it
        released."""
        if self.__dict__.get("_closed"):
            raise SpeculantError(
                f"this Engine was closed (Engine.close), so it has no {name!r}; build a new "
                "Engine to generate again"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def clear_graphs(self) -> dict:
        """Release every CUDA graph (decode and piecewise) and their memory pools; steps then run
        eagerly (padded as before) until `capture_graphs`. Every rank calls it. Returns the GPU
        memory reserved before and after, in bytes (0 on the CPU)."""
        self._not_while_generating("clear_graphs")
        on_gpu = self.device.startswith("cuda")
        if on_gpu:
            torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device) if on_gpu else 0
        self.graphs.clear()
        self.piecewise.clear()
        for attn in self._attention_backends():  # per-step tensors a capture left behind
            attn.release_step()
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
        after = torch.cuda.memory_reserved(self.device) if on_gpu else 0
        if self.pctx.rank == 0 and on_gpu:
            log.info(
                "cleared CUDA graphs: %.2f GiB reserved before, %.2f GiB after",
                before / 2**30,
                after / 2**30,
            )
        return {"reserved_before": before, "reserved_after": after}

    def capture_graphs(self) -> None:
        """Capture the decode and piecewise graphs again (after `clear_graphs`)."""
        self._not_while_generating("capture_graphs")
        self.graphs.use_graphs = self._decode_graphs
        self.graphs.capture()
        self.piecewise.capture()

    def load_weights(self, path: str) -> None:
        """Load a checkpoint of the target's architecture from `path` into the model in place
        (every rank calls it), then clear and recapture every graph: later steps run the new
        weights. The drafter keeps its weights.

        A checkpoint whose config.json describes another model (any architecture field:
        sizes, layers, RoPE, quantization; its dtype and eos ids aside) is refused before any
        weight changes. One that fails part way (a tensor missing or of the wrong shape) leaves
        the weights as they were: a host copy taken first is put back, and the graphs are
        captured again either way."""
        self._not_while_generating("load_weights")
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise SpeculantError(
                f"load_weights({path!r}): give the path of a checkpoint directory (a str or a Path)"
            )
        if not os.path.isdir(path):
            raise SpeculantError(
                f"load_weights({path!r}): not a directory; give a HF checkpoint directory"
            )
        self._check_same_architecture(path)
        self.kv.forget_cached()  # K/V of the old weights (also if the load fails: safe)
        backup = {
            name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters()
        }
        self.clear_graphs()
        try:
            load_weights(self.model, iter_safetensors(path), str(path))
        except BaseException:
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    param.copy_(backup[name])
            raise
        finally:
            del backup
            self.capture_graphs()

    # what a checkpoint may change in load_weights: the weights' stored dtype (cast to the
    # engine's), the eos ids (the engine keeps its own), the raw dict
    _LOADABLE_CONFIG_FIELDS = ("torch_dtype", "eos_token_ids", "hf")

    def _not_while_generating(self, what: str) -> None:
        """Refuse a call that changes the model or its graphs while `generate` runs (from its
        on_output): the requests in flight would mix two models' K/V."""
        if self._generating:
            raise SpeculantError(
                f"Engine.{what} was called while generate runs on this engine (from its "
                f"on_output?); call it once generate has returned"
            )

    def _check_same_architecture(self, path: str) -> None:
        theirs = ModelConfig.from_dir(path)
        for name in (f.name for f in dataclasses.fields(ModelConfig)):
            ours, new = getattr(self.model_config, name), getattr(theirs, name)
            if name not in self._LOADABLE_CONFIG_FIELDS and ours != new:
                raise SpeculantError(
                    f"{str(path)!r} is not a checkpoint of the target's architecture: its "
                    f"config.json has {name}={new!r}, the target's {ours!r}; load it into an "
                    "Engine of its own"
                )

    def _attention_backends(self) -> list:
        """The runner's and the drafter's attention backends (one level of attributes)."""
        found = [self.runner.attn]
        for value in vars(self.drafter).values() if self.drafter is not None else ():
            if isinstance(value, PoolAttention) and value not in found:
                found.append(value)
        return found

    def _compiles_at_first_use(self) -> bool:
        """Triton compiles a kernel variant the first time it runs (a second or more each);
        graph capture compiled the decode step's, not prefill's."""
        return self.attention_backend == "triton" and self.device.startswith("cuda")

    def warm_up(self, lengths: tuple[int, ...] = (1, 9, 17, 100)) -> None:
        """Prefill (target and drafter) dummy prompts of a few lengths on a scratch row, so the
        kernel variants prompts select (query tiles of 16 / 32 / 64 rows, split or not) are
        compiled before the first request is timed; the row is freed, nothing else changes.
        Every rank runs the same prefills (engines are built in lockstep), so a MoE target's
        dispatches under expert parallelism line up (with no planned sizes each forward asks
        the other ranks for their token counts)."""
        info = self._sampling_info([ScratchRequest(SamplingParams())])
        for length in lengths:
            n = max(1, min(length, self.max_model_len - 2 * self.tokens_per_req))
            row = self.kv.allocate(n + self.tokens_per_req)
            try:
                self.runner.extend([SeqInput(row, 0, [0] * n, samples=True)], info, GREEDY)
            finally:
                self.kv.free(row)

    def _profile_step_memory(self, scratch) -> tuple[int, int, int]:
        """Peak memory (bytes, with a margin) of the largest eager steps on a two-page scratch
        cache: one prefill chunk of the whole token budget, and a mixed step of every row
        verifying (`rows` of them, as many as the budget holds: what a decode graph of that
        size holds in its pool, the FULL sampler over every row); (the larger, the verify
        step's, rows); 0s on the CPU. Every rank runs the same forwards (MoE dispatches line
        up)."""
        T, budget = self.tokens_per_req, self.max_num_batched_tokens
        rows = min(self.max_num_seqs, budget // T)
        if not self.device.startswith("cuda"):
            return 0, 0, rows
        runner = ModelRunner(
            self.model, scratch, 1, self.config.spec.num_draft_tokens, self.drafter,
            self.attention_backend, self.num_logprobs,  # their memory too
        )  # fmt: skip
        span = max(1, min(budget, self.max_model_len - 2 * T))
        steps = [
            [SeqInput(0, 0, [0] * span, samples=True)],
            [SeqInput(0, 0, [0] * T, verify=True) for _ in range(rows)],
        ]
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(self.device)
        scratch.allocate_row()
        peaks = []
        try:
            for seqs in steps:
                torch.cuda.reset_peak_memory_stats(self.device)
                sampled = [ScratchRequest(SamplingParams(temperature=1.0))] * len(seqs)  # larger
                runner.extend(seqs, self._sampling_info(sampled), FULL)
                torch.cuda.synchronize(self.device)
                peaks.append(torch.cuda.max_memory_allocated(self.device) - before)
        except torch.OutOfMemoryError:
            raise SpeculantError(
                f"a step of max_num_batched_tokens={budget} tokens ({rows} verify rows) does not "
                "fit in GPU memory next to the weights; lower --max-num-batched-tokens or "
                "--max-num-seqs"
            ) from None
        peak = max(peaks)
        del runner
        torch.cuda.empty_cache()
        if self.pctx.rank == 0:
            log.info(
                "profiled step activations at %d tokens: %.2f GiB (kept out of the KV cache; "
                "a prefill chunk %.2f, %d verify rows %.2f)",
                budget, peak / 2**30, peaks[0] / 2**30, rows, peaks[1] / 2**30,
            )  # fmt: skip
        return int(peak * 1.1), int(peaks[1] * 1.1), rows  # a margin for fragmentation

    # ------------------------------------------------------------------ requests

    def _make_request(self, index: int, prompt, params: SamplingParams) -> Request:
        """Request `index` of `prompt`, its params already checked (`make_requests`)."""
        if is_integer(prompt):
            raise PromptError(
                index,
                f"is the integer {prompt}: prompts is a list of prompts, each a "
                "text or a list of token ids; wrap one prompt's ids in a list: [[...]]",
            )
        if isinstance(prompt, Chat):
            ids = self._chat_ids(index, prompt)
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError(
                    index,
                    f"is text but {self.config.target!r} has no tokenizer.json; add one, or "
                    "pass token ids (prompt_token_ids in a --prompts file)",
                )
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise PromptError(
                    index,
                    f"is not valid Unicode (a lone surrogate at character "
                    f"{exc.start}); fix the text or pass token ids",
                ) from None
            ids = self.tokenizer.encode(prompt).ids
        else:
            if hasattr(prompt, "tolist"):  # a tensor or an array of token ids
                prompt = prompt.tolist()
            if isinstance(prompt, bytes) or not isinstance(prompt, Sequence):
                raise PromptError(
                    index, f"is of type {type(prompt).__name__}; give a text or a list of token ids"
                )
            ids = list(prompt)
            bad = next((t for t in ids if not is_integer(t)), None)
            if bad is not None:
                raise PromptError(
                    index, f"has token {bad!r} ({type(bad).__name__}); token ids are integers"
                )
            ids = [int(t) for t in ids]
        vocab = self.model_config.vocab_size
        if not ids:
            raise PromptError(index, "is empty; give at least one token")
        if min(ids) < 0 or max(ids) >= vocab:
            bad = max(ids) if max(ids) >= vocab else min(ids)
            if isinstance(prompt, (str, Chat)):  # the checkpoint's tokenizer and model disagree
                raise PromptError(
                    index,
                    f"is text the tokenizer turns into token id {bad}, outside the model's "
                    f"vocabulary [0, {vocab}) (config.json vocab_size): {self.config.target!r} "
                    "holds a tokenizer.json of another model; use the model's own",
                )
            raise PromptError(
                index, f"has token id {bad} outside the vocabulary [0, {vocab}); fix the token ids"
            )
        if len(ids) >= self.max_model_len:
            raise PromptError(
                index,
                f"has {len(ids)} tokens, leaving no room for output in the "
                f"context (max_model_len={self.max_model_len}: at most "
                f"{self.max_model_len - 1} prompt tokens); shorten it or raise --max-model-len",
            )
        if params.logprobs is not None and (
            self.config.max_logprobs is None or params.logprobs > self.config.max_logprobs
        ):
            built = self.config.max_logprobs
            raise PromptError(
                index,
                f"asks for logprobs={params.logprobs}, more alternatives than this engine "
                f"computes (max_logprobs={built}); build it with "
                f"Engine(max_logprobs={params.logprobs}) (--max-logprobs {params.logprobs}): "
                "its steps compute them only when told at start",
            )
        stop = set(params.stop_token_ids)
        if stop and max(stop) >= vocab:  # the model never emits it: the stop would do nothing
            raise PromptError(
                index,
                f"has stop_token_ids holding {max(stop)}, outside the vocabulary [0, {vocab}) "
                f"of {self.config.target!r}; give token ids the model can emit",
            )
        if not params.ignore_eos:
            stop |= set(self.model_config.eos_token_ids)
        if params.stop and self.tokenizer is None:
            raise PromptError(
                index,
                f"has stop strings {shown(list(params.stop))} but {self.config.target!r} has no "
                "tokenizer.json to read the output as text; add one, or stop on token ids "
                "(stop_token_ids)",
            )
        # the engine seed's per-request default, folded into int64 (the device's seed type):
        # prompt `index` of this call, counted on from the prompts of the engine's earlier calls,
        # hashed with the engine seed (a linear mix gave unseeded request i the stream of a
        # request seeded i, and engine seed S + 1 the streams of S shifted by one)
        drawn = self._prompts_made + index
        seed = (
            params.seed
            if params.seed is not None
            else (_mix64(self.config.seed, drawn) ^ DEFAULT_SEED_SALT) % (2**63 - 1)
        )
        return Request(
            index=index,
            prompt_ids=ids,
            params=params,
            seed=int(seed),
            max_new_tokens=min(params.max_new_tokens, self.max_model_len - len(ids)),
            stop_ids=frozenset(stop),
            **self._output_state(params, ids),
        )

    @functools.cached_property
    def chat_template(self) -> tuple[str, dict[str, str]] | None:
        """The target's chat template and special tokens (executor/chat.py), read on first use."""
        return load_chat_template(self.config.target)

    def _chat_ids(self, index: int, chat: Chat) -> list[int]:
        """A conversation's token ids: rendered with the target's chat template (read once),
        tokenized without added special tokens (the template writes them; executor/chat.py)."""
        if (problem := messages_problem(chat.messages)) is not None:
            raise PromptError(index, f"is a chat whose messages {problem}")
        if self.tokenizer is None:
            raise PromptError(
                index, f"is a chat but {self.config.target!r} has no tokenizer.json; add one"
            )
        if self.chat_template is None:
            raise PromptError(
                index,
                f"is a chat but {self.config.target!r} has no chat template (chat_template.jinja, "
                "or chat_template in tokenizer_config.json); add the model's template, or give "
                "the prompt as text",
            )
        try:
            text = render_chat(*self.chat_template, chat)
        except SpeculantError as exc:
            raise PromptError(index, f"is a chat that could not be rendered: {exc}") from None
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def chat(
        self,
        conversations: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        on_output: Callable[[RequestOutput], None] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """`generate` for conversations (one, a list of {"role", "content"} messages, or a list
        of them), each rendered with the target's chat template and continued as the assistant
        (as vLLM's `LLM.chat`); `chat_template_kwargs` gives every conversation's template more
        variables (vLLM's, e.g. {"enable_thinking": False}; over a `Chat`'s own)."""
        if (problem := template_kwargs_problem(chat_template_kwargs)) is not None:
            raise SpeculantError(f"chat_template_kwargs {problem}")
        extra = chat_template_kwargs or {}
        if isinstance(conversations, Chat) or (
            isinstance(conversations, (list, tuple))
            and conversations
            and isinstance(conversations[0], dict)
        ):
            conversations = [conversations]
        if not isinstance(conversations, (list, tuple)):
            raise SpeculantError(
                f"conversations is of type {type(conversations).__name__}; give a conversation "
                '(a list of {"role": ..., "content": ...} messages) or a list of them'
            )
        for i, c in enumerate(conversations):  # a text would reach generate untemplated
            if not isinstance(c, (Chat, list, tuple)):
                raise PromptError(
                    i,
                    f"is of type {type(c).__name__}, not a conversation; give a list of "
                    '{"role": ..., "content": ...} messages (texts go to generate)',
                )
        chats = [
            Chat(c.messages, {**c.template_kwargs, **extra}) if isinstance(c, Chat)
            else Chat(c, extra)
            for c in conversations
        ]  # fmt: skip
        return self.generate(chats, sampling_params, use_tqdm=use_tqdm, on_output=on_output)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int] | Chat],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or a `Chat`: a conversation the target's
        chat template renders, executor/chat.py); outputs come back in input order (a prompt
        whose params ask for n completions gives n outputs in a row, `sample_index` 0..n-1) and
        are also passed to `on_output` as each request finishes. Every prompt is checked before
        any generation starts. With several ranks, every rank calls this; rank 0's prompts are
        spread over the DP ranks and rank 0 returns all outputs (see executor/dp.py)."""
        if on_output is not None and not callable(on_output):
            raise SpeculantError(
                f"on_output={on_output!r} is not callable; pass a function of one RequestOutput"
            )
        if not is_bool(use_tqdm):
            raise SpeculantError(f"use_tqdm={use_tqdm!r} must be True or False")
        if self._generating:  # one scheduler: a nested call would run the outer requests
            raise SpeculantError(
                "Engine.generate is already running on this engine (called from its "
                "on_output?); keep the outputs and call generate again once it returns"
            )
        self._generating = True
        try:
            if self.pctx.world_size > 1:
                return self._generate_distributed(
                    prompts, sampling_params, use_tqdm=use_tqdm, on_output=on_output
                )
            requests = self.make_requests(prompts, sampling_params)
            return self.run(requests, use_tqdm=use_tqdm, on_output=on_output)
        finally:
            self._generating = False

    def make_requests(self, prompts, sampling_params=None) -> list[Request]:
        """Checked requests for one or one-per-prompt params: each prompt's n completions in
        turn (`prompt_index` = its position in `prompts`, `index` unique in the call)."""
        if isinstance(prompts, (str, Chat)):  # one prompt
            prompts = [prompts]
        if hasattr(prompts, "tolist"):  # a 2-D tensor or array: one row per prompt
            prompts = prompts.tolist()
        if not isinstance(prompts, Sequence):
            raise SpeculantError(
                f"prompts is of type {type(prompts).__name__}; give a list of prompts (texts, "
                "lists of token ids or Chat conversations)"
            )
        if isinstance(prompts, (bytes, bytearray)):
            raise SpeculantError(
                f"prompts is {type(prompts).__name__}; give a text (str), a list of texts or of "
                "token-id lists"
            )
        if isinstance(sampling_params, dict):
            raise SpeculantError(
                "sampling_params is a dict; pass SamplingParams(**that dict), or a list of them"
            )
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [(sampling_params or SamplingParams()).validate()] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            raise SpeculantError(
                f"sampling_params is of type {type(sampling_params).__name__}; give one "
                "SamplingParams, or a list of them with one per prompt"
            )
        else:  # one per prompt, each checked once: a bad one is named by its place
            sampling_params = [_checked_params(i, sp) for i, sp in enumerate(sampling_params)]
        if len(sampling_params) != len(prompts):
            raise SpeculantError(
                f"{len(sampling_params)} sampling params for {len(prompts)} "
                "prompts; give one, or one per prompt"
            )
        firsts = [
            self._make_request(i, p, sp)
            for i, (p, sp) in enumerate(zip(prompts, sampling_params, strict=True))
        ]
        for request in firsts:  # before any generation: never after earlier requests ran
            try:
                self.scheduler.check_fits(request)
            except SpeculantError as exc:  # "prompt i needs ...", "FILE:LINE: the prompt needs"
                raise PromptError(request.index, str(exc)) from None
        self._prompts_made += len(firsts)  # (every rank makes every call's requests alike)
        if all(r.params.n == 1 for r in firsts):
            return firsts
        requests = []  # each prompt's n completions in turn, indices unique in the call
        for first in firsts:
            for j in range(first.params.n):
                requests.append(self._completion(first, j, len(requests)))
        return requests

    def _output_state(self, params: SamplingParams, prompt_ids: list[int]) -> dict:
        """A new request's own watchers of its output: its stop strings' text (continuing the
        prompt), its kept log-probabilities (none unless asked)."""
        stops = params.stop
        include = params.include_stop_str_in_output
        return {
            "stop_text": StopStrings(self.tokenizer, stops, include, prompt_ids) if stops else None,
            "logprobs": None if params.logprobs is None else KeptLogprobs(self.num_logprobs),
        }

    def _completion(self, first: Request, j: int, index: int) -> Request:
        """Completion j of `first`'s prompt as request `index`: its seed derived from the first
        one's (j = 0 is the first itself, its seed unchanged), so sampled completions are
        independent draws and a seeded call repeats exactly."""
        seed = first.seed if j == 0 else int(_mix64(first.seed, j) % (2**63 - 1))
        params = first.params
        return Request(
            index=index,
            prompt_ids=first.prompt_ids,  # never changed: shared by the completions
            params=params,
            seed=seed,
            max_new_tokens=first.max_new_tokens,
            stop_ids=first.stop_ids,
            **self._output_state(params, first.prompt_ids),
            prompt_index=first.index,
            sample_index=j,
        )

    def run(
        self,
        requests: list[Request],
        *,
        use_tqdm: bool = False,
        on_output: Callable[[RequestOutput], None] | None = None,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        progress: JobProgress | None = None,
        shares: DPShares | None = None,
    ) -> list[RequestOutput]:
        """Step until these requests (and, under DP, every other DP rank's) have finished;
        outputs in the order of `requests`. `on_step` gets each step's finished outputs (every
        rank calls it every step: the DP ranks stream outputs to rank 0 through it). Under DP,
        `progress` counts the whole job's finished requests (executor/dp.JobProgress): the bar
        then counts them, not this rank's; with `shares` (every DP rank's requests, this rank's
        being `requests`) requests not started move between ranks as the steps' exchanges settle
        (executor/dp.DPShares), and the outputs are of those this rank ran, moved ones last."""
        leads: dict[int, Request] = {}  # each prompt's first completion in this run (rank)
        order = list(requests)  # this rank's requests, with those moved in and out

        def take(request: Request) -> None:
            lead = leads.setdefault(request.prompt_index, request)
            request.first_completion = None if lead is request else lead
            self.scheduler.add(request)

        for request in requests:
            take(request)
        self.dp.shares = shares
        self._cycle = None  # the time since an earlier run's last step is no step's
        self.dp.decode_sizes = []  # this run's records: kept over every run they would grow
        self._cycles_before.clear()
        results: dict[int, RequestOutput] = {}  # by request index (unique in the call)
        total = len(requests) if progress is None else progress.total
        bar = tqdm(total=total, disable=not use_tqdm, desc="requests", unit="req")
        try:
            while self.scheduler.has_unfinished() or self.pctx.dp_size > 1:
                done = self.step()
                finished = [self._output(request) for request in done]
                for request, out in zip(done, finished, strict=True):
                    results[request.index] = out
                    if on_output is not None:
                        on_output(out)
                if progress is None:
                    if finished:
                        bar.update(len(finished))
                else:
                    count = progress.update(len(finished), not self.scheduler.has_unfinished())
                    if count is not None and count > bar.n:
                        bar.update(count - bar.n)
                if on_step is not None:
                    on_step(finished)
                moves, self.dp.last.moves = self.dp.last.moves, []
                for move in moves:
                    self._move(move, order, take)
                if self.dp.last.all_idle:
                    break
            if progress is not None:
                count = progress.final()
                if count is not None and count > bar.n:
                    bar.update(count - bar.n)
        except BaseException:  # Ctrl-C, a raising on_output: the next run starts empty
            self._abandon()
            raise
        finally:
            bar.close()
            self.dp.shares = None
        return [results[r.index] for r in order]

    def _move(self, move: Move, order: list[Request], take: Callable[[Request], None]) -> None:
        """Apply one DP move to this rank: its requests leave this rank's queue (never started
        here) or join it, `take`n as the run's own."""
        me = self.pctx.dp_rank
        moved = [self.dp.shares.requests[index] for index in move.indices]
        if move.src == me:
            self.scheduler.withdraw(moved)
            gone = set(move.indices)
            order[:] = [r for r in order if r.index not in gone]
        if move.dst == me:
            for request in moved:
                take(request)
                order.append(request)

    def _abandon(self) -> None:
        """Drop what a run that stopped part way left: the step in flight (waited for, its
        results unread) and every unfinished request with its pages and adaptive state, so
        that a later `generate` on this engine neither finishes nor returns them."""
        launched, self._launched = self._launched, None
        if launched is not None:
            try:
                launched.results.wait()
            except Exception:  # the device error that stopped the run: nothing to keep
                pass
        for request in self.scheduler.abort_all():
            self.chooser.forget(request.index)
        self.chooser.idle()

    def _output(self, request: Request) -> RequestOutput:
        ids = request.output_ids
        if request.stop_text is not None and request.stop_text.matched is not None:
            text = request.stop_text.text  # cut at the stop string
        elif self.tokenizer is None:
            text = None
        else:  # the text continues the prompt's (executor/detokenize.py `continuation`)
            tail = prompt_tail(self.tokenizer, request.prompt_ids)
            if request.finish_reason == "stop" and not request.params.include_stop_str_in_output:
                text = continuation(self.tokenizer, tail, ids[:-1])  # a stop token's text is
            else:  # left out (vLLM)
                text = continuation(self.tokenizer, tail, ids)
        steps = request.num_verify_steps
        stats = {
            "num_prompt_tokens": len(request.prompt_ids),
            "num_output_tokens": len(request.output_ids),
            "num_verify_steps": steps,
            "num_plain_steps": request.num_plain_steps,  # decode steps that verified no draft
            "decode_time_s": round(request.decode_seconds, 6),
            "num_preemptions": request.num_preemptions,
            "num_cached_tokens": request.num_cached,  # context taken from the prefix cache
            "accept_len": request.emitted_in_verify / steps if steps else None,
            "per_position_acceptance": [a / steps for a in request.accepted_per_position]
            if steps
            else [],
        }
        logprobs, cumulative = None, None
        if request.logprobs is not None:  # decoded now: a step only kept its rows
            logprobs = request.logprobs.entries(ids, request.params.logprobs)
            cumulative = sum(step[t] for step, t in zip(logprobs, ids, strict=True))
        return RequestOutput(
            request.prompt_index,
            request.prompt_ids,
            request.output_ids,
            text,
            request.finish_reason,
            stats,
            request.stop_reason,
            logprobs,
            cumulative,
            request.sample_index,
            request.params.n,
        )

    def _generate_distributed(
        self,
        prompts: Sequence[str | Sequence[int]] | None,
        sampling_params,
        *,
        use_tqdm: bool = False,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """`Engine.generate` over every rank of the job: rank 0's prompts and params count (the
        others may pass None). Rank 0 returns every output in input order and passes each to
        `on_output` in the step it finishes, on whichever DP rank (one small gather per step, only
        when rank 0 has an `on_output`): nothing finished is lost to a later interrupt or rank
        failure. Other ranks return their own DP rank's outputs. Rank 0's `use_tqdm` bar counts
        the whole job's requests as any DP rank finishes them (a counter in the job's store,
        executor/dp.JobProgress: no collective of its own, no rank waits)."""
        pctx = self.pctx
        store = pctx.store()
        # rank 0's bar counts the whole job: a store counter new to this call (JobProgress)
        counted = use_tqdm and store is not None and pctx.dp_size > 1
        key = f"speculant/progress/{uuid.uuid4().hex}" if counted else None
        prompts, sampling_params, stream, key = pctx.broadcast_object(
            (prompts, sampling_params, on_output is not None, key)
        )
        requests = self.make_requests(prompts, sampling_params)  # every rank checks every prompt
        shares = DPShares(
            assign_requests(
                [request_cost(r) for r in requests],
                pctx.dp_size,
                [r.prompt_index for r in requests],
            ),
            requests,
        )
        progress = None  # one counter per DP rank: its TP rank 0 adds
        if key is not None and store is not None and pctx.dp_size > 1 and pctx.tp_rank == 0:
            progress = JobProgress(store, key, len(requests), reads=pctx.rank == 0)
        emitted: set[tuple[int, int]] = set()
        # while streaming under DP, a Ctrl-C or SIGTERM on any rank stops every rank at the step
        # boundary after rank 0 took that step's outputs (executor/stops.py): none finished on
        # another DP rank is lost. Under TP alone rank 0 holds every output; there a stop acts
        # at once, so a rank whose node died is named by the others' failed collective, not
        # outrun by its agent's SIGTERM to the survivors
        deferred = stream and pctx.dp_size > 1
        stops = DeferredStops() if deferred else contextlib.nullcontext()

        def stream_to_rank0(finished: list[RequestOutput]) -> None:
            mine = finished if pctx.tp_rank == 0 else None
            parts, stop = pctx.gather_with_flag(mine, stops.pending if deferred else 0)
            for out in (out for part in parts or [] if part for out in part):
                if out.key not in emitted:
                    emitted.add(out.key)
                    on_output(out)
            if stop:
                stops.stop(stop)

        with stops:
            local = self.run(
                [requests[i] for i in shares.lists[pctx.dp_rank]],
                use_tqdm=use_tqdm and pctx.rank == 0,
                on_step=stream_to_rank0 if stream else None,
                progress=progress,
                shares=shares if pctx.dp_size > 1 else None,
            )
            gathered = pctx.gather_object(local if pctx.tp_rank == 0 else None)
        if gathered is None:
            return local
        outputs = sorted((out for part in gathered if part for out in part), key=lambda o: o.key)
        keys = [out.key for out in outputs]
        if keys != [(r.prompt_index, r.sample_index) for r in requests]:
            raise RuntimeError(f"DP ranks returned outputs {keys} for {len(requests)} requests")
        if on_output is not None:  # streamed already; this catches nothing unless a step was missed
            for out in outputs:
                if out.key not in emitted:
                    on_output(out)
        return outputs

    # ------------------------------------------------------------------ the step loop

    def step(self) -> list[Request]:
        """Run one planned step: the scheduler's plan (decode rows, prefill chunks, under the
        token budget), settled with the other DP ranks, then either a decode step (a graph
        replay when one was captured for its padded size) or one eager forward over the packed
        chunks and verify rows. Returns the requests that finished in this step (with overlap,
        those whose end this step read). With overlap (one rank), the decode step in flight is
        first either run ahead of (see `_can_run_ahead`) or read back."""
        finished = []
        self._observe_cycle()
        if self.overlap:
            launched, self._launched = self._launched, None
            start = time.perf_counter()  # a launched decode step's time is spent reading it
            if launched is not None and self._can_run_ahead(launched):
                finished = self._run_ahead(launched)
                self.step_seconds["decode"] += time.perf_counter() - start
                return finished
            if launched is not None:
                self._read(launched)
                self.step_seconds["decode"] += time.perf_counter() - start
            finished = self._finish_done()
        plan = self._choose_shape(self.scheduler.schedule())
        plan = self.dp.agree(plan, self.scheduler.has_unfinished(), self._queue())
        self._settle_catch_up(plan)
        self.num_steps += 1
        self.decode_rows += len(plan.decode)
        start = time.perf_counter()
        if plan.is_pure_decode:
            self._cycle = (plan.shape, plan.padded_bs or len(plan.decode))
            self._decode(plan)
            self.step_seconds["decode"] += time.perf_counter() - start
        elif plan.requests:
            self._extend(plan)
            self.step_seconds["extend"] += time.perf_counter() - start
            self.extend_steps += 1
            self.prefill_tokens += sum(len(c.tokens) for c in plan.chunks)
        elif plan.dummy:  # idle under DP with a MoE target: a dummy batch keeps ranks aligned
            self.runner.buffers.fill([], [], [], [], [], [], plan.padded_bs, self.kv.sentinel_row)
            self.graphs.run(0, plan.padded_bs, GREEDY, plan.use_graph, plan.sizes, plan.shape)
        return finished + self._finish_done()

    def _queue(self) -> tuple[int, int, int]:
        """This rank's (unstarted tail, waiting, free rows) for the DP exchange's moves."""
        shares = self.dp.shares
        if shares is None:
            return (0, 0, 0)
        scheduler = self.scheduler
        waiting, free = len(scheduler.waiting), scheduler.max_num_seqs - len(scheduler.running)
        # only a surplus (waiting past the free rows) can move: the tail counted up to it
        return (shares.unstarted_tail(self.pctx.dp_rank, waiting - free), waiting, free)

    def _observe_cycle(self) -> None:
        """A step starts: the time since the last one started is a step's cycle, host
        included, which refines adaptive speculation's costs on one rank. With overlap that
        time holds one step's launch and the previous one's read-back, and the first steps
        after a change of shape still wait for the steps before it, so a cycle counts only
        when the last StepCosts.STEADY steps launched pure decode steps of one shape and size
        (a steady run)."""
        now = time.perf_counter()
        chooser, before = self.chooser, self._cycles_before
        costs = chooser.costs
        # a rest step (its last one too) is the plain engine's step: no cycle of the costs' (and
        # no host work for them: a small model's 0.2 ms step feels every microsecond,
        # benchmarks/results/adaptive.md, wave 6); a steady run starts again after it
        last = None if self._resting else self._cycle
        if last is not None and chooser.adaptive and costs.learns:
            steady = len(before) >= costs.STEADY - 1
            if steady and all(before[-i] == last for i in range(1, costs.STEADY)):
                costs.observe(last[0], last[1], now - self._cycle_start)
        before.append(last)
        self._cycle, self._cycle_start = None, now

    def _choose_shape(self, plan: StepPlan) -> StepPlan:
        """The step's drafts (executor/speculation.py): how many it proposes (the chooser's
        decision for its batch), and how many it verifies (k when every decode row holds k
        and it drafts again, else none: a plain step). Under DP with a MoE target the DP
        exchange then settles one shape for every rank."""
        k, adaptive = self.chooser.k, self.chooser.adaptive
        bs = len(plan.decode) + sum(c.last for c in plan.chunks)
        # fixed speculation: k drafts every step, every row holds k; a rest decides nothing: no
        # per-row work per step for either (held drafts matter only to a step that drafts)
        chooser = self.chooser
        resting = chooser.rest_left > 0
        # a context that starts (admitted, or resumed after a preemption) outside a rest starts
        # warm, and so ends a rest gone on past its length (speculation.py): a step that then
        # rests marks it cold again (_settle_catch_up)
        starting = [c.request.index for c in plan.chunks if c.first]
        if adaptive and not resting and chooser.cold:
            for index in starting:
                chooser.mark_warm(index)
        indices = [r.index for r in plan.requests] if adaptive and not resting else []
        # adaptive: a step of prefill chunks alone proposes none unless its per-sequence drafting
        # replays a graph (executor/propose_graphs.py); eagerly it costs more than the round of
        # acceptance it brings, and the next decode step's graph proposes (a mixed step proposes
        # for its decode rows: back-to-back mixed steps would else never verify)
        # (a step none of whose chunks ends its context samples nothing: no drafts either)
        prefill_only = bool(plan.chunks and not plan.decode)
        proposes = not (adaptive and prefill_only)
        cheaply = adaptive and prefill_only and bs > 0 and self._drafts_cheaply(plan)
        if not bs:
            drafts = 0 if resting or adaptive else k
        else:
            drafts = self.chooser.choose(indices, bs, proposes, cheaply)
        held = k
        if adaptive and drafts:
            held = min((len(r.next_input) - 1 for r in plan.decode), default=k)
        plan.shape = step_shape(drafts, held, k)
        plan.tokens_per_req = plan.shape.tokens_per_req
        # a step that samples nothing keeps a rest going, one gone on past its length too,
        # unless a context starts in it
        plan.rests = chooser.rests_now if bs else resting or (self._resting and not starting)
        return plan

    def _drafts_cheaply(self, plan: StepPlan) -> bool:
        """Whether an extend step of these sequences would draft per sequence through a graph
        (a greedy step of at most the largest row count: executor/propose_graphs.py)."""
        graphs = self.piecewise.per_sequence
        if graphs is None:
            return False
        variant = batch_variant([r.params for r in plan.requests])
        return graphs.drafts_cheaply(len(plan.decode) + len(plan.chunks), variant)

    def _settle_catch_up(self, plan: StepPlan) -> None:
        """Adaptive speculation's drafter bookkeeping before a step. A step that rests the
        drafter (executor/speculation.py) leaves its requests cold; the first of a rest drops
        the recorded entries (the rows go cold anyway), the first after one empties every row's
        record. Otherwise the deferred catch-up (executor/catch_up.py): flush the recorded
        plain steps when `depth` of them wait or the step is not a plain decode step (it drafts,
        or extends), then note the step if it records."""
        chooser, pending = self.chooser, self.pending
        if plan.rests != self._resting:
            self._resting = plan.rests
            if plan.rests:
                chooser.mark_cold(r.index for r in self.scheduler.running)
                if pending is not None:
                    pending.drop()
            elif self.runner.catch_up is not None:
                self.runner.catch_up.count.zero_()  # rest steps recorded on the device unread
        if plan.rests:
            if plan.chunks:
                chooser.mark_cold(c.request.index for c in plan.chunks)
            return
        if chooser.cold:
            for chunk in plan.chunks:
                if chunk.first:  # its context starts again with the drafter at work
                    chooser.mark_warm(chunk.request.index)
        if pending is None:
            return
        plain = plan.is_pure_decode and plan.shape == PLAIN
        if pending.due(plain):
            rows = pending.rows_to_flush({c.request.row for c in plan.chunks})
            if rows:
                self.graphs.run_catch_up(rows)
        if plain:
            pending.recorded(plan.decode)
        starting = [c.request.row for c in plan.chunks if c.first]
        if starting:  # a context starts in these rows: no entries of an earlier owner count
            self.runner.catch_up.reset(starting)

    def _finish_done(self) -> list[Request]:
        finished = [r for r in self.scheduler.running if r.finish_reason is not None]
        for request in finished:
            self.scheduler.finish(request)
            self.chooser.forget(request.index)
        if finished and not self.scheduler.running:
            self.chooser.idle()  # the next batch starts afresh
        return finished

    def _run_ahead(self, launched: LaunchedStep) -> list[Request]:
        """Launch the next decode step of the same batch from the input ids the step in flight
        writes on the device, then read that one back; a request that ended in it is dropped
        from the step ahead (its wasted rows stay within its KV pages)."""
        k = self.chooser.k
        chooser = self.chooser
        indices = [] if chooser.rest_left else [r.index for r in launched.requests]
        drafts = chooser.choose(indices, len(launched.requests))
        shape = step_shape(drafts, launched.shape.draft, k)  # what the step in flight proposes
        plan = StepPlan(
            decode=launched.requests, tokens_per_req=shape.tokens_per_req, shape=shape,
            padded_bs=launched.padded_bs, use_graph=True, sizes=launched.sizes,
            rests=self.chooser.rests_now,
        )  # fmt: skip
        self._settle_catch_up(plan)
        self._cycle = (shape, plan.padded_bs)
        ahead = self._launch(plan, fill=False)
        self.steps_ahead += 1
        self.num_steps += 1
        self.decode_rows += len(plan.decode)
        self._read(launched)
        if all(r.finish_reason is not None for r in ahead.requests):
            ahead.results.wait()  # every request ended meanwhile: nothing to apply
        else:
            self._launched = ahead
        return self._finish_done()

    def _can_run_ahead(self, launched: LaunchedStep) -> bool:
        """Whether the next step would be the same batch's pure decode step anyway, and the
        step ahead stays in every request's KV pages: no request in prefill, the pool gives
        every request the pages of both steps, and no admission due. A request may end in the
        step in flight (a stop token or string, its length limit): its row in the step ahead is
        wasted and dropped when read, its writes within the pages reserved for both steps, which
        a request within two steps of its row's table (max_model_len) could not get. Waiting
        requests are admitted in groups (Scheduler.admit_group): they are not due while the free
        rows, with those of requests that reach their length limit in the step in flight, are
        fewer than a group (one that a stop token frees waits a step more)."""
        scheduler, requests = self.scheduler, launched.requests
        if len(scheduler.running) != len(requests) or any(r.finish_reason for r in requests):
            return False  # a prefill, or a request that ended before the step in flight
        # tokens the two steps can emit: the one in flight its verified drafts + 1, the one
        # ahead k + 1 only if the one in flight drafted (adaptive plain steps: 1 + 1)
        in_flight = launched.shape.tokens_per_req
        reach = in_flight + (self.tokens_per_req if launched.shape.draft else 1)
        # the positions a row's tables hold (RoPE: max_model_len + 2 (k + 1)); its KV pages,
        # whole pages, may hold more
        table = min(self.kv.max_tokens_per_req, self.max_positions)
        ending = 0  # requests that reach their length limit in the step in flight
        for r in requests:
            left = r.max_new_tokens - len(r.output_ids)
            if left <= reach and scheduler.decode_reach(r, steps=2) > table:
                return False
            ending += left <= in_flight
        if scheduler.waiting:
            free = scheduler.max_num_seqs - len(scheduler.running) + ending
            if free >= min(len(scheduler.waiting), scheduler.admit_group):
                return False
        return scheduler.reserve_ahead(requests, steps=2)

    def _sampling_info(self, requests) -> SamplingInfo:
        """Per-row sampling tensors of `requests` (anything with `params` and `seed`)."""

        def col(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device)

        return SamplingInfo(
            col([r.params.temperature for r in requests], torch.float32),
            col([r.params.top_k for r in requests], torch.int64),
            col([r.params.top_p for r in requests], torch.float32),
            col([r.seed for r in requests], torch.int64),
            col([r.params.min_p for r in requests], torch.float32),
        )

    def _extend(self, plan: StepPlan) -> None:
        """One eager forward over the plan's verify rows and prefill chunks, then each request's
        tokens, drafts and progress applied."""
        width = plan.shape.tokens_per_req  # a verify row's tokens
        seqs = [
            SeqInput(r.row, r.num_tokens - 1, r.next_input[:width], verify=True)
            for r in plan.decode
        ] + [
            SeqInput(
                c.request.row,
                c.start,
                c.tokens,
                successor=c.successor,
                samples=c.last and c.successor is None,
            )  # fmt: skip
            for c in plan.chunks
        ]
        requests = plan.requests
        variant = batch_variant([r.params for r in requests])
        info = self._sampling_info(requests)
        start = time.perf_counter()
        tokens = None if plan.sizes is None else plan.sizes.tokens_per_rank
        out = self.runner.extend(seqs, info, variant, tokens, plan.shape, plan.rests)
        host = out.to_host()  # one sync
        seconds = time.perf_counter() - start
        T = self.tokens_per_req  # the width of every sequence's emitted tokens
        for request, row in zip(plan.decode, host, strict=False):
            self._apply_verify(request, row, seconds, plan.shape.verify, T)
        for chunk, row in zip(plan.chunks, host[len(plan.decode) :], strict=True):
            request = chunk.request
            request.num_computed = chunk.start + len(chunk.tokens)
            if not chunk.last:
                continue
            logprobs = None
            if self.num_logprobs is not None:
                logprobs, row = self._logprobs_of(request, row, T)
            if chunk.successor is None:  # a new request's first token
                request.append(row[:1], logprobs)
                if not request.accepted_per_position:
                    request.accepted_per_position = [0] * (T - 1)
            newest = request.output_ids[-1]
            request.next_input = [newest] + row[T:-1]
        for chunk in plan.chunks:  # pages whose drafter K/V are written too go to the cache
            chunk.request.drafter_gap |= plan.rests
            self.scheduler.cache_prefilled(chunk.request)

    def _decode(self, plan: StepPlan) -> None:
        launched = self._launch(plan)
        if self.overlap:
            self._launched = launched  # read back in the next step, after or without running ahead
        else:
            self._read(launched)

    def _launch(self, plan: StepPlan, fill: bool = True) -> LaunchedStep:
        """Run the decode step of `plan` (inputs from the host when `fill`, else those the
        previous step left on the device) and start copying its results to the host."""
        requests, padded_bs = plan.decode, plan.padded_bs
        if fill:
            self.runner.buffers.fill(
                [r.row for r in requests],
                [r.next_input for r in requests],
                [r.params.temperature for r in requests],
                [r.params.top_k for r in requests],
                [r.params.top_p for r in requests],
                [r.seed for r in requests],
                padded_bs,
                self.kv.sentinel_row,
                [r.params.min_p for r in requests],
            )
        variant = batch_variant([r.params for r in requests])
        kv_len = None  # a backend that gathers every key position (torch) attends, when the
        if self.runner.attn.gathers_kv_len:  # step runs eagerly, over the pages its rows hold
            held = max((len(self.kv.pages_of_row[r.row]) for r in requests), default=1)
            kv_len = min(held, self.kv.max_pages_per_req) * self.kv.page_size
        start = time.perf_counter()
        out = self.graphs.run(
            len(requests), padded_bs, variant, plan.use_graph, plan.sizes, plan.shape, plan.rests,
            kv_len=kv_len,
        )  # fmt: skip
        packed = out.packed if out.packed is not None else StepOutput.of(*out.fields()).packed
        # synchronous steps read back at once; overlapped ones start a copy and read it later
        results = self.readback.start(packed) if self.overlap else ReadResults(packed.tolist())
        return LaunchedStep(list(requests), padded_bs, results, start, plan.sizes, plan.shape)

    def _read(self, launched: LaunchedStep) -> None:
        """Wait for a launched step's results and apply them to its requests (those that ended
        in an earlier step, when it ran ahead, are skipped)."""
        host = launched.results.wait()
        # the step's own time: from its launch, or from the read of the step before it when it
        # was launched while that one ran (overlap), so that no time counts twice
        now = time.perf_counter()
        seconds, self._read_at = now - max(launched.start, self._read_at), now
        for request, row in zip(launched.requests, host, strict=True):
            if request.finish_reason is None:
                shape = launched.shape
                self._apply_verify(request, row, seconds, shape.verify, shape.tokens_per_req)

    def _apply_verify(
        self, request: Request, row: list[int], seconds: float, verified: int, width: int
    ) -> None:
        """One verify row's result (`width` token slots, then the drafts proposed, then
        accept_len) applied to its request; `verified`: the drafts it checked (0: a plain
        step, which counts as no verify step). With log-probabilities the row starts with
        their columns."""
        request.decode_seconds += seconds
        logprobs = None
        if self.num_logprobs is not None:  # (a test per row, not a call: the host's hot path)
            logprobs, row = self._logprobs_of(request, row, width)
        emitted = row[: row[-1]]
        before = len(request.output_ids)
        request.append(emitted, logprobs)
        if verified:
            # acceptance counts what the request keeps: not drafts accepted past its length
            # limit or after a stop token (the z-lab reference's definition)
            request.record_verify(len(request.output_ids) - before)
            self.chooser.observe(request.index, verified, row[-1] - 1)
        else:
            request.num_plain_steps += 1
        request.next_input = [emitted[-1]] + row[width:-1]

    def _logprobs_of(
        self, request: Request, row: list[int], width: int
    ) -> tuple[TokenLogprobs | None, list[int]]:
        """A read-back row (of `width` token slots) of an engine computing log-probabilities:
        its log-probability columns (the row as read, for a request that asked only) and the
        rest of its columns."""
        kept = None
        if request.logprobs is not None:
            kept = unpack_logprobs(row, width, self.num_logprobs)
        return kept, row[logprob_columns(width, self.num_logprobs) :]

    def stats(self) -> dict:
        """Scheduler figures of the run so far (steps, preemptions, mean decode batch)."""
        return {
            "steps": self.num_steps,
            "preemptions": self.scheduler.num_preemptions,
            "mean_decode_batch": round(self.decode_rows / max(self.num_steps, 1), 2),
            "extend_steps": self.extend_steps,
            "prefill_tokens": self.prefill_tokens,
            "shared_prompt_tokens": self.scheduler.shared_prompt_tokens,
            "decode_s": round(self.step_seconds["decode"], 2),
            "extend_s": round(self.step_seconds["extend"], 2),
            "steps_ahead": self.steps_ahead,
            **({"dp_moved_requests": self.dp.moved} if self.pctx.dp_size > 1 else {}),
            **(
                {
                    "prefix_cache_hit_tokens": self.kv.prefix.hit_tokens,
                    "prefix_cache_hit_rate": round(
                        self.kv.prefix.hit_tokens / max(self.kv.prefix.admitted_tokens, 1), 4
                    ),
                }
                if self.kv.prefix is not None
                else {}
            ),
            **({"drafts_chosen": self.chooser.summary()} if self.chooser.adaptive else {}),
            **({"rest_steps": self.chooser.rest_steps} if self.chooser.adaptive else {}),
            **({"catch_ups": self.pending.flushes} if self.pending is not None else {}),
            **(
                {"peak_memory_gib": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)}
                if self.device.startswith("cuda")
                else {}
            ),
        }


DEFAULT_SEED_SALT = 0x5DEECE66D2B7E151  # so that engine seed 0's request 0 is not seed 0


def _mix64(seed: int, j: int) -> int:
    """A 64-bit hash of (seed, j) (splitmix64's finaliser): completion j's seed."""
    x = (seed * 0x9E3779B97F4A7C15 + j * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return x ^ (x >> 31)


def _checked_params(i: int, params: SamplingParams) -> SamplingParams:
    """sampling_params[i] of a list, checked (SamplingParams.validate), named by its place."""
    if not isinstance(params, SamplingParams):
        raise SpeculantError(
            f"sampling_params[{i}] is of type {type(params).__name__}, not SamplingParams; pass "
            "SamplingParams(...)"
        )
    try:
        return params.validate()
    except SpeculantError as exc:
        raise SpeculantError(f"sampling_params[{i}]: {exc}") from None
