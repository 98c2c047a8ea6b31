"""Reading a drafter's checkpoint folder: its tensors (safetensors or pytorch_model.bin) and the
check that it holds every tensor of its published layout."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from speculant.errors import SpeculantError
from speculant.models.loader import iter_safetensors


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
        weights = {}
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
            weights.update(state)
    return {name.removeprefix("model."): t for name, t in weights.items()}, str(path)


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
