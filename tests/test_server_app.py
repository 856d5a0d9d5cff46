"""The app in-process (ASGI transport, which buffers streams): failures the real-process
tests cannot provoke, a failure after streaming began and a dead engine, and the mapping
of msgspec errors to the field named in `param`."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest

from server.app import create_app
from server.errors import from_decode
from specloop.engine.async_engine import AsyncEngine, EngineDeadError
from specloop.protocol import ChatCompletionRequest, CompletionRequest

BODY = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture()
async def engine(tiny_ckpt):
    eng = AsyncEngine.from_options(str(tiny_ckpt), device="cpu")
    yield eng
    await eng.shutdown()


def client_for(engine: AsyncEngine) -> httpx.AsyncClient:
    app = create_app(engine, "tiny")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def events_of(text: str) -> list:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


async def test_failure_after_streaming_began_sends_error_event_then_done(engine, monkeypatch):
    real = engine.add

    class FailsAfterTwo:
        """An accepted request's stream that dies after two outputs."""

        def __init__(self, stream):
            self.stream, self.count = stream, 0

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.count == 2:
                raise EngineDeadError("the engine stopped: injected failure")
            self.count += 1
            return await self.stream.__anext__()

        def abort(self):
            self.stream.abort()

    async def add(prompt, params, request_id=None):
        return FailsAfterTwo(await real(prompt, params, request_id=request_id))

    monkeypatch.setattr(engine, "add", add)
    async with client_for(engine) as client:
        reply = await client.post("/v1/completions", json={**BODY, "stream": True, "return_token_ids": True})
        assert reply.status_code == 200
        events = events_of(reply.text)
        assert [len(e["choices"][0]["token_ids"]) for e in events[:2]] == [1, 1]
        assert events[2]["error"]["code"] == "engine_dead"
        assert "injected failure" in events[2]["error"]["message"]
        assert events[3:] == ["[DONE]"]
        plain = await client.post("/v1/completions", json=BODY)
        assert plain.status_code == 503 and plain.json()["error"]["code"] == "engine_dead"


async def test_dead_engine_turns_health_and_requests_503(engine):
    async with client_for(engine) as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.head("/health")).status_code == 200  # probes that send HEAD get GET's answer
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        engine.error = RuntimeError("boom")  # what the engine thread records when it dies
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert (await client.head("/health")).status_code == 503
        for path, body in (("/v1/completions", BODY),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            reply = await client.post(path, json=body)
            assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"
        assert "specloop_engine_alive 0.0" in (await client.get("/metrics")).text
        engine.error = None


async def test_two_apps_in_one_process_have_their_own_metrics(engine):
    async with client_for(engine) as first, client_for(engine) as second:
        await first.post("/v1/completions", json=BODY)
        assert "specloop_generation_tokens_total 6.0" in (await first.get("/metrics")).text
        assert "specloop_generation_tokens_total 0.0" in (await second.get("/metrics")).text


async def test_chat_logprobs_and_streamed_batch_prompts(engine):
    async with client_for(engine) as client:
        chat = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logprobs": True})
        content = chat.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 3 and all(c["logprob"] <= 0 and c["top_logprobs"] == [] for c in content)
        reply = await client.post("/v1/completions", json={
            "prompt": ["ab", "cde"], "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}})
        events = events_of(reply.text)
        assert events[-1] == "[DONE]" and events[-2]["usage"] == {
            "prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
        for index in (0, 1):
            mine = [c["choices"][0] for c in events[:-2] if c["choices"][0]["index"] == index]
            assert sum(len(c["token_ids"]) for c in mine) == 3 and mine[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("body,kind,param", [
    (b'{"prompt": "x", "max_tokens": "5"}', CompletionRequest, "max_tokens"),
    (b'{"max_tokens": 5}', CompletionRequest, "prompt"),
    (b'{"messages": [{"role": "user"}, {"content": "x"}]}', ChatCompletionRequest, "messages[1].role"),
    (b'{"messages": [{"role": "user", "content": [{"type": 1}]}]}', ChatCompletionRequest,
     "messages[0].content[0].type"),
    (b'{"prompt": "x", "stream_options": {"include_usage": "yes"}}', CompletionRequest,
     "stream_options.include_usage"),
    (b'"just a string"', CompletionRequest, None),
    (b'{"prompt": ', CompletionRequest, None),
])
def test_decode_errors_name_the_field(body, kind, param):
    with pytest.raises(msgspec.MsgspecError) as info:
        msgspec.json.decode(body, type=kind)
    error = from_decode(info.value)
    assert error.status == 400 and error.param == param
    if param is not None:
        assert repr(param) in error.message
