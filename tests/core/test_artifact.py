"""The artifact format: atomic writes, verification on load, inspection, genai_config.json."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from moeforge.cli.inspect import op_counts, summarize
from moeforge.compile.genai_config import genai_config
from moeforge.core.artifact import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    SHARDED_FILE,
    Artifact,
    ArtifactError,
    KVCacheSpec,
    Manifest,
    check_output_dir,
    load_artifact,
    write_artifact,
)
from moeforge.core.errors import MoeforgeError
from moeforge.core.kv_layout import contiguous_spec as kv_cache_spec
from moeforge.core.manifest import TensorSpec, tool_versions
from moeforge.model.presets import get_preset

LLAMA = get_preset("tiny-llama").config
DEEPSEEK = get_preset("tiny-deepseek-v3").config


def _tiny_onnx() -> bytes:
    """A 3-node graph with one com.microsoft op (never run, only inspected)."""
    x = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", 8])
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["f", "axes"], ["u"]),
        helper.make_node("GroupQueryAttention", ["u", "u", "u"], ["a"], domain="com.microsoft",
                         num_heads=1, kv_num_heads=1),
        helper.make_node("Expand", ["a", "shape"], ["logits"]),
    ]
    inits = [helper.make_tensor("axes", TensorProto.INT64, [1], [-1]),
             helper.make_tensor("shape", TensorProto.INT64, [3], [1, 1, 8])]
    graph = helper.make_graph(nodes, "tiny", [x], [y], initializer=inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return model.SerializeToString()


def _manifest(config=LLAMA) -> Manifest:
    kv = kv_cache_spec(config, max_seq_len=64)
    # The graph I/O lists the cache tensors kv_cache names (Manifest.check cross-checks them on load).
    past = [TensorSpec(n, kv.dtype, list(kv.shape)) for names in kv.past_input_names for n in names]
    present = [TensorSpec(n, kv.dtype, list(kv.shape)) for names in kv.present_output_names for n in names]
    return Manifest(
        model_config=config.to_dict(),
        inputs=[TensorSpec("input_ids", "int64", ["batch_size", "sequence_length"]),
                TensorSpec("attention_mask", "int64", ["batch_size", "total_sequence_length"]), *past],
        outputs=[TensorSpec("logits", "float32", ["batch_size", "sequence_length", config.vocab_size]), *present],
        kv_cache=kv,
        passes=[{"name": "fuse_gqa", "matches": 2, "seconds": 0.25},
                {"name": "cleanup", "matches": 0, "seconds": 0.01}],
        target="cpu",
        precision="fp32",
        source="preset:tiny-llama",
    )


def _payload(tmp: Path) -> None:
    (tmp / "model.onnx").write_bytes(_tiny_onnx())
    (tmp / "model.onnx.data").write_bytes(bytes(range(256)) * 40)
    (tmp / "tokenizer").mkdir()
    (tmp / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0"}')


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def artifact_dir(tmp_path) -> Path:
    return write_artifact(tmp_path / "art", write_payload=_payload, manifest=_manifest())


# ---------------------------------------------------------------------------------------------- round trip
def test_manifest_files_are_filled_in(tmp_path):
    manifest = _manifest()
    write_artifact(tmp_path / "art", write_payload=_payload, manifest=manifest)
    assert manifest == load_artifact(tmp_path / "art").manifest and len(manifest.files) == 3


def test_round_trip(artifact_dir, tmp_path):
    assert artifact_dir == (tmp_path / "art").absolute()
    art = load_artifact(artifact_dir)
    assert isinstance(art, Artifact) and art.model_path == artifact_dir / "model.onnx"
    m = art.manifest
    assert m.format_version == FORMAT_VERSION
    assert set(m.files) == {"model.onnx", "model.onnx.data", "tokenizer/tokenizer.json"}
    assert m.files["model.onnx.data"]["bytes"] == 10240 and len(m.files["model.onnx.data"]["sha256"]) == 64
    assert m.config() == LLAMA
    assert m.kv_cache == kv_cache_spec(LLAMA, max_seq_len=64)
    assert m.inputs[1].shape == ["batch_size", "total_sequence_length"]
    assert m.passes[0] == {"name": "fuse_gqa", "matches": 2, "seconds": 0.25}
    assert m.tool_versions["onnx"] == onnx.__version__ and m.tool_versions["python"]
    # manifest.json is the last file written and is not listed in itself
    assert MANIFEST_FILE not in m.files
    assert Manifest.from_json(m.to_json()) == m
    assert _leftovers(tmp_path) == []


def test_tool_versions_keys():
    versions = tool_versions()
    assert set(versions) >= {"moeforge", "python", "torch", "onnx", "onnxruntime", "onnx_ir", "onnxscript"}
    assert versions["moeforge"] and versions["onnx_ir"]


def test_kv_cache_spec_sizes():
    gqa = kv_cache_spec(LLAMA, max_seq_len=128, dtype="float16")
    assert gqa.layout == "gqa" and gqa.past_input_names[1] == ["past_key_values.1.key", "past_key_values.1.value"]
    assert gqa.values_per_token_per_layer == LLAMA.kv_cache_values_per_token()
    assert gqa.bytes_per_token == 2 * LLAMA.kv_cache_values_per_token() * LLAMA.num_hidden_layers
    mla = kv_cache_spec(DEEPSEEK, max_seq_len=128)
    assert mla.layout == "mla_latent" and mla.present_output_names[0] == ["present.0.latent", "present.0.latent_v"]
    assert mla.values_per_token_per_layer == DEEPSEEK.kv_cache_values_per_token("absorb") == 40
    assert mla.bytes_for(128) == 128 * 40 * 4 * DEEPSEEK.num_hidden_layers
    # an MLA layer may expose several present outputs aliasing its one latent buffer, but only one past input
    KVCacheSpec(layout="mla_latent", num_layers=1, past_input_names=[["l"]], present_output_names=[["p", "p_v"]],
                shape=[], dtype="float32", values_per_token_per_layer=1, bytes_per_token=4, max_seq_len=1)
    with pytest.raises(ArtifactError, match="1 buffer"):
        KVCacheSpec(layout="mla_latent", num_layers=1, past_input_names=[["a", "b"]], present_output_names=[["p"]],
                    shape=[], dtype="float32", values_per_token_per_layer=1, bytes_per_token=4, max_seq_len=1)
    with pytest.raises(ArtifactError, match="2 buffer"):
        KVCacheSpec(layout="gqa", num_layers=1, past_input_names=[["k"]], present_output_names=[["p"]],
                    shape=[], dtype="float32", values_per_token_per_layer=1, bytes_per_token=4, max_seq_len=1)


# ---------------------------------------------------------------------------------------------- existing dir
def test_existing_dir_without_force_is_untouched(artifact_dir, tmp_path):
    before = {p.name: p.read_bytes() for p in artifact_dir.iterdir() if p.is_file()}
    called = []
    with pytest.raises(ArtifactError, match=r"already exists.*--force") as info:
        write_artifact(artifact_dir, write_payload=called.append, manifest=_manifest())
    assert isinstance(info.value, MoeforgeError)
    assert called == []  # refused before the payload ran
    assert {p.name: p.read_bytes() for p in artifact_dir.iterdir() if p.is_file()} == before
    assert _leftovers(tmp_path) == []


def test_check_output_dir(artifact_dir, tmp_path):
    assert check_output_dir(tmp_path / "new" / "x") == (tmp_path / "new" / "x").absolute()
    assert not (tmp_path / "new").exists()
    with pytest.raises(ArtifactError, match="--force"):
        check_output_dir(artifact_dir)
    assert check_output_dir(artifact_dir, force=True) == artifact_dir
    (tmp_path / "some_file").write_text("")
    with pytest.raises(ArtifactError, match="some_file"):
        check_output_dir(tmp_path / "some_file" / "child" / "art")


def test_force_replaces(artifact_dir, tmp_path):
    def payload(tmp: Path) -> None:
        (tmp / "model.onnx").write_bytes(_tiny_onnx())
        (tmp / "new.bin").write_bytes(b"new")

    write_artifact(artifact_dir, write_payload=payload, manifest=_manifest(), force=True)
    art = load_artifact(artifact_dir)
    assert set(art.manifest.files) == {"model.onnx", "new.bin"}
    assert not (artifact_dir / "model.onnx.data").exists()
    assert _leftovers(tmp_path) == []


def test_force_refuses_to_delete_a_non_artifact(tmp_path):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(ArtifactError, match="not a moeforge artifact"):
        write_artifact(precious, write_payload=_payload, manifest=_manifest(), force=True)
    assert (precious / "thesis.tex").read_text() == "years of work"
    assert _leftovers(tmp_path) == []


def test_failed_force_keeps_the_old_artifact(artifact_dir, tmp_path):
    def payload(tmp: Path) -> None:
        (tmp / "model.onnx").write_bytes(b"partial")
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        write_artifact(artifact_dir, write_payload=payload, manifest=_manifest(), force=True)
    load_artifact(artifact_dir)  # still the complete old one
    assert _leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------- interrupted
@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_payload_failure_leaves_nothing(tmp_path, exc):
    seen: list[Path] = []

    def payload(tmp: Path) -> None:
        seen.append(tmp)
        assert tmp.parent == tmp_path.absolute() and tmp.name.startswith(".")
        (tmp / "model.onnx").write_bytes(b"half")
        raise exc

    with pytest.raises(type(exc)):
        write_artifact(tmp_path / "art", write_payload=payload, manifest=_manifest())
    assert seen and not seen[0].exists()
    assert list(tmp_path.iterdir()) == []


def test_real_sigint_during_payload(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from moeforge.core.artifact import KVCacheSpec, Manifest, write_artifact
        kv = KVCacheSpec(layout="gqa", num_layers=1, past_input_names=[["k", "v"]],
                         present_output_names=[["pk", "pv"]], shape=[], dtype="float32",
                         values_per_token_per_layer=2, bytes_per_token=8, max_seq_len=4)
        m = Manifest(model_config={{}}, inputs=[], outputs=[], kv_cache=kv, target="cpu", precision="fp32")
        def payload(tmp):
            (tmp / "model.onnx").write_bytes(b"x" * 1000)
            print("ready", flush=True)
            time.sleep(60)
        try:
            write_artifact(Path({str(tmp_path / "art")!r}), write_payload=payload, manifest=m)
        except KeyboardInterrupt:
            sys.exit(130)
    """)
    # cwd outside the checkout, whose artifacts are left alone: `python -c` puts the cwd first on sys.path.
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path.parent)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert len(list(tmp_path.iterdir())) == 1  # the hidden temporary directory
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
    assert list(tmp_path.iterdir()) == []


def test_payload_must_write_model(tmp_path):
    with pytest.raises(ArtifactError, match=r"no model\.onnx"):
        write_artifact(tmp_path / "art", write_payload=lambda tmp: None, manifest=_manifest())
    assert list(tmp_path.iterdir()) == []


def test_stale_scratch_of_a_dead_process_is_removed(tmp_path):
    from moeforge.core.artifact import _host_tag

    stale = tmp_path / f".art.moeforge-tmp.{_host_tag()}.999999999.deadbeef"
    stale.mkdir()
    (stale / "model.onnx").write_bytes(b"x")
    write_artifact(tmp_path / "art", write_payload=_payload, manifest=_manifest())
    assert not stale.exists()


def _unwritable_parent(tmp_path: Path) -> Path:
    """A parent directory we cannot create entries in. As root chmod does not stop writes, so fall back
    to a path below a regular file, which fails for everyone."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    probe = locked / "probe"
    try:
        probe.mkdir()
    except PermissionError:
        return locked
    probe.rmdir()
    locked.chmod(0o700)
    blocker = tmp_path / "some_file"
    blocker.write_text("")
    return blocker / "child"


def test_unwritable_parent(tmp_path):
    parent = _unwritable_parent(tmp_path)
    try:
        with pytest.raises(ArtifactError) as info:
            write_artifact(parent / "art", write_payload=_payload, manifest=_manifest())
        assert str(parent) in str(info.value) or str(parent.parent) in str(info.value)
    finally:
        (tmp_path / "locked").chmod(0o700)


def test_parent_below_a_file(tmp_path):
    (tmp_path / "some_file").write_text("")
    with pytest.raises(ArtifactError, match="some_file"):
        write_artifact(tmp_path / "some_file" / "child" / "art", write_payload=_payload, manifest=_manifest())


def test_missing_parents_are_created(tmp_path):
    out = write_artifact(tmp_path / "a" / "b" / "art", write_payload=_payload, manifest=_manifest())
    assert load_artifact(out).manifest.files


# ---------------------------------------------------------------------------------------------- verification
def test_flipped_byte_names_the_file(artifact_dir):
    data = artifact_dir / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[5000] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match=r"model\.onnx\.data.*(modified or corrupted).*[Rr]ecompile"):
        load_artifact(artifact_dir)
    load_artifact(artifact_dir, verify=False)  # sizes still agree: only hashing catches it


def test_truncated_file_is_caught_without_hashing(artifact_dir):
    (artifact_dir / "tokenizer" / "tokenizer.json").write_text("{}")
    with pytest.raises(ArtifactError, match=r"tokenizer/tokenizer\.json has 2 bytes"):
        load_artifact(artifact_dir, verify=False)


def test_deleted_file(artifact_dir):
    (artifact_dir / "model.onnx.data").unlink()
    with pytest.raises(ArtifactError, match=r"model\.onnx\.data is missing"):
        load_artifact(artifact_dir)


def test_extra_file_warns(artifact_dir, caplog):
    (artifact_dir / "notes.txt").write_text("hi")
    with caplog.at_level(logging.WARNING, logger="moeforge.core.artifact"):
        art = load_artifact(artifact_dir)
    assert art.extra_files == ["notes.txt"]
    assert "notes.txt" in caplog.text


def test_missing_dir_and_manifest(tmp_path, artifact_dir):
    with pytest.raises(ArtifactError, match="does not exist"):
        load_artifact(tmp_path / "nope")
    (artifact_dir / MANIFEST_FILE).unlink()
    with pytest.raises(ArtifactError, match=r"no manifest\.json"):
        load_artifact(artifact_dir)


def test_invalid_manifest_json(artifact_dir):
    (artifact_dir / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        load_artifact(artifact_dir)


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 0, None])
def test_unknown_format_version(artifact_dir, version):
    path = artifact_dir / MANIFEST_FILE
    data = json.loads(path.read_text())
    data["format_version"] = version
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="format_version"):
        load_artifact(artifact_dir)


def test_manifest_missing_field_and_escaping_path(artifact_dir):
    path = artifact_dir / MANIFEST_FILE
    data = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "kv_cache"}))
    with pytest.raises(ArtifactError, match="kv_cache"):
        load_artifact(artifact_dir)
    data["files"]["../outside"] = {"sha256": "0" * 64, "bytes": 1}
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="outside the artifact"):
        load_artifact(artifact_dir)


# ---------------------------------------------------------------------------------------------- inspection
def test_op_counts(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(_tiny_onnx())
    assert op_counts(path) == {"Cast": 1, "Expand": 1, "Unsqueeze": 1, "com.microsoft.GroupQueryAttention": 1}


def test_summarize(artifact_dir):
    text = summarize(load_artifact(artifact_dir))
    for needle in ("tiny-llama", "cpu", "fp32", "input_ids", "[batch_size, sequence_length]", "logits",
                   "gqa", "past_key_values.0.key", "fuse_gqa", "2 matches", "com.microsoft.GroupQueryAttention",
                   "model.onnx.data", "10.0 KiB"):
        assert needle in text, needle
    kv = kv_cache_spec(LLAMA, max_seq_len=64)
    assert f"{kv.bytes_per_token} B per token" in text
    assert "max_seq_len 64" in text


def test_summarize_mla(tmp_path):
    out = write_artifact(tmp_path / "ds", write_payload=_payload, manifest=_manifest(DEEPSEEK))
    text = summarize(load_artifact(out))
    assert "mla_latent" in text and "latent" in text and "MLA" in text and "MoE" in text


# ---------------------------------------------------------------------------------------------- genai_config
def test_genai_config_gqa():
    kv = kv_cache_spec(LLAMA, max_seq_len=1024)
    cfg = genai_config(LLAMA, kv, context_length=256)
    model, search = cfg["model"], cfg["search"]
    assert model["type"] in ("decoder", "llama")
    assert model["vocab_size"] == LLAMA.vocab_size and model["context_length"] == 256
    assert model["eos_token_id"] == LLAMA.eos_token_ids[0] and model["bos_token_id"] == LLAMA.bos_token_id
    dec = model["decoder"]
    assert dec["filename"] == "model.onnx"
    assert (dec["head_size"], dec["hidden_size"], dec["num_attention_heads"], dec["num_key_value_heads"],
            dec["num_hidden_layers"]) == (16, 64, 4, 2, 2)
    assert dec["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert dec["inputs"]["past_value_names"] == "past_key_values.%d.value"
    assert dec["inputs"]["position_ids"] == "position_ids"
    assert dec["outputs"] == {"logits": "logits", "present_key_names": "present.%d.key",
                              "present_value_names": "present.%d.value"}
    assert search == {"max_length": 256, "past_present_share_buffer": True, "do_sample": False}
    json.dumps(cfg)


def test_genai_config_options_and_checks():
    kv = kv_cache_spec(LLAMA, max_seq_len=1024)
    cfg = genai_config(LLAMA, kv, context_length=8, eos_token_id=[3, 4], pad_token_id=0,
                       input_names={"position_ids": None}, filename="m.onnx")
    assert cfg["model"]["eos_token_id"] == [3, 4] and cfg["model"]["pad_token_id"] == 0
    assert "position_ids" not in cfg["model"]["decoder"]["inputs"] and cfg["model"]["decoder"]["filename"] == "m.onnx"
    with pytest.raises(MoeforgeError, match="context_length"):
        genai_config(LLAMA, kv, context_length=2048)
    with pytest.raises(ValueError, match="GenAI patterns"):
        genai_config(LLAMA, kv, context_length=8, input_names={"past_key_names": "past.%d.k"})


def test_genai_config_none_for_mla():
    assert genai_config(DEEPSEEK, kv_cache_spec(DEEPSEEK, max_seq_len=64), context_length=64) is None


def test_no_scratch_dirs_left_anywhere(tmp_path):
    write_artifact(tmp_path / "x", write_payload=_payload, manifest=_manifest())
    assert sorted(os.listdir(tmp_path)) == ["x"]


def test_force_replaces_a_sharded_artifact_and_refuses_one_holding_other_data(tmp_path):
    """A sharded artifact (sharded.json + rank directories, each an artifact) may be replaced by an unsharded
    compile with --force; one that also holds a file it did not write may not."""
    sharded = tmp_path / "sharded"
    for rank in ("rank0", "rank1"):
        write_artifact(sharded / rank, write_payload=_payload, manifest=_manifest())
    (sharded / SHARDED_FILE).write_text("{}")  # not a sharded manifest: refused
    with pytest.raises(ArtifactError, match=r"sharded\.json that is not a moeforge sharded manifest"):
        check_output_dir(sharded, force=True)
    (sharded / SHARDED_FILE).write_text(json.dumps({"format": "moeforge-sharded", "world_size": 2}))
    (sharded / "rank2").mkdir()  # an empty rank directory: no manifest, refused
    with pytest.raises(ArtifactError, match=r"rank2 has no manifest\.json"):
        check_output_dir(sharded, force=True)
    (sharded / "rank2").rmdir()
    (sharded / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match=r"sharded moeforge artifact but also holds notes\.txt"):
        write_artifact(sharded, write_payload=_payload, manifest=_manifest(), force=True)
    assert (sharded / "notes.txt").read_text() == "mine" and load_artifact(sharded / "rank1")
    (sharded / "notes.txt").unlink()
    (sharded / "rank1" / "stray.bin").write_bytes(b"x")  # inside a rank: not listed by its manifest
    with pytest.raises(ArtifactError, match=r"stray\.bin"):
        check_output_dir(sharded, force=True)
    (sharded / "rank1" / "stray.bin").unlink()
    write_artifact(sharded, write_payload=_payload, manifest=_manifest(), force=True)
    assert not (sharded / SHARDED_FILE).exists() and load_artifact(sharded)
    assert _leftovers(tmp_path) == []
