"""Layer 7, proof that an artifact matches PyTorch: the PyTorch reference generation loop, golden outputs saved with
an artifact, teacher-forced parity (per layer), and the transformers reference."""
