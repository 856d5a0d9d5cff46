"""`specloop serve`: bind the port, load the engine, run the app under uvicorn on uvloop, shut down in order.

The listening socket is bound before the model loads, so a busy port or a bad host is one
`error:` line (exit 2) in a second, not after a long load; uvicorn then serves on that socket.

Shutdown (SIGINT or SIGTERM): the server stops admitting at once (new requests get 503,
/health turns 503, the listening socket closes), in-flight requests get `shutdown_timeout`
seconds to finish, then the engine aborts what is left, so every open stream ends with
finish_reason "abort" and `data: [DONE]`. The process then exits 0. A second signal skips
the wait.

If the engine dies (a forward call raised), a watchdog lets in-flight requests send their
error responses for `ENGINE_DEATH_GRACE_S`, then stops the server; the process exits 1, so a
supervisor restarts it instead of leaving a server that answers every request with 503.

With `data_parallel_size` N > 1 the engine is a `DataParallelEngine`: N replicas in
processes of their own. A replica that dies ends only its requests and the server serves
on; the watchdog stops the server once none is left.

Test-only: $SPECLOOP_FAULTS arms `specloop.engine.faults` on the engine (forward call N
raises, say; with data parallelism on replica 0 alone), so tests can watch a real server
process die; a malformed value is an `error:` line (exit 2) before the model loads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from server.app import DEFAULT_MAX_BODY_BYTES, ServerState, create_app
from specloop.engine import faults
from specloop.engine.async_engine import AsyncEngine
from specloop.engine.data_parallel.engine import DataParallelEngine
from specloop.engine.serving import ServingEngine
from specloop.errors import ConfigError

log = logging.getLogger("specloop.serve")
DEFAULT_MODEL_NAME = "specloop-default"  # the shipped model's name on the wire
EXIT_ENGINE_FAILED = 1  # the process status after the engine died
WATCH_INTERVAL_S = 0.2  # how often the watchdog looks at the engine
ENGINE_DEATH_GRACE_S = 2.0  # after the engine died: time for in-flight error responses to go out
ENGINE_DEATH_FORCE_S = 3.0  # then: time for connections to close before the stop is forced


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    model: str | None = None  # None: the shipped default model
    engine_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the start-up line says which)
    served_model_name: str | None = None  # default: DEFAULT_MODEL_NAME or the checkpoint folder's name
    log_level: str = "info"
    shutdown_timeout: float = 10.0  # seconds in-flight requests get before they are aborted
    api_key: str | None = dataclasses.field(default=None, repr=False)  # never printed or logged
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens_default: int | None = None  # chat without max_tokens; None: everything that fits
    data_parallel_size: int = 1  # engine replicas, each in its own process; 1: one engine in this process


def serve(opts: ServeOptions) -> int:
    """Serve until SIGINT or SIGTERM (returns 0) or the engine dies (returns 1).

    Raises SpecloopError for a port it cannot listen on (before loading anything), a bad
    model or a bad option."""
    from specloop.llm import default_model

    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = bind_socket(opts.host, opts.port)
    try:
        model = opts.model or default_model()
        name, aliases = served_names(opts.model, model, opts.served_model_name, default_model())
        injected = faults.from_env()  # test-only; None unless $SPECLOOP_FAULTS is set
        engine = start_engine(model, opts, injected)
    except BaseException:
        sock.close()
        raise
    app = create_app(engine, name, model, api_key=opts.api_key, max_body_bytes=opts.max_body_bytes,
                     model_aliases=aliases, max_tokens_default=opts.max_tokens_default)
    config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level=opts.log_level, lifespan="off",
                            timeout_graceful_shutdown=opts.shutdown_timeout + 5.0)
    server = _Server(config, app.state.server, opts.shutdown_timeout)
    _run_loop(_serve(server, engine, sock))
    return EXIT_ENGINE_FAILED if engine.error is not None else 0


def start_engine(model: str, opts: ServeOptions, injected: faults.Faults | None) -> ServingEngine:
    """One engine on a thread of this process, or `data_parallel_size` replicas in processes of
    their own (there replica 0 reads $SPECLOOP_FAULTS itself)."""
    if opts.data_parallel_size > 1:
        return DataParallelEngine.from_options(model, opts.data_parallel_size, **opts.engine_options)
    engine = AsyncEngine.from_options(model, **opts.engine_options)
    if injected is not None:  # before listening: the engine thread is idle, no step runs
        faults.install(engine.core, injected)
    return engine


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind HOST:PORT as uvicorn would (IPv6 for a host with ':', SO_REUSEADDR on POSIX).

    Binding (not listening) claims the port without accepting connections that could
    not be served while the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if sys.platform != "win32":  # on Windows SO_REUSEADDR would let two servers share a port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except (OSError, OverflowError) as exc:  # OverflowError: a port outside 0..65535
        sock.close()
        raise ConfigError(f"cannot listen on {_address(host, port)}: {_reason(exc)}") from None
    return sock


def _address(host: str, port: int) -> str:
    """HOST:PORT, with an IPv6 host in brackets as in a URL."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc)


def served_names(given: str | None, model: str, served: str | None, shipped: str) -> tuple[str, tuple[str, ...]]:
    """(the served name, aliases that also match): --served-model-name, else DEFAULT_MODEL_NAME for
    the shipped model, else the checkpoint folder's base name (a full local path is no API
    name); the model as given stays an alias, so clients that send the path still match."""
    if served:
        name = served
    elif given is None or os.path.realpath(model) == os.path.realpath(shipped):
        name = DEFAULT_MODEL_NAME
    else:
        name = Path(os.path.abspath(given)).name or given
    return name, ((given,) if given is not None and given != name else ())


def _listen(sock: socket.socket, config: uvicorn.Config) -> None:
    """Start listening once the model is loaded. Two SO_REUSEADDR sockets may both bind a port;
    the second to listen fails here, with the same one-line error (uvloop would not say)."""
    try:
        sock.listen(config.backlog)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {_address(config.host, config.port)}: {_reason(exc)}") from None


async def _serve(server: "_Server", engine: ServingEngine, sock: socket.socket) -> None:
    watchdog = asyncio.ensure_future(_watch_engine(server, engine))
    try:
        _listen(sock, server.config)
        await server.serve(sockets=[sock])
    finally:
        watchdog.cancel()
        server.cancel_drain()
        await engine.shutdown()
        sock.close()
        log.info("stopped")


async def _watch_engine(server: "_Server", engine: ServingEngine) -> None:
    """Stop the server once the engine died (with data parallelism: every replica): a dead
    engine only answers 503."""
    while engine.error is None:
        await asyncio.sleep(WATCH_INTERVAL_S)
    first_line = (str(engine.error).strip().splitlines() or [""])[0]
    log.error("the engine failed (%s: %s); stopping the server, exit status %d",
              type(engine.error).__name__, first_line, EXIT_ENGINE_FAILED)
    await asyncio.sleep(ENGINE_DEATH_GRACE_S)
    server.should_exit = True
    await asyncio.sleep(ENGINE_DEATH_FORCE_S)
    server.force_exit = True


class _Server(uvicorn.Server):
    """uvicorn's server with our start-up line and drain-then-abort shutdown.

    uvicorn re-raises a captured signal after a graceful stop (so SIGTERM would kill the
    process with -15); `handle_exit` here does not record the signal, so we exit 0.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float) -> None:
        super().__init__(config)
        self._state = state
        self._grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"specloop serve: listening on http://{_address(host, port)}, serving model "
                  f"{self._state.model_name!r} from {self._state.model_path}", flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
            return
        self.should_exit = True
        self._state.draining = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._abort_after_grace())

    async def _abort_after_grace(self) -> None:
        await asyncio.sleep(self._grace_s)
        stats = self._state.engine.stats()
        if stats.running or stats.waiting:
            log.info("aborting %d running and %d waiting requests", stats.running, stats.waiting)
        await self._state.engine.shutdown()

    def cancel_drain(self) -> None:
        if self._drain is not None:
            self._drain.cancel()


def _run_loop(main: Any) -> None:
    try:
        import uvloop
    except ImportError:  # Windows: plain asyncio
        asyncio.run(main)
        return
    uvloop.run(main)

