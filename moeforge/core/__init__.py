"""Layer 1, the contracts every stage shares: errors, the model config, the KV layout, the artifact manifest and
directory. Imports nothing else from moeforge."""
