"""Wire types of the OpenAI-compatible HTTP API, as msgspec Structs.

They live in the library, not in `server/`, because both ends speak them: the server
(`server/`) decodes requests and encodes responses with them, and `specloop.client`
decodes responses into them. This module imports nothing of specloop, so the client needs
neither the server nor torch.

Requests are decoded straight from the raw body with `msgspec.json.decode(body, type=...)`,
so a wrong type or a missing field comes back as one `msgspec.ValidationError` whose path
names the field. Unknown fields are ignored, as OpenAI clients send many optional ones;
fields of features the server lacks (tools, structured output, audio...) are declared, typed
`Any`, so that the schema shows them and server/params.py can refuse them by name.
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


class GenerationRequest(Struct, kw_only=True):
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
    # Structured output (OpenAI's response_format, vLLM's extensions): refused unless unset.
    response_format: Any = None  # only {"type": "text"}
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None


class CompletionRequest(GenerationRequest, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a list of either (checked in server/params.py)
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


class ChatCompletionRequest(GenerationRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # only 0 is supported
    add_generation_prompt: bool = True  # extension (vLLM)
    # Tools, audio and predicted outputs: refused unless unset (or the value that means "off").
    tools: Any = None  # only empty
    tool_choice: Any = None  # only "none" (or "auto" without tools)
    parallel_tool_calls: bool | None = None  # meaningless without tools, so accepted
    functions: Any = None  # only empty
    function_call: Any = None  # only "none"
    audio: Any = None
    modalities: Any = None  # only ["text"]
    prediction: Any = None


class TokenizeRequest(Struct, kw_only=True):
    """/tokenize (vLLM's shape): exactly one of `prompt` or `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False  # False: count tokens as /v1/completions feeds them to the model
    add_generation_prompt: bool = True  # messages only, as on /v1/chat/completions


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


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
    root: str  # the served name (never a local path)
    max_model_len: int


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Struct):
    prompt: str


class VersionInfo(Struct):
    version: str  # specloop.__version__
    model: str  # the served name
    engine: dict[str, Any]  # EngineConfig.summary(), with `model` the served name: the options as configured
    limits: dict[str, int | None]  # what start-up derived: context length, KV tokens per request, body bytes,
    # a chat's default max_tokens (null: all that fits)
    resolved: dict[str, Any]  # ResolvedConfig.summary(): what `auto` and unset options became (dtype, device,
    # max_model_len, num_kv_pages, ...)


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorInfo
