"""specloop.client.AsyncClient against a real server process (tiny checkpoint, CPU)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import httpx
import pytest

from server.testing import ServerProcess
from specloop.client import (
    APIConnectionError, APITimeoutError, AsyncClient, BadRequestError, NotFoundError, ServiceUnavailableError,
    StreamError,
)
from specloop.protocol import ChatCompletion, ChatCompletionChunk, Completion, ModelList

GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
LONG = {"prompt": list(range(10, 20)), "max_tokens": 1900, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    srv = ServerProcess(["--model", str(tiny_ckpt), "--served-model-name", "tiny", "--device", "cpu",
                         "--max-num-seqs", "1", "--max-waiting-requests", "1", "--log-level", "warning"],
                        env={"OMP_NUM_THREADS": "1"})
    srv.start()
    yield srv
    assert srv.stop() == 0, srv.output


async def test_completions_plain_and_streamed(server):
    async with AsyncClient(server.url + "/v1") as client:
        models = await client.models()
        assert isinstance(models, ModelList) and models.data[0].id == "tiny"
        done = await client.completions([5, 6, 7], model="tiny", **GREEDY)
        assert isinstance(done, Completion)
        assert done.choices[0].finish_reason == "length" and len(done.choices[0].token_ids) == 6
        assert done.usage.completion_tokens == 6
        stream = await client.completions([5, 6, 7], stream=True, stream_options={"include_usage": True}, **GREEDY)
        chunks = [chunk async for chunk in stream]
        assert all(isinstance(c, Completion) for c in chunks)
        assert [t for c in chunks for ch in c.choices for t in ch.token_ids] == done.choices[0].token_ids
        assert "".join(ch.text for c in chunks for ch in c.choices) == done.choices[0].text
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 9


async def test_chat_plain_and_streamed(server):
    messages = [{"role": "user", "content": "hi"}]
    async with AsyncClient(server.url) as client:
        done = await client.chat(messages, **GREEDY)
        assert isinstance(done, ChatCompletion) and done.choices[0].message.role == "assistant"
        async with await client.chat(messages, stream=True, **GREEDY) as stream:
            chunks = [chunk async for chunk in stream]
        assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content for c in chunks if isinstance(c.choices[0].delta.content, str))
        assert text == done.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == "length"


async def test_typed_errors_carry_the_envelope(server):
    async with AsyncClient(server.url) as client:
        with pytest.raises(BadRequestError) as bad:
            await client.completions("x", max_tokens=-1)
        assert bad.value.status == 400 and bad.value.param == "max_tokens" and "max_tokens" in bad.value.message
        with pytest.raises(BadRequestError) as bad_stream:
            await client.chat([{"role": "user", "content": "x"}], stream=True, temperature=-1)
        assert bad_stream.value.param == "temperature"
        with pytest.raises(NotFoundError) as missing:
            await client.completions("x", model="nope")
        assert missing.value.code == "model_not_found" and missing.value.param == "model"


async def test_timeout_raises_and_the_server_frees_the_request(server):
    async with AsyncClient(server.url, timeout=0.3, max_retries=0) as client:
        with pytest.raises(APITimeoutError):
            await client.completions(LONG["prompt"], max_tokens=1900, ignore_eos=True)
    await wait_idle(server)


async def test_retry_on_503_until_the_queue_frees(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as raw, AsyncExitStack() as stack:
        keep = [await open_stream(raw, stack)]  # running
        keep.append(asyncio.create_task(open_stream(raw, stack)))  # waiting: the queue is full
        await wait_for_waiting(raw, 1)
        async with AsyncClient(server.url, max_retries=0) as impatient:
            with pytest.raises(ServiceUnavailableError) as full:
                await impatient.completions("x", max_tokens=2)
        assert full.value.status == 503 and full.value.code == "queue_full"

        async def release_later():
            await asyncio.sleep(0.3)
            keep[1].cancel()
            await asyncio.gather(keep[1], return_exceptions=True)
            await stack.aclose()

        async with AsyncClient(server.url, max_retries=5, backoff=0.05) as patient:
            release = asyncio.create_task(release_later())
            done = await patient.completions([5, 6], max_tokens=2, ignore_eos=True)
            await release
        assert done.choices[0].finish_reason == "length"
        errors = (await raw.get("/metrics")).text
        assert 'specloop_request_errors_total{status="503"} 2.0' in errors  # one refusal each


async def test_stream_error_event_and_unreachable_server():
    body = (b'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":'
            b'[{"index":0,"text":"a","finish_reason":null}]}\n\n'
            b'data: {"error":{"message":"the engine stopped","type":"server_error","param":null,'
            b'"code":"engine_dead"}}\n\ndata: [DONE]\n\n')

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    mock = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://mock")
    async with AsyncClient(http=mock) as client:
        stream = await client.completions("x", stream=True)
        seen = []
        with pytest.raises(StreamError) as failed:
            async for chunk in stream:
                seen.append(chunk.choices[0].text)
        assert seen == ["a"] and failed.value.code == "engine_dead"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once the socket closes
    async with AsyncClient(f"http://127.0.0.1:{port}", max_retries=1, backoff=0.01) as client:
        with pytest.raises(APIConnectionError):
            await client.completions("x")
        assert not await client.health()


async def open_stream(client: httpx.AsyncClient, stack: AsyncExitStack) -> AsyncIterator[str]:
    response = await stack.enter_async_context(client.stream("POST", "/v1/completions", json=LONG))
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: "):
            return lines  # keep it: a collected iterator closes the connection
    raise AssertionError("no event")


async def wait_for_waiting(client: httpx.AsyncClient, waiting: int) -> None:
    for _ in range(400):
        if f"specloop_num_requests_waiting {waiting}.0" in (await client.get("/metrics")).text:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"the queue never held {waiting}")


async def wait_idle(server: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=server.url) as client:
        for _ in range(400):
            text = (await client.get("/metrics")).text
            if "specloop_num_requests_running 0.0" in text and "specloop_kv_cache_used_bytes 0.0" in text:
                return
            await asyncio.sleep(0.025)
    raise AssertionError("the server never went idle")


async def test_api_key_and_body_limit_errors_are_typed(tiny_ckpt):
    """401 and 413 come back as their own types, in process (no second server needed)."""
    from server.app import create_app
    from specloop.client import AuthenticationError, RequestTooLargeError
    from specloop.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_options(str(tiny_ckpt), device="cpu")
    app = create_app(engine, "tiny", api_key="k", max_body_bytes=1024)
    try:
        def client(key):
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
            return AsyncClient("http://test/v1", http=http, max_retries=0)

        async with client(None) as anonymous:
            with pytest.raises(AuthenticationError) as info:
                await anonymous.models()
            assert info.value.status == 401 and info.value.code == "invalid_api_key"
        async with client("k") as authorised:
            assert (await authorised.models()).data[0].id == "tiny"
            with pytest.raises(RequestTooLargeError) as too_large:
                await authorised.completions("x" * 2048, max_tokens=1)
            assert too_large.value.status == 413
    finally:
        await engine.shutdown()
