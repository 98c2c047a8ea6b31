"""Triton kernels for the decode step: paged attention (decode, verify, prefill), fused
residual-add + RMSNorm, fused RoPE + KV-cache write, SiLU-and-mul. Each has a torch reference
that is also its fallback where Triton cannot run (kernels/runtime.py); `ops` groups them into
the two op sets attention backends declare."""
