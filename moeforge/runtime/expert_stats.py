"""Expert-load statistics of a run, as the JSON file ``--expert-load-out`` writes and ``moeforge eplb`` reads.

    {"format": "moeforge-expert-load", "version": 1, "artifact_sha256": "...", "model": "...",
     "layers": [[tokens routed to expert e of MoE layer l, ...], ...],          # [L_moe][E]
     "imbalance": [max / mean over the experts, per layer],
     "rank_load": [[token x expert computations of rank r, ...], ...] | null,  # [L_moe][N], sharded artifacts
     "rank_imbalance": [max / mean over the ranks, per layer] | null,
     "groups": the model's expert groups (n_group; 1 without group-limited routing)}

The counts are the graph's own routing (``expert_hits``), over every token the model ran (prompts and generated
tokens); ``artifact_sha256`` is ``core.artifact.artifact_digest`` of the artifact that routed them.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from moeforge.core.artifact import artifact_digest, artifact_model_config
from moeforge.core.errors import MoeforgeError

FORMAT = "moeforge-expert-load"
VERSION = 1


def imbalance(load: np.ndarray) -> list[float]:
    """Per row of ``load`` [L, X]: max / mean (1 = balanced; 0 for a row without any count)."""
    rows = np.asarray(load, dtype=np.float64)
    mean = rows.mean(axis=1)
    return [round(float(m), 6) for m in np.where(mean > 0, rows.max(axis=1) / np.where(mean > 0, mean, 1), 0.0)]


def expert_load_record(load: np.ndarray, rank_load: np.ndarray | None, artifact_sha256: str,
                       model: str | None, groups: int = 1) -> dict[str, Any]:
    """The statistics file's content (see the module docstring)."""
    return {"format": FORMAT, "version": VERSION, "artifact_sha256": artifact_sha256, "model": model, "groups": groups,
            "layers": np.asarray(load).tolist(), "imbalance": imbalance(load),
            "rank_load": None if rank_load is None else np.asarray(rank_load).tolist(),
            "rank_imbalance": None if rank_load is None else imbalance(rank_load)}


def write_expert_load(path: str | os.PathLike[str], record: dict[str, Any]) -> Path:
    """Write ``record`` to ``path`` atomically (a temporary file beside it, then a rename)."""
    target = Path(path).expanduser()
    if not target.parent.is_dir():
        raise MoeforgeError(f"cannot write --expert-load-out {target}: folder {target.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w") as out:
            json.dump(record, out)
            out.write("\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def check_writable(path: str | os.PathLike[str] | None) -> None:
    """Refuse, before a run starts, an ``--expert-load-out`` whose folder does not exist (the run would be lost)."""
    if path is not None and not Path(path).expanduser().parent.is_dir():
        raise MoeforgeError(f"--expert-load-out {path}: folder {Path(path).expanduser().parent} does not exist; "
                            "create it or choose another path")


def run_record(load: np.ndarray, rank_load: np.ndarray | None, artifact: str | os.PathLike[str],
               model: str | None) -> dict[str, Any]:
    """The statistics of a run of ``artifact`` (its top directory): named by its digest, with its expert groups."""
    moe = artifact_model_config(Path(artifact)).get("moe") or {}
    return expert_load_record(load, rank_load, artifact_digest(Path(artifact)), model, int(moe.get("n_group") or 1))


def save_expert_load(path: str | os.PathLike[str], load: np.ndarray | None, rank_load: np.ndarray | None,
                     artifact: str | os.PathLike[str], model: str | None) -> Path:
    """Write a run's statistics for ``--expert-load-out``: ``load`` [L_moe, E] (None: the artifact routes no
    experts, refused), ``rank_load`` [L_moe, N] or None, named by the digest of ``artifact`` (its top directory)."""
    if load is None:
        raise MoeforgeError(f"--expert-load-out {path}: {artifact} routes no experts (not a MoE model); leave the "
                            "flag out")
    return write_expert_load(path, run_record(load, rank_load, artifact, model))
