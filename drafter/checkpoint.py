"""Reading a drafter's checkpoint folder: what its config.json says it is (`drafter_format`: the
algorithm, and vLLM's `speculators` format with its default k), that format's config flattened
to the fields the loaders read (`speculators_fields`), its tensors (safetensors or
pytorch_model.bin) and the check that it holds every tensor of its published layout.

The speculators format (vLLM's `speculators` package, `Eagle3Converter` / `DFlashConverter`, and
what vLLM's `transformers_utils/configs/speculators` reads): `speculators_model_type` names the
algorithm, `speculators_config` holds `algorithm`, `proposal_methods` (the default method's
`speculative_tokens` is the default k) and `verifier` (the target it was made for); the decoder
layers' shapes sit in the nested `transformer_layer_config`; the algorithm's own fields
(`draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`, `norm_before_residual`, `block_size`,
`aux_hidden_state_layer_ids`, `mask_token_id`, ...) at the top level."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from speculant.config import (
    MAX_DRAFT_TOKENS,
    ModelConfig,
    config_architectures,
    config_int,
    read_hf_config,
)
from speculant.errors import SpeculantError
from speculant.models.loader import iter_safetensors


def check_tp_split(
    layer: ModelConfig, tp: int, head: str, path: str | Path, source: str | None = None
) -> None:
    """Refuse, in one line, a drafter's decoder layers that QKVParallelLinear and the MLP cannot
    split over `tp` ranks (attention heads and the MLP are sharded like the target's; KV heads
    split, or are replicated when tp is a multiple of them). The line names the head (`head`:
    "EAGLE-3 head", "DFLASH drafter", ...), its folder `path`, the config field and value, the
    tp and the fix; `source` (the config file read) follows the field."""
    heads, kv, inter = layer.num_heads, layer.num_kv_heads, layer.intermediate_size
    if heads % tp:
        bad, fix = f"num_attention_heads={heads} is not divisible by --tp {tp}", f"divides {heads}"
    elif kv % tp and tp % kv:
        bad = f"num_key_value_heads={kv} neither divides nor is a multiple of --tp {tp}"
        fix = f"divides {kv} or is a multiple of it"
    elif inter % tp:
        bad, fix = f"intermediate_size={inter} is not divisible by --tp {tp}", f"divides {inter}"
    else:
        return
    where = f" ({source})" if source else ""
    raise SpeculantError(
        f"{head} {str(path)!r}: {bad}{where}; its attention and MLP are split over the "
        f"tensor-parallel ranks like the target's: use a --tp that {fix}"
    )


def read_head_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of a head folder (safetensors, sharded or not, else pytorch_model.bin), with a
    leading `model.` stripped; returns them and a name for error messages."""
    path = Path(path)
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        weights = dict(iter_safetensors(path))
    else:
        bins = sorted(path.glob("pytorch_model*.bin"))
        if not bins:
            raise SpeculantError(
                f"no model.safetensors or pytorch_model.bin in {str(path)!r}; "
                "download the head or pass --load-format dummy"
            )
        weights, held_by = {}, {}
        for file in bins:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as exc:  # pickle and zip errors vary by torch version
                raise SpeculantError(
                    f"cannot read {str(file)!r} ({exc}); the file is corrupt or "
                    "truncated, download it again"
                ) from exc
            if not isinstance(state, dict):
                raise SpeculantError(f"{str(file)!r} does not hold a state dict")
            bad = [name for name, value in state.items() if not isinstance(value, torch.Tensor)]
            if bad:
                raise SpeculantError(
                    f"{str(file)!r} holds {bad[0]!r}, which is not a tensor; it is not a "
                    "state dict of weights"
                )
            for name in state:  # as for safetensors: one file per tensor, never a silent winner
                if name in held_by:
                    raise SpeculantError(
                        f"tensor {name!r} is in both {str(held_by[name])!r} and {str(file)!r}; "
                        "a checkpoint holds each tensor once: remove the stray file"
                    )
                held_by[name] = file
            weights.update(state)
    stripped: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        short = name.removeprefix("model.")
        if short in stripped:  # `model.x` and `x`: both would load as x, one silently lost
            raise SpeculantError(
                f"{str(path)!r} holds both {short!r} and 'model.{short}'; keep one of them"
            )
        stripped[short] = tensor
    return stripped, str(path)


def require_tensors(
    weights: dict[str, torch.Tensor], keys: Iterable[str], source: str, noun: str, kind: str
) -> None:
    """Raise naming the first of `keys` that `weights` (read from `source`) lacks; `noun` and
    `kind` say what the folder should be ("head", "an EAGLE-3 head")."""
    for key in keys:
        if key not in weights:
            raise SpeculantError(
                f"{source} lacks the tensor {key!r}; the {noun} is incomplete or not {kind} "
                "in the published layout"
            )


SPECULATORS_ALGOS = ("eagle3", "dflash")
# Top-level keys of a speculators config.json that describe the file, not the drafter.
_SPECULATORS_META = {
    "architectures", "auto_map", "speculators_config", "speculators_model_type",
    "speculators_version", "transformer_layer_config", "transformers_version",
}  # fmt: skip


@dataclass(frozen=True)
class DrafterFormat:
    """What a drafter folder's config.json says it is: `algo` ("eagle3", "dflash", or None when
    it does not say), whether it is in the speculators format, that format's default number of
    draft tokens (`speculative_tokens`, read through `num_draft_tokens`) and the verifier it
    names."""

    algo: str | None
    speculators: bool = False
    speculative_tokens: int | None = None
    verifier: str | None = None
    tokens_field: str = "speculative_tokens"  # where speculative_tokens sits, for errors
    max_tokens: int = MAX_DRAFT_TOKENS  # the most drafts it may default to (a DFLASH block's)
    source: str = "config.json"

    @property
    def num_draft_tokens(self) -> int | None:
        """The default k this config sets (None: it sets none). One above what the engine (or a
        DFLASH block) runs is refused here, when it is taken as k, rather than lowered: an
        explicit --num-draft-tokens overrides it and never reads it (executor/build.check_spec
        asks only without one), so such a config still runs with one."""
        tokens = self.speculative_tokens
        if tokens is not None and tokens > self.max_tokens:
            limit = (
                f"the engine's maximum of {MAX_DRAFT_TOKENS} draft tokens"
                if self.max_tokens == MAX_DRAFT_TOKENS
                else f"the {self.max_tokens} drafts a DFLASH block of {self.max_tokens + 1} holds"
            )
            raise SpeculantError(
                f"{self.tokens_field}={tokens} in {self.source} is above {limit}; pass "
                f"--num-draft-tokens N with N <= {self.max_tokens} to override it (or lower it "
                "in config.json)"
            )
        return tokens


def drafter_format(path: str | Path) -> DrafterFormat:
    """The format of the drafter in folder `path` (see `format_of`)."""
    return format_of(read_hf_config(path), str(Path(path) / "config.json"))


def format_of(hf: dict, source: str) -> DrafterFormat:
    """A speculators config names its algorithm in `speculators_model_type`; a published head's
    `architectures` name it too (`LlamaForCausalLMEagle3`, `DFlashDraftModel`). The
    speculators_config fields read here (algorithm, verifier, proposal_methods) are checked:
    a value of the wrong type is one line naming it, never a crash or a silent default."""
    kind = hf.get("speculators_model_type")
    archs = " ".join(config_architectures(hf, source)).lower()  # checked in either format
    if kind is None:
        algo = "eagle3" if "eagle3" in archs else "dflash" if "dflash" in archs else None
        return DrafterFormat(algo, source=source)
    if kind not in SPECULATORS_ALGOS:
        raise SpeculantError(
            f"speculators_model_type={kind!r} in {source} is not supported; supported: "
            f"{', '.join(SPECULATORS_ALGOS)}"
        )
    spec = hf.get("speculators_config")
    if not isinstance(spec, dict):
        raise SpeculantError(
            f"{source} has speculators_model_type={kind!r} but no speculators_config; "
            "re-convert the drafter with the speculators package"
        )
    if spec.get("algorithm", kind) != kind:
        raise SpeculantError(
            f"speculators_config.algorithm={spec['algorithm']!r} in {source} contradicts "
            f"speculators_model_type={kind!r}; fix config.json"
        )
    tokens, field = _speculative_tokens(spec, source)
    limit = speculators_block_size(hf, source) - 1 if kind == "dflash" else MAX_DRAFT_TOKENS
    return DrafterFormat(
        kind, True, tokens, _verifier(spec, source), field, min(limit, MAX_DRAFT_TOKENS), source
    )


def _verifier(spec: dict, source: str) -> str | None:
    """`verifier.name_or_path`: the target the drafter was made for (null when absent)."""
    verifier = spec.get("verifier")
    if verifier is None:
        return None
    if not isinstance(verifier, dict):
        raise SpeculantError(
            f"speculators_config.verifier={verifier!r} in {source} must be an object "
            '({"name_or_path": ..., "architectures": [...]}); fix config.json'
        )
    name = verifier.get("name_or_path")
    if name is not None and not isinstance(name, str):
        raise SpeculantError(
            f"speculators_config.verifier.name_or_path={name!r} in {source} must be a string; "
            "fix config.json"
        )
    return name


def _speculative_tokens(spec: dict, source: str) -> tuple[int | None, str]:
    """`speculative_tokens` of the default proposal method (else the first, as vLLM reads) and
    the field it came from. `proposal_methods` must be a list of method objects, and
    `default_proposal_method`, when given, the `proposal_type` of one of them."""
    where = "speculators_config.proposal_methods"
    methods = spec.get("proposal_methods")
    if methods is None or methods == []:
        return None, where
    if not isinstance(methods, list) or not all(isinstance(m, dict) for m in methods):
        raise SpeculantError(
            f"{where}={methods!r} in {source} must be a list of method objects, e.g. "
            '[{"proposal_type": "greedy", "speculative_tokens": 3}]; fix config.json'
        )
    types = [m.get("proposal_type") for m in methods]
    default = spec.get("default_proposal_method")
    if default is None:
        index = 0
    elif default in types and isinstance(default, str):
        index = types.index(default)
    else:
        raise SpeculantError(
            f"speculators_config.default_proposal_method={default!r} in {source} names none of "
            f"the proposal_methods ({', '.join(map(repr, types))}); fix config.json"
        )
    field = f"{where}[{index}].speculative_tokens"
    tokens = methods[index].get("speculative_tokens")
    if tokens is None:
        return None, field
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise SpeculantError(
            f"{field}={tokens!r} in {source} must be a positive integer; fix config.json"
        )
    return tokens, field


def speculators_block_size(hf: dict, source: str) -> int:
    """A speculators DFLASH drafter's `block_size`: its transformer_layer_config's when that
    has one (it wins there, as in `speculators_fields`), else the top level's, else the
    speculators schema's default, 8. The model and the default k both read it here."""
    layer = hf.get("transformer_layer_config")
    if isinstance(layer, dict) and layer.get("block_size") is not None:
        return config_int(layer, "block_size", f"transformer_layer_config of {source}", minimum=2)
    return config_int(hf, "block_size", source, 8, minimum=2)


def speculators_fields(hf: dict, source: str) -> dict:
    """A speculators config flattened: `transformer_layer_config` (the layers' shapes) with the
    algorithm's top-level fields beside it (null ones left out, so defaults apply)."""
    layer = hf.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise SpeculantError(
            f"{source} is in the speculators format but has no transformer_layer_config "
            "object; re-convert the drafter with the speculators package"
        )
    extra = {k: v for k, v in hf.items() if k not in _SPECULATORS_META and v is not None}
    return {**extra, **layer}


DFLASH2_FIELDS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")


def is_dflash2(hf: dict) -> bool:
    """A DFlash2 drafter (`--algo dflash`, its own loader): its architectures name
    DFlash2DraftModel, as the reference's loader picks the class; without architectures, its
    `dflash_config` (or top level) has the selector and convolution fields."""
    archs = hf.get("architectures")
    if archs and isinstance(archs, list):  # one of another type: the loader refuses it by name
        return any("dflash2" in str(arch).lower() for arch in archs)
    extra = hf.get("dflash_config") if isinstance(hf.get("dflash_config"), dict) else {}
    return any(name in hf or name in extra for name in DFLASH2_FIELDS)
