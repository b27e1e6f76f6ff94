"""Floor 3: text generation (KV cache, sampling, modes)."""
