"""TensorRT target: adapter over TensorRT / TensorRT-RTX, engine build, inspection, golden parity.

Nothing here imports TensorRT at module import time; ``adapter.load_tensorrt`` does, when asked.
"""
