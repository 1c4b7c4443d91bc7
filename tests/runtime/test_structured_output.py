"""Constrained decoding (runtime/grammar.py): the sampler's per-row masks, and engine outputs that always match.

tiny-llama has random weights: left alone it writes arbitrary bytes, so every answer that validates is the
constraint's doing. Its byte-level tokenizer also exercises multi-byte characters split over tokens.
"""

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from moeforge.compile.driver import CompileOptions, compile_model
from moeforge.model.tokenizer import Tokenizer
from moeforge.runtime.engine import CacheOptions, EngineConfig, LLMEngine, SchedulingOptions
from moeforge.runtime.grammar import GrammarCompiler, bitmask_words, unpack_bitmask
from moeforge.runtime.sampler import Sampler, SamplingParams, apply_token_bitmask
from moeforge.runtime.structured_output import StructuredOutput, StructuredOutputError, closed_objects

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("structured") / "tiny-llama"
    return compile_model(CompileOptions(model="tiny-llama", output_dir=out, max_seq_len=128, progress=False)).output_dir


def _bitmask(allowed: list[list[int]] | list[None], vocab: int) -> np.ndarray:
    mask = np.full((len(allowed), bitmask_words(vocab)), -1, np.int32)
    for row, ids in enumerate(allowed):
        if ids is not None:
            bits = np.zeros(bitmask_words(vocab) * 32, np.uint8)
            bits[ids] = 1
            mask[row] = np.packbits(bits, bitorder="little").view(np.int32)
    return mask


def test_the_sampler_masks_constrained_rows_and_leaves_the_others():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 70)).astype(np.float32)
    allowed = [[3, 65], None, [69], None]
    mask = _bitmask(allowed, 70)
    assert unpack_bitmask(mask[0], 70).nonzero()[0].tolist() == [3, 65]
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=1.0, seed=2)]
    out = Sampler().sample(logits, params, [p.make_generator() for p in params], [[]] * 4, [[1]] * 4, mask)
    tokens = out.token_ids.tolist()
    assert tokens[0] == (3 if logits[0, 3] > logits[0, 65] else 65)
    assert tokens[1] == int(logits[1].argmax())  # unconstrained greedy row: untouched
    assert tokens[2] == 69
    free = Sampler().sample(logits[3:], params[3:], [params[3].make_generator()], [[]], [[1]])
    assert tokens[3] == int(free.token_ids[0])  # unconstrained sampled row: the same draw as without masks
    masked = apply_token_bitmask(logits, mask)
    assert np.isneginf(masked[0, [0, 1, 2, 4]]).all() and masked[0, 3] == logits[0, 3]
    assert apply_token_bitmask(logits, _bitmask([None] * 4, 70)) is logits  # nothing constrained: no copy
    with pytest.raises(ValueError, match="allow no token"):
        apply_token_bitmask(logits[:1], _bitmask([[]], 70))


def test_logprobs_stay_those_of_the_raw_distribution():
    logits = np.array([[0.0, 2.0, 1.0, -1.0]], np.float32)
    params = [SamplingParams(logprobs=1)]
    out = Sampler().sample(logits, params, [None], [[]], [[0]], _bitmask([[2]], 4))
    raw = logits[0] - np.log(np.exp(logits[0]).sum())
    assert out.token_ids.tolist() == [2]
    assert out.logprobs[0] == pytest.approx(raw[2], abs=1e-6)
    assert out.top_logprobs[0][0][0] == 1  # the model's favourite, though masked out


def test_50_seeded_prompts_validate_with_batching_and_preemption(tiny):
    spec = StructuredOutput.json_schema(SCHEMA)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 256, size=8 + i % 13)] for i in range(50)]
    engine = LLMEngine.from_artifact(tiny, EngineConfig(
        scheduling=SchedulingOptions(max_num_seqs=16, max_num_batched_tokens=64), cache=CacheOptions(kv_blocks=12)))
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_output=spec) for i in range(40)]
    params += [SamplingParams(max_tokens=100, structured_output=spec) for _ in range(5)]  # greedy
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=20) for i in range(5)]  # free, batched alongside
    outputs = engine.generate(prompts, params)
    assert engine.metrics.preemptions > 0
    for out in outputs[:45]:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert all(out.error is None and out.token_ids for out in outputs[45:])
    assert not engine.requests and engine.kv.stats().blocks_in_use == 0


def test_json_object_regex_and_grammar(tiny):
    engine = LLMEngine.from_artifact(tiny, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4)))
    specs = [StructuredOutput.regex(r"[0-9]{3}-[a-z]{2}"),
             StructuredOutput.grammar('start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'),
             StructuredOutput.grammar('root ::= "A" [bc]{2}', syntax="gbnf"),
             StructuredOutput.json_schema({"type": "array", "items": {"type": "integer"}, "minItems": 2,
                                           "maxItems": 2})]
    outs = engine.generate([[1, 2, 3]] * 4, [SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                                                            structured_output=s) for s in specs])
    texts = [o.text for o in outs]
    assert all(o.finish_reason == "stop" for o in outs), outs
    assert len(texts[0]) == 6 and texts[0][3] == "-" and texts[0][:3].isdigit()
    assert texts[1] in ("yes", "no") or (texts[1].startswith("maybe ") and texts[1][-1].isdigit())
    assert texts[2][0] == "A" and set(texts[2][1:]) <= {"b", "c"} and len(texts[2]) == 3
    assert len(json.loads(texts[3])) == 2


@pytest.mark.parametrize(("spec", "reason"), [
    (StructuredOutput.json_schema('{"type": "objec"}'), "objec"),
    (StructuredOutput.json_schema("[1, 2]"), "must be a JSON object"),
    (StructuredOutput.json_schema("{not json"), "not valid JSON"),
    (StructuredOutput.json_schema({"type": "string", "pattern": "x" * 70_000}), "limit"),
    (StructuredOutput.regex("(unclosed"), "regex"),
    (StructuredOutput.grammar("start: undefined_rule"), "undefined_rule"),
])
def test_a_bad_spec_is_refused_naming_why_and_nothing_is_queued(tiny, spec, reason):
    engine = LLMEngine.from_artifact(tiny, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=2)))
    with pytest.raises(StructuredOutputError, match=reason) as refused:
        engine.add_request([1, 2, 3], SamplingParams(structured_output=spec))
    assert refused.value.param == "response_format"
    assert not engine.requests
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0]  # the engine still serves
    assert out.error is None and len(out.token_ids) == 2


def test_objects_that_list_properties_take_no_others_unless_they_say_so():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "free": {"type": "object", "additionalProperties": True},
                                               "any": {"anyOf": [{"properties": {"c": {}}}, {"type": "null"}]},
                                               "both": {"allOf": [{"properties": {"d": {}}},
                                                                  {"properties": {"e": {}}}]}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["free"]["additionalProperties"] is True
    assert closed["properties"]["any"]["anyOf"][0]["additionalProperties"] is False
    assert all("additionalProperties" not in part for part in closed["properties"]["both"]["allOf"])
    assert "additionalProperties" not in schema  # a copy


def test_a_schema_left_open_is_closed_in_the_output(tiny):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    engine = LLMEngine.from_artifact(tiny, EngineConfig(scheduling=SchedulingOptions(max_num_seqs=4)))
    outs = engine.generate([[5, 6, 7]] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=40,
                                                            structured_output=StructuredOutput.json_schema(schema))
                                             for s in range(4)])
    assert all(o.finish_reason == "stop" and set(json.loads(o.text)) == {"n"} for o in outs), outs


def test_a_matcher_in_error_allows_only_end_of_sequence():
    tokenizer = Tokenizer.byte_level(260, bos_id=256, eos_id=257)
    state = GrammarCompiler(tokenizer, 260).new_state(StructuredOutput.regex("ab"))
    first = np.zeros(bitmask_words(260), np.int32)
    state.fill(first)
    assert unpack_bitmask(first, 260).nonzero()[0].tolist() == [ord("a")]
    assert state.accept([ord("a")]) and not state.is_finished
    assert not state.accept([ord("z")])  # outside the mask: a bug elsewhere, never a crash
    assert state.error
    row = np.zeros(bitmask_words(260), np.int32)
    state.fill(row)
    assert unpack_bitmask(row, 260).nonzero()[0].tolist() == [257]
    done = GrammarCompiler(tokenizer, 260).new_state(StructuredOutput.regex("ab"))
    assert done.accept([ord("a"), ord("b")]) and done.is_finished
