"""Shared TensorRT artifacts: each tiny preset is compiled once (--target trt, TensorRT-RTX, SM89, on CPU)."""

from pathlib import Path

import pytest

from moeforge.compile.driver import CompileOptions, compile_model

TRT_PRESETS = ("tiny-llama", "tiny-deepseek-v3")
MAX_SEQ_LEN = 64


def have_tensorrt_rtx() -> bool:
    try:
        import tensorrt_rtx_bindings  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


needs_trt_rtx = pytest.mark.skipif(not have_tensorrt_rtx(),
                                   reason='TensorRT-RTX is not installed: pip install ".[tensorrt-rtx]"')


def have_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def full_tensorrt_with_gpu() -> bool:
    """A GPU and full TensorRT: what running a Python plugin inside an engine needs (TensorRT-RTX 1.7's parser
    aborts the process when it imports a node as a Python plugin)."""
    if not have_cuda():
        return False
    try:
        import tensorrt  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


@pytest.fixture(scope="session")
def trt_artifacts(tmp_path_factory) -> dict[str, Path]:
    if not have_tensorrt_rtx():
        pytest.skip('TensorRT-RTX is not installed: pip install ".[tensorrt-rtx]"')
    root = tmp_path_factory.mktemp("trt_artifacts")
    out = {}
    for name in TRT_PRESETS:
        options = CompileOptions.from_flags(model=name, output_dir=root / name, target="trt", max_seq_len=MAX_SEQ_LEN,
                                            trt_impl="tensorrt-rtx", sm=89, max_prefill_tokens=32, progress=False)
        out[name] = compile_model(options).output_dir
    return out
