"""Layer 5, quantisation: one spec (``spec.QuantSpec``), one registry of schemes (``schemes.SCHEMES``), the
calibration steps and their graph runner, and the pass list that applies a spec (``plan.quant_passes``), which
joins the ordered pass list after the target's pipeline."""
