"""Issue 13, the artifact side: crafted artifacts and output paths are refused with one clear error, and
nothing is deleted or left behind (--force on foreign data, a replace killed mid-way, unwritable output,
absurd manifest numbers, symlinked or relocated external data, profiling temp dirs, bench memory)."""

from __future__ import annotations

import copy
import gc
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeforge.cli import bench as bench_mod
from moeforge.cli import main
from moeforge.cli.bench import bench_memory, check_bench_memory, run_bench
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.core import artifact as artifact_mod
from moeforge.core.artifact import (
    MANIFEST_FILE,
    MODEL_FILE,
    ArtifactError,
    KVCacheSpec,
    check_output_dir,
    load_artifact,
    write_artifact,
)
from moeforge.core.errors import MoeforgeError
from moeforge.core.manifest import MAX_SEQ_LEN, Manifest
from moeforge.core.safe_paths import remove_tree
from moeforge.runtime.engine import BackendOptions, EngineConfig, LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the deep folder chains
from deep_tree import add_file, deep_tree

DATA_FILE = "model.onnx.data"
DEAD_PID = 999_999_999  # above any pid_max: never a live process


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama compiled once per session (contiguous fp32, max_seq_len 64): never mutated, copy it."""
    out = tmp_path_factory.mktemp("tiny") / "artifact"
    return compile_model(CompileOptions(model="tiny-llama", output_dir=out, max_seq_len=64, progress=False)).output_dir


@pytest.fixture
def art(tiny_artifact: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny artifact, at tmp_path/art."""
    return Path(shutil.copytree(tiny_artifact, tmp_path / "art"))


def _snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under root (hidden ones included): file bytes, or the link target / 'dir'."""
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = path.read_bytes()
    return out


def _edit_manifest(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = root / MANIFEST_FILE
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _copy_payload(source: Path) -> Callable[[Path], None]:
    """A write_artifact payload that copies every file of ``source`` but its manifest."""
    def payload(tmp: Path) -> None:
        for path in source.rglob("*"):
            rel = path.relative_to(source)
            if path.is_file() and rel.as_posix() != MANIFEST_FILE:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, tmp / rel)
    return payload


def _manifest_of(source: Path) -> Manifest:
    manifest = Manifest.from_json((source / MANIFEST_FILE).read_text())
    manifest.files = {}
    return manifest


def _manifest_of_dummy() -> Manifest:
    """A manifest for payloads that must never run."""
    kv = KVCacheSpec(layout="gqa", num_layers=1, past_input_names=[["k", "v"]], present_output_names=[["pk", "pv"]],
                     shape=[], dtype="float32", values_per_token_per_layer=2, bytes_per_token=8, max_seq_len=4)
    return Manifest(model_config={}, inputs=[], outputs=[], kv_cache=kv, target="cpu", precision="fp32")


def _never(tmp: Path) -> None:
    raise AssertionError("the payload ran although the destination must be refused first")


def _aside(out: Path, tag: str = "moeforge-old", suffix: str = "deadbeef") -> Path:
    return out.parent / f".{out.name}.{tag}.{artifact_mod._host_tag()}.{DEAD_PID}.{suffix}"


# ---------------------------------------------------------------------------------------------- 1: --force
def test_force_refuses_a_folder_that_merely_holds_a_manifest_json(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    app = tmp_path / "webapp"
    (app / "src").mkdir(parents=True)
    (app / MANIFEST_FILE).write_text('{"name": "My App", "icons": [], "start_url": "/"}')
    (app / "src" / "index.js").write_text("console.log('years of work')")
    before = _snapshot(tmp_path)
    with pytest.raises(ArtifactError, match=r"not a moeforge artifact.*not a moeforge manifest.*even with --force"):
        check_output_dir(app, force=True)
    with pytest.raises(ArtifactError, match="not a moeforge artifact"):
        write_artifact(app, write_payload=_never, manifest=_manifest_of_dummy(), force=True)
    # the CLI refuses before loading the model, exit code 2 and one line
    assert main(["compile", "tiny-llama", "-o", str(app), "--force", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "not a moeforge artifact" in err and str(app) in err and len(err.strip().splitlines()) == 1
    assert _snapshot(tmp_path) == before


def test_force_refuses_an_artifact_that_holds_unlisted_files(art: Path, tmp_path: Path) -> None:
    (art / "notes").mkdir()
    (art / "notes" / "thesis.tex").write_text("mine")
    before = _snapshot(tmp_path)
    with pytest.raises(ArtifactError, match=r"notes/thesis\.tex.*even with --force"):
        check_output_dir(art, force=True)
    with pytest.raises(ArtifactError, match=r"notes/thesis\.tex"):
        write_artifact(art, write_payload=_never, manifest=_manifest_of(art), force=True)
    assert _snapshot(tmp_path) == before


def test_force_replaces_an_artifact_or_an_empty_directory(art: Path, tmp_path: Path) -> None:
    assert check_output_dir(art, force=True) == art
    out = write_artifact(art, write_payload=_copy_payload(art), manifest=_manifest_of(art), force=True)
    load_artifact(out)
    empty = tmp_path / "empty"
    empty.mkdir()
    write_artifact(empty, write_payload=_copy_payload(art), manifest=_manifest_of(art), force=True)
    load_artifact(empty)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "empty"]  # no scratch left


# ---------------------------------------------------------------------------------------------- 2: killed replace
def _crash_between_renames(art: Path) -> tuple[Path, Path]:
    """The state a compile --force killed between _install's two renames leaves: NAME gone, the old artifact
    in .NAME.moeforge-old.*, the complete new one in .NAME.moeforge-tmp.* (both of a dead process)."""
    old = _aside(art)
    os.rename(art, old)
    new = Path(shutil.copytree(old, _aside(art, "moeforge-tmp", "cafef00d")))
    return old, new


def test_load_restores_the_artifact_a_killed_replace_moved_aside(art: Path, caplog: pytest.LogCaptureFixture) -> None:
    old, _ = _crash_between_renames(art)
    expected = _snapshot(old)
    with caplog.at_level(logging.WARNING, logger="moeforge.core.artifact"):
        assert main(["inspect", str(art)]) == 0
    assert "restored" in caplog.text and not old.exists()
    assert _snapshot(art) == expected
    load_artifact(art)


def test_compile_restores_then_refuses_without_force(art: Path, tmp_path: Path) -> None:
    old, new = _crash_between_renames(art)
    expected = _snapshot(old)
    with pytest.raises(ArtifactError, match="already exists; pass --force"):
        check_output_dir(art)
    assert _snapshot(art) == expected and not old.exists()
    os.rename(art, old)  # crash state again, now through write_artifact
    with pytest.raises(ArtifactError, match="already exists; pass --force"):
        write_artifact(art, write_payload=_never, manifest=_manifest_of(old))
    assert _snapshot(art) == expected and not old.exists()
    # with --force the replace goes through; the dead writer's scratch is cleaned up
    write_artifact(art, write_payload=_copy_payload(art), manifest=_manifest_of(art), force=True)
    load_artifact(art)
    assert not new.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_several_or_incomplete_old_copies_are_kept_and_named(art: Path, tmp_path: Path) -> None:
    first = _aside(art)
    os.rename(art, first)
    second = Path(shutil.copytree(first, _aside(art, suffix="0badf00d")))
    before = _snapshot(tmp_path)
    for attempt in (lambda: load_artifact(art), lambda: check_output_dir(art, force=True),
                    lambda: write_artifact(art, write_payload=_never, manifest=_manifest_of(first), force=True)):
        with pytest.raises(ArtifactError, match=r"is missing.*2 of 2 complete.*nothing was deleted") as info:
            attempt()
        assert str(first) in str(info.value) and str(second) in str(info.value)
        assert _snapshot(tmp_path) == before
    assert main(["inspect", str(art)]) == 2
    shutil.rmtree(second)
    (first / DATA_FILE).write_bytes(b"truncated")  # the one copy left is not complete: kept, not restored
    before = _snapshot(tmp_path)
    with pytest.raises(ArtifactError, match=r"0 of 1 complete"):
        load_artifact(art)
    assert _snapshot(tmp_path) == before


def test_an_old_copy_is_removed_only_once_the_artifact_is_complete(art: Path, tmp_path: Path) -> None:
    old = Path(shutil.copytree(art, _aside(art)))  # killed after the second rename: NAME is the new one
    write_artifact(art, write_payload=_copy_payload(art), manifest=_manifest_of(art), force=True)
    assert not old.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    kept = Path(shutil.copytree(art, _aside(empty)))  # NAME is no artifact: keep the only real copy
    write_artifact(empty, write_payload=_copy_payload(art), manifest=_manifest_of(art), force=True)
    assert kept.exists()


# ---------------------------------------------------------------------------------------------- 3: unwritable
def test_an_output_where_no_directory_can_be_made_is_refused_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc passes the permission bits for root, but nothing can be created there: refused up front, not after
    a whole compile."""
    def no_load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded before the output location was checked")

    monkeypatch.setattr("moeforge.compile.stages.load_model", no_load)
    with pytest.raises(ArtifactError, match=r"/proc/moeforge-x: creating a directory in /proc fails"):
        compile_model(CompileOptions(model="tiny-llama", output_dir="/proc/moeforge-x", progress=False))


def test_unwritable_output_is_refused_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests run as root, where os.access passes any permission bits (only a read-only mount fails it):
    # simulate the read-only location through os.access itself.
    real_access = os.access
    locked = tmp_path / "readonly"
    locked.mkdir()

    def access(path: Any, mode: int, **kwargs: Any) -> bool:
        if Path(path) == locked and mode & os.W_OK:
            return False
        return real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", access)
    for out in (locked / "art", locked / "a" / "b" / "art"):  # the parent, or the nearest existing ancestor
        with pytest.raises(ArtifactError, match=rf"{locked}.*not writable.*choose an output path"):
            check_output_dir(out)
    with pytest.raises(ArtifactError, match="not writable"):
        write_artifact(locked / "art", write_payload=_never, manifest=_manifest_of_dummy())

    def no_load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded before the output location was checked")

    monkeypatch.setattr("moeforge.compile.stages.load_model", no_load)
    with pytest.raises(ArtifactError, match="not writable"):
        compile_model(CompileOptions(model="tiny-llama", output_dir=locked / "art", max_seq_len=64, progress=False))
    assert list(locked.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_read_only_directory_as_non_root(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ArtifactError, match="not writable"):
            check_output_dir(locked / "art")
    finally:
        locked.chmod(0o700)


def test_output_below_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "some_file").write_text("")
    with pytest.raises(ArtifactError, match="some_file is a file"):
        check_output_dir(tmp_path / "some_file" / "child" / "art")


# ---------------------------------------------------------------------------------------------- 4+5: numbers
HUGE = "__1e400__"  # json.dumps cannot write 1e400; replaced in the text


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[last] = value
    return edit


CRAFTED = [
    ("kv_cache.max_seq_len", 10**12, "max_seq_len"),
    ("kv_cache.max_seq_len", 1e12, "max_seq_len must be an integer"),
    ("kv_cache.max_seq_len", -5, "max_seq_len"),
    ("kv_cache.max_seq_len", 0, "max_seq_len"),
    ("kv_cache.max_seq_len", HUGE, "1e400 is out of a double's range"),  # refused as the JSON is read
    ("kv_cache.max_seq_len", MAX_SEQ_LEN + 1, "max_seq_len"),
    ("kv_cache.max_seq_len", 2000, "max_position_embeddings"),  # tiny-llama's rotary tables end at 1024
    ("kv_cache.max_seq_len", True, "max_seq_len must be an integer"),
    ("kv_cache.max_seq_len", "64", "max_seq_len must be an integer"),
    ("model_config.vocab_size", 10**15, "vocab_size"),
    ("model_config.vocab_size", -512, "vocab_size"),
    ("model_config.vocab_size", 512.0, "vocab_size"),
    ("model_config.vocab_size", 4096, "logits have 512"),  # within bounds, but not the graph's
    ("model_config.num_hidden_layers", 10**9, "num_hidden_layers"),
    ("model_config.num_hidden_layers", 3, "num_layers is 2"),  # layers disagree with the cache
    ("model_config.num_hidden_layers", True, "num_hidden_layers"),
    ("model_config.num_key_value_heads", 4, "kv_cache.shape"),
    ("kv_cache.num_layers", 10**9, "num_layers"),
    ("kv_cache.num_layers", 3, "num_layers"),
    ("kv_cache.bytes_per_token", 1, "bytes_per_token"),
    ("kv_cache.bytes_per_token", -1, "bytes_per_token"),
    ("kv_cache.values_per_token_per_layer", 10**12, "values_per_token_per_layer"),
    ("kv_cache.shape", ["batch_size", 2, "max_sequence_length", 10**6], "shape"),
    ("kv_cache.block_size", 0, "block_size"),
    ("kv_cache.dtype", "float1024", "dtype"),
    ("kv_cache.past_input_names", [["past_key_values.0.key", "past_key_values.0.value"],
                                   ["past_key_values.9.key", "past_key_values.9.value"]], "past_key_values.9.key"),
    ("kv_cache", [], "kv_cache must be an object"),
    ("files", [], "files must be an object"),
    ("format_version", True, "format_version"),
]


@pytest.mark.parametrize(("field", "value", "message"), CRAFTED, ids=[f"{f}={v!r}"[:60] for f, v, _ in CRAFTED])
def test_crafted_manifest_numbers_are_refused(art: Path, field: str, value: Any, message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _edit_manifest(art, _set(field, value))
    path = art / MANIFEST_FILE
    path.write_text(path.read_text().replace(f'"{HUGE}"', "1e400"))
    before = _snapshot(art)
    start = time.perf_counter()
    with pytest.raises(ArtifactError, match=message):
        load_artifact(art)
    assert main(["inspect", str(art)]) == 2
    assert main(["inspect", "--no-verify", str(art)]) == 2
    err = capsys.readouterr().err
    assert "recompile" in err and err.count("error:") == 2
    with pytest.raises(ArtifactError, match=message):  # `run` loads the same way, before allocating
        LLMEngine.from_artifact(art)
    assert time.perf_counter() - start < 10
    assert _snapshot(art) == before


def test_unbound_cache_input_is_refused(art: Path) -> None:
    def add_layer_input(data: dict[str, Any]) -> None:
        data["inputs"].append({"name": "past_key_values.2.key", "dtype": "float32", "shape": [1]})

    _edit_manifest(art, add_layer_input)
    with pytest.raises(ArtifactError, match=r"past_key_values\.2\.key.*does not list"):
        load_artifact(art)


def test_huge_or_special_manifest_file_is_refused(art: Path) -> None:
    path = art / MANIFEST_FILE
    text = path.read_text()
    path.unlink()
    os.mkfifo(path)  # reading a FIFO would block forever
    with pytest.raises(ArtifactError, match="not a regular file"):
        load_artifact(art)
    path.unlink()
    (art / "elsewhere.json").write_text(text)
    path.symlink_to(art / "elsewhere.json")
    with pytest.raises(ArtifactError, match="symlink"):
        load_artifact(art)
    path.unlink()
    path.write_text("[" * 100_000 + "]" * 100_000)  # nesting deeper than the recursion limit
    with pytest.raises(ArtifactError, match=r"manifest nests deeper than \d+ levels.*recompile"):
        load_artifact(art)


# Mutations for the fuzz test: a random path into the manifest, then a deletion or a replacement. Values are
# copied: a later mutation may edit one in place, and a shared one would leak into the next example.
ODD_VALUES: st.SearchStrategy[Any] = st.sampled_from([
    None, True, False, -1, 0, 1, 2**31, 10**12, 10**30, -(10**9), 1.5, float("nan"), float("inf"), float("-inf"),
    "", "64", "abc", [], {}, [1, 2], {"a": 1}, [[]], ["batch_size"], "past_key_values.0.key",
]).map(copy.deepcopy)


def _mutate(data: Any, draw: Any) -> Any:
    """Replace, delete or type-swap one randomly reached node of ``data`` (a JSON tree)."""
    node: Any = data
    parent: Any = None
    key: Any = None
    while isinstance(node, dict | list) and node and draw(st.booleans()):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, draw(st.sampled_from(keys))
        node = node[key]
    action = draw(st.sampled_from(["replace", "delete", "swap"]))
    if action == "swap":
        if isinstance(node, dict):
            new: Any = list(node.values())
        elif isinstance(node, list):
            new = {str(i): v for i, v in enumerate(node)}
        elif isinstance(node, int | float) and not isinstance(node, bool):
            new = draw(st.sampled_from([str(node), -node, node * 10**9, float(node) + 0.5, [node]]))
        else:
            new = draw(ODD_VALUES)
    else:
        new = draw(ODD_VALUES)
    if parent is None:
        return new if action != "delete" else {}
    if action == "delete":
        del parent[key]
    else:
        parent[key] = new
    return data


@settings(max_examples=40, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_manifest_inspect_exits_0_or_2(tiny_artifact: Path, tmp_path: Path, data: st.DataObject) -> None:
    art = tmp_path / "fuzz"
    if not art.exists():
        shutil.copytree(tiny_artifact, art)
    original = json.loads((tiny_artifact / MANIFEST_FILE).read_text())
    mutated = json.loads(json.dumps(original))
    for _ in range(data.draw(st.integers(1, 3))):
        mutated = _mutate(mutated, data.draw)
    (art / MANIFEST_FILE).write_text(json.dumps(mutated))
    start = time.perf_counter()
    code = main(["inspect", str(art)])
    assert code in (0, 2)
    assert time.perf_counter() - start < 5
    assert sorted(p.name for p in art.iterdir()) == sorted(p.name for p in tiny_artifact.iterdir())


# ---------------------------------------------------------------------------------------------- 11: external data
def test_symlinked_external_data_is_refused(art: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.data"
    shutil.move(art / DATA_FILE, outside)
    (art / DATA_FILE).symlink_to(outside)  # same bytes, same hash: only the link gives it away
    for verify in (True, False):
        with pytest.raises(ArtifactError, match=rf"{DATA_FILE} is a symlink"):
            load_artifact(art, verify=verify)
    assert main(["inspect", str(art)]) == 2 and main(["inspect", "--no-verify", str(art)]) == 2
    assert outside.exists() and (art / DATA_FILE).is_symlink()  # nothing deleted


def test_a_symlink_anywhere_in_the_artifact_is_refused(art: Path, tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("x")
    (art / "golden" / "link").symlink_to(tmp_path / "secret")  # not even listed in the manifest
    with pytest.raises(ArtifactError, match=r"golden/link is a symlink"):
        load_artifact(art)


def _relocate(art: Path, location: str, fix_manifest: bool) -> None:
    """Point the first external initializer of model.onnx at ``location``; optionally re-record model.onnx's
    size and sha256 in the manifest (manifest.json is not covered by any hash)."""
    model = onnx.load(str(art / MODEL_FILE), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(model, str(art / MODEL_FILE))
    if fix_manifest:
        sha, size = artifact_mod._hash_file(art / MODEL_FILE)
        _edit_manifest(art, lambda data: data["files"].__setitem__(MODEL_FILE, {"sha256": sha, "bytes": size}))


@pytest.mark.parametrize("where", ["relative", "absolute", "listed-but-too-short"])
def test_external_data_outside_the_artifact_is_refused(art: Path, tmp_path: Path, where: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    outside = tmp_path / "outside.data"
    shutil.copyfile(art / DATA_FILE, outside)
    location = {"relative": "../outside.data", "absolute": str(outside),
                "listed-but-too-short": "tokenizer_config.json"}
    _relocate(art, location[where], fix_manifest=False)
    with pytest.raises(ArtifactError, match=rf"{MODEL_FILE} (has|does not match)"):  # the hash catches the edit
        load_artifact(art)
    _relocate(art, location[where], fix_manifest=True)  # ... unless the manifest was edited to match
    message = "lies outside" if where == "listed-but-too-short" else "not a file of this artifact"
    for verify in (True, False):
        with pytest.raises(ArtifactError, match=message):
            load_artifact(art, verify=verify)
    assert main(["inspect", str(art)]) == 2 and main(["inspect", "--no-verify", str(art)]) == 2
    assert message in capsys.readouterr().err
    assert outside.exists()


# ---------------------------------------------------------------------------------------------- 12: profiling
def _profile_dirs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("moeforge-profile-"))


def test_profiled_runs_leave_no_temp_dir(art: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    result = run_bench(art, batch=1, prompt_len=4, new_tokens=2, compare=False)
    assert 0 <= result["moeforge_onnxruntime"]["attention_time_share"] <= 1
    gc.collect()
    assert _profile_dirs(temp) == []
    # never asked for its profile
    engine = LLMEngine.from_artifact(art, EngineConfig(backend=BackendOptions(profile=True)))
    assert len(_profile_dirs(temp)) == 1
    del engine
    gc.collect()
    assert _profile_dirs(temp) == []


# ---------------------------------------------------------------------------------------------- 7: bench memory
def test_bench_refuses_a_batch_beyond_the_available_memory(art: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench_mod, "available_memory", lambda: 1 << 30)
    monkeypatch.setattr(bench_mod, "bench_engine", lambda *a, **k: pytest.fail("bench ran"))
    assert main(["bench", str(art), "--batch", "100000", "--no-compare"]) == 2
    err = capsys.readouterr().err
    kv = load_artifact(art).manifest.kv_cache
    need = bench_memory(kv, 512, 100_000, 64)
    assert f"{need} bytes" in err and "1.0 GiB" in err and "lower --batch to at most" in err
    fits = int(err.split("at most ")[1].split()[0])
    assert bench_memory(kv, 512, fits, 64) <= 1 << 30 < bench_memory(kv, 512, fits + 1, 64)


def test_bench_refuses_an_absurd_batch_with_the_real_limit(art: Path) -> None:
    start = time.perf_counter()
    with pytest.raises(MoeforgeError, match=r"--batch 1000000000 needs .* more than the .* available"):
        run_bench(art, batch=10**9, prompt_len=4, new_tokens=2, compare=False)
    assert time.perf_counter() - start < 10


def test_bench_memory_counts_the_cache_and_logits(art: Path) -> None:
    kv = load_artifact(art).manifest.kv_cache
    assert bench_memory(kv, 512, 3, 8) == 3 * 64 * kv.bytes_per_token + 4 * 3 * 8 * 512
    check_bench_memory(kv, 512, 3, 8, available=bench_memory(kv, 512, 3, 8))
    with pytest.raises(MoeforgeError, match="at most 2"):
        check_bench_memory(kv, 512, 3, 8, available=bench_memory(kv, 512, 3, 8) - 1)


def test_force_onto_a_symbolic_link_says_it_is_a_link(tmp_path: Path) -> None:
    """--force replaces a directory, never what a link points to, and says so (it used to say "not a directory")."""
    target = tmp_path / "real"
    target.mkdir()
    (target / "keep.txt").write_text("data")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ArtifactError, match=r"is a symbolic link \(to .*real\).*give the real path"):
        check_output_dir(link, force=True)
    assert (target / "keep.txt").read_text() == "data" and link.is_symlink()


# ---------------------------------------------------------------------------------------------- strict manifest JSON
@pytest.mark.parametrize(("edit", "message"), [
    (lambda text: text.replace('"source": "', '"source": "\\ud800', 1), "lone surrogate"),
    (lambda text: text.replace("{", '{"target": "cpu", ', 1), "'target' appears twice"),
], ids=["lone-surrogate", "duplicate-key"])
def test_a_manifest_that_is_not_strict_json_is_an_artifact_error(art: Path, capsys: pytest.CaptureFixture[str],
                                                                 edit: Callable[[str], str], message: str) -> None:
    """A lone surrogate escape ("\\ud800") in a manifest string used to end ``inspect`` in a UnicodeEncodeError
    where it was printed; a key given twice was read as its last value. Both are refused as the manifest is read."""
    path = art / MANIFEST_FILE
    text = path.read_text()
    path.write_text(edit(text))
    assert path.read_text() != text
    with pytest.raises(ArtifactError, match=rf"manifest is not valid JSON \(.*{message}.*\).*recompile it"):
        load_artifact(art)
    assert main(["inspect", str(art)]) == 2
    err = capsys.readouterr().err
    assert message in err and "recompile" in err and len(err.strip().splitlines()) == 1, err


# ---------------------------------------------------------------------------------------------- deep folder trees
DEEP = 3000  # folders, far past the recursion limit (os.walk, shutil.rmtree) and PATH_MAX (6000 characters)


def _deep_tree(top: Path, depth: int = DEEP, bottom_file: bool = False) -> None:
    """``top/d/d/.../d`` ``depth`` folders deep, with a file ``x`` in the deepest one if ``bottom_file``."""
    deep_tree(top, depth, add_file("x") if bottom_file else None)


def test_force_replaces_an_artifact_holding_a_3000_deep_folder_tree(tiny_artifact: Path, art: Path,
                                                                    tmp_path: Path) -> None:
    """``compile -o DIR --force`` died with RecursionError where DIR (or a stale scratch copy of it) held a folder
    tree thousands deep: the artifact's walks and removals are iterative now (``safe_paths.remove_tree``)."""
    scratch = _aside(art, "moeforge-tmp", "cafef00d")  # a killed writer's scratch: removed by the next write
    _deep_tree(art / "deep")
    _deep_tree(scratch)
    try:
        assert load_artifact(art).extra_files == []  # empty folders: nothing unlisted, nothing refused
        assert check_output_dir(art, force=True) == art
        out = write_artifact(art, write_payload=_copy_payload(tiny_artifact), manifest=_manifest_of(tiny_artifact),
                             force=True)
        assert not (out / "deep").exists() and load_artifact(out).manifest.files
        assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # the old copy and the scratch are gone
    finally:  # pytest's own clean-up of old temporary folders recurses (shutil.rmtree): leave no deep tree to it
        for left in [art / "deep", scratch, *tmp_path.glob(".art.moeforge-old.*")]:
            if os.path.lexists(left):
                remove_tree(left)


def test_force_refuses_a_file_thousands_of_folders_deep(art: Path, tmp_path: Path) -> None:
    """Unlisted data is refused at any depth, past PATH_MAX too, and named in a line of readable length."""
    _deep_tree(art / "deep", bottom_file=True)
    try:
        with pytest.raises(ArtifactError, match=r"also holds deep/d/d/.*/\.\.\./.*d/d/x, which it does not list") \
                as info:
            check_output_dir(art, force=True)
        assert len(str(info.value)) < 600
        with pytest.raises(ArtifactError, match="also holds deep/"):
            write_artifact(art, write_payload=_never, manifest=_manifest_of_dummy(), force=True)
        assert (art / "deep" / "d").is_dir()  # nothing was deleted
        assert "x" in load_artifact(art).extra_files[0]  # reading it lists it as unlisted, as any other extra file
    finally:
        remove_tree(art / "deep")  # pytest's own clean-up of old temporary folders recurses (shutil.rmtree)
