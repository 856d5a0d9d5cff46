"""What each request field accepts, as JSON Schema laid over msgspec's types in /openapi.json.

msgspec's schema of a request type says what decodes (`max_tokens` is an integer); the
checks after decoding (`server.params`, `SamplingParams`, `EngineCore.add_request`) refuse
more (`max_tokens` 0, a token id outside the vocabulary, `n` 2, a chat `prediction`). A
generated client that trusts the document would send requests the server refuses, so the
document narrows each field to what those checks accept, with the served engine's bounds
(vocabulary, context length, stop-string limits, the served name) filled in at start-up.
`tests/test_openapi_accepts.py` generates requests from the document and checks that the
server accepts them.

What JSON Schema cannot say is left to the server and named in the field's description:
a prompt's length in tokens (the schema bounds its characters and token ids; prompt plus
`max_tokens` beyond the context is a 400 naming `prompt` or `messages`), and the characters
of all stop strings together.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from server.params import CHAT_ROLES
from specloop.sampling_params import FP32_MAX, FP32_TINY, INT64_MAX, INT64_MIN

NULL = {"type": "null"}


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The served engine's bounds that the checks apply, read once at start-up."""

    model_name: str
    vocab_size: int
    max_model_len: int
    max_request_tokens: int  # prompt + max_tokens the KV cache can ever hold
    max_prompts: int  # prompts of one completion request
    max_stop_strings: int
    max_stop_chars: int
    max_prompt_chars: int | None  # characters beyond which a prompt certainly exceeds the context

    @property
    def max_total_tokens(self) -> int:
        return min(self.max_model_len, self.max_request_tokens)


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, NULL]}


def _only(value: Any, kind: str) -> dict[str, Any]:
    """The one value a field of an unsupported feature accepts besides null."""
    return _nullable({"type": kind, "enum": [value]})


def _token_ids(b: Bounds, **extra: Any) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": b.vocab_size - 1}, **extra}


def _text(b: Bounds, **extra: Any) -> dict[str, Any]:
    limit = {} if b.max_prompt_chars is None else {"maxLength": b.max_prompt_chars}
    return {"type": "string", **limit, **extra}


def _generation(b: Bounds) -> dict[str, Any]:
    """Fields of both /v1/completions and /v1/chat/completions."""
    stop = {"type": "string", "minLength": 1, "maxLength": b.max_stop_chars}
    return {
        "model": _nullable({"type": "string", "enum": [b.model_name]}),
        "max_tokens": _max_tokens(b),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": FP32_MAX}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": FP32_TINY / 2, "maximum": 1,
                            "description": "in (0, 1], and above 0 in fp32"}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": b.vocab_size,
                            "description": "-1 or 0: off"}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "seed": _nullable({"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}),
        "stop": {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": b.max_stop_strings}, NULL],
                 "description": f"at most {b.max_stop_strings} strings of {b.max_stop_chars} characters in all"},
        "stop_token_ids": _nullable(_token_ids(b)),
        "n": _only(1, "integer"),
        "presence_penalty": _only(0, "number"),
        "frequency_penalty": _only(0, "number"),
        "logit_bias": _nullable({"type": "object", "maxProperties": 0}),
        "response_format": _nullable({"type": "object", "properties": {"type": {"type": "string", "enum": ["text"]}},
                                      "required": ["type"], "additionalProperties": False}),
        **{name: NULL for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                   "structured_outputs")},
    }


def _max_tokens(b: Bounds) -> dict[str, Any]:
    return _nullable({"type": "integer", "minimum": 1, "maximum": b.max_total_tokens - 1,
                      "description": f"prompt plus max_tokens at most {b.max_total_tokens} tokens"})


def _stream_options_need_stream() -> dict[str, Any]:
    """`stream_options` only with `"stream": true`."""
    return {"if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
            "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}


def _messages(b: Bounds) -> dict[str, Any]:
    return {"type": "array", "items": {"$ref": "#/components/schemas/ChatMessage"}, "minItems": 1}


def refinements(b: Bounds) -> dict[str, dict[str, Any]]:
    """Per component schema: `properties` replacing msgspec's, and object-level keywords."""
    ids = _token_ids(b, minItems=1, maxItems=b.max_total_tokens - 1)
    text = _text(b, minLength=1)
    return {
        "CompletionRequest": {
            "properties": {
                **_generation(b),
                "prompt": {"anyOf": [text, ids,
                                     {"type": "array", "items": text, "minItems": 1, "maxItems": b.max_prompts},
                                     {"type": "array", "items": ids, "minItems": 1, "maxItems": b.max_prompts}],
                           "description": "a string, token ids, or a list of either (one choice each); its "
                                          "tokens plus max_tokens must fit the context"},
                "logprobs": _only(0, "integer"),
                "echo": {"type": "boolean", "enum": [False]},
                "best_of": _only(1, "integer"),
                "suffix": _nullable({"type": "string", "maxLength": 0}),
            },
            **_stream_options_need_stream(),
        },
        "ChatCompletionRequest": {
            "properties": {
                **_generation(b),
                "messages": {**_messages(b), "description": "after the chat template, its tokens plus max_tokens "
                                                            "must fit the context"},
                "max_completion_tokens": _max_tokens(b),
                "top_logprobs": _only(0, "integer"),
                "tools": _nullable({"type": "array", "maxItems": 0}),
                "tool_choice": _nullable({"type": "string", "enum": ["none", "auto"]}),
                "functions": _nullable({"type": "array", "maxItems": 0}),
                "function_call": _only("none", "string"),
                "audio": NULL,
                "modalities": _nullable({"type": "array", "items": {"type": "string", "enum": ["text"]},
                                         "minItems": 1, "maxItems": 1}),
                "prediction": NULL,
            },
            **_stream_options_need_stream(),
        },
        "ChatMessage": {"properties": {"role": {"type": "string", "enum": list(CHAT_ROLES)}}},
        "ContentPart": {"properties": {"type": {"type": "string", "enum": ["text"]}}},
        "TokenizeRequest": {
            "properties": {"model": _nullable({"type": "string", "enum": [b.model_name]})},
            "oneOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": NULL}},
                      {"required": ["messages"], "properties": {"prompt": NULL, "messages": _messages(b)}}],
            "description": "exactly one of prompt and messages",
        },
        "DetokenizeRequest": {"properties": {"model": _nullable({"type": "string", "enum": [b.model_name]}),
                                             "tokens": _token_ids(b)}},
    }


def refine(components: dict[str, Any], b: Bounds) -> None:
    """Narrow msgspec's component schemas in place to what the server accepts."""
    for name, change in refinements(b).items():
        schema = components.get(name)
        if schema is None:  # a document of fewer types (`openapi.request_schema`)
            continue
        unknown = set(change.get("properties", {})) - set(schema.get("properties", {}))
        assert not unknown, f"{name} has no field {sorted(unknown)}"  # a renamed field must be renamed here
        for field, narrowed in change.get("properties", {}).items():
            default = schema["properties"][field].get("default", ...)
            schema["properties"][field] = narrowed if default is ... else {**narrowed, "default": default}
        schema.update({k: v for k, v in change.items() if k != "properties"})
