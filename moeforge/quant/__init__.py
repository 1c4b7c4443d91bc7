"""Quantisation: one spec (``spec.QuantSpec``), one registry of schemes (``schemes.SCHEMES``), and the passes that
apply a spec (``passes.quant_passes``), which join the ordered pass list after the target's pipeline."""
