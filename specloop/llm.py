"""`specloop.LLM`: the synchronous API for scripts.

    llm = specloop.LLM(model="path/to/checkpoint")
    outs = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.scheduling.request import Usage
from specloop.sampling_params import SamplingParams
from specloop.errors import RequestFailedError


@dataclasses.dataclass
class GenerationOutput:
    request_id: str
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[float] | None


def default_model() -> str:
    """The checkpoint folder shipped with the package."""
    from specloop.assets import default_model_path

    return str(default_model_path())


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = EngineCore(EngineConfig.from_kwargs(model or default_model(), **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); idempotent. Also on leaving
        a `with LLM(...) as llm:` block, and when the LLM is collected or the interpreter exits."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self, prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt together (continuous batching); one output per prompt, in order.

        A refused prompt (InvalidRequestError, QueueFullError) raises before anything runs.
        A prompt that fails inside the engine raises RequestFailedError once the others
        finished (their outputs are on the exception's `outputs`); the LLM stays usable.
        After a failed forward call the engine is dead and every call raises EngineDeadError.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, params_list):
                self.engine.add_request(rid, prompt, p)
        except Exception:
            if self.engine.failure is None:
                for rid in ids:
                    self.engine.abort(rid)
                self.engine.drain()
            raise
        results: dict[str, GenerationOutput] = {
            rid: GenerationOutput(rid, prompt, "", [], "", None, [] if p.logprobs else None)  # type: ignore[arg-type]
            for rid, prompt, p in zip(ids, prompts, params_list)
        }
        errors: dict[str, str] = {}
        for out in self.engine.drain():
            res = results[out.request_id]
            res.text += out.text
            res.token_ids.extend(out.token_ids)
            if res.logprobs is not None and out.logprobs:
                res.logprobs.extend(out.logprobs)
            res.usage = out.usage
            if out.finished:
                res.finish_reason = out.finish_reason or ""
            if out.error is not None:
                errors[out.request_id] = out.error
        ordered = [results[rid] for rid in ids]
        if errors:
            first = next(i for i, rid in enumerate(ids) if rid in errors)
            exc = RequestFailedError(f"prompt {first} failed: {errors[ids[first]]}"
                                     + (f" ({len(errors) - 1} more failed)" if len(errors) > 1 else ""))
            exc.outputs = ordered  # type: ignore[attr-defined]
            raise exc
        return ordered
