"""Per-rank runtime: engine, scheduler, paged KV cache, attention, sampling, verify, graphs."""
