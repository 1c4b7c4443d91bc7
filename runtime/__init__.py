"""Runtime: backends, KV cache, scheduler, sampler, engine."""
