"""``moeforge run --json-schema FILE``: the output validates against the schema; a bad file is refused naming it."""

import json
import os

import jsonschema
import pytest

from moeforge.cli import main
from moeforge.compile.driver import CompileOptions, compile_model

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6}, "n": {"enum": [1, 2, 3]}},
          "required": ["word", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("run-schema") / "tiny-llama"
    return compile_model(CompileOptions(model="tiny-llama", output_dir=out, max_seq_len=128, progress=False)).output_dir


def test_run_with_a_json_schema_prints_valid_json(capsys, tmp_path, tiny):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    for seed in ("1", "2"):
        code = main(["run", str(tiny), "--prompt", "hello", "--max-new-tokens", "60", "--temperature", "1",
                     "--seed", seed, "--json-schema", str(schema), "--json", "--quiet"])
        out = capsys.readouterr()
        assert code == 0, out.err
        jsonschema.validate(json.loads(json.loads(out.out)["text"]), SCHEMA)


@pytest.mark.parametrize(("content", "reason"), [
    (None, "does not exist"), ("fifo", "not a regular file"), ("{bad", "not valid JSON"),
    ('"a string"', "must be a JSON object"),
])
def test_a_bad_schema_file_is_refused_before_loading(capsys, tmp_path, tiny, content, reason):
    schema = tmp_path / "schema.json"
    if content == "fifo":  # a FIFO would block a plain read: refused without opening it for a blocking read
        os.mkfifo(schema)
    elif content is not None:
        schema.write_text(content)
    code = main(["run", str(tiny), "--prompt", "hello", "--json-schema", str(schema), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and reason in err and "--json-schema" in err, err


def test_an_invalid_schema_is_refused_with_the_libraries_reason(capsys, tmp_path, tiny):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "objec"}')
    code = main(["run", str(tiny), "--prompt", "hello", "--json-schema", str(schema), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "objec" in err, err
