"""The collectives of a sharded artifact's graphs, on ONNX Runtime: NCCL on CUDA, torch.distributed (gloo) on CPU.

A rank's graph holds ``com.microsoft.AllReduce`` and ``com.microsoft.AllGather(axis, group_size)`` nodes
(``moeforge/ops/collectives/torch_op.py``). ONNX Runtime's CUDA execution provider implements them over NCCL in its
collective-enabled builds, so on a GPU the graph runs as written. ONNX Runtime's CPU provider has no kernel for
them: ``prepare_session`` moves those nodes, in an in-memory copy, to the domain of onnxruntime-extensions'
Python custom ops (``ai.onnx.contrib``, same op names and attributes) and registers that library, whose ops call
``torch.distributed`` on the process group this process joined (``init_process_group``). The artifact on disk is
never changed; the same graph serves both.

Every collective has the process group's timeout: a rank that died or hangs makes the others' next collective
fail with an error (gloo reports a closed peer at once, a silent one after the timeout), never wait forever.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.distributed as dist

from moeforge.core.errors import MoeforgeError
from moeforge.ops.collectives.torch_op import COLLECTIVE_OPS, MS_DOMAIN

log = logging.getLogger(__name__)

CPU_DOMAIN = "ai.onnx.contrib"  # onnxruntime-extensions' domain for Python custom ops
DEFAULT_TIMEOUT_S = 60.0
_CUDA = "CUDAExecutionProvider"


class CollectiveError(MoeforgeError):
    """A rank could not join its group, or a collective failed (a rank died, hung or runs another artifact)."""


def init_process_group(rank: int, world_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the gloo group of ``world_size`` ranks as ``rank``, through torchrun's environment
    (``MASTER_ADDR``/``MASTER_PORT``): the same variables on one node or several."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise CollectiveError(f"{name} is not set: start the ranks with torchrun (or moeforge run, which sets it "
                                  "for one node)")
    if dist.is_initialized():
        return
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise CollectiveError(f"rank {rank} of {world_size} could not join the group at "
                              f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {timeout_s:.0f} s "
                              f"({type(exc).__name__}: {exc}); check that every rank was started") from None


_REGISTERED: list[str] = []
# The process group the graph's collectives run on: None = the default (every rank). A pipeline artifact's stage
# runs its tensor-parallel collectives on its own stage's group (``set_collective_group``). A process runs one rank,
# so one group per process; ONNX Runtime's custom ops take no such argument, hence this module-level setting.
_GROUP: list[dist.ProcessGroup] = []


def set_collective_group(group: dist.ProcessGroup | None) -> None:
    """Run this process's graph collectives on ``group`` (a ``torch.distributed`` group; None: the default)."""
    _GROUP.clear()
    if group is not None:
        _GROUP.append(group)


def _group() -> dist.ProcessGroup | None:
    return _GROUP[0] if _GROUP else None


def _library() -> str:
    """Register the CPU collectives with onnxruntime-extensions (once per process); its library path."""
    if not _REGISTERED:
        # lazy: the extensions library takes ~1.5 s to import, and only a CPU session of a sharded rank needs it
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op  # type: ignore[import-untyped]

        @onnx_op(op_type="AllReduce", inputs=[PyCustomOpDef.dt_float],  # type: ignore[untyped-decorator]
                 outputs=[PyCustomOpDef.dt_float])
        def _all_reduce(x: np.ndarray) -> np.ndarray:
            tensor = torch.from_numpy(np.array(x, dtype=np.float32, copy=True))
            _collective("AllReduce", lambda: dist.all_reduce(tensor, group=_group()))
            return tensor.numpy()

        @onnx_op(op_type="AllGather", inputs=[PyCustomOpDef.dt_float],  # type: ignore[untyped-decorator]
                 outputs=[PyCustomOpDef.dt_float],
                 attrs={"axis": PyCustomOpDef.dt_int64, "group_size": PyCustomOpDef.dt_int64})
        def _all_gather(x: np.ndarray, axis: int = 0, group_size: int = 1) -> np.ndarray:
            tensor = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
            parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group=_group()))]
            _collective("AllGather", lambda: dist.all_gather(parts, tensor, group=_group()))
            return torch.cat(parts, dim=int(axis)).numpy()

        _REGISTERED.append(get_library_path())
    return _REGISTERED[0]


# Why a collective failed in this process (first failure only). A failed collective leaves the group unusable.
_FAILURE: list[str] = []


def _collective(name: str, run: Callable[[], object]) -> None:
    """Run one collective inside ONNX Runtime. An exception cannot cross the custom-op boundary (it would abort
    the process with a C++ terminate), so a failure is recorded instead: the op returns whatever its buffer holds,
    every later collective of the run returns at once, and the caller of the session raises the failure when the
    run is over (``raise_collective_failure``). The process stays up, so rank 0 can end its requests properly."""
    if _FAILURE:
        return
    try:
        run()
    except Exception as exc:
        rank = dist.get_rank() if dist.is_initialized() else "?"
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        _FAILURE.append(f"rank {rank}: the {name} collective failed ({type(exc).__name__}: {first_line}); another "
                        "rank died or hung past the timeout")
        log.error("%s", _FAILURE[0])


def raise_collective_failure() -> None:
    """Raise ``CollectiveError`` if a collective of this process has failed (call it after each session run of a
    sharded rank: the run's outputs are then garbage, and the group cannot run another collective)."""
    if _FAILURE:
        raise CollectiveError(_FAILURE[0])


def cpu_graph(graph: onnx.ModelProto) -> int:
    """Move ``graph``'s collective nodes to the CPU custom-op domain, in place; returns how many."""
    moved = 0
    for node in graph.graph.node:
        if node.domain == MS_DOMAIN and node.op_type in COLLECTIVE_OPS:
            node.domain = CPU_DOMAIN
            moved += 1
    if moved and not any(o.domain == CPU_DOMAIN for o in graph.opset_import):
        graph.opset_import.append(onnx.helper.make_opsetid(CPU_DOMAIN, 1))
    return moved


def prepare_session(model_path: str | Path, graph: onnx.ModelProto | None, options: ort.SessionOptions,
                    providers: Sequence[str]) -> onnx.ModelProto | None:
    """Make a rank's graph runnable on ``providers``: unchanged with CUDA (NCCL kernels), else its collectives
    moved to the torch.distributed custom ops registered in ``options``. Returns the graph to load (None: the
    file as it is)."""
    if _CUDA in providers:
        return graph
    if not (dist.is_available() and dist.is_initialized()):
        raise CollectiveError(f"{model_path} is one rank of a sharded artifact: its collectives need the ranks' "
                              "process group (moeforge run/serve/parity on the artifact directory start it)")
    graph = graph if graph is not None else onnx.load(str(model_path), load_external_data=False)
    cpu_graph(graph)
    options.register_custom_ops_library(_library())
    # Collectives must run in the same order on every rank: one node at a time (ONNX Runtime's default).
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return graph
