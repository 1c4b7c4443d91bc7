"""Layer 4, ONNX -> ONNX graph passes (onnx-ir); one rule family per file, ordered lists in ``pipeline.py`` (ONNX
Runtime) and ``trt_lowering.py`` (TensorRT)."""
