"""The front door, in-process (ASGI transport or raw ASGI calls), tiny checkpoint on CPU.

Bounded bodies (413 before parsing, also when chunked), deep JSON, the catch-all 500, refused
OpenAI fields, the prompt count, auth before the body, /version, /tokenize, /detokenize,
/openapi.json against the msgspec types, model aliases, metrics that leave refusals out of
the finished and latency series, vLLM metric names, and one request failing in the engine.
"""

from __future__ import annotations

import json
import re
import threading

import httpx
import msgspec
import pytest

import specloop
from server.app import create_app, schema_bounds
from server.errors import from_decode
from server.openapi import request_schema
from specloop.engine.async_engine import AsyncEngine
from specloop.engine.core import QueueFullError
from specloop.errors import RequestFailedError
from specloop.scheduling.request import RequestOutput, Usage

NAME = "tiny"
KEY = "sekret-key"
BODY = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
ENVELOPE = {"message", "type", "param", "code"}


@pytest.fixture()
async def engine(tiny_ckpt):
    eng = AsyncEngine.from_options(str(tiny_ckpt), device="cpu", max_waiting_requests=3)
    yield eng
    await eng.shutdown()


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def app_for(engine: AsyncEngine, **kw):
    return create_app(engine, NAME, **kw)


def events_of(text: str) -> list:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def error_of(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert set(error) == ENVELOPE and error["message"]
    return error


async def raw_call(app, path: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, bytes, int]:
    """Call the ASGI app directly; returns (status, body, how many times it pulled `receive`)."""
    pulled, sent = 0, []
    queue = list(chunks)

    async def receive():
        nonlocal pulled
        pulled += 1
        if queue:
            return {"type": "http.request", "body": queue.pop(0), "more_body": bool(queue)}
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "headers": headers, "scheme": "http",
             "server": ("test", 80), "client": ("127.0.0.1", 1), "root_path": ""}
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), pulled


# ---- bounded bodies, deep JSON, the catch-all ------------------------------------------


async def test_body_over_the_limit_is_413_before_parsing(engine):
    app = app_for(engine, max_body_bytes=1000)
    async with client_for(app) as client:
        fits = {"prompt": "x" * 900, "max_tokens": 1}
        assert len(json.dumps(fits)) <= 1000
        assert (await client.post("/v1/completions", json=fits)).status_code == 200
        over = await client.post("/v1/completions", content=b'{"prompt": "' + b"x" * 1000 + b'"}',
                                 headers={"content-type": "application/json"})
        error = error_of(over, 413)
        assert error["code"] == "request_too_large" and "1000 bytes" in error["message"]
        chunks_sent = 0

        async def chunked():  # no Content-Length: the server must stop reading at the limit
            nonlocal chunks_sent
            yield b'{"prompt": "'
            for _ in range(100):
                chunks_sent += 1
                yield b"y" * 300

        reply = await client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert error_of(reply, 413)["code"] == "request_too_large"
        assert chunks_sent <= 1000 // 300 + 2  # the limit plus one chunk, never the whole body
        text = (await client.get("/metrics")).text
        assert metric(text, "specloop_request_errors_total", '{status="413"}') == 2
    # with a declared length over the limit, the body is not read at all
    status, body, pulled = await raw_call(app, "/v1/completions", [(b"content-length", b"5000")], [b"x" * 5000])
    assert status == 413 and pulled == 0 and json.loads(body)["error"]["code"] == "request_too_large"
    status, _, pulled = await raw_call(app, "/v1/completions", [], [b"z" * 400] * 50)
    assert status == 413 and pulled == 3  # 1,200 bytes > 1,000 at the third chunk


@pytest.mark.parametrize("path,field,base", [
    ("/v1/completions", "prompt", {}),
    ("/v1/completions", "guided_json", {"prompt": "x"}),
    ("/v1/completions", "some_unknown_field", {"prompt": "x"}),
    ("/v1/chat/completions", "tools", {"messages": [{"role": "user", "content": "x"}]}),
])
async def test_json_nested_1000_deep_is_a_400_not_a_crash(engine, path, field, base):
    deep = "[" * 1000 + "]" * 1000
    body = json.dumps(base)[:-1] + (", " if base else "") + f'"{field}": {deep}}}'
    async with client_for(app_for(engine)) as client:
        error = error_of(await client.post(path, content=body, headers={"content-type": "application/json"}), 400)
        assert error["code"] == "invalid_json" and "deep" in error["message"]
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200


async def test_unhandled_exception_is_a_500_in_the_envelope_and_the_server_serves_on(engine, monkeypatch):
    real = engine.add

    async def broken(prompt, params, request_id=None):
        raise ZeroDivisionError("injected")

    monkeypatch.setattr(engine, "add", broken)
    async with client_for(app_for(engine)) as client:
        error = error_of(await client.post("/v1/completions", json=BODY), 500)
        assert error["type"] == "server_error" and "ZeroDivisionError" in error["message"]
        monkeypatch.setattr(engine, "add", real)
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        text = (await client.get("/metrics")).text
        assert metric(text, "specloop_request_errors_total", '{status="500"}') == 1
        assert metric(text, "specloop_requests_finished_total", '{finish_reason="abort"}') == 0


# ---- refused fields and the prompt count -------------------------------------------------

REFUSED = [
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", "guided_choice", ["a", "b"]),
    ("/v1/completions", "response_format", {"type": "json_schema", "json_schema": {}}),
    ("/v1/completions", "guided_json", {"type": "object"}),
    ("/v1/completions", "guided_regex", "a+"),
    ("/v1/completions", "guided_grammar", "root ::= 'a'"),
    ("/v1/completions", "structured_outputs", {"regex": "a+"}),
]
ACCEPTED = {"tools": [], "tool_choice": "none", "parallel_tool_calls": True, "function_call": "none",
            "response_format": {"type": "text"}, "modalities": ["text"], "user": "u-1", "metadata": {"k": "v"}}


async def test_unsupported_fields_are_refused_by_name_and_their_off_values_accepted(engine):
    async with client_for(app_for(engine)) as client:
        for path, field, value in REFUSED:
            base = CHAT if path.endswith("chat/completions") else BODY
            for stream in (False, True):
                reply = await client.post(path, json={**base, field: value, "stream": stream})
                error = error_of(reply, 400)
                assert error["param"] == field and field in error["message"], (field, error)
        ok = await client.post("/v1/chat/completions", json={**CHAT, **ACCEPTED})
        assert ok.status_code == 200, ok.text
        ok = await client.post("/v1/completions", json={**BODY, "response_format": {"type": "text"}, "user": "u"})
        assert ok.status_code == 200, ok.text


async def test_more_prompts_than_the_queue_holds_is_a_400_not_a_503(engine):
    async with client_for(app_for(engine)) as client:
        reply = await client.post("/v1/completions", json={**BODY, "prompt": [[5, 6]] * 4})
        error = error_of(reply, 400)
        assert error["param"] == "prompt" and "4 prompts" in error["message"] and "at most 3" in error["message"]
        assert "retry-after" not in reply.headers
        ok = await client.post("/v1/completions", json={**BODY, "prompt": ["a", "b", "c"]})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 3


async def test_chat_templating_and_tokenizer_routes_run_in_the_tokenizer_pool(engine, monkeypatch):
    threads: dict[str, set[str]] = {}
    cls = type(engine.tokenizer)
    for method in ("apply_chat_template", "encode", "decode"):
        real = getattr(cls, method)

        def spy(self, *args, _real=real, _name=method, **kwargs):
            threads.setdefault(_name, set()).add(threading.current_thread().name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, method, spy)
    async with client_for(app_for(engine)) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await client.post("/tokenize", json={"prompt": "hello"})).status_code == 200
        assert (await client.post("/detokenize", json={"tokens": [5, 6]})).status_code == 200
    assert threads["apply_chat_template"] and threads["decode"]
    for method, names in threads.items():
        if method == "decode":
            names = names - {"specloop-engine"}  # the engine thread's incremental detokenizer
        assert names and all(n.startswith("specloop-tokenizer") for n in names), (method, names)


# ---- auth ----------------------------------------------------------------------------------


async def test_api_key_guards_v1_and_tokenizer_routes_before_the_body(engine):
    app = app_for(engine, api_key=KEY)
    good = {"Authorization": f"Bearer {KEY}"}
    async with client_for(app) as client:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/nothing-here")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                reply = await client.request(method, path, json=BODY, headers=headers)
                error = error_of(reply, 401)
                assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
                assert reply.headers["www-authenticate"] == "Bearer"
        assert (await client.get("/v1/models", headers=good)).status_code == 200
        assert (await client.get("/v1/models", headers={"Authorization": f"bearer {KEY}"})).status_code == 200
        assert (await client.post("/v1/completions", json=BODY, headers=good)).status_code == 200
        for path in ("/health", "/metrics", "/version", "/openapi.json", "/docs"):
            assert (await client.get(path)).status_code == 200, path
        text = (await client.get("/metrics")).text
        assert metric(text, "specloop_request_errors_total", '{status="401"}') == 24
        # 401 comes first: an oversized body without the key is never read
        huge = (await client.post("/v1/completions", content=b"x" * (5 << 20),
                                  headers={"content-type": "application/json"}))
        assert error_of(huge, 401)["code"] == "invalid_api_key"
    status, _, pulled = await raw_call(app, "/v1/completions", [(b"content-length", b"10")], [b"{}" * 5])
    assert status == 401 and pulled == 0


# ---- /version, /v1/models, /tokenize, /detokenize, aliases -----------------------------------


async def test_version_and_models_never_show_the_checkpoint_path(engine, tiny_ckpt):
    async with client_for(app_for(engine, max_body_bytes=12345)) as client:
        version = await client.get("/version")
        models = await client.get("/v1/models")
    info = version.json()
    assert info["version"] == specloop.__version__ and info["model"] == NAME
    assert info["engine"]["model"] == NAME and info["engine"]["max_waiting_requests"] == 3
    assert info["engine"]["device"] == "cpu"
    core = engine.core
    assert info["resolved"] == {  # what `auto` and unset options became at start-up
        "dtype": "float32", "device": "cpu", "max_model_len": core.max_model_len, "num_kv_pages": core.kv.num_pages,
        "kv_page_bytes": core.kv.page_bytes, "attention_backend": "torch", "cuda_graphs": False,
        "exit_threshold": core.model.config.early_exit_threshold, "prefix_caching": True}
    assert info["engine"]["dtype"] == "auto" and info["engine"]["num_kv_pages"] is None  # configured as given
    assert info["engine"]["enable_prefix_caching"] is None
    assert info["limits"]["max_model_len"] == info["resolved"]["max_model_len"]
    assert info["limits"]["max_body_bytes"] == 12345 and info["limits"]["max_model_len"] > 0
    [card] = models.json()["data"]
    assert card["id"] == card["root"] == NAME
    for text in (version.text, models.text):
        assert str(tiny_ckpt) not in text and tiny_ckpt.name not in text


async def test_tokenize_and_detokenize(engine):
    tok = engine.tokenizer
    async with client_for(app_for(engine)) as client:
        plain = (await client.post("/tokenize", json={"prompt": "def f(x):", "model": NAME})).json()
        assert plain["tokens"] == tok.encode("def f(x):", add_special_tokens=False)
        assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == engine.limits()[0]
        done = (await client.post("/v1/completions", json={**BODY, "prompt": "def f(x):"})).json()
        assert done["usage"]["prompt_tokens"] == plain["count"]  # /tokenize counts what completions feed
        chat = (await client.post("/tokenize", json={"messages": CHAT["messages"]})).json()
        chat_done = (await client.post("/v1/chat/completions", json=CHAT)).json()
        assert chat["count"] == chat_done["usage"]["prompt_tokens"]
        back = (await client.post("/detokenize", json={"tokens": plain["tokens"]})).json()
        assert back == {"prompt": tok.decode(plain["tokens"])}
        vocab = engine.core.model.config.vocab_size
        for tokens, index in (([5, vocab], 1), ([-1], 0)):
            error = error_of(await client.post("/detokenize", json={"tokens": tokens}), 400)
            assert error["param"] == "tokens" and f"tokens[{index}]" in error["message"]
        assert error_of(await client.post("/detokenize", json={"tokens": [True]}), 400)["param"] == "tokens[0]"
        for body in ({"prompt": "x", "messages": CHAT["messages"]}, {}):
            assert error_of(await client.post("/tokenize", json=body), 400)["message"].startswith("give exactly one")
        assert error_of(await client.post("/tokenize", json={"prompt": "x", "model": "nope"}), 404)["param"] == "model"


async def test_model_aliases_are_accepted_and_answered_with_the_served_name(engine):
    async with client_for(app_for(engine, model_aliases=("ouro", "/some/local/path"))) as client:
        for name in (NAME, "ouro", "/some/local/path"):
            reply = await client.post("/v1/completions", json={**BODY, "model": name})
            assert reply.status_code == 200 and reply.json()["model"] == NAME
        assert error_of(await client.post("/v1/completions", json={**BODY, "model": "gpt-9"}), 404)["param"] == "model"
        models = (await client.get("/v1/models")).text
        assert "/some/local/path" not in models and "ouro" not in models


async def test_chat_without_max_tokens_runs_to_the_context_limit_or_the_default(tiny_ckpt):
    """As in vLLM, a chat request without max_tokens generates up to the context length; the
    server's --max-tokens-default caps that (never beyond what fits), and the request's own
    max_tokens wins over it."""
    short = AsyncEngine.from_options(str(tiny_ckpt), device="cpu", max_model_len=40)
    try:
        body = {"messages": CHAT["messages"], "temperature": 0, "ignore_eos": True}
        for default, extra, want in ((None, {}, None), (3, {}, 3), (1000, {}, None), (3, {"max_tokens": 5}, 5),
                                     (3, {"max_completion_tokens": 4}, 4)):
            async with client_for(app_for(short, max_tokens_default=default)) as client:
                reply = (await client.post("/v1/chat/completions", json={**body, **extra})).json()
                if default is not None:
                    assert (await client.get("/version")).json()["limits"]["chat_max_tokens_default"] == default
            usage, choice = reply["usage"], reply["choices"][0]
            room = 40 - usage["prompt_tokens"]
            assert usage["completion_tokens"] == (room if want is None else want), (default, extra)
            assert choice["finish_reason"] == "length"
    finally:
        await short.shutdown()


# ---- OpenAPI ----------------------------------------------------------------------------------


async def test_openapi_lists_every_route_with_the_schema_it_decodes(engine):
    app = app_for(engine, api_key=KEY)
    async with client_for(app) as client:
        doc = (await client.get("/openapi.json")).json()
        page = await client.get("/docs")
        served = [(m, r.path) for r in app.routes for m in sorted(getattr(r, "methods", ()) - {"HEAD"})]
        assert doc["openapi"] == "3.1.0" and doc["info"]["version"] == specloop.__version__
        assert sorted(served) == sorted((m.upper(), p) for p, ops in doc["paths"].items() for m in ops)
        assert {p for _, p in served} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
                                          "/detokenize", "/version", "/health", "/metrics", "/openapi.json", "/docs"}
        documented = {(d.method, d.path): d for d in app.state.routes}
        components = doc["components"]["schemas"]
        for method, path in served:
            op = doc["paths"][path][method.lower()]
            kind = documented[(method, path)].body
            if kind is None:
                assert "requestBody" not in op
                continue
            schema, needed = request_schema(kind, schema_bounds(app.state.server))
            assert op["requestBody"]["content"]["application/json"]["schema"] == schema
            assert {name: components[name] for name in needed} == needed
            # narrowed to what the checks accept (test_openapi_accepts), never to other fields
            (_, plain) = msgspec.json.schema_components([kind], ref_template="#/components/schemas/{name}")
            for name, component in plain.items():
                assert set(needed[name].get("properties", {})) == set(component.get("properties", {})), name
                assert needed[name].get("required") == component.get("required"), name
            assert op["security"] == [{"bearer": []}]
            # the route really decodes that type: a wrong type fails exactly as msgspec fails on it
            probe = b'{"model": 1}'
            with pytest.raises(msgspec.ValidationError) as info:
                msgspec.json.decode(probe, type=kind)
            reply = await client.post(path, content=probe, headers={"Authorization": f"Bearer {KEY}",
                                                                     "content-type": "application/json"})
            assert error_of(reply, 400)["message"] == from_decode(info.value).message
        chat = components["ChatCompletionRequest"]["properties"]
        assert {"tools", "tool_choice", "functions", "response_format", "guided_json", "structured_outputs"} <= set(chat)
        assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
        assert "security" not in doc["paths"]["/health"]["get"]
        assert page.status_code == 200 and "swagger" in page.text.lower() and "/openapi.json" in page.text


# ---- metrics -----------------------------------------------------------------------------------


async def test_refusals_are_counted_once_and_never_as_finished_or_timed(engine, monkeypatch):
    app = app_for(engine, max_body_bytes=4096)
    async with client_for(app) as client:
        refusals = [
            (400, client.post("/v1/completions", json={**BODY, "max_tokens": "many"})),  # decode
            (400, client.post("/v1/completions", json={**BODY, "temperature": -1})),  # SamplingParams
            (400, client.post("/v1/completions", json={**BODY, "prompt": [[5], [10 ** 6]]})),  # engine, 2nd job
            (400, client.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})),
            (404, client.post("/v1/completions", json={**BODY, "model": "nope"})),
            (404, client.get("/v1/none")),
            (405, client.get("/v1/completions")),
            (413, client.post("/v1/completions", json={"prompt": "x" * 5000})),
            (415, client.post("/v1/completions", content=b"{}", headers={"content-type": "text/plain"})),
        ]
        for status, call in refusals:
            assert (await call).status_code == status

        async def full(prompt, params, request_id=None):
            raise QueueFullError("the waiting queue is full (3 requests)")

        real = engine.add
        monkeypatch.setattr(engine, "add", full)
        full_reply = await client.post("/v1/completions", json=BODY)
        assert full_reply.status_code == 503 and full_reply.headers["retry-after"] == "1"
        monkeypatch.setattr(engine, "add", real)
        text = (await client.get("/metrics")).text
        expected = {"400": 4, "404": 2, "405": 1, "413": 1, "415": 1, "503": 1}
        for status, count in expected.items():
            assert metric(text, "specloop_request_errors_total", f'{{status="{status}"}}') == count, status
        assert metric(text, "specloop_e2e_request_latency_seconds_count") == 0
        assert metric(text, "vllm:e2e_request_latency_seconds_count", f'{{model_name="{NAME}"}}') == 0
        for finished in ("specloop_requests_finished_total{", "vllm:request_success_total{"):
            assert not re.search(rf"^{re.escape(finished)}", text, re.M), finished  # no abort, nothing
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        text = (await client.get("/metrics")).text
        assert metric(text, "specloop_e2e_request_latency_seconds_count") == 1
        assert metric(text, "specloop_requests_finished_total", '{finish_reason="length"}') == 1
        assert metric(text, "specloop_requests_finished_total", '{finish_reason="abort"}') == 0


async def test_vllm_metric_names_beside_ours(engine):
    async with client_for(app_for(engine)) as client:
        await client.post("/v1/completions", json=BODY)
        text = (await client.get("/metrics")).text
    label = f'{{model_name="{NAME}"}}'
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert f"# TYPE {name} histogram" in text
        ours = name.replace("vllm:", "specloop_")
        assert metric(text, name + "_count", label) == metric(text, ours + "_count") > 0
    assert metric(text, "vllm:request_success_total", f'{{finished_reason="length",model_name="{NAME}"}}') == 1
    assert metric(text, "vllm:prompt_tokens_total", label) == 3
    assert metric(text, "vllm:generation_tokens_total", label) == 4
    for gauge, ours in (("vllm:num_requests_running", "specloop_num_requests_running"),
                        ("vllm:num_requests_waiting", "specloop_num_requests_waiting"),
                        ("vllm:kv_cache_usage_perc", "specloop_kv_cache_usage_ratio")):
        assert f"# TYPE {gauge} gauge" in text and f"{gauge}{label} " in text
        assert metric(text, gauge, label) == metric(text, ours)
    for counter in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                    "vllm:spec_decode_num_accepted_tokens"):
        assert f"# TYPE {counter}_total counter" in text or f"# TYPE {counter} counter" in text
        assert f"{counter}_total{label} 0.0" in text
    assert "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total" in text


async def test_vllm_request_histograms_cache_info_and_success_without_aborts(engine):
    """vLLM's per-request histograms, tokens per step and cache info; `vllm:request_success_total`
    counts finished requests only (an abort is in specloop_requests_finished_total alone)."""
    app = app_for(engine)
    async with client_for(app) as client:
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200  # 3 prompt, 4 generated
        metrics = app.state.server.metrics
        aborted = metrics.track()  # a request aborted after one token, and one whose client left at once
        aborted.observe(RequestOutput("x-0", "a", [7], False, None, Usage(5, 1)))
        aborted.observe(RequestOutput("x-0", "", [], True, "abort", Usage(5, 1)))
        metrics.track().close()
        text = (await client.get("/metrics")).text
    label = f'{{model_name="{NAME}"}}'
    assert metric(text, "vllm:request_success_total", f'{{finished_reason="length",model_name="{NAME}"}}') == 1
    assert not re.search(r'^vllm:request_success_total\{finished_reason="abort"', text, re.M)
    assert metric(text, "specloop_requests_finished_total", '{finish_reason="abort"}') == 2
    counts = {"time_per_output_token_seconds": 1, "request_queue_time_seconds": 1,  # only the served one
              "request_prompt_tokens": 2, "request_generation_tokens": 2}  # ended with a usage
    for name, count in counts.items():
        assert f"# TYPE vllm:{name} histogram" in text
        assert metric(text, f"vllm:{name}_count", label) == metric(text, f"specloop_{name}_count") == count, name
    assert metric(text, "vllm:request_prompt_tokens_sum", label) == 3 + 5
    assert metric(text, "vllm:request_generation_tokens_sum", label) == 4 + 1
    assert metric(text, "vllm:request_prompt_tokens_bucket", f'{{le="5.0",model_name="{NAME}"}}') == 2
    assert "# TYPE vllm:iteration_tokens_total histogram" in text
    steps = metric(text, "vllm:iteration_tokens_total_count", label)
    assert steps > 0 and metric(text, "vllm:iteration_tokens_total_bucket", f'{{le="+Inf",model_name="{NAME}"}}') == steps
    assert metric(text, "vllm:iteration_tokens_total_sum", label) == 3 + 3  # the prompt, the tokens sampled but the last
    assert metric(text, "specloop_iteration_tokens_count") == steps
    pages = engine.core.kv.num_pages
    assert (f'vllm:cache_config_info{{block_size="16",cache_dtype="float32",enable_prefix_caching="True",'
            f'gpu_memory_utilization="0.9",model_name="{NAME}",num_gpu_blocks="{pages}"}} 1.0') in text


# ---- one request failing in the engine -------------------------------------------------------------


class FailsAfterOne:
    """An accepted stream that ends with RequestFailedError after its first output."""

    def __init__(self, stream, aborts: set):
        self.stream, self.count, self.aborts = stream, 0, aborts

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.count == 1:
            raise RequestFailedError("request x failed: injected")
        self.count += 1
        return await self.stream.__anext__()

    def abort(self):
        self.aborts.add(("failing", self.stream.request_id))
        self.stream.abort()


class Recorded:
    def __init__(self, stream, aborts: set):
        self.stream, self.aborts = stream, aborts

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.stream.__anext__()

    def abort(self):
        self.aborts.add(("sibling", self.stream.request_id))
        self.stream.abort()


def inject_failure(engine, monkeypatch) -> set:
    """Choice 0 fails after one output; other choices run (and record their abort)."""
    real, aborts = engine.add, set()

    async def add(prompt, params, request_id=None):
        stream = await real(prompt, params, request_id=request_id)
        return FailsAfterOne(stream, aborts) if request_id.endswith("-0") else Recorded(stream, aborts)

    monkeypatch.setattr(engine, "add", add)
    return aborts


async def test_request_failed_is_a_500_and_aborts_its_siblings(engine, monkeypatch):
    aborts = inject_failure(engine, monkeypatch)
    body = {**BODY, "prompt": [[5, 6], [7, 8]], "max_tokens": 400}
    async with client_for(app_for(engine)) as client:
        error = error_of(await client.post("/v1/completions", json=body), 500)
        assert error["code"] == "request_failed" and error["type"] == "server_error"
        assert "injected" in error["message"]
        assert {kind for kind, _ in aborts} >= {"sibling"}
        reply = await client.post("/v1/completions", json={**body, "stream": True})
        assert reply.status_code == 200
        events = events_of(reply.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_failed"
        assert sum(kind == "sibling" for kind, _ in aborts) == 2  # one per HTTP request
        monkeypatch.undo()
        ok = await client.post("/v1/completions", json=BODY)  # the engine serves on
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        text = (await client.get("/metrics")).text
        assert metric(text, "specloop_requests_finished_total", '{finish_reason="error"}') == 2
        assert metric(text, "specloop_requests_finished_total", '{finish_reason="abort"}') == 2
        assert metric(text, "specloop_request_errors_total", '{status="500"}') == 1


async def test_request_failed_while_adding_is_a_500(engine, monkeypatch):
    async def add(prompt, params, request_id=None):
        raise RequestFailedError("adding request x failed: injected")

    monkeypatch.setattr(engine, "add", add)
    async with client_for(app_for(engine)) as client:
        for stream in (False, True):
            error = error_of(await client.post("/v1/completions", json={**BODY, "stream": stream}), 500)
            assert error["code"] == "request_failed"
        text = (await client.get("/metrics")).text
        assert metric(text, "specloop_e2e_request_latency_seconds_count") == 0
