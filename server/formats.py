"""The two OpenAI response shapes over the same engine outputs.

A format turns `(choice index, RequestOutput)` pairs into stream chunks, or folds them into
one response. `CompletionFormat` serves /v1/completions, `ChatFormat` /v1/chat/completions.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from msgspec import UNSET, Struct

from specloop.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatLogprobs,
    ChatResponseMessage, ChatTokenLogprob, Completion, CompletionChoice, CompletionLogprobs, Usage,
)
from specloop.scheduling.request import RequestOutput
from specloop.scheduling.request import Usage as EngineUsage


@dataclasses.dataclass
class ChoiceResult:
    """One choice folded over its outputs."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    tokens: list[str] = dataclasses.field(default_factory=list)
    text_offset: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


def wire_usage(usage: EngineUsage) -> Usage:
    return Usage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)


class ResponseFormat:
    def __init__(self, request_id: str, model: str, tokenizer: Any, want_logprobs: bool,
                 want_token_ids: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self._want_logprobs = want_logprobs
        self._want_token_ids = want_token_ids
        self._offsets: dict[int, int] = {}  # choice -> characters streamed so far

    def preamble(self, indices: list[int]) -> list[Struct]:
        return []

    def fold(self, items: list[tuple[int, RequestOutput]], num_choices: int) -> list[ChoiceResult]:
        results = [ChoiceResult() for _ in range(num_choices)]
        for index, out in items:
            res = results[index]
            res.text_offset.extend([len(res.text)] * len(out.token_ids))
            res.text += out.text
            res.token_ids.extend(out.token_ids)
            res.tokens.extend(self._token_texts(out.token_ids))
            res.logprobs.extend(out.logprobs or [])
            res.finish_reason = out.finish_reason if out.finished else res.finish_reason
        return results

    def _worth_sending(self, out: RequestOutput) -> bool:
        return bool(out.text) or out.finished or (bool(out.token_ids) and (self._want_token_ids or self._want_logprobs))

    def _token_ids(self, ids: list[int]) -> list[int] | Any:
        return list(ids) if self._want_token_ids else UNSET

    def _token_texts(self, ids: list[int]) -> list[str]:
        return [self._tokenizer.decode([t]) for t in ids] if self._want_logprobs else []

    def _advance(self, index: int, text: str) -> int:
        """The character offset where `text` starts in choice `index`'s stream."""
        start = self._offsets.get(index, 0)
        self._offsets[index] = start + len(text)
        return start


class CompletionFormat(ResponseFormat):
    def chunk(self, index: int, out: RequestOutput) -> Completion | None:
        if not self._worth_sending(out):
            return None
        offset = self._advance(index, out.text)
        logprobs = None
        if self._want_logprobs:
            logprobs = CompletionLogprobs(self._token_texts(out.token_ids), list(out.logprobs or []),
                                          [offset] * len(out.token_ids))
        choice = CompletionChoice(index, out.text, out.finish_reason, logprobs, self._token_ids(out.token_ids))
        return Completion(id=self.request_id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self, usage: EngineUsage) -> Completion:
        return Completion(id=self.request_id, created=self.created, model=self.model, choices=[],
                          usage=wire_usage(usage))

    def response(self, results: list[ChoiceResult], usage: EngineUsage) -> Completion:
        choices = [
            CompletionChoice(
                i, r.text, r.finish_reason,
                CompletionLogprobs(r.tokens, r.logprobs, r.text_offset) if self._want_logprobs else None,
                self._token_ids(r.token_ids))
            for i, r in enumerate(results)
        ]
        return Completion(id=self.request_id, created=self.created, model=self.model, choices=choices,
                          usage=wire_usage(usage))


class ChatFormat(ResponseFormat):
    def preamble(self, indices: list[int]) -> list[Struct]:
        """OpenAI streams open each choice with the assistant role and empty content."""
        return [self._chunk(ChatChunkChoice(i, ChatDelta(role="assistant", content=""))) for i in indices]

    def chunk(self, index: int, out: RequestOutput) -> ChatCompletionChunk | None:
        if not self._worth_sending(out):
            return None
        delta = ChatDelta(content=out.text) if out.text else ChatDelta()
        logprobs = self._logprobs(out.token_ids, out.logprobs) if self._want_logprobs else None
        return self._chunk(ChatChunkChoice(index, delta, out.finish_reason, logprobs,
                                           self._token_ids(out.token_ids)))

    def usage_chunk(self, usage: EngineUsage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[],
                                   usage=wire_usage(usage))

    def response(self, results: list[ChoiceResult], usage: EngineUsage) -> ChatCompletion:
        choices = [
            ChatChoice(i, ChatResponseMessage(r.text), r.finish_reason,
                       self._logprobs(r.token_ids, r.logprobs) if self._want_logprobs else None,
                       self._token_ids(r.token_ids))
            for i, r in enumerate(results)
        ]
        return ChatCompletion(id=self.request_id, created=self.created, model=self.model, choices=choices,
                              usage=wire_usage(usage))

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[choice])

    def _logprobs(self, ids: list[int], logprobs: list[float] | None) -> ChatLogprobs:
        texts = self._token_texts(ids)
        return ChatLogprobs([ChatTokenLogprob(t, lp, list(t.encode())) for t, lp in zip(texts, logprobs or [])])
