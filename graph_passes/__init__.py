"""ONNX -> ONNX graph passes (onnx-ir); one rule family per file."""
