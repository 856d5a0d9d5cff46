"""One replica process: an `EngineCore` that steps while it has work and reads commands between steps.

It runs `serve_replica` as the target of a spawned process. Between steps it handles every
command waiting on its pipe (blocking while it has no work); after each step it sends the
step's outputs and its statistics. A command it cannot decode, a step that raises or a
start-up failure (up to and including sending `Ready`) ends it: it sends `Died` (when the
pipe still works) and exits with status 1; an add that raises fails only that request. The
server's end of the command pipe closing (the server died) ends it too, so no replica
outlives its server.

Test-only: $SPECLOOP_FAULTS arms `specloop.engine.faults` on replica 0 alone, so a test can
watch one replica of a running server die.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

import torch

from specloop.engine import faults
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.engine.data_parallel import wire
from specloop.errors import RequestFailedError, SpecloopError
from specloop.sampling_params import SamplingParams

log = logging.getLogger(__name__)
EXIT_FAILED = 1


class _Stopped(Exception):
    """A `Stop` command came, or the server's end of the pipe closed."""


def serve_replica(index: int, config: EngineConfig, cpu_threads: int, commands: Connection,
                  events: Connection) -> None:
    """The replica process's main function (spawn target). On the CPU it computes with
    `cpu_threads` threads (its share of the cores) unless $OMP_NUM_THREADS says otherwise.

    SIGINT and SIGTERM are ignored: a Ctrl-C reaches the whole process group, and the
    server drains in-flight requests before it stops its replicas (or dies, closing the pipe)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:  # (Ready too: a failure after the engine is built must reach the server as `Died`, with its cause)
        core = _start(index, config, cpu_threads)
        events.send_bytes(wire.encoder.encode(wire.Ready(
            os.getpid(), core.model.config.vocab_size, core.max_model_len, core.max_request_tokens,
            core.max_prompt_chars, core.resolved, core.stats())))
    except BaseException as exc:
        if not isinstance(exc, SpecloopError):  # a bug, not a bad checkpoint or option: keep its traceback
            log.exception("replica %d failed to start", index)
        _send_died(events, exc)
        sys.exit(EXIT_FAILED)
    try:
        _loop(core, commands, events)
    except _Stopped:
        return
    except BaseException as exc:
        log.exception("replica %d failed", index)
        _send_died(events, exc)
        sys.exit(EXIT_FAILED)


def _start(index: int, config: EngineConfig, cpu_threads: int) -> EngineCore:
    if config.device.startswith("cuda:"):
        torch.cuda.set_device(config.device)  # kernels and CUDA graphs use the current device
    elif "OMP_NUM_THREADS" not in os.environ:  # replicas sharing the cores must not each take all of them
        torch.set_num_threads(cpu_threads)
    core = EngineCore(config)
    injected = faults.from_env() if index == 0 else None
    if injected is not None:
        faults.install(core, injected)
    return core


def _loop(core: EngineCore, commands: Connection, events: Connection) -> None:
    while True:
        _run_commands(core, commands, events, block=not core.has_unfinished())
        if core.has_unfinished():
            outputs = core.step()
            events.send_bytes(wire.encoder.encode(wire.Outputs(outputs, core.stats())))


def _run_commands(core: EngineCore, commands: Connection, events: Connection, block: bool) -> None:
    """Every command waiting on the pipe (at least one when `block`)."""
    while commands.poll(None if block else 0):
        block = False
        try:
            command = wire.command_decoder.decode(commands.recv_bytes())
        except EOFError:
            raise _Stopped() from None
        if isinstance(command, wire.Add):
            _add(core, command, events)
        elif isinstance(command, wire.Abort):
            _send_outputs(core, [core.abort(command.request_id)], events)
        else:
            _send_outputs(core, [core.abort(rid) for rid in list(core.requests)], events)
            raise _Stopped()


def _add(core: EngineCore, command: wire.Add, events: Connection) -> None:
    """Add a request and answer `Accepted`, or `Refused` when adding it raised anything: a plain exception
    (a bug) fails that request alone, as a `RequestFailedError` (a 500), and the replica serves on, as
    `AsyncEngine` does."""
    try:
        core.add_request(command.request_id, command.prompt_ids, SamplingParams(**command.params))
    except Exception as exc:
        if not isinstance(exc, SpecloopError):
            log.exception("adding request %s failed", command.request_id)
            exc = RequestFailedError(f"the request failed while being added: {type(exc).__name__}: {exc}")
        events.send_bytes(wire.encoder.encode(wire.Refused(command.request_id, wire.failure_of(exc))))
        return
    events.send_bytes(wire.encoder.encode(wire.Accepted(command.request_id, core.stats())))


def _send_outputs(core: EngineCore, outputs: list, events: Connection) -> None:
    found = [out for out in outputs if out is not None]
    if found:
        events.send_bytes(wire.encoder.encode(wire.Outputs(found, core.stats())))


def _send_died(events: Connection, exc: BaseException) -> None:
    try:
        events.send_bytes(wire.encoder.encode(wire.Died(wire.failure_of(exc))))
    except OSError:  # the server is gone: nobody to tell
        pass
