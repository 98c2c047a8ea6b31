"""What one rank's Engine is built from: the flat options as an EngineConfig (`engine_config`),
their checks, and the components (`build_model`, `build_kv_cache`, `build_drafter`) for a
`RankSetup`: the sizes, device and dtype the engine settled on."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from speculant.comm.groups import ParallelContext
from speculant.config import (
    MAX_CATCH_UP_DEPTH,
    MAX_DRAFT_TOKENS,
    MAX_PAGE_SIZE,
    CacheConfig,
    EngineConfig,
    GraphConfig,
    ModelConfig,
    MoeConfig,
    ParallelConfig,
    SpecConfig,
    read_hf_config,
)
from speculant.drafter.base import Drafter
from speculant.drafter.checkpoint import drafter_format, is_dflash2
from speculant.drafter.dflash import DFlashDrafter, block_size_of, load_dflash
from speculant.drafter.dflash2 import DFlash2Drafter, load_dflash2
from speculant.drafter.draft_model import DraftModelDrafter
from speculant.drafter.eagle import load_eagle3
from speculant.drafter.eagle_drafter import Eagle3Drafter
from speculant.drafter.tokenizer_vocab import check_draft_tokenizer
from speculant.errors import SpeculantError
from speculant.executor.cuda_graph import capture_sizes
from speculant.executor.kv_cache import PagedKVCache, choose_num_pages, kv_bytes_per_token
from speculant.executor.piecewise import CAPTURE_MODES
from speculant.executor.request import MAX_LOGPROBS, is_bool, is_integer, is_number
from speculant.models.layers import enable_gemv
from speculant.models.llama import CausalLM
from speculant.models.loader import (
    build_causal_lm,
    default_device_and_dtype,
    init_dummy_weights,
    iter_safetensors,
    load_weights,
)

log = logging.getLogger("speculant")

DEFAULT_MAX_MODEL_LEN = 4096
ALGOS = ("eagle3", "draft-model", "dflash")
DEFAULT_DRAFT_TOKENS = 3


@dataclass(frozen=True)
class RankSetup:
    """The settled sizes one rank's components are built for."""

    config: EngineConfig
    model_config: ModelConfig
    pctx: ParallelContext
    device: str
    dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int  # request rows on this DP rank
    tokens_per_req: int  # k + 1
    attention_backend: str

    @property
    def max_positions(self) -> int:
        """Positions a row may reach: the context, then the last step's verify tokens and the
        drafter's lookahead past them (a chain drafter writes up to k - 1 positions past the
        newest token, DFLASH's block k + 1): at most 2 x (k + 1)."""
        return self.max_model_len + 2 * self.tokens_per_req


def load_tokenizer(path: str | Path):
    """tokenizer.json of a checkpoint as a `tokenizers.Tokenizer`, or None when absent. A
    truncation or padding saved in the file is turned off, as transformers does for a call that
    asks for neither: a prompt is encoded whole, without pad ids. tokenizer_config.json's
    `split_special_tokens: true` is honoured as transformers (and so vLLM) does: text that
    spells a special token is encoded as text, not as that token."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:
        raise SpeculantError(f"cannot read {str(file)!r} ({exc}); re-export the tokenizer") from exc
    tokenizer.no_truncation()
    tokenizer.no_padding()
    config = Path(path) / "tokenizer_config.json"
    if config.is_file():
        from speculant.executor.chat import _read_json

        if _read_json(config).get("split_special_tokens") is True:
            tokenizer.encode_special_tokens = True
    return tokenizer


def tokenizer_eos_id(path: str | Path, tokenizer) -> int | None:
    """The id of the tokenizer's own end-of-sequence token (`eos_token` of
    tokenizer_config.json, or of special_tokens_map.json in the legacy layout, as transformers
    reads it), or None. vLLM stops on it besides generation_config.json's ids: a ChatML
    fine-tune of a base model may name <|im_end|> there and keep the base's </s> in config.json."""
    from speculant.executor.chat import named_special_tokens

    if tokenizer is None:
        return None
    eos = named_special_tokens(path).get("eos_token")
    return None if eos is None else tokenizer.token_to_id(eos)


def resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpeculantError(
            f"device {device!r} was asked for but CUDA is not available; pass --device cpu"
        )
    if device != "cpu" and not device.startswith("cuda"):
        raise SpeculantError(f"device {device!r} is not supported; use cpu or cuda")
    return device


# Engine options that take whole numbers, checked before anything uses them (and seed):
# the least value (None: check_spec checks the range) and whether None (the default) may be given
INTEGER_OPTIONS = {
    "page_size": (1, False), "max_num_seqs": (1, True), "max_num_batched_tokens": (1, True),
    "max_model_len": (2, True), "num_pages": (2, True), "max_capture_size": (1, True),
    "tp": (1, False), "dp": (1, False), "moe_max_tokens_per_rank": (1, True),
    "num_draft_tokens": (None, True), "catch_up_depth": (None, True), "max_logprobs": (0, True),
}  # fmt: skip
NONE_MEANS = {"max_logprobs": " (None: off)"}  # where None is no default value
SIZE_LIST_OPTIONS = ("capture_sizes", "piecewise_sizes")  # lists of sizes (piecewise: [] = none)
BOOL_OPTIONS = (
    "enforce_eager", "eager_padding", "disable_graph_padding", "piecewise", "overlap",
    "enable_prefix_caching",
)  # fmt: skip


def check_options(options: dict) -> None:
    """One SpeculantError line for an option value of the wrong kind or range (the CLI's
    argparse refuses the same values): whole numbers (a bool is not one), lists of sizes, the
    memory fraction, switches."""
    device = options.get("device")
    if isinstance(device, torch.device):  # as torch takes it: torch.device("cuda", 1) too
        options["device"] = str(device)
    elif device is not None and not isinstance(device, str):
        raise SpeculantError(
            f"device={device!r} must be 'cpu', 'cuda' or 'cuda:N' (a str or a torch.device)"
        )
    draft = options.get("draft")
    if isinstance(draft, os.PathLike):
        options["draft"] = draft = os.fspath(draft)
    if draft is not None and (not isinstance(draft, str) or not draft):
        raise SpeculantError(
            f"draft={draft!r} must be the path of a drafter checkpoint directory (a str or a "
            "Path; None: no drafter)"
        )
    for name in INTEGER_OPTIONS.keys() & options.keys():
        value, (least, nullable) = options[name], INTEGER_OPTIONS[name]
        if value is None and nullable:
            continue
        if least is None:
            if not is_integer(value):  # check_spec checks the range
                raise SpeculantError(f"{name}={value!r} must be an integer")
        elif not is_integer(value) or value < least:
            default = NONE_MEANS.get(name, " (None: the default)") if nullable else ""
            raise SpeculantError(f"{name}={value!r} must be an integer >= {least}{default}")
    if (options.get("max_logprobs") or 0) > MAX_LOGPROBS:
        raise SpeculantError(
            f"max_logprobs={options['max_logprobs']!r} must be in 0..{MAX_LOGPROBS} (None: off)"
        )
    if options.get("page_size", 0) > MAX_PAGE_SIZE:  # as the CLI's --page-size
        raise SpeculantError(
            f"page_size={options['page_size']!r} must be in 1..{MAX_PAGE_SIZE} (tokens a KV page)"
        )
    seed = options.get("seed", 0)  # any integer: dummy weights take it mod 2**64, requests a hash
    if not is_integer(seed):
        raise SpeculantError(f"seed={seed!r} must be an integer")
    if "seed" in options:  # a numpy integer as the int it holds: its int64 arithmetic wraps
        options["seed"] = int(seed)
    for name in SIZE_LIST_OPTIONS:
        value = options.get(name)
        if value is not None and (
            not isinstance(value, (list, tuple)) or not all(is_integer(v) and v >= 1 for v in value)
        ):
            none = "; [] for none" if name == "piecewise_sizes" else ""
            raise SpeculantError(
                f"{name}={value!r} must be a list of integers >= 1 (None: the default{none})"
            )
    fraction = options.get("kv_cache_memory_fraction", 0.85)
    if not is_number(fraction) or not 0 < fraction <= 1:  # NaN and inf fail too
        raise SpeculantError(f"kv_cache_memory_fraction={fraction!r} must be a number in (0, 1]")
    for name in BOOL_OPTIONS:
        value = options.get(name, False)
        if not is_bool(value):
            raise SpeculantError(f"{name}={value!r} must be True or False")
    capture = options.get("piecewise_capture", "eager")  # (before the model loads)
    if not isinstance(capture, str) or capture not in CAPTURE_MODES:
        raise SpeculantError(
            f"piecewise capture {capture!r} is not supported; use {' or '.join(CAPTURE_MODES)}"
        )


def engine_config(target: str, **options) -> EngineConfig:
    """An EngineConfig from the flat keyword options `Engine` and the CLI take."""
    groups = {
        "cache": (
            CacheConfig,
            {
                "page_size",
                "max_num_seqs",
                "max_num_batched_tokens",
                "max_model_len",
                "num_pages",
                "kv_cache_memory_fraction",
                "enable_prefix_caching",
            },
        ),
        "graph": (
            GraphConfig,
            {
                "capture_sizes",
                "max_capture_size",
                "enforce_eager",
                "eager_padding",
                "disable_graph_padding",
                "piecewise",
                "piecewise_sizes",
                "piecewise_capture",
            },
        ),
        "spec": (
            SpecConfig,
            {
                "algo",
                "draft",
                "num_draft_tokens",
                "speculation",
                "catch_up_depth",
                "sampled_verify",
            },
        ),  # fmt: skip
        "parallel": (ParallelConfig, {"tp", "dp"}),
        "moe": (MoeConfig, {"moe_backend", "moe_max_tokens_per_rank"}),
    }
    check_options(options)
    sections = {}
    for section, (cls, names) in groups.items():
        values = {n: options.pop(n) for n in list(options) if n in names}
        if "disable_graph_padding" in values:
            values["disable_padding"] = values.pop("disable_graph_padding")
        if section == "moe":
            values = {n.removeprefix("moe_"): v for n, v in values.items()}
        sections[section] = cls(**values)
    unknown = set(options) - {
        "device", "dtype", "load_format", "seed", "attention_backend", "overlap", "max_logprobs"
    }  # fmt: skip
    if unknown:
        raise TypeError(f"unknown Engine option(s): {sorted(unknown)}")
    return EngineConfig(target=target, **options, **sections)


def check_spec(spec: SpecConfig) -> None:
    """Validate the speculative options. Without --algo, a drafter whose config.json names its
    algorithm (speculators' `speculators_model_type`, or a published head's architectures) sets
    it; k unset (None) defaults to the speculators `speculative_tokens`, DFLASH's block minus the
    newest token, else DEFAULT_DRAFT_TOKENS; an explicit 0 is plain decoding (the drafter is not
    loaded). Explicit --algo / --num-draft-tokens win."""
    k = spec.num_draft_tokens
    if spec.speculation not in ("auto", "fixed"):
        raise SpeculantError(f"speculation={spec.speculation!r} must be 'auto' or 'fixed'")
    if spec.sampled_verify not in ("rejection", "match"):
        raise SpeculantError(
            f"sampled_verify={spec.sampled_verify!r} must be 'rejection' or 'match' "
            "(--sampled-verify)"
        )
    depth = spec.catch_up_depth
    if not is_integer(depth) or not 0 <= depth <= MAX_CATCH_UP_DEPTH:  # numpy integers too
        raise SpeculantError(
            f"catch_up_depth={depth!r} must be an integer in 0..{MAX_CATCH_UP_DEPTH} (0: catch up "
            "every step)"
        )
    spec.catch_up_depth = int(depth)
    if k is not None and (not is_integer(k) or k < 0):  # numpy integers too
        raise SpeculantError(f"num_draft_tokens={k!r} must be an integer >= 0 (0 = plain decoding)")
    if k is not None:
        k = spec.num_draft_tokens = int(k)
    fmt = None
    if spec.draft is not None and (spec.algo is None or k is None):
        fmt = drafter_format(spec.draft)
        spec.algo = spec.algo or fmt.algo
    if spec.algo is None:
        if k and spec.draft is None:
            raise SpeculantError(
                f"--num-draft-tokens {k} needs a drafter: pass --draft DIR (and --algo "
                f"{'|'.join(ALGOS)} when its config.json does not name it), or leave it out"
            )
        if k or spec.draft:
            raise SpeculantError(
                f"--num-draft-tokens/--draft need --algo ({', '.join(ALGOS)}): the drafter's "
                "config.json does not name its algorithm"
            )
        spec.num_draft_tokens = 0
        if spec.speculation != "fixed":
            log.warning("speculation=%r without a drafter: plain decoding", spec.speculation)
        return
    if spec.algo not in ALGOS:
        raise SpeculantError(f"algo {spec.algo!r} is not supported; use one of {', '.join(ALGOS)}")
    if spec.draft is None:
        raise SpeculantError(f"--algo {spec.algo} needs --draft DIR (the drafter checkpoint)")
    if k == 0:
        log.warning("num_draft_tokens=0: plain decoding, the %s drafter is not loaded", spec.algo)
        return
    if k is None:
        k = fmt.num_draft_tokens if fmt.speculators and fmt.algo == spec.algo else None
        if spec.algo == "dflash":  # at most the block minus the newest token
            block_k = block_size_of(spec.draft) - 1
            k = block_k if k is None else min(k, block_k)
        spec.num_draft_tokens = min(k or DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS)
        if k is not None and k > MAX_DRAFT_TOKENS:  # a DFLASH block of more than 17 tokens
            log.info(
                "num_draft_tokens: %d (the most the engine drafts; the drafter's block takes %d; "
                "--num-draft-tokens N to choose)", MAX_DRAFT_TOKENS, k,
            )  # fmt: skip
    if not 1 <= spec.num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise SpeculantError(
            f"num_draft_tokens={spec.num_draft_tokens} must be in 0..{MAX_DRAFT_TOKENS} with "
            "--algo (0 = plain decoding)"
        )


def check_capture_sizes(config: EngineConfig) -> None:
    """Explicit capture sizes must fit max_num_seqs per DP rank, and some size must remain."""
    graph, cap = config.graph, config.cache.max_num_seqs // config.parallel.dp
    if graph.capture_sizes and max(graph.capture_sizes) > cap:
        raise SpeculantError(
            f"capture size {max(graph.capture_sizes)} exceeds max_num_seqs "
            f"per DP rank ({cap}); lower --capture-sizes or raise "
            "--max-num-seqs"
        )
    if not capture_sizes(graph, config.cache.max_num_seqs, config.parallel.dp):
        smallest = min(graph.capture_sizes or [1])
        raise SpeculantError(
            f"no batch size to capture under --max-capture-size={graph.max_capture_size}: "
            f"the smallest capture size is {smallest}; raise --max-capture-size to at least "
            f"{smallest} or give smaller --capture-sizes"
        )


def build_model(setup: RankSetup) -> CausalLM:
    """The target model, its weights loaded (or dummy), with the backend's kernels."""
    cfg, mc = setup.config, setup.model_config
    with default_device_and_dtype(setup.device, setup.dtype):
        model = build_causal_lm(
            mc,
            setup.max_positions,
            setup.pctx,
            cfg.moe,
            decode_tokens=setup.max_num_seqs * setup.tokens_per_req,
        )
    if cfg.load_format == "dummy":
        init_dummy_weights(model, cfg.seed)
    else:
        load_weights(model, iter_safetensors(cfg.target), cfg.target)
    return with_kernels(model.eval(), setup.attention_backend)


def with_kernels(model: torch.nn.Module, attention_backend: str) -> torch.nn.Module:
    """With the Triton attention backend, single-row projections run the Triton GEMV
    (kernels/gemv.py); the torch backend stays the pure-torch reference."""
    if attention_backend == "triton":
        enable_gemv(model)
    return model


def build_kv_cache(
    setup: RankSetup, model: CausalLM, num_pages: int | None = None, reserved_bytes: int = 0
) -> PagedKVCache:
    """The paged KV cache: as many pages as the memory budget allows after `reserved_bytes` (or
    --num-pages); `num_pages` given: a scratch cache of that size with one request row."""
    cache, mc = setup.config.cache, setup.model_config
    attn = model.model.layers[0].self_attn
    per_token = kv_bytes_per_token(mc.num_layers, attn.num_kv_heads, mc.head_dim, setup.dtype)
    max_requests = setup.max_num_seqs if num_pages is None else 1
    num_pages_given = num_pages  # a scratch cache: never a prefix cache
    if num_pages is None:
        # the CPU ranks of a job share the host's memory; each GPU rank has its own device
        on_host = int(os.environ.get("LOCAL_WORLD_SIZE", setup.pctx.world_size))
        num_pages = choose_num_pages(
            cache.page_size,
            setup.max_num_seqs,
            setup.max_positions,  # a row's context and the last step's lookahead past it
            per_token,
            setup.device,
            cache.kv_cache_memory_fraction,
            cache.num_pages,
            reserved_bytes,
            ranks_on_host=on_host if setup.device == "cpu" else 1,
        )
        # one pool size on every rank: each rank's scheduler admits by it (free memory differs)
        num_pages = min(setup.pctx.all_gather_object(num_pages))
    max_pages = -(-setup.max_positions // cache.page_size)
    return PagedKVCache(
        mc.num_layers,
        num_pages,
        cache.page_size,
        attn.num_kv_heads,
        mc.head_dim,
        setup.dtype,
        setup.device,
        max_requests,
        max_pages,
        prefix_caching=cache.enable_prefix_caching and num_pages_given is None,
    )


def build_drafter(setup: RankSetup, model: CausalLM, kv: PagedKVCache) -> Drafter | None:
    """The drafter --algo names (None without one), sharing the target's KV cache."""
    cfg, spec, max_positions = setup.config, setup.config.spec, setup.max_positions
    if spec.algo is None or spec.num_draft_tokens == 0:
        return None
    if spec.algo in ("eagle3", "dflash"):  # a head in its published layout, on our target
        load, drafter_cls = (
            (load_eagle3, Eagle3Drafter) if spec.algo == "eagle3" else (load_dflash, DFlashDrafter)
        )
        if spec.algo == "dflash" and is_dflash2(read_hf_config(spec.draft)):
            load, drafter_cls = load_dflash2, DFlash2Drafter
        head = load(
            spec.draft,
            setup.model_config,
            setup.device,
            setup.dtype,
            setup.pctx,
            max_positions,
            cfg.load_format,
            cfg.seed + 1,
        )
        if spec.algo == "eagle3":  # a speculators head's copy of the target's table is dropped
            head.share_target_embeddings(model.model.embed_tokens)
        return drafter_cls(
            with_kernels(head, setup.attention_backend),
            model,
            kv,
            setup.dtype,
            spec.num_draft_tokens,
            setup.attention_backend,
        )
    draft_cfg = ModelConfig.from_dir(spec.draft)
    if draft_cfg.is_moe:  # its layers would be built dense, and its expert tensors not found
        raise SpeculantError(
            f"{spec.draft}/config.json is a mixture-of-experts {draft_cfg.architecture}: a draft "
            "model must be a dense Llama / Qwen2 / Qwen3 checkpoint; pass a dense --draft (or "
            "--algo eagle3 / dflash with their heads)"
        )
    # another vocab_size: one tokenizer padded to other sizes, shown by the tokenizer files
    check_draft_tokenizer(
        cfg.target, spec.draft, setup.model_config.vocab_size, draft_cfg.vocab_size
    )
    window = draft_cfg.sliding_window
    if window is not None and window < max_positions:  # as build_block_drafter refuses for DFLASH
        raise SpeculantError(
            f"sliding_window={window} in {spec.draft}/config.json is shorter than the "
            f"{max_positions} positions a request may reach (--max-model-len + 2 x (k + 1)), and "
            "windowed attention is not supported; lower --max-model-len"
        )
    with default_device_and_dtype(setup.device, setup.dtype):
        draft_lm = CausalLM(draft_cfg, max_positions, setup.pctx)
    if cfg.load_format == "dummy":
        init_dummy_weights(draft_lm, cfg.seed + 1)
    else:
        load_weights(draft_lm, iter_safetensors(spec.draft), spec.draft)
    return DraftModelDrafter(
        with_kernels(draft_lm.eval(), setup.attention_backend),
        setup.model_config.vocab_size,
        kv,
        setup.dtype,
        spec.num_draft_tokens,
        setup.attention_backend,
    )
