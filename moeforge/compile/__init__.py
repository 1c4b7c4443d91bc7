"""Layer 8, the compiler: options, the one driver (``driver.compile_model``), the per-artifact stages, the
torch -> ONNX export, targets (ONNX Runtime, TensorRT) and the sharded (tp/ep) compile."""
