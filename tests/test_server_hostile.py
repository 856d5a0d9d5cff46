"""Hostile clients against a real `specloop serve` process (tiny checkpoint, CPU, float64).

While greedy streams run back to back in a background thread, a table of hostile
requests each gets its status and error envelope (naming the field), `/health` stays 200
after every case, and every background stream keeps flowing and equals the solo greedy
run. A property-based fuzz test (hypothesis) then builds requests from the server's own
`/openapi.json` request schemas, biased to hostile values, and asserts no 5xx and a live
engine afterwards. Nothing refused is counted as an abort.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.testing import ServerProcess
from specloop.sampling_params import SamplingParams
from specloop.llm import LLM

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 << 10
MAX_WAITING = 8
MAX_MODEL_LEN = 512
VOCAB = 384  # the tiny preset's
STREAM_PROMPT = [17, 18, 19, 20]
STREAM_TOKENS = 48
MAX_GAP_S = 3.0  # no chunk of a background stream may wait longer than this


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    srv = ServerProcess([str(tiny_ckpt), "--served-model-name", "tiny", "--device", "cpu", "--dtype", "float64",
                         "--max-model-len", str(MAX_MODEL_LEN), "--max-waiting-requests", str(MAX_WAITING),
                         "--max-request-body-bytes", str(BODY_LIMIT), "--api-key", KEY, "--log-level", "warning"],
                        env={"OMP_NUM_THREADS": "1"})
    srv.start()
    yield srv
    assert srv.stop() == 0, srv.output


@pytest.fixture(scope="module")
def solo_stream(tiny_ckpt) -> list[int]:
    llm = LLM(str(tiny_ckpt), device="cpu", dtype="float64")
    params = SamplingParams(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True)
    return llm.generate([STREAM_PROMPT], params)[0].token_ids


class BackgroundStreams(threading.Thread):
    """Greedy streams one after another until stopped; records tokens, gaps and failures."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.results: list[list[int]] = []
        self.failures: list[str] = []
        self.max_gap = 0.0

    def run(self) -> None:
        body = {"prompt": STREAM_PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=60) as client:
            while not self.stop.is_set():
                tokens, last = [], time.monotonic()
                try:
                    with client.stream("POST", "/v1/completions", json=body) as response:
                        if response.status_code != 200:
                            self.failures.append(f"status {response.status_code}")
                            continue
                        for line in response.iter_lines():
                            now = time.monotonic()
                            self.max_gap, last = max(self.max_gap, now - last), now
                            if line.startswith("data: {"):
                                chunk = json.loads(line[6:])
                                if "error" in chunk:
                                    self.failures.append(str(chunk))
                                else:
                                    tokens += chunk["choices"][0]["token_ids"]
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                self.results.append(tokens)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def chunked(data: bytes):
    for i in range(0, len(data), 4096):
        yield data[i:i + 4096]


MSG = [{"role": "user", "content": "hi"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"
# (name, path, body: dict | bytes | callable -> content, extra headers, status, param or code)
HOSTILE: list[tuple[str, str, Any, dict | None, int, str | None]] = [
    ("top_k 2^63 (the issue's engine killer)", C, {"prompt": "x", "temperature": 1, "top_k": 2**63}, None, 400, "top_k"),
    ("top_k 10^30", C, {"prompt": "x", "temperature": 1, "top_k": 10**30}, None, 400, "top_k"),
    ("top_k above the vocabulary", C, {"prompt": "x", "temperature": 1, "top_k": VOCAB + 1}, None, 400, "top_k"),
    ("max_tokens 2^63", C, {"prompt": "x", "max_tokens": 2**63}, None, 400, "max_tokens"),
    ("max_tokens 10^40", C, {"prompt": "x", "max_tokens": 10**40}, None, 400, "max_tokens"),
    ("max_tokens -2^63", C, {"prompt": "x", "max_tokens": -(2**63)}, None, 400, "max_tokens"),
    ("max_tokens past the context", C, {"prompt": "x", "max_tokens": 2**40}, None, 400, "prompt"),
    ("seed 2^64", C, {"prompt": "x", "seed": 2**64}, None, 400, "seed"),
    ("seed below int64", C, {"prompt": "x", "seed": -(2**63) - 1}, None, 400, "seed"),
    ("stop_token_ids 2^63", C, {"prompt": "x", "stop_token_ids": [2**63]}, None, 400, "stop_token_ids"),
    ("stop_token_ids outside the vocabulary", C, {"prompt": "x", "stop_token_ids": [VOCAB]}, None, 400,
     "stop_token_ids"),
    ("n 2^64", C, {"prompt": "x", "n": 2**64}, None, 400, "n"),
    ("logprobs 2^63", C, {"prompt": "x", "logprobs": 2**63}, None, 400, "logprobs"),
    ("top_logprobs 10^30", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 10**30}, None, 400,
     "top_logprobs"),
    ("max_completion_tokens 2^64", CHAT, {"messages": MSG, "max_completion_tokens": 2**64}, None, 400,
     "max_completion_tokens"),
    ("prompt token 2^63", C, {"prompt": [5, 2**63]}, None, 400, "prompt"),
    ("prompt token -1", C, {"prompt": [-1]}, None, 400, "prompt"),
    ("temperature 1e39 (inf in fp32)", C, {"prompt": "x", "temperature": 1e39}, None, 400, "temperature"),
    ("temperature 1e400", C, b'{"prompt": "x", "temperature": 1e400}', None, 400, "temperature"),
    ("top_p 1e-300 (0 in fp32)", C, {"prompt": "x", "temperature": 1, "top_p": 1e-300}, None, 400, "top_p"),
    ("NaN literal", C, b'{"prompt": "x", "temperature": NaN}', None, 400, "invalid_json"),
    ("Infinity literal", C, b'{"prompt": "x", "top_p": Infinity}', None, 400, "invalid_json"),
    ("prompt nested 1000 deep", C, b'{"prompt": ' + nested(1000) + b'}', None, 400, "invalid_json"),
    ("unknown field nested 1000 deep", C, b'{"prompt": "x", "extra": ' + nested(1000) + b'}', None, 400,
     "invalid_json"),
    ("messages nested 1000 deep", CHAT, b'{"messages": ' + nested(1000) + b'}', None, 400, "messages[0]"),
    ("tools nested 1000 deep", CHAT, b'{"messages": [], "tools": ' + nested(1000) + b'}', None, 400,
     "invalid_json"),
    ("oversized body", C, json.dumps({"prompt": "x" * BODY_LIMIT}).encode(), None, 413, "request_too_large"),
    ("oversized chunked body", C, lambda: chunked(json.dumps({"prompt": "y" * 2 * BODY_LIMIT}).encode()), None,
     413, "request_too_large"),
    ("100,000 stop strings", C, {"prompt": "x", "stop": ["ab"] * 100_000}, None, 413, "request_too_large"),
    ("too many stop strings", C, {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, None, 400, "stop"),
    ("stop strings too long", C, {"prompt": "x", "stop": ["z" * 5000]}, None, 400, "stop"),
    ("more prompts than the queue holds", C, {"prompt": [[5]] * (MAX_WAITING + 1)}, None, 400, "prompt"),
    ("prompt near the body limit, past the context", C, {"prompt": "word " * (BODY_LIMIT // 6)}, None, 400,
     "prompt"),
    ("tools", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, None, 400,
     "tools"),
    ("response_format json", CHAT, {"messages": MSG, "response_format": {"type": "json_object"}}, None, 400,
     "response_format"),
    ("guided_json", C, {"prompt": "x", "guided_json": {"type": "object"}}, None, 400, "guided_json"),
    ("no api key", C, {"prompt": "x"}, {"Authorization": ""}, 401, "invalid_api_key"),
    ("wrong api key", C, {"prompt": "x"}, {"Authorization": "Bearer nope"}, 401, "invalid_api_key"),
    ("key without Bearer", C, {"prompt": "x"}, {"Authorization": KEY}, 401, "invalid_api_key"),
    ("wrong key on /v1/models", "/v1/models", None, {"Authorization": "Bearer nope"}, 401, "invalid_api_key"),
    ("wrong key on /tokenize", "/tokenize", {"prompt": "x"}, {"Authorization": "Bearer x"}, 401, "invalid_api_key"),
    ("detokenize outside the vocabulary", "/detokenize", {"tokens": [1, 2**63]}, None, 400, "tokens"),
]


def send(server, path: str, body: Any, headers: dict | None) -> httpx.Response:
    hdrs = {**AUTH, "content-type": "application/json", **(headers or {})}
    hdrs = {k: v for k, v in hdrs.items() if v}
    if body is None:
        return httpx.get(server.url + path, headers=hdrs, timeout=60)
    content = body() if callable(body) else body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=hdrs, timeout=60)


def metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_hostile_table_while_streams_flow(server, solo_stream):
    streams = BackgroundStreams(server.url)
    streams.start()
    try:
        for name, path, body, headers, status, where in HOSTILE:
            reply = send(server, path, body, headers)
            assert reply.status_code == status, (name, reply.text)
            assert reply.headers["content-type"] == "application/json", name
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], (name, error)
            assert where in (error["param"], error["code"]), (name, error)
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200, name
        assert streams.is_alive(), "the background streams stopped"
    finally:
        streams.stop.set()
        streams.join(120)
    assert not streams.failures, streams.failures[:3]
    assert len(streams.results) >= 2
    assert all(tokens == solo_stream for tokens in streams.results)
    assert streams.max_gap < MAX_GAP_S
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "specloop_requests_finished_total", '{finish_reason="abort"}') == 0  # refusals are not aborts
    assert metric(text, "specloop_engine_alive") == 1


# ---- fuzzing over the request schema ------------------------------------------------------

HUGE_INTS = st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63) - 1, -(2**31)])
ODD_FLOATS = st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-45, 3.5e38, 1e308, -1e308, 1e-5, 1.0, 2.0])
SMALL_TOKENS = st.integers(min_value=1, max_value=6)  # keeps accepted requests quick on the CPU


def from_schema(schema: dict, defs: dict, name: str = "", depth: int = 0) -> st.SearchStrategy:
    """A hypothesis strategy for the subset of JSON Schema that msgspec emits."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, name, depth)
    if "anyOf" in schema:
        return st.one_of(*(from_schema(s, defs, name, depth) for s in schema["anyOf"]))
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        fields = {k: from_schema(v, defs, k, depth + 1) for k, v in props.items()}
        return st.fixed_dictionaries({k: fields[k] for k in props if k in required},
                                     optional={k: fields[k] for k in props if k not in required})
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs, name, depth + 1)
        return st.lists(items, max_size=4 if depth < 3 else 1)
    if kind == "integer":
        if name in ("max_tokens", "max_completion_tokens"):
            return st.one_of(SMALL_TOKENS, HUGE_INTS, st.integers(-5, 0))
        return st.one_of(st.integers(-3, VOCAB + 3), HUGE_INTS)
    if kind == "number":
        return st.one_of(ODD_FLOATS, st.floats(allow_nan=False, allow_infinity=False, width=64))
    if kind == "string":
        return st.one_of(st.sampled_from(["user", "assistant", "system", "text", "tiny", "", "<|im_end|>"]),
                         st.text(max_size=20))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                    max_size=3),
                        max_leaves=6)


@pytest.fixture(scope="module")
def request_strategies(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    defs = doc["components"]["schemas"]
    result = {}
    for path in (C, CHAT, "/tokenize", "/detokenize"):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        result[path] = from_schema(schema, defs)
    return result


def _check_reply(server, path: str, body: dict) -> int:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        with client.stream("POST", path, json=body) as reply:
            text = reply.read().decode()
    assert reply.status_code < 500, (path, body, text[:500])
    if reply.status_code != 200:
        assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    elif reply.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", text[-300:]
        assert not any('"server_error"' in e for e in events), (body, text[:500])
    return reply.status_code


def test_fuzz_requests_from_the_schema(server, request_strategies, solo_stream):
    paths = st.sampled_from(sorted(request_strategies))
    statuses: list[int] = []

    @settings(max_examples=120, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def one_request(data):
        path = data.draw(paths)
        statuses.append(_check_reply(server, path, data.draw(request_strategies[path])))

    one_request()
    assert {200, 400} <= set(statuses), sorted(set(statuses))  # both accepted and refused requests were tried
    assert httpx.get(server.url + "/health").status_code == 200
    reply = httpx.post(server.url + C, headers=AUTH, timeout=60, json={
        "prompt": STREAM_PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert reply.json()["choices"][0]["token_ids"] == solo_stream  # the engine is alive and unharmed
