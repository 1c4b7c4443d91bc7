"""Which backend runs an artifact: one registry keyed by the manifest's ``target``.

Every question of the form "which target is this?" is asked here: the engine opening an artifact, the sharded
ranks, ``moeforge run / parity / bench / inspect / launch``, and the compiler, which refuses at compile time a
combination no backend can run (``refusal``). Adding a backend: one ``BackendSpec`` in ``BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moeforge.core.artifact import Artifact
from moeforge.core.errors import ArtifactError
from moeforge.core.manifest import Manifest
from moeforge.runtime.backends.base import Backend, BackendOptions
from moeforge.runtime.backends.onnxruntime import OrtBackend
from moeforge.runtime.backends.onnxruntime_paged import PagedOrtBackend

# (artifact, options, num_slots, num_blocks or None for a contiguous artifact, collectives) -> an opened backend.
Opener = Callable[[Artifact, BackendOptions, int, int | None, bool], Backend]


@dataclass(frozen=True)
class BackendSpec:
    """What one backend runs, and how it is opened.

    ``target``: the manifest target it runs (``compile --target``). ``name``: its ``--backend`` name; ``title``: how
    messages name it.
    ``paged`` / ``sharded``: whether it runs paged KV pools / the ranks of a sharded artifact (``--tp/--ep``).
    ``kv_layouts``: the KV-cache layouts (``KVCacheSpec.layout``) it binds; None: every layout.
    ``needs_gpu``: it runs only with a CUDA GPU. ``host_kv``: its KV caches are host memory (the engine checks they
    fit before allocating). ``teacher_forced_parity``: ``moeforge parity`` can compare it with PyTorch token by
    token (an ONNX graph it runs), else it is checked against the artifact's golden outputs."""

    target: str
    name: str
    title: str  # how messages name what it runs: "ONNX Runtime", "TensorRT"
    paged: bool
    sharded: bool
    needs_gpu: bool
    host_kv: bool
    teacher_forced_parity: bool
    open: Opener
    why_not_paged: str = ""
    why_not_sharded: str = ""
    kv_layouts: tuple[str, ...] | None = None
    why_not_layout: str = ""

    def refusal(self, *, paged: bool, sharded: bool, layout: str | None = None) -> str | None:
        """Why this backend cannot run an artifact of that shape (``layout``: its KV-cache layout, where known), or
        None."""
        if layout is not None and self.kv_layouts is not None and layout not in self.kv_layouts:
            return self.why_not_layout
        if paged and not self.paged:
            return self.why_not_paged
        if sharded and not self.sharded:
            return self.why_not_sharded
        return None

    def unavailable(self) -> str | None:
        """Why this host cannot run this backend (no GPU), or None."""
        if not self.needs_gpu:
            return None
        import torch  # lazy: only a GPU backend asks, and torch's CUDA probe is cheap once imported

        return None if torch.cuda.is_available() else "it needs a CUDA GPU with TensorRT, and this host has none"


def _open_ort(artifact: Artifact, options: BackendOptions, num_slots: int, num_blocks: int | None,
              collectives: bool) -> Backend:
    kv = artifact.manifest.kv_cache
    vocab = int(artifact.manifest.model_config["vocab_size"])
    if kv.paged:
        assert num_blocks is not None, "a paged artifact needs its pool's block count"
        return PagedOrtBackend(artifact.model_path, kv_cache=kv, num_blocks=num_blocks, num_slots=num_slots,
                               vocab_size=vocab, options=options, collectives=collectives)
    return OrtBackend(artifact.model_path, kv_cache=kv, num_slots=num_slots, max_seq_len=kv.max_seq_len,
                      vocab_size=vocab, options=options, collectives=collectives)


def _open_trt(artifact: Artifact, options: BackendOptions, num_slots: int, num_blocks: int | None,
              collectives: bool) -> Backend:
    from moeforge.runtime.backends.tensorrt import TensorRTBackend  # lazy: needs TensorRT and a GPU

    return TensorRTBackend.from_artifact(artifact.root, num_slots=num_slots)


ORT = BackendSpec(target="ort", name="onnxruntime", title="ONNX Runtime", paged=True, sharded=True, needs_gpu=False,
                  host_kv=True, teacher_forced_parity=True, open=_open_ort)
TRT = BackendSpec(
    target="trt", name="tensorrt", title="TensorRT", paged=False, sharded=False, needs_gpu=True, host_kv=False,
    teacher_forced_parity=False, open=_open_trt,
    why_not_paged="moeforge's TensorRT backend runs contiguous-cache engines only (its paged engines take block "
                  "pools and block tables it does not bind yet)",
    why_not_sharded="running sharded TensorRT plans needs NVIDIA GPUs, NCCL and a communicator per execution "
                    "context, which moeforge's TensorRT backend does not set up yet",
    kv_layouts=("gqa", "mla_latent", "mla_dsa"),
    why_not_layout="moeforge's TensorRT backend binds per-head caches [slots, Hkv, L, D] and feeds past_lengths; a "
                   "DeepSeek-V4 engine takes its ring and entry buffers (layout v4_hybrid) and an attention mask, "
                   "which it does not bind yet")
BACKENDS: dict[str, BackendSpec] = {spec.target: spec for spec in (ORT, TRT)}


def backend_for(manifest: Manifest) -> BackendSpec:
    """The backend that runs an artifact with this manifest; ``ArtifactError`` for a target no backend runs."""
    spec = BACKENDS.get(manifest.target)
    if spec is None:
        raise ArtifactError(f"manifest target {manifest.target!r} has no backend here; backends run "
                            f"{', '.join(sorted(BACKENDS))}: recompile with one of them")
    return spec


def backend_named(name: str) -> BackendSpec:
    """The backend a ``--backend NAME`` flag means."""
    for spec in BACKENDS.values():
        if spec.name == name:
            return spec
    raise ArtifactError(f"no backend named {name!r}; backends: {', '.join(s.name for s in BACKENDS.values())}")


def refusal(target: str, *, paged: bool, sharded: bool, layout: str | None = None) -> str | None:
    """Why no backend can run an artifact compiled for ``target`` with that shape (``layout``: its KV-cache layout,
    where known), or None (the compiler asks)."""
    spec = BACKENDS.get(target)
    if spec is None:
        return f"no backend runs target {target!r}"
    return spec.refusal(paged=paged, sharded=sharded, layout=layout)


def open_backend(artifact: Artifact, options: BackendOptions, *, num_slots: int, num_blocks: int | None = None,
                 collectives: bool = False) -> Backend:
    """Open the backend of ``artifact``: ``ArtifactError`` naming the reason when its backend cannot run it here."""
    spec = backend_for(artifact.manifest)
    kv = artifact.manifest.kv_cache
    why = spec.refusal(paged=kv.paged, sharded=collectives, layout=kv.layout) or spec.unavailable()
    if why:
        advice = "" if spec.target == ORT.target else (
            f"; to run this model here, compile it for ONNX Runtime: moeforge compile {artifact.manifest.source} "
            "-o DIR --target ort")
        raise ArtifactError(f"{artifact.root} ({spec.name} artifact) cannot run here: {why}{advice}")
    return spec.open(artifact, options, num_slots, num_blocks, collectives)
