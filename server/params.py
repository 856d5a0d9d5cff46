"""From decoded wire requests to engine work: prompts and `SamplingParams`.

Each prompt of a request becomes one `Job` (one engine request, one choice). Fields the
engine cannot honour with a non-default value (n > 1, penalties, echo, tools, structured
output...) are refused with a 400 naming the field, rather than silently ignored.

Everything here is cheap and runs on the event loop, except `encode_chat` (the messages'
checks, the chat template and the encoding), which the app runs in the tokenizer pool.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from server.errors import bad_request
from specloop.errors import InvalidRequestError
from specloop.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, GenerationRequest
from specloop.sampling_params import SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Job:
    index: int  # the choice index
    prompt: str | list[int]
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served engine can hold, read once at start-up."""

    max_model_len: int
    max_request_tokens: int  # prompt + max_tokens that the KV cache can ever hold
    max_prompts: int  # prompts of one request: more can never all be queued (the waiting queue's size)
    chat_max_tokens: int | None = None  # chat without max_tokens (--max-tokens-default); None: all that fits


def completion_jobs(req: CompletionRequest, limits: Limits) -> list[Job]:
    _refuse_unsupported(req)
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of not in (None, 1):
        raise bad_request(f"best_of must be 1, got {req.best_of}", "best_of")
    if req.logprobs not in (None, 0):
        raise bad_request("logprobs must be 0 (the chosen tokens' logprobs) or null: top alternatives "
                          f"are not supported, got {req.logprobs}", "logprobs")
    max_tokens = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = sampling_params(req, max_tokens, logprobs=req.logprobs is not None)
    prompts = _prompts(req.prompt)
    if len(prompts) > limits.max_prompts:  # a 503 would make clients retry a request that can never fit
        raise bad_request(f"the request has {len(prompts)} prompts but the server queues at most "
                          f"{limits.max_prompts} requests at once (--max-waiting-requests); send fewer "
                          "prompts per request", "prompt")
    return [Job(i, p, params) for i, p in enumerate(prompts)]


def check_chat(req: ChatCompletionRequest) -> None:
    """Refuse what chat cannot honour (cheap: before anything is tokenized)."""
    _refuse_unsupported(req)
    _refuse_chat_only(req)
    if req.top_logprobs not in (None, 0):
        raise bad_request(f"top_logprobs must be 0 or null: top alternatives are not supported, "
                          f"got {req.top_logprobs}", "top_logprobs")
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")


def content_chars(messages: list[ChatMessage]) -> int:
    """Characters of the messages' text (a lower bound on the templated prompt's)."""
    total = 0
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif isinstance(m.content, list):
            total += sum(len(part.text or "") for part in m.content)
    return total


def encode_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool,
                add_special_tokens: bool = False) -> list[int]:
    """The messages checked, through the chat template and encoded: up to seconds for long chats,
    so the app runs this in the tokenizer pool."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    turns = [_message_dict(i, m) for i, m in enumerate(messages)]
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("the served model's tokenizer has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja raises many types for messages a template refuses
        raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chat_job(req: ChatCompletionRequest, prompt_ids: list[int], limits: Limits) -> Job:
    """The templated prompt as one job; max_tokens defaults to what fits (as in vLLM: a chat
    runs to the context limit unless it stops), or to `limits.chat_max_tokens` when that is
    smaller."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        room = min(limits.max_model_len, limits.max_request_tokens) - len(prompt_ids)
        if room < 1:
            raise bad_request(f"the messages take {len(prompt_ids)} tokens, which leaves no room to generate "
                              f"within {min(limits.max_model_len, limits.max_request_tokens)} tokens",
                              "messages", code="context_length_exceeded")
        max_tokens = room if limits.chat_max_tokens is None else min(room, limits.chat_max_tokens)
    try:
        params = sampling_params(req, max_tokens, logprobs=req.logprobs)
    except InvalidRequestError as exc:
        if exc.param == "max_tokens" and req.max_completion_tokens is not None:
            exc.param = "max_completion_tokens"  # name the field the client sent
        raise
    return Job(0, prompt_ids, params)


def sampling_params(req: GenerationRequest, max_tokens: int, logprobs: bool) -> SamplingParams:
    """Null means "the default"; SamplingParams checks ranges and names the field it refuses."""
    given = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p}
    return SamplingParams(
        max_tokens=max_tokens, seed=req.seed, stop=req.stop, stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
        **{k: v for k, v in given.items() if v is not None})


def _refuse_unsupported(req: GenerationRequest) -> None:
    if req.n not in (None, 1):
        raise bad_request(f"n must be 1, got {req.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise bad_request(f"{name} is not supported (only 0), got {getattr(req, name)}", name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options needs stream set to true", "stream_options")
    if req.response_format is not None and req.response_format != {"type": "text"}:
        raise bad_request('response_format is not supported (only {"type": "text"}): the server has no '
                          "structured output", "response_format")
    for name in STRUCTURED_OUTPUT_FIELDS:
        if getattr(req, name) is not None:
            raise bad_request(f"{name} is not supported: the server has no structured (guided) output", name)


STRUCTURED_OUTPUT_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def _refuse_chat_only(req: ChatCompletionRequest) -> None:
    """Tools, functions, audio and predicted outputs: accepted only with the value that means "off"."""
    if req.tools:
        raise bad_request("tools are not supported: the server has no tool calling", "tools")
    if req.tool_choice not in (None, "none", "auto"):  # "auto" without tools means plain text
        raise bad_request(f'tool_choice must be "none" or null: the server has no tool calling, '
                          f"got {req.tool_choice!r}", "tool_choice")
    if req.functions:
        raise bad_request("functions are not supported: the server has no function calling", "functions")
    if req.function_call not in (None, "none"):
        raise bad_request(f'function_call must be "none" or null, got {req.function_call!r}', "function_call")
    if req.audio is not None:
        raise bad_request("audio output is not supported", "audio")
    if req.modalities is not None and req.modalities != ["text"]:
        raise bad_request(f'modalities must be ["text"] or null, got {req.modalities!r}', "modalities")
    if req.prediction is not None:
        raise bad_request("prediction (predicted outputs) is not supported", "prediction")


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """A string, a list of token ids, or a non-empty list of either (checked by msgspec, in C)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt:
        ids = _convert(prompt, list[int])
        if ids is not None:
            return [ids]
        texts = _convert(prompt, list[str])
        if texts is not None:
            return list(texts)
        batch = _convert(prompt, list[list[int]])
        if batch is not None and all(batch):
            return list(batch)
    raise bad_request("prompt must be a string, a list of token ids, or a non-empty list of strings or of "
                      "token-id lists", "prompt")


def _message_dict(index: int, message: Any) -> dict[str, str]:
    param = f"messages[{index}]"
    if message.role not in CHAT_ROLES:
        raise bad_request(f"{param}.role must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}",
                          f"{param}.role")
    content = message.content
    if isinstance(content, list):
        kinds = {part.type for part in content}
        if kinds - {"text"}:
            raise bad_request(f"{param}.content: only text parts are supported, got {sorted(kinds)}",
                              f"{param}.content")
        content = "".join(part.text or "" for part in content)
    return {"role": message.role, "content": content or ""}


def _convert(value: Any, kind: Any) -> Any:
    """`value` as `kind` (bools are not ints), or None."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError:
        return None
