"""From decoded wire requests to engine work: prompts and `SamplingParams`.

Each prompt of a request becomes one `Job` (one engine request, one choice). Fields the
engine cannot honour with a non-default value (n > 1, penalties, echo...) are refused with
a 400 naming the field, rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from server.errors import bad_request
from server.protocol import ChatCompletionRequest, CompletionRequest, _GenerationRequest
from specloop.engine.sampling_params import SamplingParams
from specloop.errors import InvalidRequestError

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


def completion_jobs(req: CompletionRequest) -> list[Job]:
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
    return [Job(i, p, params) for i, p in enumerate(_prompts(req.prompt))]


def chat_job(req: ChatCompletionRequest, tokenizer: Any, limits: Limits) -> Job:
    """The chat template applied to the messages, tokenized; max_tokens defaults to what fits."""
    _refuse_unsupported(req)
    if req.top_logprobs not in (None, 0):
        raise bad_request(f"top_logprobs must be 0 or null: top alternatives are not supported, "
                          f"got {req.top_logprobs}", "top_logprobs")
    prompt_ids = _apply_chat_template(req, tokenizer)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        room = min(limits.max_model_len, limits.max_request_tokens) - len(prompt_ids)
        if room < 1:
            raise bad_request(f"the messages take {len(prompt_ids)} tokens, which leaves no room to generate "
                              f"within {min(limits.max_model_len, limits.max_request_tokens)} tokens",
                              "messages", code="context_length_exceeded")
        max_tokens = room
    try:
        params = sampling_params(req, max_tokens, logprobs=req.logprobs)
    except InvalidRequestError as exc:
        if exc.param == "max_tokens" and req.max_completion_tokens is not None:
            exc.param = "max_completion_tokens"  # name the field the client sent
        raise
    return Job(0, prompt_ids, params)


def sampling_params(req: _GenerationRequest, max_tokens: int, logprobs: bool) -> SamplingParams:
    """Null means "the default"; SamplingParams checks ranges and names the field it refuses."""
    given = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p}
    return SamplingParams(
        max_tokens=max_tokens, seed=req.seed, stop=req.stop, stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
        **{k: v for k, v in given.items() if v is not None})


def _refuse_unsupported(req: _GenerationRequest) -> None:
    if req.n not in (None, 1):
        raise bad_request(f"n must be 1, got {req.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise bad_request(f"{name} is not supported (only 0), got {getattr(req, name)}", name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options needs stream set to true", "stream_options")


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """A string, a list of token ids, or a non-empty list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(_is_token(t) for t in prompt):
        return [list(prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise bad_request("prompt must be a string, a list of token ids, or a non-empty list of strings or of "
                      "token-id lists", "prompt")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _apply_chat_template(req: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("the served model's tokenizer has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt)
    except Exception as exc:  # jinja raises many types for messages a template refuses
        raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


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

