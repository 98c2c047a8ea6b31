"""Configuration dataclasses: the model (from HF config.json), the cache, graphs, speculation and
parallelism. Everything an `Engine` is built from lives here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from speculant.errors import SpeculantError

DENSE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def read_hf_config(path: str | Path) -> dict:
    """Read `config.json` of a Hugging Face checkpoint directory, with clear errors."""
    path = Path(path)
    if not path.is_dir():
        raise SpeculantError(
            f"checkpoint directory {str(path)!r} does not exist; pass a folder "
            "holding config.json and *.safetensors"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SpeculantError(
            f"{str(config_file)!r} is missing; {str(path)!r} is not a Hugging Face "
            "checkpoint (it needs config.json and *.safetensors)"
        )
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise SpeculantError(
            f"{str(config_file)!r} is not valid JSON ({exc}); re-export the checkpoint"
        ) from exc


def _rope_settings(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either the transformers-4 or transformers-5 layout."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or None
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise SpeculantError(f"rope scaling type {kind!r} is not supported; supported: llama3")
    return float(theta), scaling


def _moe_settings(hf: dict, num_layers: int) -> dict:
    """Qwen3-MoE fields with transformers' defaults; `moe_layer_ids` are the layers whose MLP is
    sparse (not in mlp_only_layers, and every decoder_sparse_step-th layer)."""
    num_experts = int(hf.get("num_experts", hf.get("num_local_experts", 128)))
    step = int(hf.get("decoder_sparse_step", 1))
    dense = set(hf.get("mlp_only_layers") or [])
    sparse = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layer_ids=tuple(sparse) if num_experts > 0 else (),
    )


@dataclass
class ModelConfig:
    """The architecture of a decoder (Llama / Qwen2 / Qwen3, and Qwen3-MoE's expert fields) as
    read from config.json."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    num_experts: int = 0  # MoE only: routed experts per sparse layer
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    moe_layer_ids: tuple[int, ...] = ()  # layers with a sparse MoE block instead of the MLP
    hf: dict = field(default_factory=dict, repr=False)

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layer_ids)

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in DENSE_ARCHITECTURES + MOE_ARCHITECTURES:
            raise SpeculantError(
                f"architecture {arch!r} in {source} is not supported; supported: "
                f"{', '.join(DENSE_ARCHITECTURES + MOE_ARCHITECTURES)}"
            )
        if hf.get("mlp_bias"):
            raise SpeculantError(f"mlp_bias=true in {source} is not supported")
        try:
            hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
            theta, scaling = _rope_settings(hf)
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            num_layers = int(hf["num_hidden_layers"])
            moe = _moe_settings(hf, num_layers) if arch in MOE_ARCHITECTURES else {}
            return cls(
                architecture=arch,
                hidden_size=hidden,
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                intermediate_size=int(hf["intermediate_size"]),
                vocab_size=int(hf["vocab_size"]),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
                qk_norm=arch in QK_NORM_ARCHITECTURES,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                eos_token_ids=eos_ids,
                torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
                **moe,
                hf=hf,
            )
        except KeyError as exc:
            raise SpeculantError(
                f"{source} lacks the field {exc.args[0]!r}; re-export the "
                "checkpoint with transformers"
            ) from exc

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf(read_hf_config(path), source=str(Path(path) / "config.json"))


@dataclass
class CacheConfig:
    """Paged KV cache sizing. `num_pages=None` sizes the pool from max_num_seqs * max_model_len on
    the CPU, or from `kv_cache_memory_fraction` of free memory on a GPU."""

    page_size: int = 16
    max_num_seqs: int | None = None  # None: 256 on a GPU, 64 on the CPU (over all DP ranks)
    max_num_batched_tokens: int | None = None  # tokens per forward; None: 8192 GPU, 2048 CPU
    max_model_len: int | None = None
    num_pages: int | None = None
    kv_cache_memory_fraction: float = 0.85


@dataclass
class GraphConfig:
    """CUDA graph capture policy (see DESIGN.md, graph wrapper behaviour)."""

    capture_sizes: list[int] | None = None
    max_capture_size: int | None = None
    disable_padding: bool = False
    enforce_eager: bool = False
    eager_padding: bool = False


@dataclass
class SpecConfig:
    """Speculative decoding: which drafter and how many draft tokens per step (0 = plain)."""

    algo: str | None = None
    draft: str | None = None
    num_draft_tokens: int = 0


@dataclass
class ParallelConfig:
    """Data-parallel groups of tensor-parallel ranks."""

    tp: int = 1
    dp: int = 1


@dataclass
class MoeConfig:
    """Expert parallelism for MoE targets: how tokens reach the rank holding their expert
    (`auto`: local on one rank, else DeepEP on CUDA when installed, else all2all) and the most
    tokens one rank dispatches at once (None: one decode step, max_num_seqs // dp * (k + 1))."""

    backend: str = "auto"  # auto | local | all2all | deepep
    max_tokens_per_rank: int | None = None


@dataclass
class EngineConfig:
    """Everything an Engine needs."""

    target: str
    device: str = "cpu"
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    # auto (triton on CUDA when it imports, else torch) | triton | torch
    attention_backend: str = "auto"
    # one rank: launch the next decode step before reading back the current one (when the
    # batch cannot change in between); off by default until it has run on a GPU
    overlap: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
