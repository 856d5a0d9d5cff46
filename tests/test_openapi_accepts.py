"""/openapi.json says what the server accepts: requests generated from the app's own document
(every operation, a small example budget) are served, never refused with a 4xx the schema
would have excluded, and never a 5xx.

A property test in the spirit of schemathesis's positive-data check, built on hypothesis:
`from_schema` turns the JSON Schema the document holds (`$ref`, `anyOf` / `oneOf`, `if` /
`then`, `enum` / `const`, numeric and length bounds, required and optional properties) into a
strategy of valid values. The one refusal allowed is the one JSON Schema cannot state: a
prompt whose tokens plus max_tokens exceed the context (the schema bounds characters and
token ids, not tokens), a 400 that says so. In-process (TestClient), tiny checkpoint on CPU,
a 48-token context so that every accepted request is short.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from server.app import create_app
from specloop.engine.async_engine import AsyncEngine

EXAMPLES = 15  # per operation
CONTEXT = 48
NAME = "tiny"
LONGEST = 6  # generated strings and lists are at most this long (bounds above it are honoured, not reached)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=6)


def from_schema(schema: dict, defs: dict) -> st.SearchStrategy:
    """Values valid under `schema` (the keywords the document uses; others fail loudly)."""
    known = {"$ref", "anyOf", "oneOf", "if", "then", "type", "enum", "const", "minimum", "maximum",
             "exclusiveMinimum", "minLength", "maxLength", "minItems", "maxItems", "maxProperties", "items",
             "properties", "required", "additionalProperties", "default", "description", "title"}
    assert set(schema) <= known, f"from_schema does not know {sorted(set(schema) - known)}"
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of(*(from_schema(s, defs) for s in schema["anyOf"]))
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        return _object(schema, defs)
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs)
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=max(low, min(schema.get("maxItems", LONGEST), LONGEST)))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        low, high = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum")
        floats = st.floats(low, high, exclude_min="exclusiveMinimum" in schema, allow_nan=False,
                           allow_infinity=False)
        ints = st.integers(None if low is None else math.floor(low) + 1, None if high is None else math.floor(high))
        return floats | ints.filter(lambda i: low is None or i > low or ("minimum" in schema and i == low))
    if kind == "string":
        low = schema.get("minLength", 0)
        return st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", LONGEST), LONGEST)))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    assert not schema or set(schema) <= {"description", "default", "title"}, schema
    return JSON


def _object(schema: dict, defs: dict) -> st.SearchStrategy:
    if schema.get("maxProperties") == 0:
        return st.just({})
    branches = schema.get("oneOf") or [{}]
    strategies = []
    for branch in branches:
        props = {**schema.get("properties", {}), **branch.get("properties", {})}
        required = set(schema.get("required", ())) | set(branch.get("required", ()))
        fields = {k: from_schema(v, defs) for k, v in props.items()}
        strategies.append(st.fixed_dictionaries({k: fields[k] for k in props if k in required},
                                                optional={k: fields[k] for k in props if k not in required}))
    value = st.one_of(strategies)
    if "if" in schema:
        return value.filter(lambda v: not _matches(schema["if"], v) or _matches(schema["then"], v))
    return value


def _matches(schema: dict, value: Any) -> bool:
    """The part of validation `if` / `then` use here: required, and properties' type or const."""
    if not isinstance(value, dict) or not set(schema.get("required", ())) <= set(value):
        return False
    for name, sub in schema.get("properties", {}).items():
        if name not in value:
            continue
        if "const" in sub and value[name] != sub["const"]:
            return False
        if sub.get("type") == "object" and not isinstance(value[name], dict):
            return False
    return True


def beyond_the_context(reply) -> bool:
    """The refusal the schema cannot state: the prompt's tokens plus max_tokens exceed the context."""
    error = reply.json()["error"]
    return reply.status_code == 400 and (error["code"] == "context_length_exceeded"
                                         or "context length" in error["message"])


@pytest.fixture(scope="module")
def client(tiny_ckpt):
    engine = AsyncEngine.from_options(str(tiny_ckpt), device="cpu", max_model_len=CONTEXT, max_waiting_requests=4)
    try:
        with TestClient(create_app(engine, NAME), raise_server_exceptions=False) as client:
            yield client
    finally:
        asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def document(client) -> dict:
    return client.get("/openapi.json").json()


def operations(doc: dict) -> list[tuple[str, str]]:
    return [(method, path) for path, ops in doc["paths"].items() for method in ops]


def test_the_schema_is_narrowed_to_what_the_server_accepts(document):
    """The four schema-valid requests schemathesis found refused are no longer schema-valid."""
    defs = document["components"]["schemas"]
    detokenize = defs["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert detokenize["minimum"] == 0 and detokenize["maximum"] == 383  # the tiny vocabulary
    tokenize = defs["TokenizeRequest"]["oneOf"]
    assert [b["required"] for b in tokenize] == [["prompt"], ["messages"]]  # not neither, not both
    assert defs["ChatCompletionRequest"]["properties"]["prediction"]["type"] == "null"
    assert defs["CompletionRequest"]["properties"]["suffix"]["anyOf"][0]["maxLength"] == 0
    prompt = defs["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[0]["minLength"] == 1 and prompt[1]["minItems"] == 1  # an empty prompt is refused


@pytest.mark.parametrize("method, path", [("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                                          ("post", "/tokenize"), ("post", "/detokenize")])
def test_schema_valid_requests_are_served(client, document, method, path):
    op = document["paths"][path][method]
    body = from_schema(op["requestBody"]["content"]["application/json"]["schema"], document["components"]["schemas"])
    served = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(body)
    def check(value):
        reply = client.request(method.upper(), path, content=json.dumps(value),
                               headers={"content-type": "application/json"})
        assert reply.status_code < 500, (value, reply.text[:300])
        if reply.status_code != 200:
            assert beyond_the_context(reply), (value, reply.text[:300])
            return
        served.append(value)
        if reply.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), (value, reply.text[-300:])

    check()
    assert len(served) >= EXAMPLES // 4, f"only {len(served)} of {EXAMPLES} served"  # not all beyond the context


def test_every_operation_is_covered_and_gets_answer_200(client, document):
    posts = {("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("post", "/tokenize"),
             ("post", "/detokenize")}
    ops = set(operations(document))
    assert posts <= ops
    for method, path in sorted(ops - posts):
        assert method == "get" and "requestBody" not in document["paths"][path][method], (method, path)
        assert client.get(path).status_code == 200, path
