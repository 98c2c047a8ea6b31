"""Target models (Llama / Qwen2 / Qwen3), TP-aware layers and the checkpoint loader."""
