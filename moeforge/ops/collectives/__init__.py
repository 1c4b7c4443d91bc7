"""The collectives of tensor/expert-parallel graphs (``com.microsoft.AllReduce`` / ``AllGather``): the torch ops the
exporter records (``torch_op``), their CPU implementation for ONNX Runtime on gloo (``ort``), and how TensorRT
parses them (``tensorrt``)."""
