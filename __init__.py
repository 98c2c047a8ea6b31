"""speculant: a distributed speculative-decoding executor (EAGLE-3, DFLASH) with graph capture."""

from speculant.config import EngineConfig, ModelConfig
from speculant.errors import SpeculantError
from speculant.executor.engine import Engine
from speculant.executor.request import RequestOutput, SamplingParams

__all__ = [
    "Engine",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SpeculantError",
]
