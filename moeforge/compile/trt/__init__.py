"""TensorRT target, build side: engine build, optimisation profiles, inspection, ORT check of the lowering.

Nothing here imports TensorRT at module import time; ``runtime.backends.trt_adapter.load_tensorrt`` does, when asked.
"""
