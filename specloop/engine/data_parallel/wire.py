"""The messages between the server process and a replica process (msgpack, msgspec Structs).

Commands go down one pipe, events come up another, each message one `send_bytes`. The
order on a pipe is the order of events: a request's `Accepted` comes before its first
`Outputs`, and an `Abort` sent before an `Add` of the same ID is handled first.
Exceptions cross as a `Failure` (class name, message, field) and are raised again on the
other side as the same specloop error, so the server maps them to the same HTTP status.
"""

from __future__ import annotations

from typing import Any

import msgspec

from specloop.engine.config import ResolvedConfig
from specloop.engine.core import EngineStats, QueueFullError
from specloop.errors import (CheckpointError, ConfigError, EngineDeadError, InvalidRequestError, RequestFailedError,
                             SnapshotError, SpecloopError)
from specloop.scheduling.request import RequestOutput


class Add(msgspec.Struct, tag=True):
    request_id: str
    prompt_ids: list[int]
    params: dict[str, Any]  # SamplingParams' fields; the replica builds (and so checks) them again


class Abort(msgspec.Struct, tag=True):
    request_id: str


class Stop(msgspec.Struct, tag=True):
    """Abort every request, send their final outputs, exit."""


Command = Add | Abort | Stop


class Failure(msgspec.Struct):
    kind: str  # the exception's class name
    message: str
    param: str | None = None  # InvalidRequestError's field


class Ready(msgspec.Struct, tag=True):
    """The replica's engine is built; what the server needs to know of it."""

    pid: int
    vocab_size: int
    max_model_len: int
    max_request_tokens: int
    max_prompt_chars: int | None
    resolved: ResolvedConfig
    stats: EngineStats


class Accepted(msgspec.Struct, tag=True):
    request_id: str
    stats: EngineStats


class Refused(msgspec.Struct, tag=True):
    request_id: str
    failure: Failure


class Outputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]
    stats: EngineStats


class Died(msgspec.Struct, tag=True):
    """The replica's engine failed (at start-up or in a step) and its process ends."""

    failure: Failure


Event = Ready | Accepted | Refused | Outputs | Died

encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
event_decoder = msgspec.msgpack.Decoder(Event)

_KNOWN: dict[str, type[SpecloopError]] = {cls.__name__: cls for cls in (
    SpecloopError, ConfigError, CheckpointError, InvalidRequestError, QueueFullError, RequestFailedError,
    EngineDeadError, SnapshotError)}


def failure_of(exc: BaseException) -> Failure:
    return Failure(type(exc).__name__, str(exc), getattr(exc, "param", None))


def error_of(failure: Failure) -> Exception:
    """The exception a `Failure` describes: the same specloop error, else a RuntimeError naming the type."""
    cls = _KNOWN.get(failure.kind)
    if cls is InvalidRequestError:
        return InvalidRequestError(failure.message, failure.param)
    if cls is not None:
        return cls(failure.message)
    return RuntimeError(f"{failure.kind}: {failure.message}")
