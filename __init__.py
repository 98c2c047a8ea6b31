"""speculant: a distributed speculative-decoding executor (EAGLE-3, DFLASH) with graph capture.

`Engine`, `SamplingParams` and the configs import torch on first use, so `import speculant`
(and `speculant --help`) stays fast; `bundled(name)` gives the installed bundled models.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING


def _unshadow() -> None:
    """Take this folder (the package, a checkout's root) off sys.path. `python -m ...` run from
    the checkout puts it there (as ''), and then its subfolders are top-level names too,
    shadowing distributions of the same name: `kernels` (Hugging Face's, which transformers
    >= 5.25 imports when installed: an ImportError from our kernels/) and `comm` (Jupyter's). A
    module already imported from here under such a name is dropped too."""
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None) or ""
        if "." not in name and origin and os.path.dirname(origin) == os.path.join(here, name):
            del sys.modules[name]


_unshadow()

from speculant.errors import SpeculantError  # noqa: E402

if TYPE_CHECKING:
    from speculant.config import EngineConfig, ModelConfig
    from speculant.executor.chat import Chat
    from speculant.executor.engine import Engine
    from speculant.executor.request import RequestOutput, SamplingParams

ASSETS = Path(__file__).resolve().parent / "assets"
# bundled() names: the asset folders, and each --algo's drafter under its algo name.
BUNDLED_NAMES = {
    "target": "target",
    "eagle3": "eagle3",
    "dflash": "dflash",
    "draft_lm": "draft_lm",
    "draft-model": "draft_lm",
}
_LAZY = {
    "Chat": "speculant.executor.chat",
    "Engine": "speculant.executor.engine",
    "EngineConfig": "speculant.config",
    "ModelConfig": "speculant.config",
    "RequestOutput": "speculant.executor.request",
    "SamplingParams": "speculant.executor.request",
}


def bundled(name: str) -> Path:
    """The installed folder of a bundled model: "target" (the 8.4 M-parameter Python-code
    Llama), or its drafter "eagle3", "dflash" or "draft_lm" (also "draft-model", the --algo
    name). Pass it as `Engine(target=...)` or `draft=...`."""
    if name not in BUNDLED_NAMES:
        raise SpeculantError(
            f"no bundled model {name!r}; use one of {', '.join(sorted(BUNDLED_NAMES))}"
        )
    path = ASSETS / BUNDLED_NAMES[name]
    if not (path / "config.json").is_file():
        raise SpeculantError(
            f"the bundled model {name!r} is missing from {ASSETS}; reinstall speculant or pass "
            "--target/--draft explicitly"
        )
    return path


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'speculant' has no attribute {name!r}")


__all__ = [
    "Chat",
    "Engine",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SpeculantError",
    "bundled",
]
