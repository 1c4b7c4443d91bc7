"""Layer 6, the runtime: backends, KV-cache manager and block pool, scheduler, sampler, engine."""
