"""The HTTP server as a real uvicorn process on 127.0.0.1 (one per module), tiny checkpoint, CPU.

Greedy outputs are compared with solo runs of `specloop.LLM` in float64, where batching
cannot change an argmax.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
import torch

from server.testing import ServerProcess
from specloop.sampling_params import SamplingParams
from specloop.llm import LLM

MAX_MODEL_LEN = 1024
NAME = "tiny-test"


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    srv = ServerProcess(["--model", str(tiny_ckpt), "--served-model-name", NAME, "--device", "cpu",
                         "--dtype", "float64", "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning"],
                        env={"OMP_NUM_THREADS": "1"})  # the tiny model gains nothing from threads
    srv.start()
    yield srv
    assert srv.stop() == 0, srv.output


@pytest.fixture(scope="module")
def solo(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cpu", dtype="float64")

    def run(prompt, max_tokens=8, **kw):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny shapes: threads only contend with the server process
        try:
            return llm.generate([prompt], params)[0]
        finally:
            torch.set_num_threads(threads)

    return run


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


async def stream_events(client: httpx.AsyncClient, path: str, body: dict) -> list:
    """Every `data:` payload of a stream, JSON-decoded, with '[DONE]' kept as a string."""
    events = []
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric(text: str, name: str, labels: str = "", default: float | None = None) -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    if match is None and default is not None:
        return default
    assert match, f"{name}{labels} missing from /metrics"
    return float(match.group(1))


def test_models_and_health(server, tiny_ckpt):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list"
    [card] = models["data"]
    assert card["id"] == NAME and card["root"] == NAME and card["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url + "/health").status_code == 200
    assert f"serving model {NAME!r}" in server.output


async def test_32_concurrent_streams_match_solo_greedy(server, solo):
    distinct = [[10 + i, 20 + (7 * i) % 200, 30 + i] * (1 + i % 5) for i in range(8)]
    prompts = [distinct[i % 8] for i in range(32)]  # 32 clients; 8 solo runs to compare with
    body = {"model": NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        results = await asyncio.gather(*(stream_events(client, "/v1/completions", {**body, "prompt": p})
                                         for p in prompts))
    expectations = [solo(p) for p in distinct]
    for i, (prompt, events) in enumerate(zip(prompts, results)):
        expected = expectations[i % 8]
        assert events[-1] == "[DONE]"
        usage_chunk, chunks = events[-2], events[:-2]
        assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {
            "prompt_tokens": len(prompt), "completion_tokens": 8, "total_tokens": len(prompt) + 8}
        choices = [c["choices"][0] for c in chunks]
        assert [t for c in choices for t in c["token_ids"]] == expected.token_ids
        assert "".join(c["text"] for c in choices) == expected.text
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
        assert all(c["object"] == "text_completion" and c["model"] == NAME for c in chunks)
        assert len({c["id"] for c in chunks}) == 1


def test_non_streaming_completion_matches_stream_and_solo(server, solo):
    prompt = [5, 6, 7, 8, 9]
    expected = solo(prompt, max_tokens=6)
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "logprobs": 0}
    reply = post(server, "/v1/completions", body)
    assert reply.status_code == 200
    data = reply.json()
    [choice] = data["choices"]
    assert choice["token_ids"] == expected.token_ids and choice["text"] == expected.text
    assert choice["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["text_offset"]) == 6
    assert all(x <= 0 for x in lp["token_logprobs"])


def test_stop_token_and_batch_prompts(server, solo):
    expected = solo([11, 12, 13], max_tokens=8)
    stop_at = expected.token_ids[2]
    cut = expected.token_ids.index(stop_at) + 1
    body = {"prompt": [[11, 12, 13], [40, 41]], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [stop_at], "return_token_ids": True}
    data = post(server, "/v1/completions", body).json()
    first, second = data["choices"]
    assert first["index"] == 0 and first["finish_reason"] == "stop"
    assert first["token_ids"] == expected.token_ids[:cut]
    assert second["index"] == 1 and second["token_ids"] == solo([40, 41], max_tokens=8).token_ids[:len(second["token_ids"])]


async def test_chat_stream_and_plain(server, tiny_ckpt):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    plain = post(server, "/v1/chat/completions", body).json()
    assert plain["object"] == "chat.completion"
    [choice] = plain["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    from specloop.checkpoint import load_tokenizer

    tok = load_tokenizer(tiny_ckpt)
    prompt_ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    assert plain["usage"]["prompt_tokens"] == len(prompt_ids)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        events = await stream_events(client, "/v1/chat/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed_ids = [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]]
    assert streamed_ids == choice["token_ids"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_default_max_tokens_fills_the_context(server):
    body = {"messages": [{"role": "user", "content": "x" * (MAX_MODEL_LEN - 20)}], "temperature": 0,
            "ignore_eos": True}
    data = post(server, "/v1/chat/completions", body).json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["total_tokens"] == MAX_MODEL_LEN


BAD_REQUESTS = [
    # (name, path, body or raw bytes, headers, status, param)
    ("invalid json", "/v1/completions", b'{"prompt": "x",', None, 400, None),
    ("not an object", "/v1/completions", b'[1, 2]', None, 400, None),
    ("empty body", "/v1/completions", b'', None, 400, None),
    ("wrong content type", "/v1/completions", b'{"prompt": "x"}', {"content-type": "text/plain"}, 415, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, None, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 3}, None, 400, "messages"),
    ("prompt of wrong type", "/v1/completions", {"prompt": 5}, None, 400, "prompt"),
    ("prompt of mixed list", "/v1/completions", {"prompt": [1, "a"]}, None, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, None, 400, "prompt"),
    ("token outside vocab", "/v1/completions", {"prompt": [5, 10**6]}, None, 400, "prompt"),
    ("max_tokens a string", "/v1/completions", {"prompt": "x", "max_tokens": "3"}, None, 400, "max_tokens"),
    ("max_tokens a bool", "/v1/completions", {"prompt": "x", "max_tokens": True}, None, 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -4}, None, 400, "max_tokens"),
    ("zero max_completion_tokens", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, None, 400,
     "max_completion_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -0.1}, None, 400, "temperature"),
    ("top_p above 1", "/v1/completions", {"prompt": "x", "top_p": 1.5}, None, 400, "top_p"),
    ("top_k below -1", "/v1/completions", {"prompt": "x", "top_k": -3}, None, 400, "top_k"),
    ("min_p above 1", "/v1/completions", {"prompt": "x", "min_p": 2}, None, 400, "min_p"),
    ("empty stop string", "/v1/completions", {"prompt": "x", "stop": [""]}, None, 400, "stop"),
    ("seed a float", "/v1/completions", {"prompt": "x", "seed": 1.5}, None, 400, "seed"),
    ("n above 1", "/v1/completions", {"prompt": "x", "n": 2}, None, 400, "n"),
    ("top logprobs", "/v1/completions", {"prompt": "x", "logprobs": 3}, None, 400, "logprobs"),
    ("penalty", "/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, None, 400, "presence_penalty"),
    ("stream_options without stream", "/v1/completions",
     {"prompt": "x", "stream_options": {"include_usage": True}}, None, 400, "stream_options"),
    ("stream not a bool", "/v1/completions", {"prompt": "x", "stream": "yes"}, None, 400, "stream"),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, None, 404, "model"),
    ("oversized prompt", "/v1/completions", {"prompt": [7] * MAX_MODEL_LEN}, None, 400, "prompt"),
    ("oversized chat", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "y" * MAX_MODEL_LEN}]}, None, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400,
     "messages[0].role"),
    ("missing role", "/v1/chat/completions", {"messages": [{"content": "x"}]}, None, 400, "messages[0].role"),
    ("content of wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, None, 400,
     "messages[0].content"),
    ("image content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400, "messages[0].content"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, None, 400, "messages"),
]


@pytest.mark.parametrize("name,path,body,headers,status,param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(server, name, path, body, headers, status, param):
    for stream in (False, True):
        if isinstance(body, dict):
            payload = {**body, "stream": body.get("stream", stream)}
            if "stream_options" in body:
                payload["stream"] = False
            reply = httpx.post(server.url + path, json=payload, headers=headers, timeout=30)
        else:
            reply = httpx.post(server.url + path, content=body, headers=headers or {"content-type": "application/json"},
                               timeout=30)
        assert reply.status_code == status, reply.text
        assert reply.headers["content-type"] == "application/json"
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param, error
        assert error["type"] == "invalid_request_error" and error["message"]
    ok = post(server, "/v1/completions", {"prompt": [5], "max_tokens": 1})  # still serving
    assert ok.status_code == 200


def test_unknown_route_and_method(server):
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx.get(server.url + "/v1/completions")
    assert wrong.status_code == 405 and "message" in wrong.json()["error"]
    for path in ("/health", "/version", "/metrics", "/v1/models"):  # HEAD answers like GET, without a body
        head, get = httpx.head(server.url + path), httpx.get(server.url + path)
        assert head.status_code == get.status_code == 200 and head.content == b"", path
        assert head.headers.get("content-type") == get.headers.get("content-type"), path


async def test_disconnect_mid_stream_frees_pages(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        before = metric((await client.get("/metrics")).text, "specloop_requests_finished_total",
                        '{finish_reason="abort"}', default=0.0)
        body = {"prompt": list(range(5, 40)), "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break
            text = (await client.get("/metrics")).text
            assert metric(text, "specloop_kv_cache_used_bytes") > 0
            assert metric(text, "specloop_num_requests_running") == 1
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = (await client.get("/metrics")).text
            if metric(text, "specloop_kv_cache_used_bytes") == 0 and metric(text, "specloop_num_requests_running") == 0:
                break
            await asyncio.sleep(0.05)
        assert metric(text, "specloop_kv_cache_used_bytes") == 0
        assert metric(text, "specloop_num_requests_running") == 0
        assert metric(text, "specloop_kv_cache_usage_ratio") == 0
        assert metric(text, "specloop_requests_finished_total", '{finish_reason="abort"}') == before + 1
        generated = metric(text, "specloop_generation_tokens_total")
        await asyncio.sleep(0.3)  # the aborted request generates nothing more
        assert metric((await client.get("/metrics")).text, "specloop_generation_tokens_total") == generated


def test_metrics_contents(server):
    post(server, "/v1/completions", {"prompt": [9, 9, 9], "max_tokens": 4, "ignore_eos": True})
    assert post(server, "/v1/completions", {"prompt": [9], "max_tokens": 0}).status_code == 400  # its own, so
    # that the test holds alone or on another xdist worker than the table of bad requests
    reply = httpx.get(server.url + "/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    text = reply.text
    for name in ("specloop_time_to_first_token_seconds", "specloop_inter_token_latency_seconds",
                 "specloop_e2e_request_latency_seconds"):
        assert f"# TYPE {name} histogram" in text
        assert metric(text, name + "_count") >= 1
        assert metric(text, name + "_bucket", '{le="+Inf"}') == metric(text, name + "_count")
    assert metric(text, "specloop_prompt_tokens_total") >= 3
    assert metric(text, "specloop_generation_tokens_total") >= 4
    assert metric(text, "specloop_requests_finished_total", '{finish_reason="length"}') >= 1
    assert metric(text, "specloop_request_errors_total", '{status="400"}') >= 1
    for gauge in ("specloop_num_requests_running", "specloop_num_requests_waiting", "specloop_kv_cache_usage_ratio",
                  "specloop_kv_cache_used_bytes", "specloop_kv_cache_pages"):
        assert f"# TYPE {gauge} gauge" in text
    assert metric(text, "specloop_kv_cache_pages") > 0
    assert metric(text, "specloop_engine_alive") == 1
    assert metric(text, "specloop_sparse_decode_fallbacks_total") == 0  # off: no state, nothing served dense
    assert metric(text, "specloop_sparse_decode_reference_bytes") == 0
