"""GGUF checkpoints beyond SmolLM2 through the whole pipeline: a Llama-3.x GGUF (rope_freqs.weight), a Qwen3-MoE
GGUF and a DeepSeek-V3 GGUF compile and pass ``--check`` (the rope factors survive the manifest and the rotary
fusion; the experts reach the MoE op), and a Qwen2 GGUF's artifact matches transformers running the GGUF
(``moeforge parity --reference transformers``)."""

import json
import sys
from pathlib import Path

import pytest
import torch

from moeforge.cli.commands import EXIT_OK, main
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core.artifact import load_artifact

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_gguf_architectures import BUILDERS, _randomise, write_gguf  # tiny models written as llama.cpp would
from test_gguf_deepseek import write_deepseek_gguf
from test_hf_parity import _deepseek_v3


def _gguf(folder: Path, kind: str) -> Path:
    torch.manual_seed(0)
    model = _deepseek_v3() if kind == "deepseek_v3" else BUILDERS[kind]()
    _randomise(model, seed=1)
    path = folder / f"tiny-{kind}.gguf"
    if kind == "deepseek_v3":
        write_deepseek_gguf(model.eval(), path)
    else:
        write_gguf(model.eval(), path, kind)
    return path


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "deepseek_v3"])
def test_gguf_compiles_and_passes_its_check(kind: str, tmp_path: Path) -> None:
    source = _gguf(tmp_path, kind)
    artifact = tmp_path / "artifact"
    result = compile_model(CompileOptions(model=str(source), output_dir=artifact, max_seq_len=64, check=True,
                                          progress=False))
    assert result.parity is not None and result.parity.passed and result.parity.max_abs_err < 1e-4
    config = load_artifact(artifact).manifest.model_config
    assert config["model_type"] == kind
    if kind == "llama":
        factors = config["rope"]["frequency_factors"]
        assert len(factors) == 8 and max(factors) == 8.0  # llama.cpp's divisors, as the converter wrote them
    else:  # MoE: the experts reach the MoE op (DeepSeek-V3: MLA, sigmoid routing with its correction bias)
        assert config["moe"]["n_routed_experts"] == 8 and config["moe"]["norm_topk_prob"] is True


def test_qwen2_gguf_artifact_matches_transformers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _gguf(tmp_path, "qwen2")
    artifact = tmp_path / "artifact"
    compile_model(CompileOptions(model=str(source), output_dir=artifact, max_seq_len=64, progress=False))
    code = main(["parity", str(artifact), "--reference", "transformers", "--prompt-len", "24", "--steps", "8",
                 "--json"])
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{"):])
    assert code == EXIT_OK, result
    assert result["reference"] == "transformers" and result["greedy_match"] and result["max_abs_err"] < 1e-4


def test_transformers_reference_refuses_what_its_gguf_reader_gets_wrong(tmp_path: Path) -> None:
    """transformers reads a Mixtral GGUF as a dense Llama (random MLPs) and ignores rope_freqs: refused by name."""
    from moeforge.core.errors import MoeforgeError
    from moeforge.verify.transformers_reference import load_transformers_model

    for kind, reason in (("mixtral", "llama GGUF with experts"), ("llama", "rope_freqs.weight")):
        with pytest.raises(MoeforgeError, match=reason):
            load_transformers_model(str(_gguf(tmp_path, kind)))
