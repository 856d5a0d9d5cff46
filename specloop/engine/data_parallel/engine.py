"""DataParallelEngine: N engine replicas, each in its own process, behind `AsyncEngine`'s interface.

A replica is a whole engine (model, KV pool, scheduler) in a process of its own, so one
replica's CPU work (planning, committing) never stalls another's, and one replica's
crash ends only its requests. The server process keeps the tokenizer (prompts cross as
token ids), routes each new request to the live replica with the least outstanding work
(`router.py`), forwards an abort to the replica that owns the request, and merges the
replicas' statistics (`stats.py`). Outputs are detokenized in the replica, as in one
engine, and come back with the replica's statistics.

The engine serves while at least one replica lives; `error` is set once none does (the
server then stops, as after the death of its one engine). A dead replica is not
restarted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from specloop.checkpoint import load_tokenizer
from specloop.engine.async_engine import Generates, RequestStream, encode_prompt
from specloop.engine.config import EngineConfig, ResolvedConfig
from specloop.engine.core import EngineStats, check_token_ids
from specloop.engine.data_parallel.handle import ReplicaHandle
from specloop.engine.data_parallel.router import least_loaded
from specloop.engine.data_parallel.stats import merge_stats
from specloop.engine.tokenizer_pool import TokenizerPool
from specloop.errors import ConfigError, EngineDeadError, InvalidRequestError
from specloop.sampling_params import SamplingParams

log = logging.getLogger(__name__)
START_TIMEOUT_S = 900.0  # a replica's start-up: loading a large checkpoint, capturing CUDA graphs


def replica_devices(device: str, size: int, cuda_devices: int) -> list[str]:
    """Where each replica runs: replica i on cuda:i (`--device cuda` or `auto` with CUDA), or
    all on the CPU. `cuda_devices` is how many CUDA devices this process sees."""
    if size < 1:
        raise ConfigError(f"data_parallel_size must be a positive integer, got {size}")
    kind = device.split(":")[0]
    if kind == "cpu" or (kind == "auto" and cuda_devices == 0):
        return ["cpu"] * size
    if device.startswith("cuda:"):
        raise ConfigError(f"with data parallelism replica i runs on cuda:i; give --device cuda (or auto), "
                          f"not {device}")
    if cuda_devices < size:
        raise ConfigError(f"data_parallel_size {size} needs {size} CUDA devices, one per replica; "
                          f"{cuda_devices} visible")
    return [f"cuda:{i}" for i in range(size)]


class DataParallelEngine(Generates):
    def __init__(self, config: EngineConfig, size: int, start_timeout_s: float = START_TIMEOUT_S) -> None:
        """Start `size` replicas of the engine `config` describes and wait until each is built;
        a replica's start-up error is raised here (after the others are stopped)."""
        if size > 1 and config.tensor_parallel_size > 1:  # (replicas are daemonic: no worker processes of their own)
            raise ConfigError("data_parallel_size > 1 does not work with tensor_parallel_size > 1 yet; use one of them")
        devices = replica_devices(config.device, size, torch.cuda.device_count())
        self.config = config
        self.error: BaseException | None = None
        self._stopping = False
        self._lock = threading.Lock()  # routing: every replica's load and streams
        cpu_threads = max(1, (os.cpu_count() or 1) // size)
        self.replicas: list[ReplicaHandle] = []
        try:  # (a replica that cannot even start stops those started before it)
            for i, device in enumerate(devices):
                self.replicas.append(ReplicaHandle(i, dataclasses.replace(config, device=device), cpu_threads,
                                                   self._lock, self._died))
            deadline = time.monotonic() + start_timeout_s
            readies = [r.wait_ready(max(0.0, deadline - time.monotonic())) for r in self.replicas]
            self.tokenizer = load_tokenizer(config.model)
        except BaseException:
            self._stopping = True
            for replica in self.replicas:
                replica.kill()
            raise
        first = readies[0]
        self.resolved: ResolvedConfig = first.resolved  # replica 0's; the others differ in device (and pages)
        self.vocab_size = first.vocab_size
        self.max_prompt_chars = first.max_prompt_chars
        self._max_model_len = first.max_model_len
        self._max_request_tokens = min(ready.max_request_tokens for ready in readies)  # holds on any replica
        self.tokenizer_pool = TokenizerPool(self.tokenizer)
        for replica, ready in zip(self.replicas, readies):
            log.info("data-parallel replica %d: pid %d on %s", replica.index, ready.pid, replica.device)

    @classmethod
    def from_options(cls, model: str, size: int, **options: Any) -> "DataParallelEngine":
        return cls(EngineConfig.from_kwargs(model, **options), size)

    @property
    def is_alive(self) -> bool:
        return self.error is None and not self._stopping and any(r.alive for r in self.replicas)

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse, before tokenizing, a text too long for the context whatever its tokens."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"the prompt has {num_chars} characters, which is certainly more than the context length of "
                f"{self._max_model_len} tokens", param=param)

    def limits(self) -> tuple[int, int]:
        """(context length, most tokens a request may reserve on any replica); fixed at start-up."""
        return self._max_model_len, self._max_request_tokens

    def stats(self) -> EngineStats:
        """The replicas' last published statistics, merged (`stats.merge_stats`)."""
        return merge_stats([(r.alive, r.stats) for r in self.replicas if r.stats is not None])

    async def in_tokenizer_pool(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(tokenizer)` on a tokenizer worker thread of this process."""
        return await self.tokenizer_pool.run(fn)

    async def add(self, prompt: str | list[int], params: SamplingParams | None = None,
                  request_id: str | None = None) -> RequestStream:
        """Tokenize here, route to the least-loaded live replica, return the stream once it accepted.

        A refusal (invalid request, that replica's queue full) raises here, as in `AsyncEngine.add`."""
        params = params or SamplingParams()
        rid = request_id or uuid.uuid4().hex
        self._check_alive()
        ids = await encode_prompt(prompt, self.check_prompt_chars, self.in_tokenizer_pool)
        ids = check_token_ids(ids, self.vocab_size)  # here: an id the wire cannot carry is a 400 too
        work = min(len(ids) + params.max_tokens, self._max_model_len)
        with self._lock:
            if any(r.owns(rid) for r in self.replicas):
                raise InvalidRequestError(f"request_id {rid!r} is already in use", param="request_id")
            index = least_loaded([r.load for r in self.replicas])
            if index is None:
                raise EngineDeadError("the engine stopped: no data-parallel replica is alive")
            owned = self.replicas[index].take(rid, work)
        return await self.replicas[index].add(rid, ids, params, owned)

    async def abort(self, request_id: str) -> None:
        """Abort a request on the replica that serves it (its stream gets the final output)."""
        for replica in self.replicas:
            replica.abort(request_id)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Every replica aborts what it serves (the streams get their final outputs) and exits."""
        self._stopping = True
        for replica in self.replicas:
            replica.stop()
        self.tokenizer_pool.shutdown()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, r.join, timeout) for r in self.replicas))

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    def _died(self, replica: ReplicaHandle) -> None:
        """On the dead replica's reader thread: log it; with no replica left, the engine is dead."""
        alive = sum(r.alive for r in self.replicas)
        log.error("data-parallel replica %d (pid %s) failed: %s; %d of %d replicas serve on",
                  replica.index, replica.pid, replica.error, alive, len(self.replicas))
        if alive == 0 and not self._stopping:
            self.error = replica.error
