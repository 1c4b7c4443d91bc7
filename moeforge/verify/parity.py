"""Parity of a compiled artifact against the PyTorch model, teacher-forced.

The PyTorch model generates greedily (prefill + N decode steps, with its cache); the artifact is
fed exactly the same tokens through its own in-place cache, and the logits are compared at every
position: max/mean absolute error, the smallest cosine similarity, top-1 agreement, and whether
the artifact's greedy choice equals PyTorch's at every step.

A model larger than memory (``streamed_parity``, ``moeforge parity --stream``, ``compile --stream --check``): the
artifact generates first, then PyTorch runs once over the prompt and those tokens with one decoder layer resident
at a time (``layered_reference.py``), so both see the same tokens and PyTorch's greedy choice is its argmax there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from moeforge.core.config import ModelConfig
from moeforge.core.errors import MoeforgeError
from moeforge.core.kv_layout import KVCacheSpec
from moeforge.core.ort_session import UNPACKED_WEIGHTS
from moeforge.model.lazy_weights import LazyWeights
from moeforge.model.model import CausalLM
from moeforge.quant.calibration import mean_kl
from moeforge.quant.schemes import Thresholds, thresholds_for
from moeforge.runtime.backends.onnxruntime import OrtSession
from moeforge.runtime.backends.onnxruntime_paged import PagedSequenceSession
from moeforge.verify.layered_reference import LayeredOutput, layered_forward


@dataclass
class StepReport:
    """One step: ``kind`` prefill (all prompt positions) or decode (one position)."""

    step: int
    kind: str
    max_abs_err: float
    mean_abs_err: float
    cosine_min: float
    top1_agreement: float
    tolerance_used: float  # max |ours - ref| / (atol + rtol * max|ref row|): <= 1 passes


@dataclass
class ParityReport:
    """Aggregates over all steps, the per-step rows and the verdict."""

    prompt_len: int
    decode_steps: int
    max_abs_err: float
    mean_abs_err: float
    cosine_min: float
    top1_agreement: float
    tolerance_used: float
    greedy_match: bool
    precision: str
    mean_kl: float
    thresholds: Thresholds
    passed: bool
    failures: list[str] = field(default_factory=list)
    steps: list[StepReport] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def table(self) -> str:
        """A readable per-step table plus the verdict."""
        lines = [f"{'step':>5} {'kind':<8} {'max_abs_err':>12} {'mean_abs_err':>13} {'cosine_min':>11} {'top1':>6}"
                 f" {'tol_used':>9}"]
        for s in self.steps:
            lines.append(f"{s.step:>5} {s.kind:<8} {s.max_abs_err:>12.3e} {s.mean_abs_err:>13.3e} "
                         f"{s.cosine_min:>11.7f} {s.top1_agreement:>6.3f} {s.tolerance_used:>9.3f}")
        verdict = "PASS" if self.passed else "FAIL: " + "; ".join(self.failures)
        lines.append(f"overall: max_abs_err {self.max_abs_err:.3e}, cosine_min {self.cosine_min:.7f}, "
                     f"top1 {self.top1_agreement:.3f}, KL {self.mean_kl:.2e}, greedy_match {self.greedy_match}"
                     f" ({self.precision})"
                     f" -> {verdict}")
        lines.append(f"thresholds ({self.precision}): {describe_thresholds(self.thresholds)}")
        return "\n".join(lines)


def describe_thresholds(limits: Thresholds) -> str:
    """What a precision must meet, as a line: only the limits that apply."""
    parts = []
    if limits.atol != float("inf"):
        parts.append(f"|err| <= {limits.atol:.0e} + {limits.rtol:.0e} * max|ref row|")
    if limits.cosine_min > 0:
        parts.append(f"cosine >= {limits.cosine_min}")
    if limits.top1_agreement > 0:
        parts.append(f"top1 >= {limits.top1_agreement}")
    if limits.kl_max != float("inf"):
        parts.append(f"KL <= {limits.kl_max}")
    if limits.greedy_match:
        parts.append("greedy tokens identical")
    return ", ".join(parts) or "none"


class ParityCheckFailed(MoeforgeError):
    """``compile --check`` found the artifact outside its precision's thresholds (exit code 1)."""

    def __init__(self, report: ParityReport) -> None:
        super().__init__("parity check failed: " + "; ".join(report.failures))
        self.report = report


def check_comparable(artifact: str, artifact_config: ModelConfig, reference: str, reference_config: ModelConfig,
                     source: str, *, per_layer: bool = False) -> None:
    """Refuse (``MoeforgeError``, naming both sizes and the fix) a reference model that cannot be compared with the
    artifact: parity compares the logits over the vocabulary at every position, so the vocabularies must be the same
    size; ``per_layer`` compares every decoder layer's output [P, H] too, so the layer counts and hidden sizes must
    match. Configs alone: asked before any weight loads. ``source``: the model the artifact was compiled from."""
    sizes = [("vocab_size", "vocabulary size", "the logits of every position")]
    if per_layer:
        sizes += [("num_hidden_layers", "decoder layers", "each decoder layer's output (--per-layer)"),
                  ("hidden_size", "hidden size", "each decoder layer's output (--per-layer)")]
    for name, what, compared in sizes:
        ours, theirs = getattr(artifact_config, name), getattr(reference_config, name)
        if ours != theirs:
            raise MoeforgeError(f"{reference} has {what} {theirs} and the artifact {artifact} has {ours} ({name}): "
                                f"parity compares {compared}, so they must be one model; compare the artifact with "
                                f"the model it was compiled from, {source} (moeforge parity without --model uses it)")


def _compare(step: int, kind: str, ours: np.ndarray, ref: np.ndarray, limits: Thresholds) -> StepReport:
    # ours/ref: [P, V] logits
    ours64, ref64 = ours.astype(np.float64), ref.astype(np.float64)
    diff = np.abs(ours64 - ref64)
    cos = (ours64 * ref64).sum(-1) / (np.linalg.norm(ours64, axis=-1) * np.linalg.norm(ref64, axis=-1) + 1e-30)
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    row_scale = np.abs(ref64).max(axis=-1, keepdims=True)  # [P, 1]
    used = float((diff / (limits.atol + limits.rtol * row_scale)).max())
    return StepReport(step, kind, float(diff.max()), float(diff.mean()), float(cos.min()), top1, used)


@dataclass(frozen=True)
class TorchReference:
    """What PyTorch generated greedily from ``prompt_ids``: the logits of every step (prefill [P, V], then one
    [1, V] per decode step) and the greedy token each step chose. A few MB: it outlives the model's weights."""

    prompt_ids: list[int]
    logits: list[np.ndarray]
    tokens: list[int]

    @property
    def decode_steps(self) -> int:
        return len(self.logits) - 1


@torch.inference_mode()
def torch_reference(torch_model: CausalLM, prompt_ids: list[int], decode_steps: int = 16) -> TorchReference:
    """Prefill ``prompt_ids`` and decode ``decode_steps`` greedy tokens with ``torch_model`` (its own cache)."""
    prompt_len = len(prompt_ids)
    out = torch_model(torch.tensor([prompt_ids], dtype=torch.int64), torch.arange(prompt_len)[None])
    logits = [out.logits[0].numpy()]  # [P, V]
    past = out.past_key_values
    tokens = [int(out.logits[0, -1].argmax())]
    for step in range(decode_steps):
        out = torch_model(torch.tensor([[tokens[-1]]]), torch.tensor([[prompt_len + step]]), past)
        past = out.past_key_values
        logits.append(out.logits[0].numpy())
        tokens.append(int(out.logits[0, -1].argmax()))
    return TorchReference(list(prompt_ids), logits, tokens)


def run_parity(
    model_path: str | Path,
    kv_cache: KVCacheSpec,
    torch_model: CausalLM,
    prompt_ids: list[int],
    decode_steps: int = 16,
    precision: str = "fp32",
    threads: int | None = None,
) -> ParityReport:
    """Teacher-forced comparison of the graph at ``model_path`` (its cache as ``kv_cache`` says) against
    ``torch_model``."""
    reference = torch_reference(torch_model, prompt_ids, decode_steps)
    return compare_with_reference(model_path, kv_cache, reference, precision=precision, threads=threads)


def compare_with_reference(
    model_path: str | Path,
    kv_cache: KVCacheSpec,
    reference: TorchReference,
    precision: str = "fp32",
    threads: int | None = None,
    session: Any = None,
) -> ParityReport:
    """``run_parity`` against a reference taken earlier (``torch_reference``), e.g. before the torch weights
    were released: the graph is fed the reference's tokens and its logits are compared at every step.
    ``session``: a whole-sequence session opened already (``forward`` as ``OrtSession``'s; a sharded
    artifact's ``ShardedSession``), long enough for the prompt and the steps."""
    if session is None:
        session = open_sequence_session(model_path, kv_cache, len(reference.prompt_ids) + reference.decode_steps + 1,
                                        threads=threads)
    ours, ours_tokens = run_sequence(session, reference.prompt_ids, reference.decode_steps, reference.tokens)
    return parity_report(ours, ours_tokens, reference, precision)


def streamed_parity(
    model_path: str | Path,
    kv_cache: KVCacheSpec,
    weights: LazyWeights,
    prompt_ids: list[int],
    decode_steps: int = 16,
    precision: str = "fp32",
    threads: int | None = None,
    on_layer: Callable[[int], None] | None = None,
) -> tuple[ParityReport, LayeredOutput]:
    """Parity of a model larger than memory: the graph at ``model_path`` generates greedily first (its weights
    mapped from the artifact, not prepacked), then PyTorch runs once over the prompt and those tokens with one
    decoder layer resident at a time (``layered_forward``). Each position's logits are compared as in
    ``compare_with_reference``; PyTorch's greedy choice at each step is its argmax there, so the greedy tokens match
    when they equal the graph's. Also returns the layered run (each layer's output, for ``run_layer_parity``)."""
    session = open_sequence_session(model_path, kv_cache, len(prompt_ids) + decode_steps + 1, threads=threads,
                                    session_config=UNPACKED_WEIGHTS)
    ours, ours_tokens = run_sequence(session, prompt_ids, decode_steps, None)
    del session  # its buffers and mapped weights go before PyTorch's layers are read
    layered = layered_forward(weights, [*prompt_ids, *ours_tokens[:decode_steps]], on_layer)
    prompt_len = len(prompt_ids)
    ref_logits = [layered.logits[:prompt_len]] + [layered.logits[prompt_len + k:prompt_len + k + 1]
                                                    for k in range(decode_steps)]
    reference = TorchReference(list(prompt_ids), ref_logits, [int(rows[-1].argmax()) for rows in ref_logits])
    return parity_report(ours, ours_tokens, reference, precision), layered


def open_sequence_session(model_path: str | Path, kv_cache: KVCacheSpec, max_len: int, *, threads: int | None = None,
                          session_config: Sequence[tuple[str, str]] = ()) -> Any:
    """A one-sequence session of the graph at ``model_path`` for up to ``max_len`` tokens, its cache as ``kv_cache``
    says (contiguous buffers, or pools with one block table), with ``OrtSession.forward``'s signature."""
    if kv_cache.paged:  # --kv-cache paged: one sequence over block pools, same comparison
        return PagedSequenceSession(model_path, max_len, kv_cache=kv_cache, threads=threads,
                                    session_config=session_config)
    session = OrtSession(model_path, kv_cache=kv_cache, threads=threads, session_config=session_config)
    session.allocate(batch=1, max_len=max_len)
    return session


def run_sequence(session: Any, prompt_ids: list[int], decode_steps: int,
                 fed_tokens: list[int] | None) -> tuple[list[np.ndarray], list[int]]:
    """Prefill ``prompt_ids`` and run ``decode_steps`` single-token steps, feeding ``fed_tokens[k]`` at step k (the
    graph's own greedy choice when None). Returns each step's logits (prefill [P, V], then [1, V]) and the graph's
    greedy choice after each step."""
    prompt_len = len(prompt_ids)
    ours = [session.forward(np.array([prompt_ids], np.int64), np.arange(prompt_len)[None],
                            np.ones((1, prompt_len), np.int64))[0]]
    chosen = [int(ours[0][-1].argmax())]
    for step in range(decode_steps):
        pos = prompt_len + step
        token = chosen[step] if fed_tokens is None else fed_tokens[step]
        ours.append(session.forward(np.array([[token]], np.int64), np.array([[pos]], np.int64),
                                    np.ones((1, pos + 1), np.int64))[0])
        chosen.append(int(ours[-1][-1].argmax()))
    return ours, chosen


def parity_report(ours: list[np.ndarray], ours_tokens: list[int], reference: TorchReference,
                  precision: str) -> ParityReport:
    """The verdict on the graph's logits and greedy tokens against ``reference``'s, by ``precision``'s thresholds."""
    prompt_len, decode_steps, tokens, ref_logits = (len(reference.prompt_ids), reference.decode_steps,
                                                    reference.tokens, reference.logits)
    limits = thresholds_for(precision)
    for step, (o, r) in enumerate(zip(ours, ref_logits, strict=True)):
        if o.shape != r.shape:  # another model's logits would only broadcast, or fail to, in numpy
            raise MoeforgeError(f"step {step}: the artifact's logits are {list(o.shape)} and the reference's "
                                f"{list(r.shape)} (vocabulary {o.shape[-1]} vs {r.shape[-1]}): not one model; compare "
                                "the artifact with the model it was compiled from")
    steps = [_compare(i, "prefill" if i == 0 else "decode", o, r, limits)
             for i, (o, r) in enumerate(zip(ours, ref_logits, strict=True))]
    greedy_match = ours_tokens == tokens
    report = ParityReport(
        prompt_len=prompt_len, decode_steps=decode_steps,
        max_abs_err=max(s.max_abs_err for s in steps), mean_abs_err=float(np.mean([s.mean_abs_err for s in steps])),
        cosine_min=min(s.cosine_min for s in steps),
        top1_agreement=float(np.mean(np.concatenate([(o.argmax(-1) == r.argmax(-1)) for o, r in zip(ours, ref_logits,
                                                                                                   strict=True)]))),
        tolerance_used=max(s.tolerance_used for s in steps),
        greedy_match=greedy_match, precision=precision, thresholds=limits, passed=True, steps=steps,
        mean_kl=mean_kl(np.concatenate(ref_logits), np.concatenate(ours)),
    )
    if report.tolerance_used > 1.0:
        report.failures.append(f"logits outside atol {limits.atol:.0e} + rtol {limits.rtol:.0e} * max|ref row| "
                               f"(max_abs_err {report.max_abs_err:.3e}, {report.tolerance_used:.2f}x the tolerance)")
    if report.mean_kl > limits.kl_max:
        report.failures.append(f"mean KL {report.mean_kl:.4f} > {limits.kl_max}")
    if report.cosine_min < limits.cosine_min:
        report.failures.append(f"cosine_min {report.cosine_min:.7f} < {limits.cosine_min}")
    if report.top1_agreement < limits.top1_agreement:
        report.failures.append(f"top1_agreement {report.top1_agreement:.3f} < {limits.top1_agreement}")
    if limits.greedy_match and not greedy_match:
        first = next(i for i, (a, b) in enumerate(zip(ours_tokens, tokens, strict=True)) if a != b)
        report.failures.append(f"greedy tokens differ from step {first}")
    report.passed = not report.failures
    return report


def default_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """A seeded random prompt (parity must not depend on a tokenizer)."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, vocab_size, length)]


@dataclass
class LayerReport:
    """One decoder layer's output over the prefill: absolute and relative (to max|ref|) error."""

    layer: int
    max_abs_err: float
    relative_err: float
    diverged: bool


# A layer "diverges" when its output is off by more than this fraction of its own scale; fp32 graphs
# sit around 1e-6, a wrong weight or a broken rewrite at 1e-2 and above.
LAYER_RELATIVE_LIMIT = 1e-4


@torch.inference_mode()
def torch_hidden_states(torch_model: CausalLM, prompt_ids: list[int]) -> list[np.ndarray]:
    """Each decoder layer's output [P, H] over a prefill of ``prompt_ids`` (the model loaded whole)."""
    ids = torch.tensor([prompt_ids], dtype=torch.int64)
    hidden = torch_model(ids, torch.arange(len(prompt_ids))[None], output_hidden_states=True).hidden_states
    assert hidden is not None
    return [h[0].numpy() for h in hidden]


def run_layer_parity(
    model_path: str | Path, kv_cache: KVCacheSpec, layer_outputs: list[str], reference_hidden: list[np.ndarray],
    prompt_ids: list[int], session_config: Sequence[tuple[str, str]] = (),
) -> tuple[list[LayerReport], int | None]:
    """Compare every decoder layer's output over a prefill of ``prompt_ids`` with PyTorch's (``reference_hidden``:
    [>= P, H] per layer, from ``torch_hidden_states`` or ``layered_forward``; rows past P are ignored, as a causal
    model's first P rows depend on the prompt alone); return the rows and the first diverging layer.

    The artifact's graph keeps each layer's output as a named internal value (manifest
    ``layer_outputs``); an in-memory copy of the graph exposes them as outputs over the same weights.
    """
    if kv_cache.paged:
        raise MoeforgeError("--per-layer needs a contiguous-cache artifact; this one is paged (--kv-cache paged): "
                            "run parity without --per-layer, or compile without --kv-cache paged to bisect layers")
    model_path = Path(model_path)
    proto = onnx.load(str(model_path), load_external_data=False)
    existing = {o.name for o in proto.graph.output}
    for name in layer_outputs:
        if name not in existing:
            proto.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    ids = np.array([prompt_ids], dtype=np.int64)
    positions = np.arange(len(prompt_ids))[None]
    # weights still read from the artifact
    session = OrtSession(model_path, kv_cache=kv_cache, graph=proto, session_config=session_config)
    session.allocate(batch=1, max_len=len(prompt_ids) + 1)
    outputs = session.forward_with_outputs(ids, positions, np.ones_like(ids), extra_outputs=tuple(layer_outputs))[1:]
    if len(outputs) != len(reference_hidden):
        raise MoeforgeError(f"the artifact records {len(outputs)} layer outputs and the reference has "
                            f"{len(reference_hidden)} decoder layers: not one model; compare the artifact with the "
                            "model it was compiled from")
    rows, first = [], None
    for layer, (ours, ref) in enumerate(zip(outputs, reference_hidden, strict=True)):
        ref_np = ref[:len(prompt_ids)].astype(np.float64)
        if ours.size != ref_np.size:
            raise MoeforgeError(f"layer {layer}: the artifact's output has {ours.size} values and the reference's "
                                f"{list(ref_np.shape)}: not one model (hidden size); compare the artifact with the "
                                "model it was compiled from")
        err = float(np.abs(ours.reshape(ref_np.shape).astype(np.float64) - ref_np).max())
        relative = err / max(float(np.abs(ref_np).max()), 1e-30)
        diverged = relative > LAYER_RELATIVE_LIMIT
        if diverged and first is None:
            first = layer
        rows.append(LayerReport(layer, err, relative, diverged))
    return rows, first


def layer_table(rows: list[LayerReport], first: int | None) -> str:
    """Per-layer errors with a bar per layer (log scale), and the first diverging layer."""
    lines = [f"{'layer':>5} {'max_abs_err':>12} {'relative':>10}  log10(relative) from -8 to 0"]
    for row in rows:
        level = int(np.clip(np.log10(max(row.relative_err, 1e-12)) + 8, 0, 8) * 5)
        lines.append(f"{row.layer:>5} {row.max_abs_err:>12.3e} {row.relative_err:>10.2e}  {'#' * level}"
                     f"{'  <- diverges' if row.layer == first else ''}")
    lines.append("no layer diverges" if first is None else f"first diverging layer: {first}")
    return "\n".join(lines)
