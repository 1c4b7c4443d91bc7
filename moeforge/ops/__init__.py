"""Layer 2, custom ops: one folder per op (schema, torch reference, ONNX function, ONNX Runtime lowering,
TensorRT plugin), the collectives of sharded graphs, and the node-building helpers their functions share."""
