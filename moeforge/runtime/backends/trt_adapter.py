"""One interface over the two TensorRT Python packages.

- ``tensorrt`` (full TensorRT, GPU machines): builds for the GPU it runs on (no ahead-of-time target).
- ``tensorrt_rtx_bindings`` (TensorRT for RTX, ``pip install "moeforge[tensorrt-rtx]"``): builds ahead
  of time for a chosen compute capability, also on a machine with no GPU.

The module is imported lazily (``load_tensorrt``), so nothing imports TensorRT unless the trt target
or backend is used. Errors name the fix.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from moeforge.core.errors import MoeforgeError

IMPLS = ("auto", "tensorrt", "tensorrt-rtx")
_MODULES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx_bindings"}
INSTALL_HINT = ('install TensorRT-RTX with  pip install "moeforge[tensorrt-rtx]"  (builds engines ahead of time, '
                "also without a GPU), or the full TensorRT Python package on a GPU machine")


class TensorRTNotInstalled(MoeforgeError):
    """No usable TensorRT Python package."""


class ComputeCapabilityNotOffered(MoeforgeError):
    """The requested SM is not a build target of the installed TensorRT."""


@dataclass(frozen=True)
class TensorRT:
    """A loaded TensorRT flavour: the module plus what differs between flavours."""

    module: ModuleType
    impl: str  # "tensorrt" | "tensorrt-rtx"

    @property
    def version(self) -> str:
        return str(self.module.__version__)

    @property
    def aot(self) -> bool:
        """Whether it builds for a chosen compute capability (TensorRT-RTX) rather than the local GPU."""
        return hasattr(self.module, "ComputeCapability")

    def logger(self, verbose: bool = False) -> Any:
        trt = self.module
        return trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.ERROR)

    def offered_sms(self) -> list[int]:
        """Compute capabilities this TensorRT can build for ahead of time (e.g. [75, 80, 86, 89, 120, 121])."""
        if not self.aot:
            return []
        names = [n for n in dir(self.module.ComputeCapability) if n.startswith("SM") and n[2:].isdigit()]
        return sorted(int(n[2:]) for n in names)

    def network_flags(self) -> int:
        """Strongly typed: precision comes from the graph's casts (TensorRT 11 knows nothing else)."""
        flags = self.module.NetworkDefinitionCreationFlag
        return 1 << int(flags.STRONGLY_TYPED) if hasattr(flags, "STRONGLY_TYPED") else 0

    def set_target(self, config: Any, sm: int | None) -> str:
        """Point a builder config at compute capability ``sm``; return the target's name (e.g. "SM89")."""
        if self.aot:
            offered = self.offered_sms()
            if sm is None:
                raise ComputeCapabilityNotOffered(
                    f"{self.impl} {self.version} builds ahead of time: pass --sm (one of "
                    f"{', '.join(map(str, offered))})")
            if sm not in offered:
                hint = " (Hopper SM90 needs full TensorRT on a Hopper machine)" if sm == 90 else ""
                raise ComputeCapabilityNotOffered(
                    f"--sm {sm} is not offered by {self.impl} {self.version}; it builds for SM "
                    f"{', '.join(map(str, offered))}{hint}")
            config.num_compute_capabilities = 1
            config.set_compute_capability(getattr(self.module.ComputeCapability, f"SM{sm}"), 0)
            return f"SM{sm}"
        local = local_sm()
        if local is None:
            raise ComputeCapabilityNotOffered(
                f"full TensorRT {self.version} builds for the GPU it runs on and no GPU is visible; "
                "use --trt-impl tensorrt-rtx to build ahead of time")
        if sm is not None and sm != local:
            raise ComputeCapabilityNotOffered(
                f"--sm {sm} differs from this machine's GPU (SM{local}); full TensorRT builds for the local GPU: "
                f"drop --sm, or use --trt-impl tensorrt-rtx")
        return f"SM{local}"


def local_sm() -> int | None:
    """The first visible CUDA GPU's compute capability as an int (89), or None without one."""
    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return major * 10 + minor
    except Exception:  # no CUDA build of torch, no driver
        return None
    return None


def load_tensorrt(impl: str = "auto") -> TensorRT:
    """Import TensorRT: ``auto`` prefers full TensorRT and falls back to TensorRT-RTX."""
    if impl not in IMPLS:
        raise MoeforgeError(f"--trt-impl {impl!r}: expected one of {', '.join(IMPLS)}")
    candidates = ["tensorrt", "tensorrt-rtx"] if impl == "auto" else [impl]
    reasons = []
    for name in candidates:
        try:
            module = importlib.import_module(_MODULES[name])
            module.Logger  # noqa: B018  (the bindings-only stub of full TensorRT imports but has no classes)
        except (ImportError, OSError, AttributeError) as exc:
            reasons.append(f"{_MODULES[name]}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            continue
        return TensorRT(module, name)
    raise TensorRTNotInstalled(f"no TensorRT found ({'; '.join(reasons)}); {INSTALL_HINT}")
