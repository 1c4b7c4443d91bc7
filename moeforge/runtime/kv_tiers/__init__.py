"""KV-cache tiers below the backend's pool: host memory (L2) and disk (L3)."""
