"""The compile and plan surfaces against hostile input (issue 48): the partial directory of a sharded compile, its
resume.json, the numeric compile flags and ``--plan``, placement plans, sharded.json, and the advice for an existing
output folder. Each case is a ``MoeforgeError`` (the CLI's one line, exit 2) that names the problem and the fix,
never a traceback, and nothing of the user's is touched. Cheap: the readers and checks are called directly; one
tiny-llama tp 2 compile (interrupted at rank 1, then resumed) covers the partial directory end to end."""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeforge.cli.commands import main
from moeforge.compile import sharded_compile
from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.compile.options import MAX_RANKS, check_flags
from moeforge.compile.partial_compile import RESUME_FILE, compile_fingerprint, open_partial, partial_dir
from moeforge.compile.plan import check_compile, plan_compile
from moeforge.compile.sharded_compile import ShardedManifest, read_sharded
from moeforge.core.artifact import SHARDED_FILE, ArtifactError, artifact_model_config, check_output_dir
from moeforge.core.errors import MoeforgeError
from moeforge.core.safe_paths import OWNED_MARKER, create_owned_dir, is_owned_dir
from moeforge.model.expert_slots import MAX_SLOTS_PER_EXPERT, ExpertSlots, PlacementError, load_plan
from moeforge.model.loader import load_config

BOMB = "[" * 200000  # Python's own decoder raises RecursionError on it
PLAN = {"format": "moeforge-eplb-plan", "version": 1, "ep": 2}
TABLE = [[*range(8), 0, 1]] * 2  # tiny-deepseek-v3: 2 MoE layers of 8 experts, on 2 ranks of 5 slots


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` (links not followed) -> its content, link target or "dir"."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        out[rel] = f"-> {os.readlink(path)}" if path.is_symlink() else "dir" if path.is_dir() else path.read_text()
    return out


def _user_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "u"
    (folder / "sub").mkdir(parents=True)
    (folder / "thesis.tex").write_text("years of work")
    (folder / "sub" / "notes").write_text("mine")
    return folder


def _options(out: Path, **flags: Any) -> CompileOptions:
    flags = {"model": "tiny-llama", "tp": 2, "max_seq_len": 64, "progress": False, **flags}
    return CompileOptions.from_flags(output_dir=out, **flags)


def _no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: Any) -> None:
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(sharded_compile, "open_source", refuse)


# ------------------------------------------------------------------------ 1. the partial directory is moeforge's
@pytest.mark.parametrize("kind", ["link", "file", "foreign-folder"])
def test_a_partial_dir_name_holding_a_link_file_or_foreign_folder_is_refused_untouched(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The data-loss repro: ``.pc2.moeforge-partial`` a link to a user's folder made ``compile --tp 2 -o pc2`` empty
    it and write the artifact into it. Now it, a file or a folder moeforge did not create there is refused before
    the model loads, with the advice to move it away; nothing is touched."""
    user = _user_folder(tmp_path)
    out = tmp_path / "pc2"
    partial = partial_dir(out)
    if kind == "link":
        partial.symlink_to(user)
    elif kind == "file":
        partial.write_text("a file of the user's")
    else:
        partial.mkdir()
        (partial / "rank0").mkdir()
        (partial / "rank0" / "data").write_text("mine")
    before = _snapshot(tmp_path)
    _no_model_load(monkeypatch)
    assert main(["compile", "tiny-llama", "-o", str(out), "--tp", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "move it away" in err and str(partial) in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(MoeforgeError, match="move it away"):  # the context manager itself refuses it too
        with open_partial(out, _options(out), 2):
            pass
    assert _snapshot(tmp_path) == before and not out.exists()


def test_the_partial_dir_is_created_owned_and_links_inside_are_removed_as_links(tmp_path: Path) -> None:
    """An owned partial directory (moeforge's marker) is resumed and cleared of what it may not keep: a link named
    like a rank, or to a file, goes as a link; what it points to stays. An error removes the directory; an
    interruption keeps it."""
    user = _user_folder(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with open_partial(out, _options(out), 2) as partial:
            assert is_owned_dir(partial.root) and partial.done == set()
            raise KeyboardInterrupt
    root = partial_dir(out)
    assert is_owned_dir(root)  # kept for the next run
    (root / "rank0").symlink_to(user, target_is_directory=True)
    (root / "rank1").symlink_to(user / "thesis.tex")
    (root / "stray").mkdir()
    (root / "stray" / "link").symlink_to(user)
    before = _snapshot(user)
    with pytest.raises(RuntimeError):
        with open_partial(out, _options(out), 2) as partial:
            assert partial.done == set()  # the linked "rank0" is not a written rank
            assert sorted(p.name for p in root.iterdir()) == [OWNED_MARKER, RESUME_FILE]
            raise RuntimeError("a corrupt weight")
    assert not os.path.lexists(root) and _snapshot(user) == before


BAD_RESUME = [BOMB, "NaN", '{"fingerprint": "FP", "tp": 2.0}', '{"fingerprint": "FP", "tp": "2"}',
              '{"fingerprint": "FP", "tp": true}', '{"fingerprint": ["FP"], "tp": 2}', "[]", "\xff\xfe", "1e400"]


@pytest.mark.parametrize("text", BAD_RESUME, ids=range(len(BAD_RESUME)))
def test_a_resume_record_that_does_not_read_as_moeforge_s_starts_over(tmp_path: Path, text: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """resume.json is read by the strict reader: a nesting bomb, NaN, ``"tp": 2.0`` or ``"2"`` (once read as the
    same compile), a record of other types: another compile's, so the compile starts over, saying so."""
    out = tmp_path / "out"
    root = create_owned_dir(partial_dir(out))
    (root / "rank0").mkdir()
    (root / "rank0" / "manifest.json").write_text("{}")
    fingerprint = compile_fingerprint(_options(out))
    (root / RESUME_FILE).write_text(text.replace("FP", fingerprint), encoding="utf-8", errors="surrogateescape")
    with caplog.at_level(logging.WARNING), open_partial(out, _options(out), 2) as partial:
        assert partial.done == set() and not (root / "rank0").exists()
        assert json.loads((root / RESUME_FILE).read_text()) == {"fingerprint": fingerprint, "tp": 2}
    assert "starting over" in caplog.text


def test_a_linked_resume_record_is_not_followed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    root = create_owned_dir(partial_dir(out))
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"fingerprint": compile_fingerprint(_options(out)), "tp": 2}))
    (root / RESUME_FILE).symlink_to(elsewhere)
    with open_partial(out, _options(out), 2) as partial:
        assert partial.done == set() and not (root / RESUME_FILE).is_symlink()
    assert json.loads(elsewhere.read_text())["tp"] == 2  # written beside, not through the link


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                              lambda inner: st.lists(inner, max_size=3)
                              | st.dictionaries(st.sampled_from(["fingerprint", "tp", "x"]), inner, max_size=3),
                              max_leaves=8).map(lambda value: json.dumps(value).encode())))
def test_fuzzed_resume_records_never_raise(tmp_path: Path, content: bytes) -> None:
    out = Path(tempfile.mkdtemp(dir=tmp_path)) / "out"
    root = create_owned_dir(partial_dir(out))
    (root / RESUME_FILE).write_bytes(content)
    with open_partial(out, _options(out), 2) as partial:
        assert partial.done == set() and is_owned_dir(root)


def test_a_killed_compile_resumes_from_its_owned_partial_dir_and_the_artifact_holds_no_marker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end (the one compile of this file): interrupted in rank 1, the partial directory is moeforge's (its
    marker) with rank 0; a link planted in it is removed as a link; the same command builds rank 1 only, and the
    artifact holds neither the marker nor resume.json (so --force may replace it later)."""
    user = _user_folder(tmp_path)
    out = tmp_path / "out"
    built: list[int] = []
    interrupt = [True]
    original = sharded_compile.build_rank

    def build(options: CompileOptions, loaded: Any, weights: Any, rank: int, root: Path, bar: Any) -> None:
        if rank == 1 and interrupt.pop():  # the first attempt dies in rank 1, rank 0 written
            raise KeyboardInterrupt
        built.append(rank)
        original(options, loaded, weights, rank, root, bar)

    monkeypatch.setattr(sharded_compile, "build_rank", build)
    with pytest.raises(KeyboardInterrupt):
        compile_model(_options(out))
    root = partial_dir(out)
    assert is_owned_dir(root) and sorted(p.name for p in root.iterdir()) == [OWNED_MARKER, "rank0", RESUME_FILE]
    (root / "rank1").symlink_to(user, target_is_directory=True)
    before = _snapshot(user)
    interrupt.append(False)
    built.clear()
    compile_model(_options(out))
    assert built == [1] and not os.path.lexists(root) and _snapshot(user) == before
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1", SHARDED_FILE]
    assert read_sharded(out).tp == 2 and check_output_dir(out, force=True) == out


# ------------------------------------------------------------------------ 3. one check for the compile and --plan
@pytest.mark.parametrize(("flags", "message"), [
    ({"pp": -1}, r"--pp must be in 1\.\.1024, got -1"),
    ({"tp": 10**30}, r"--tp must be in 1\.\.1024"),
    ({"tp": 2, "ep": -1}, r"--ep must be in 1\.\.1024"),
    ({"tp": 2, "pp": 1000}, r"2000 ranks, over the 1024"),
    ({"workers": 0}, r"--workers must be in 1\.\.1024"),
    ({"workers": 10**6}, r"--workers must be in 1\.\.1024"),
    ({"max_memory": 0}, r"--max-memory must be in 1\.\."),
    ({"max_memory": 2**70}, r"--max-memory must be in 1\.\."),
    ({"tp": True}, r"--tp must be in 1\.\.1024, got True"),
], ids=["pp-negative", "tp-huge", "ep-negative", "world", "workers-0", "workers-huge", "memory-0", "memory-huge",
        "tp-bool"])
def test_numeric_compile_flags_are_bounded_before_any_model_loads(tmp_path: Path, flags: dict[str, Any],
                                                                  message: str) -> None:
    options = _options(tmp_path / "out", **{"tp": 1, **flags})
    with pytest.raises(MoeforgeError, match=message):
        check_flags(options)
    with pytest.raises(MoeforgeError, match=message):
        check_compile(options)
    assert MAX_RANKS == 1024 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flags", "message"), [
    ({"tp": 3}, "does not divide the 4 attention heads"),
    ({"pp": -1}, r"--pp must be in 1\.\.1024"),
    ({"tp": 10**30}, r"--tp must be in 1\.\.1024"),
    ({"pp": 9}, "has 2 decoder layers"),
], ids=["tp-3", "pp-negative", "tp-huge", "pp-9"])
def test_the_plan_refuses_what_the_compile_refuses(tmp_path: Path, flags: dict[str, Any], message: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``--plan --pp -1`` was ``max() arg is an empty sequence``, ``--plan --tp 3`` printed a plan the compile
    refuses, ``--tp 10**30`` blamed the model's intermediate_size: the plan and the compile share ``check_compile``
    (the compile's before its model loads)."""
    config = load_config("tiny-llama")
    with pytest.raises(MoeforgeError, match=message):
        plan_compile("tiny-llama", config, tp=flags.get("tp", 1), pp=flags.get("pp", 1))
    options = _options(tmp_path / "out", **{"tp": 1, "kv_cache": "paged", **flags})
    with pytest.raises(MoeforgeError, match=message):
        check_compile(options)
    _no_model_load(monkeypatch)
    with pytest.raises(MoeforgeError, match=message):
        sharded_compile.compile_sharded(options)
    assert not (tmp_path / "out").exists()


def test_plan_on_the_command_line_refuses_a_bad_split_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "tiny-llama", "--plan", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "does not divide the 4 attention heads" in err and len(err.strip().splitlines()) == 1
    assert main(["compile", "tiny-llama", "--plan", "--tp", "2"]) == 0
    assert capsys.readouterr().out.startswith("plan: tiny-llama")


# ------------------------------------------------------------------------ 4. placement plans
def _write_plan(folder: Path, text: str) -> Path:
    path = folder / "plan.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "message"), [
    (json.dumps(PLAN | {"physical_to_logical": TABLE}).replace('"ep": 2', '"ep": Infinity'), "not valid JSON"),
    (json.dumps(PLAN | {"physical_to_logical": TABLE}).replace('"ep": 2', '"ep": 1e400'), "not valid JSON"),
    (json.dumps(PLAN | {"physical_to_logical": TABLE}).replace('"ep": 2', '"ep": 2.9'), "'ep' must be an integer"),
    (json.dumps(PLAN | {"physical_to_logical": TABLE}).replace('"ep": 2', '"ep": "2"'), "'ep' must be an integer"),
    (json.dumps(PLAN | {"physical_to_logical": TABLE}).replace('"ep": 2', '"ep": true'), "'ep' must be an integer"),
    (json.dumps(PLAN | {"physical_to_logical": [[0, 1, 2, 3], [0, 1]]}), "2-D integer table"),
    (json.dumps(PLAN | {"physical_to_logical": [[0, 1.0]]}), "2-D integer table"),
    (json.dumps(PLAN | {"physical_to_logical": [[0, True]]}), "2-D integer table"),
    (json.dumps(PLAN | {"physical_to_logical": []}), "2-D integer table"),
    (json.dumps(PLAN | {"physical_to_logical": [[0, 1]], "version": True}), "version True is not supported"),
    (BOMB, "nests deeper than"),
], ids=["ep-infinity", "ep-1e400", "ep-2.9", "ep-string", "ep-bool", "ragged", "float-id", "bool-id", "no-layers",
        "version-bool", "nesting-bomb"])
def test_hostile_placement_plans_are_placement_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        load_plan(_write_plan(tmp_path, text))


def test_slots_per_layer_are_bounded_by_the_experts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """4000 slots per layer made a 190 MB tiny artifact: at most MAX_SLOTS_PER_EXPERT x the experts, named."""
    wide = [[slot % 8 for slot in range(4000)]] * 2
    with pytest.raises(PlacementError, match=rf"4000 slots per MoE layer, over the {MAX_SLOTS_PER_EXPERT} x 8"):
        ExpertSlots.from_array(wide, 2).check(2, 8, 2, "tiny-deepseek-v3")
    ExpertSlots.from_array([[slot % 8 for slot in range(4 * 8)]] * 2, 2).check(2, 8, 2, "tiny-deepseek-v3")
    plan = _write_plan(tmp_path, json.dumps(PLAN | {"physical_to_logical": wide}))
    assert main(["compile", "tiny-deepseek-v3", "--plan", "--tp", "2", "--ep", "2", "--placement", str(plan)]) == 2
    assert "4000 slots per MoE layer" in capsys.readouterr().err
    _write_plan(tmp_path, BOMB)
    assert main(["compile", "tiny-deepseek-v3", "--plan", "--tp", "2", "--ep", "2", "--placement", str(plan)]) == 2
    assert "nests deeper than" in capsys.readouterr().err


_JSON = st.recursive(st.none() | st.booleans() | st.integers(min_value=-2**80, max_value=2**80)
                     | st.floats() | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                                  max_size=3),
                     max_leaves=16)
_TABLES = st.lists(st.lists(st.integers(min_value=-3, max_value=12) | _JSON, max_size=12), max_size=4) | _JSON


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ep=_JSON | st.integers(min_value=-2, max_value=12), table=_TABLES, raw=st.none() | st.binary(max_size=40))
def test_fuzzed_placement_plans_are_read_or_refused(tmp_path: Path, ep: Any, table: Any, raw: bytes | None) -> None:
    path = Path(tempfile.mkdtemp(dir=tmp_path)) / "plan.json"
    path.write_bytes(raw if raw is not None else json.dumps(PLAN | {"ep": ep, "physical_to_logical": table}).encode())
    try:
        slots = load_plan(path)
    except PlacementError:
        return
    assert type(slots.ep) is int and 1 <= slots.ep <= len(slots.physical_to_logical[0])
    assert len({len(row) for row in slots.physical_to_logical}) == 1
    assert all(type(v) is int and v >= -1 for row in slots.physical_to_logical for v in row)
    try:
        slots.check(2, 8, 2, "tiny-deepseek-v3")
    except PlacementError:
        pass


# ------------------------------------------------------------------------ 5. sharded.json
def _sharded(tp: int = 2) -> dict[str, Any]:
    ranks = [{"rank": r, "dir": f"rank{r}", "manifest_sha256": "0" * 64} for r in range(tp)]
    return ShardedManifest(tp=tp, ep=tp, model_config={"name": "x"}, ranks=ranks).to_dict()


def test_hostile_sharded_json_is_an_artifact_error(tmp_path: Path) -> None:
    art = tmp_path / "art"
    art.mkdir()
    (art / SHARDED_FILE).write_text(BOMB)
    with pytest.raises(ArtifactError, match="nests deeper than"):
        read_sharded(art)
    with pytest.raises(ArtifactError, match="not a moeforge sharded manifest"):
        check_output_dir(art, force=True)
    with pytest.raises(ArtifactError, match="nests deeper than"):
        artifact_model_config(art)
    for field, value in (("tp", 2.9), ("tp", "2"), ("ep", True), ("world_size", 2.0), ("ranks", {"0": 1}),
                         ("model_config", [["a", 1]]),
                         ("placement", {"physical_to_logical": [[0, 1], [0]]})):
        (art / SHARDED_FILE).write_text(json.dumps(_sharded() | {field: value}))
        with pytest.raises(ArtifactError, match="is malformed"):
            read_sharded(art)
    (art / SHARDED_FILE).write_text(json.dumps(_sharded()))
    assert read_sharded(art).world_size == 2


_FIELDS = ["tp", "ep", "pp", "world_size", "ranks", "stages", "placement", "model_config", "compile_id", "format",
           "format_version", "collectives"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(_FIELDS), value=_JSON, rank_field=st.sampled_from(["rank", "dir", "manifest_sha256"]),
       in_rank=st.booleans(), raw=st.none() | st.binary(max_size=40))
def test_fuzzed_sharded_json_is_read_or_refused(tmp_path: Path, field: str, value: Any, rank_field: str,
                                                in_rank: bool, raw: bytes | None) -> None:
    art = Path(tempfile.mkdtemp(dir=tmp_path))
    data = _sharded()
    if in_rank:
        data["ranks"][1][rank_field] = value
    else:
        data[field] = value
    (art / SHARDED_FILE).write_bytes(raw if raw is not None else json.dumps(data).encode())
    try:
        sharded = read_sharded(art)
    except ArtifactError:
        return
    assert type(sharded.tp) is int and len(sharded.ranks) == sharded.world_size
    sharded.expert_slots()  # a placement that was read is one ExpertSlots takes


# ------------------------------------------------------------------------ 6. advice that holds
def test_an_existing_folder_that_is_no_artifact_is_not_advised_force(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``-o`` an existing folder that is not an artifact said "pass --force", which --force then refused: it now
    says what works (remove it yourself, or another directory) without --force too."""
    user = _user_folder(tmp_path)
    before = _snapshot(tmp_path)
    for force in (False, True):
        with pytest.raises(ArtifactError, match="remove it yourself or choose another output path") as info:
            check_output_dir(user, force=force)
        assert "pass --force" not in str(info.value)
    assert main(["compile", "tiny-llama", "-o", str(user), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "pass --force" not in err and "choose another output path" in err
    assert main(["compile", "tiny-llama", "-o", str(user / "thesis.tex"), "--quiet"]) == 2
    assert "pass --force" not in capsys.readouterr().err
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-seq-len", "1"], r"--max-seq-len must be >= 2"),
    (["--kv-cache", "paged", "--kv-block-size", "0"], r"--kv-block-size must be >= 1"),
    (["--pp-layers", "0-1"], r"--pp-layers splits the layers into pipeline stages"),
], ids=["max-seq-len-1", "block-size-0", "pp-layers-without-pp"])
def test_plan_on_the_command_line_refuses_the_compiles_option_checks(argv: list[str], message: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``--plan`` printed a plan for options the compile refuses (the options every target shares): both run
    ``plan.check_options`` now."""
    assert main(["compile", "tiny-llama", "--plan", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)
