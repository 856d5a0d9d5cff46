"""Tokenization off the event loop and off the engine thread.

Encoding a large prompt or applying a chat template can take seconds; on the event loop
that would stall every stream and `/health`, on the engine thread every forward call. The
pool runs such work on a few worker threads instead. Each worker uses its own copy of the
tokenizer: a Hugging Face fast tokenizer mutates its Rust state on some calls and raises
"Already borrowed" when two threads share it. The Rust encoder releases the GIL, so the
event loop keeps running while a worker encodes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
DEFAULT_WORKERS = 2


class TokenizerPool:
    def __init__(self, tokenizer: Any, workers: int = DEFAULT_WORKERS) -> None:
        self.tokenizer = tokenizer
        self._local = threading.local()
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="specloop-tokenizer")

    async def run(self, fn: Callable[[Any], T]) -> T:
        """`fn(tokenizer)` on a worker thread, with that worker's own tokenizer copy."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, fn)

    def _call(self, fn: Callable[[Any], T]) -> T:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return fn(tok)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
