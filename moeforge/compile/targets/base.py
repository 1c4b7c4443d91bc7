"""The ``Target`` protocol and the ``CompileJob`` every target reads.

One target object serves one compile (it may keep what its passes decided, e.g. the quantisation plan, for
the manifest). ``driver.py`` calls, in order: ``check`` (cheap, before anything is loaded), ``passes``,
``kv_spec`` / ``precision`` / ``quantization`` (the manifest), then ``write_payload`` inside the artifact's
temporary directory, after the graph and the tokenizer are saved there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from moeforge.compile.options import CompileOptions
from moeforge.core.config import ModelConfig
from moeforge.core.kv_layout import KVCacheSpec
from moeforge.core.manifest import Manifest
from moeforge.core.progress import QUIET, Stages
from moeforge.model.lazy_weights import LazyWeights
from moeforge.model.loader import LoadedModel
from moeforge.passes.base import GraphPass, PassContext, PassReport
from moeforge.verify.parity import ParityReport

GOLDEN_PROMPT_LEN = 16
GOLDEN_PROMPT_SEED = 1


@dataclass
class CompileJob:
    """What the stages of one compile share: the options, the loaded model, the sequence length the artifact
    serves and the tokenised calibration prompts ([] without ``--calib``). ``weights``: a streamed compile's
    (``--stream``) tensors, read one at a time; its model is on the meta device. ``stages``: the compile's progress
    display, where a target names the stages it runs (``stages.stage("golden logits")``)."""

    options: CompileOptions
    loaded: LoadedModel
    max_seq_len: int
    prompts: list[list[int]]
    weights: LazyWeights | None = None
    stages: Stages = QUIET

    @property
    def config(self) -> ModelConfig:
        return self.loaded.config

    @property
    def context(self) -> PassContext:
        # Streamed: calibration maps the graph's weights from a folder beside the artifact (same disk, not /tmp,
        # which may be a tmpfs counted as memory).
        out = self.options.output_dir.absolute() if self.weights is not None else None
        return PassContext(config=self.loaded.config, max_seq_len=self.max_seq_len, artifact_dir=out,
                           progress=self.options.progress)


class Target(Protocol):
    """One kind of artifact."""

    name: str
    parity: ParityReport | None  # what ``--check`` measured, where the target runs it

    def check(self) -> None:
        """Refuse options this target cannot build, before any expensive stage (MoeforgeError)."""
        ...

    def passes(self, job: CompileJob) -> list[GraphPass]:
        """The ordered pass list from the stateless export to the artifact graph (quantisation included)."""
        ...

    def kv_spec(self, job: CompileJob) -> KVCacheSpec:
        """The manifest's KV-cache layout of the graph the passes produced."""
        ...

    def precision(self) -> str:
        """The manifest's precision (parity thresholds are chosen by it)."""
        ...

    def quantization(self, reports: list[PassReport]) -> dict[str, Any] | None:
        """The manifest's ``quantization`` summary, or None for an unquantised artifact."""
        ...

    def write_payload(self, job: CompileJob, folder: Path, manifest: Manifest) -> None:
        """Write the target's own files (golden logits, runtime configs, engines) into ``folder``; may record
        what it built in ``manifest`` (e.g. ``engine``). Raises to abandon the artifact. By now the PyTorch
        model's weights are released (compile.py keeps peak memory down): anything a target needs from PyTorch
        (the ``--check`` reference logits) it computes in ``passes``."""
        ...
