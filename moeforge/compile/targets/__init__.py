"""Compile targets: what differs between ONNX Runtime and TensorRT artifacts, one module each.

``driver.py`` runs the stages once (load, export, passes, manifest, write) and asks the target for its pass
list, KV-cache spec, precision, quantisation summary and extra files. Adding a target: one module with a class
following ``base.Target``, and its name in ``TARGETS``.
"""

from collections.abc import Callable

from moeforge.compile.options import CompileOptions
from moeforge.compile.targets.base import CompileJob, Target
from moeforge.compile.targets.ort import OrtTarget
from moeforge.compile.targets.trt import TrtTarget

# --target NAME -> the class that makes that target's Target for one compile.
TARGETS: dict[str, Callable[[CompileOptions], Target]] = {OrtTarget.name: OrtTarget, TrtTarget.name: TrtTarget}

__all__ = ["TARGETS", "CompileJob", "OrtTarget", "Target", "TrtTarget"]
