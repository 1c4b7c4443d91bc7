"""Expert-load statistics of a run, as the JSON file ``--expert-load-out`` writes and ``moeforge eplb`` reads.

    {"format": "moeforge-expert-load", "version": 1, "artifact_sha256": "...", "model": "...",
     "layers": [[tokens routed to expert e of MoE layer l, ...], ...],          # [L_moe][E]
     "imbalance": [max / mean over the experts, per layer],
     "rank_load": [[token x expert computations of rank r, ...], ...] | null,  # [L_moe][N], sharded artifacts
     "rank_imbalance": [max / mean over the ranks, per layer] | null,
     "groups": the model's expert groups (n_group; 1 without group-limited routing)}

The counts are the graph's own routing (``expert_hits``), over every token the model ran (prompts and generated
tokens); ``artifact_sha256`` is ``core.artifact.artifact_digest`` of the artifact that routed them.

The path follows ``core.safe_paths``' rule: ``check_expert_load_out`` refuses it before any model loads (a link,
directory, device or FIFO at it; an existing file without ``--force``; a folder that takes no new file; an artifact
without MoE layers), and the file is written atomically at the end, a late failure being a user error (exit 2).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from moeforge.core.artifact import artifact_digest, artifact_model_config
from moeforge.core.errors import ArtifactError, MoeforgeError
from moeforge.core.safe_paths import check_output_file, write_output_file
from moeforge.core.strict_json import dumps_strict

FORMAT = "moeforge-expert-load"
VERSION = 1
FLAG = "--expert-load-out"


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


def write_expert_load(path: str | os.PathLike[str], record: dict[str, Any], force: bool = False) -> Path:
    """Write ``record`` to ``path`` under the safe-path rule (``core.safe_paths.write_output_file``: atomic, never
    through a link or over a special file, an existing file replaced only with ``force``). A failure is an
    ``UnsafePathError`` that names the flag, never an ``OSError``."""
    return write_output_file(Path(path), dumps_strict(record) + "\n", force=force, flag=FLAG)


def check_expert_load_out(path: str | os.PathLike[str] | None, artifact: str | os.PathLike[str],
                          force: bool = False) -> Path | None:
    """Refuse, before any model loads, an ``--expert-load-out`` the run could not write at its end or must not:
    a link, directory, device or FIFO at the path, an existing file without ``force``, a folder that takes no new
    file (``core.safe_paths.check_output_file``), or an ``artifact`` without MoE layers (from its manifest, or
    ``sharded.json``: nothing to count). None when the flag is not given."""
    if path is None:
        return None
    checked = check_output_file(Path(path), force=force, flag=FLAG)
    try:
        moe = artifact_model_config(Path(artifact)).get("moe")
    except ArtifactError:
        return checked  # not a readable artifact: the command's own check says so, in its words
    if not moe:
        raise MoeforgeError(f"{FLAG} {path}: {artifact} routes no experts (not a MoE model); leave the flag out")
    return checked


def run_record(load: np.ndarray, rank_load: np.ndarray | None, artifact: str | os.PathLike[str],
               model: str | None) -> dict[str, Any]:
    """The statistics of a run of ``artifact`` (its top directory): named by its digest, with its expert groups."""
    moe = artifact_model_config(Path(artifact)).get("moe") or {}
    return expert_load_record(load, rank_load, artifact_digest(Path(artifact)), model, int(moe.get("n_group") or 1))


def save_expert_load(path: str | os.PathLike[str], load: np.ndarray | None, rank_load: np.ndarray | None,
                     artifact: str | os.PathLike[str], model: str | None, force: bool = False) -> Path:
    """Write a run's statistics for ``--expert-load-out``: ``load`` [L_moe, E] (None: the artifact routes no
    experts, refused), ``rank_load`` [L_moe, N] or None, named by the digest of ``artifact`` (its top directory);
    an existing file is replaced only with ``force``."""
    if load is None:
        raise MoeforgeError(f"{FLAG} {path}: {artifact} routes no experts (not a MoE model); leave the flag out")
    return write_expert_load(path, run_record(load, rank_load, artifact, model), force=force)
