"""The server through the real ``openai`` client: what it returns equals ``LLMEngine`` run directly."""

from __future__ import annotations

import httpx
import openai
import pytest

from moeforge.model.tokenizer import Tokenizer
from moeforge.runtime.engine import LLMEngine, RequestOutput
from moeforge.runtime.sampler import SamplingParams

API_KEY = "test-key"
MODEL = "tiny-llama"
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPT_IDS = [5, 17, 99, 3, 250, 42, 7]


@pytest.fixture(scope="module")
def client(shared_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_server + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def solo(engine: LLMEngine, prompt: list[int] | str, **params: object) -> RequestOutput:
    (out,) = engine.generate([prompt], SamplingParams(**params))  # type: ignore[arg-type]
    return out


def chat_prompt(engine: LLMEngine, content: str) -> list[int]:
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    templated = Tokenizer(tokenizer.backend, bos_token_id=tokenizer.bos_token_id,
                          eos_token_ids=tokenizer.eos_token_ids, chat_template=TEMPLATE, add_bos=tokenizer.add_bos)
    # Chat prompts get no BOS beyond what the template writes (transformers' tokenize=True, vLLM's default).
    return tokenizer.encode(templated.apply_chat_template([{"role": "user", "content": content}]), add_bos=False)


def test_models_and_health(client: openai.OpenAI, shared_server: str) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL and model.model_extra == {"max_model_len": 128}
    assert httpx.get(shared_server + "/health").json() == {"status": "ok"}


def test_completion_greedy_equals_the_engine_with_logprobs(client: openai.OpenAI, reference: LLMEngine) -> None:
    want = solo(reference, PROMPT_IDS, max_tokens=24, logprobs=3, ignore_eos=True)
    got = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=24, temperature=0, logprobs=3,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    (choice,) = got.choices
    assert choice.model_extra["token_ids"] == want.token_ids
    assert choice.text == want.text and choice.finish_reason == "length"
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-6)
    tokenizer = reference.tokenizer
    assert tokenizer is not None
    assert choice.logprobs.top_logprobs == [
        pytest.approx({tokenizer.decode([t]): lp for t, lp in top}, abs=1e-6) for top in want.top_logprobs]
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(PROMPT_IDS), 24)


def test_completion_stream_equals_the_engine(client: openai.OpenAI, reference: LLMEngine) -> None:
    want = solo(reference, "The capital of France is", max_tokens=30)
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=30,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    ids = [t for c in chunks for choice in c.choices for t in choice.model_extra["token_ids"]]
    assert ids == want.token_ids
    assert "".join(choice.text for c in chunks for choice in c.choices) == want.text
    assert [choice.finish_reason for c in chunks for choice in c.choices][-1] == want.finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_equals_the_engine_streamed_or_not(client: openai.OpenAI, reference: LLMEngine) -> None:
    prompt = chat_prompt(reference, "Hello there")
    want = solo(reference, prompt, max_tokens=20, logprobs=2)
    messages = [{"role": "user", "content": "Hello there"}]
    got = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                         max_tokens=20, temperature=0, logprobs=True, top_logprobs=2)
    (choice,) = got.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(want.logprobs, abs=1e-6)
    assert [len(e.top_logprobs) for e in choice.logprobs.content] == [2] * len(want.token_ids)
    assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == len(want.token_ids)

    stream = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_n_seed_and_stop(client: openai.OpenAI, reference: LLMEngine) -> None:
    # n choices: choice i samples with seed + i, so choice 0 is the single request with that seed.
    got = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=12, temperature=0.8, seed=11, n=3,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2]
    for i, choice in enumerate(got.choices):
        want = solo(reference, PROMPT_IDS, max_tokens=12, temperature=0.8, seed=11 + i, ignore_eos=True)
        assert choice.model_extra["token_ids"] == want.token_ids
    # A stop string ends the text before it.
    full = solo(reference, "abc", max_tokens=30, ignore_eos=True).text
    assert full
    # A printable ASCII character of the second half: stable text (not half of a multi-byte character).
    stop = next(ch for ch in full[len(full) // 2:] if ch.isascii() and ch.isprintable())
    got = client.completions.create(model=MODEL, prompt="abc", max_tokens=30, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == full[:full.index(stop)] and got.choices[0].finish_reason == "stop"


def test_errors_have_the_openai_shape(client: openai.OpenAI, shared_server: str) -> None:
    with pytest.raises(openai.BadRequestError) as oversize:  # prompt + max_tokens > max_seq_len: never fits
        client.completions.create(model=MODEL, prompt=[1] * 100, max_tokens=100)
    assert "max_seq_len 128" in oversize.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=4, top_p=0)
    assert bad.value.body["param"] == "top_p"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as invalid:  # a validation error: 400, not FastAPI's 422
        client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=-1)
    assert invalid.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=[1, 2], max_tokens=4)
    response = httpx.post(shared_server + "/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 2})
    assert response.status_code == 401
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=shared_server + "/v1", api_key="wrong", max_retries=0).models.list()


def test_hostile_fields_are_400s_and_counted(shared_server: str) -> None:
    # Found by an audit: each of these was a 500, a silent coercion, or a failure of every request in the step.
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    def post(body: str) -> httpx.Response:
        return httpx.post(shared_server + "/v1/completions", content=body, headers=headers, timeout=60)

    def rejected_invalid() -> float:
        for line in httpx.get(shared_server + "/metrics").text.splitlines():
            if line.startswith("moeforge:request_rejected_total") and 'reason="invalid"' in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no request_rejected_total{reason=invalid} series")

    before = rejected_invalid()
    lone_surrogate = post(f'{{"model": "{MODEL}", "prompt": "hi \\ud800", "max_tokens": 2}}')
    assert lone_surrogate.status_code == 400 and "not valid Unicode" in lone_surrogate.json()["error"]["message"]
    for field, value in (("top_k", -5), ("top_k", 2**70), ("seed", -1), ("seed", 2**64)):
        response = post(f'{{"model": "{MODEL}", "prompt": [1, 2], "max_tokens": 2, "temperature": 1, '
                        f'"{field}": {value}}}')
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, value)
    assert rejected_invalid() == before + 5  # validation 400s count as refusals too
    # the RFC's case-insensitive scheme
    lower = httpx.get(shared_server + "/v1/models", headers={"Authorization": f"bearer {API_KEY}"})
    assert lower.status_code == 200


def test_a_request_larger_than_the_server_is_a_400_not_a_429(start_server) -> None:
    with start_server(max_num_seqs=2, max_queued=1) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as too_big:  # 4 engine requests; the server holds 3
            client.completions.create(model=MODEL, prompt=[[1, 2], [3, 4]], n=2, max_tokens=2)
        assert "split it" in too_big.value.body["message"]  # type: ignore[index]
        fits = client.completions.create(model=MODEL, prompt=[[1, 2], [3, 4]], n=1, max_tokens=2)
        assert len(fits.choices) == 2
