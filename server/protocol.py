"""Wire types of the OpenAI-compatible HTTP API, as msgspec Structs.

Requests are decoded straight from the raw body with `msgspec.json.decode(body, type=...)`,
so a wrong type or a missing field comes back as one `msgspec.ValidationError` whose path
names the field. Unknown fields are ignored, as OpenAI clients send many optional ones.
Most sampling fields accept `null` and mean "the default" then; the ranges are checked by
`SamplingParams`, which names the field it refuses.

Responses and stream chunks follow the OpenAI shapes. Fields that only exist on request
(`token_ids` with `return_token_ids`) default to `UNSET` and are left out of the JSON.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

# ---- requests ---------------------------------------------------------------------------


class StreamOptions(Struct):
    include_usage: bool = False


class _GenerationRequest(Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): -1 or 0 disables
    min_p: float | None = None  # extension (vLLM)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    ignore_eos: bool = False  # extension (vLLM)
    skip_special_tokens: bool = True  # extension (vLLM)
    return_token_ids: bool = False  # extension: each choice carries its new token ids
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None  # only 1 is supported
    presence_penalty: float | None = None  # only 0 is supported
    frequency_penalty: float | None = None  # only 0 is supported
    logit_bias: dict[str, float] | None = None  # only empty is supported
    user: str | None = None


class CompletionRequest(_GenerationRequest, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a list of either (checked in params.py)
    logprobs: int | None = None  # 0: the chosen tokens' logprobs (top alternatives unsupported)
    echo: bool = False  # unsupported
    best_of: int | None = None  # only 1 is supported
    suffix: str | None = None  # unsupported


class ContentPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # only 0 is supported
    add_generation_prompt: bool = True  # extension (vLLM)


# ---- responses --------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    text_offset: list[int]
    top_logprobs: None = None  # top alternatives are not supported


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None = None  # stop | length | abort
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | UnsetType = UNSET


class Completion(Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[Any] = msgspec.field(default_factory=list)


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(Struct):
    content: str
    role: str = "assistant"


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletion(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int = msgspec.field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# Completion chunks have the shape of a completion (OpenAI streams "text_completion" objects).
CompletionChunk = Completion


class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int = msgspec.field(default_factory=_now)
    owned_by: str = "specloop"
    root: str  # the checkpoint folder
    max_model_len: int


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorInfo
