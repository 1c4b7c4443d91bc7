"""A tied table the LM head's codes hold exactly (a GGUF's Q8_0 token_embd under the int8 head) is read from them:
one copy of the matrix, the same logits; any other table stays fp32."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType as T

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact
from moeforge.model.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_gguf_loader import VOCAB, H, write_tiny_gguf  # a tiny llama written as llama.cpp would


def _lookup(artifact: Path) -> tuple[list[str], dict[str, list[int]]]:
    graph = onnx.load(str(artifact / "model.onnx"), load_external_data=False).graph
    return [n.op_type for n in graph.node], {i.name: list(i.dims) for i in graph.initializer}


def _compile(source: Path, out: Path, quant: str) -> Path:
    return compile_model(CompileOptions.from_flags(model=str(source), output_dir=out, max_seq_len=64, quant=quant,
                                                   progress=False)).output_dir


# int4 / int4-asym keep the head int8 in blocks of 32 (Q8_0's grid); --quant int8 is per channel, another grid.
@pytest.mark.parametrize(("quant", "shared"), [("int4", True), ("int4-asym", True), ("int8", False)])
def test_a_q8_0_tied_table_is_read_from_the_int8_head(tmp_path: Path, quant: str, shared: bool) -> None:
    source = tmp_path / "tied.gguf"
    write_tiny_gguf(source, tied=True, types={"token_embd.weight": T.Q8_0})
    out = _compile(source, tmp_path / quant, quant)
    ops, inits = _lookup(out)
    assert ("GatherBlockQuantized" in ops) == shared
    assert ([VOCAB, H] in inits.values()) != shared  # the fp32 table is gone exactly when it is shared
    q = load_artifact(out).manifest.quantization
    assert q["embedding"].startswith("int8") == shared and ("embedding lookup" in q["always_fp32"]) != shared


def test_a_table_the_head_rounds_stays_fp32(tmp_path: Path) -> None:
    source = tmp_path / "tied.gguf"
    write_tiny_gguf(source, tied=True, types={"token_embd.weight": T.F32})  # fp32: the int8 head rounds it
    out = tmp_path / "int4"
    _compile(source, out, "int4")
    ops, inits = _lookup(out)
    assert "GatherBlockQuantized" not in ops and [VOCAB, H] in inits.values()
    q = load_artifact(out).manifest.quantization
    assert q["embedding"] == "fp32" and "embedding lookup" in q["always_fp32"]


def test_the_shared_lookup_equals_the_table_row_for_row(tmp_path: Path) -> None:
    source = tmp_path / "tied.gguf"
    write_tiny_gguf(source, tied=True, types={"token_embd.weight": T.Q8_0})
    out = tmp_path / "int4"
    _compile(source, out, "int4")
    model = onnx.load(str(out / "model.onnx"))
    graph = model.graph
    lookup = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    assert lookup.input[1] == "input_ids"
    rows = next(n for n in graph.node if lookup.output[0] in n.input)  # [1, S, K/bs, bs] -> [1, S, K]
    nodes = [lookup, rows]
    # its own copy of the codes: the head's are freed once ONNX Runtime prepacks them, if nothing else reads them
    assert not any(lookup.input[0] in n.input for n in graph.node if n.op_type == "MatMulNBits")
    needed = {name for n in nodes for name in n.input}
    sub = onnx.helper.make_graph(
        nodes, "lookup", [onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, [1, None])],
        [onnx.helper.make_tensor_value_info(rows.output[0], onnx.TensorProto.FLOAT, None)],
        [i for i in graph.initializer if i.name in needed])
    session = ort.InferenceSession(onnx.helper.make_model(sub, opset_imports=list(model.opset_import))
                                   .SerializeToString(), providers=["CPUExecutionProvider"])
    rows = session.run(None, {"input_ids": np.arange(VOCAB, dtype=np.int64)[None, :]})[0][0]
    # PyTorch embeds with the Q8_0 table as the loader dequantises it
    table = load_model(str(source)).model.state_dict()["model.embed_tokens.weight"].numpy()
    np.testing.assert_allclose(rows, table, rtol=2**-20, atol=0)
