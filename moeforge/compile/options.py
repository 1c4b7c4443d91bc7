"""What ``moeforge compile`` is asked for, grouped by concern: the KV-cache layout, quantisation
(``moeforge.quant.spec.QuantSpec``) and the TensorRT build. Read by ``driver.py`` and the targets; ``check_flags``
refuses the flags no compile takes before anything loads."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from moeforge.core.errors import MoeforgeError
from moeforge.core.host_memory import MAX_SIZE
from moeforge.core.kv_layout import DEFAULT_BLOCK_SIZE
from moeforge.model.sharding import check_degrees
from moeforge.quant.spec import ActivationOptions, QuantSpec

DEFAULT_MAX_SEQ_LEN = 2048
MAX_RANKS = 1024  # ranks of one sharded artifact (tp x pp); the sharded.json reader takes no more


@dataclass(frozen=True)
class KVOptions:
    """``--kv-cache contiguous|paged`` and ``--kv-block-size`` (tokens per pool block, paged only)."""

    layout: str = "contiguous"
    # None: DEFAULT_BLOCK_SIZE, or for DeepSeek-V4 the smallest multiple of it that every compress rate divides
    # (``plan.resolve_block_size`` decides once the config is read)
    block_size: int | None = None

    @property
    def paged(self) -> bool:
        return self.layout == "paged"

    @property
    def tokens_per_block(self) -> int:
        """The pool block size in tokens (``block_size``, or the default)."""
        return DEFAULT_BLOCK_SIZE if self.block_size is None else self.block_size


@dataclass(frozen=True)
class TrtOptions:
    """``--target trt``: which TensorRT, the target SM, the engine precision and its optimisation profiles."""

    impl: str = "auto"  # auto | tensorrt | tensorrt-rtx
    sm: int | None = None  # TensorRT-RTX target SM (default 89); full TensorRT: the local GPU
    dtype: str = "fp16"  # fp16 | bf16
    max_batch: int = 8
    max_prefill_tokens: int = 256
    optimization_level: int | None = None  # TensorRT builder level 0..5 (None: its default, 3)


@dataclass(frozen=True)
class CompileOptions:
    """One compile: the model, where to write it, the target, and the option groups."""

    model: str
    output_dir: Path
    target: str = "ort"  # a name in moeforge.compile.targets.TARGETS
    max_seq_len: int | None = None  # None: min(DEFAULT_MAX_SEQ_LEN, the model's max_position_embeddings)
    force: bool = False
    check: bool = False  # parity against PyTorch before publishing (ONNX Runtime target)
    check_steps: int = 16
    progress: bool = True
    check_weights: bool = True  # refuse NaN/Inf weights at load (--no-weight-check skips the scan)
    tp: int = 1  # tensor-parallel ranks: > 1 writes one artifact per rank (moeforge/compile/sharded_compile.py)
    ep: int = 1  # expert-parallel ranks: 1 (each expert split tp ways) or tp (whole experts per rank)
    pp: int = 1  # pipeline stages: > 1 writes pp x tp rank artifacts, each a stage's layers (model/pipeline_stages.py)
    pp_layers: str | None = None  # "0-13,14-27": each stage's layers (None: balanced by bytes)
    # An EPLB plan (``moeforge eplb -o``) with --ep N: each rank holds the logical experts of its slots, replicas
    # included (``moeforge/model/expert_slots.py``); None: contiguous experts.
    placement: Path | None = None
    argmax_head: bool = True  # ONNX Runtime, float32 head: the certified greedy head (moeforge/passes/argmax_head.py)
    # Build an artifact no moeforge backend runs yet (runtime/backends/registry.py says which: TensorRT paged engines
    # and --tp plans), for a runtime of the user's own; without it such a compile is refused before anything runs.
    build_only: bool = False
    # Read each weight from the checkpoint only when the artifact is written (HF safetensors folders): the streamed
    # compile, whose memory does not grow with the model's weights (moeforge/model/lazy_weights.py). None: streamed
    # wherever it applies (an HF folder, --target ort, no --calib; ``driver.resolve_stream``).
    stream: bool | None = None
    # Memory the compile may use (bytes); None: the container's limit, else the physical memory. The compile plans
    # its peak from the config (``plan.py``) and refuses up front when the plan does not fit.
    max_memory: int | None = None
    # Ranks of a streamed sharded compile built at once, each in its own process (its memory: the plan's per-rank
    # peak, so ``workers`` times that is checked against ``max_memory``).
    workers: int = 1
    kv: KVOptions = field(default_factory=KVOptions)
    quant: QuantSpec = field(default_factory=QuantSpec)
    trt: TrtOptions = field(default_factory=TrtOptions)

    @classmethod
    def from_flags(cls, *, model: str, output_dir: str | Path, **flags: Any) -> CompileOptions:
        """Options from the command line's flat flag names (``quant="int4", kv_cache="paged", trt_impl=...``): the
        one place that maps each ``moeforge compile`` flag to its group. An unknown name is a TypeError."""
        groups: dict[str, dict[str, Any]] = {"top": {}, "kv": {}, "quant": {}, "act": {}, "trt": {}}
        for name, value in flags.items():
            group, field_name = _FLAG_FIELDS.get(name, ("top", name))
            groups[group][field_name] = value
        activations = ActivationOptions(**groups["act"])
        return cls(model=model, output_dir=Path(output_dir), **groups["top"], kv=KVOptions(**groups["kv"]),
                   quant=QuantSpec(**groups["quant"], activations=activations), trt=TrtOptions(**groups["trt"]))


# flag name (argparse dest) -> (option group, field)
_FLAG_FIELDS: dict[str, tuple[str, str]] = {
    "kv_cache": ("kv", "layout"), "kv_block_size": ("kv", "block_size"),
    "quant": ("quant", "weights"), "block_size": ("quant", "block_size"), "lm_head": ("quant", "lm_head"),
    "accuracy_level": ("quant", "accuracy_level"), "asym_offsets": ("quant", "asym_offsets"),
    "keep_fp": ("quant", "keep_fp"), "kv_quant": ("quant", "kv_cache"),
    "calib": ("quant", "calib"),
    "calib_method": ("act", "method"), "percentile": ("act", "percentile"), "smooth_alpha": ("act", "smooth_alpha"),
    "act_keep_fp32": ("act", "keep_fp32"),
    **{f"trt_{f.name}" if f.name in ("impl", "optimization_level") else f.name: ("trt", f.name)
       for f in fields(TrtOptions)},
}


def _check_count(flag: str, value: object, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        small = not isinstance(value, int) or abs(value) < 10**24  # str() of a 5000-digit int raises
        shown = f"{value!r:.24}" if small else "a number over 10^24"
        raise MoeforgeError(f"{flag} must be in 1..{hi}, got {shown}")


def check_ranks(tp: int, ep: int, pp: int = 1) -> None:
    """Refuse parallel degrees out of bounds (each in 1..MAX_RANKS, at most MAX_RANKS ranks in all) and a tp/ep pair
    no split takes (``sharding.check_degrees``)."""
    for flag, value in (("--tp", tp), ("--ep", ep), ("--pp", pp)):
        _check_count(flag, value, MAX_RANKS)
    if tp * pp > MAX_RANKS:
        raise MoeforgeError(f"--tp {tp} x --pp {pp} makes {tp * pp} ranks, over the {MAX_RANKS} a sharded artifact "
                            "may have; use fewer ranks")
    check_degrees(tp, ep)


def check_flags(options: CompileOptions) -> None:
    """Refuse, before any model loads, the flags no compile takes: parallel degrees out of bounds (``check_ranks``),
    ``--workers`` outside 1..MAX_RANKS, ``--max-memory`` outside 1..MAX_SIZE (1 PiB, as ``parse_size``), and the
    sharded combinations the compile refuses. The model's own limits (its heads, layers, experts) are
    ``plan.check_compile``'s."""
    check_ranks(options.tp, options.ep, options.pp)
    _check_count("--workers", options.workers, MAX_RANKS)
    if options.max_memory is not None:
        _check_count("--max-memory", options.max_memory, MAX_SIZE)
    if options.pp_layers is not None and options.pp == 1:
        raise MoeforgeError("--pp-layers splits the layers into pipeline stages: it needs --pp P with P > 1")
    if options.placement is not None and not (options.ep > 1 and options.ep == options.tp):
        raise MoeforgeError(f"--placement places whole experts on expert-parallel ranks: it needs --tp N --ep N "
                            f"with N > 1 (got --tp {options.tp} --ep {options.ep}); pass the --ep the plan was made "
                            "for to both")
    if options.tp == options.ep == options.pp == 1:
        return
    if options.pp > 1 and not options.kv.paged:
        raise MoeforgeError("--pp: pipeline stages run on the paged KV cache (each stage's pools hold its own layers); "
                            "add --kv-cache paged")
    if options.pp > 1 and options.placement is not None:
        raise MoeforgeError("--placement is not supported with --pp yet: place experts with --tp N --ep N alone")
    if options.check:
        raise MoeforgeError("--check runs one process; a sharded artifact is checked with all its ranks: compile "
                            "without --check, then run moeforge parity DIR")
    if options.quant.calib is not None:
        raise MoeforgeError("--calib calibrates on one process's graph; it is not supported with --tp yet: "
                            "use a scheme without calibration (int8, int4, int4-asym, fp8)")
