"""What waits for a slow HTTP client is bounded: unread outputs of a choice merge into one (its newest, with the new
ids and text joined), and a client that reads nothing while its requests keep producing is aborted after the stall
timeout (its KV blocks freed); a server whose client does not read its stream neither grows nor keeps the request."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from moeforge.runtime.outputs import RequestOutput
from moeforge.serve.streams import Admission, ChoiceStream

from .conftest import MODEL


class FakeLoop:
    """The EngineLoop surface ChoiceStream uses: submit returns ids at once; aborts are recorded."""

    def __init__(self) -> None:
        self.aborted: list[int] = []

    def submit(self, prompts, sink, arrival):  # type: ignore[no-untyped-def]
        from concurrent.futures import Future

        self.sink = sink
        future: Future[list[int]] = Future()
        future.set_result(list(range(len(prompts))))
        return future

    def abort(self, request_ids):  # type: ignore[no-untyped-def]
        self.aborted += list(request_ids)


def _output(i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(0, list(range(i + 1)), [i], finished, "length" if finished else None,
                         text="".join(chr(97 + k % 26) for k in range(i + 1)), text_delta=chr(97 + i % 26))


def test_unread_outputs_merge_into_one_per_choice():
    async def run() -> None:
        loop = FakeLoop()
        stream = ChoiceStream(loop, Admission(8), 1, stall_timeout_s=60)  # type: ignore[arg-type]
        await stream.submit([([1], None)], 0.0)  # type: ignore[list-item]
        for i in range(1000):  # the handler reads nothing meanwhile
            stream._offer(0, _output(i, finished=i == 999))
        assert len(stream._pending) == 1  # one output waits, not 1000
        index, out = await stream.next()
        assert index == 0 and out.finished and out.token_ids == list(range(1000))
        assert out.new_token_ids == list(range(1000)) and out.text_delta == out.text  # nothing lost in the merge
        assert stream.done and not stream.stalled and loop.aborted == []

    asyncio.run(run())


def test_a_client_that_reads_nothing_is_aborted_after_the_stall_timeout():
    async def run() -> None:
        loop = FakeLoop()
        stream = ChoiceStream(loop, Admission(8), 2, stall_timeout_s=0.05)  # type: ignore[arg-type]
        await stream.submit([([1], None), ([2], None)], 0.0)  # type: ignore[list-item]
        stream._offer(0, _output(0))
        stream._offer(0, _output(1))  # unread, but within the timeout
        assert loop.aborted == []
        await asyncio.sleep(0.1)
        stream._offer(0, _output(2))  # still unread past the timeout: both choices are aborted
        assert stream.stalled and loop.aborted == [0, 1]

    asyncio.run(run())


def test_a_stream_nobody_reads_is_aborted_and_the_server_stays_small(start_server):
    """The app itself, called with a client whose socket never drains (its ``send`` of the first body chunk never
    returns): the handler cannot send, the engine keeps producing, and after the stall timeout the request's 8
    choices are aborted (slots and blocks freed) instead of being buffered to the end."""
    with start_server(max_num_seqs=8, stall_timeout_s=0.3, delay=0.01) as (url, app):
        body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 120, "stream": True, "logprobs": 5,
                           "ignore_eos": True, "n": 8}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}

        async def client() -> None:
            sent = asyncio.Event()
            messages = iter([{"type": "http.request", "body": body, "more_body": False}])

            async def receive() -> dict[str, object]:
                message = next(messages, None)
                if message is None:
                    await asyncio.Event().wait()  # no disconnect either: the client just never reads
                return message  # type: ignore[return-value]

            async def send(message: dict[str, object]) -> None:
                if message["type"] == "http.response.body":
                    sent.set()
                    await asyncio.Event().wait()  # the socket never drains

            task = asyncio.create_task(app(scope, receive, send))
            await asyncio.wait_for(sent.wait(), 30)
            admission, deadline = app.state.server.admission, time.monotonic() + 60
            while admission.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert admission.in_flight == 0  # every choice ended while the handler could not send
            task.cancel()

        asyncio.run(client())
        success = [line for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
                   if line.startswith("moeforge:request_success_total{")]
        assert any('finished_reason="abort"' in line and line.endswith(" 8.0") for line in success), success
        ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200  # the server still serves
