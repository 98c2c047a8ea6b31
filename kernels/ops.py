"""The element-wise ops a decoder layer runs around attention, as two interchangeable sets that
an attention backend declares (`backend.ops`). `TorchOps` is the reference: the exact torch
code the models always ran (the CPU path). `TritonOps` runs the fused Triton kernels (each
falling back to its reference where Triton cannot run) and has the backend fuse RoPE into its
KV write; build it only with the Triton backend: it imports triton (kernels/runtime.py)."""

from __future__ import annotations

import contextlib

import torch

from speculant.kernels import reference


class TorchOps:
    """Reference ops; `fuses_rope` False: the model rotates q and k itself."""

    fuses_rope = False

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return reference.rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x)."""
        return reference.add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(gate_up)

    @staticmethod
    def top_logprobs(
        logits: torch.Tensor, num_top: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log-sum-exp [R], the `num_top` largest logits less it, their ids) of logits [R, V]."""
        return reference.top_logprobs(logits, num_top)

    @staticmethod
    def launch_modes(modes: dict[str, int] | None):
        """A context whose kernel launches take `modes` ({kind: PDL mode}, kernels/runtime.py
        launch_modes); nothing to set for the reference ops."""
        return contextlib.nullcontext()


class TritonOps(TorchOps):
    """Fused kernels; `fuses_rope` True: the attention backend's `forward(..., rope)` rotates q
    and k while it writes the KV cache."""

    fuses_rope = True

    def __init__(self):
        from speculant.kernels import activation, logprobs, norm, runtime

        self.rms_norm = norm.rms_norm
        self.add_rms_norm = norm.add_rms_norm
        self.silu_and_mul = activation.silu_and_mul
        self.top_logprobs = logprobs.top_logprobs
        self.launch_modes = runtime.launch_modes


TORCH_OPS = TorchOps()
