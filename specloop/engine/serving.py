"""The engine as the HTTP server sees it.

`AsyncEngine` (one engine core on a thread of this process) and `DataParallelEngine`
(replicas in processes of their own) both provide it, so the server is the same over
either; `specloop serve --data-parallel-size` picks one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from specloop.engine.async_engine import RequestStream
from specloop.engine.config import EngineConfig, ResolvedConfig
from specloop.engine.core import EngineStats
from specloop.sampling_params import SamplingParams


class ServingEngine(Protocol):
    config: EngineConfig  # the options as asked for
    error: BaseException | None  # set once the engine can serve nothing more

    @property
    def tokenizer(self) -> Any: ...

    @property
    def resolved(self) -> ResolvedConfig: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_prompt_chars(self) -> int | None: ...

    @property
    def is_alive(self) -> bool: ...

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None: ...

    def limits(self) -> tuple[int, int]: ...

    def stats(self) -> EngineStats: ...

    async def in_tokenizer_pool(self, fn: Callable[[Any], Any]) -> Any: ...

    async def add(self, prompt: str | list[int], params: SamplingParams | None = None,
                  request_id: str | None = None) -> RequestStream: ...

    async def shutdown(self, timeout: float = 30.0) -> None: ...
