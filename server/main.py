"""`specloop serve`: load the engine, run the app under uvicorn on uvloop, shut down in order.

Shutdown (SIGINT or SIGTERM): the server stops admitting at once (new requests get 503,
/health turns 503, the listening socket closes), in-flight requests get `shutdown_timeout`
seconds to finish, then the engine aborts what is left, so every open stream ends with
finish_reason "abort" and `data: [DONE]`. The process then exits 0. A second signal skips
the wait.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from types import FrameType
from typing import Any

import uvicorn

from server.app import ServerState, create_app
from specloop.engine.async_engine import AsyncEngine

log = logging.getLogger("specloop.serve")
DEFAULT_MODEL_NAME = "specloop-default"  # the shipped model's name on the wire


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    model: str | None = None  # None: the shipped default model
    engine_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the start-up line says which)
    served_model_name: str | None = None  # default: --model as given, or DEFAULT_MODEL_NAME
    log_level: str = "info"
    shutdown_timeout: float = 10.0  # seconds in-flight requests get before they are aborted


def serve(opts: ServeOptions) -> None:
    """Serve until SIGINT or SIGTERM. Raises SpecloopError for a bad model or option."""
    from specloop.llm import default_model

    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = opts.model or default_model()
    name = opts.served_model_name or opts.model or DEFAULT_MODEL_NAME
    engine = AsyncEngine.from_options(model, **opts.engine_options)
    app = create_app(engine, name, model)
    config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level=opts.log_level, lifespan="off",
                            timeout_graceful_shutdown=opts.shutdown_timeout + 5.0)
    server = _Server(config, app.state.server, opts.shutdown_timeout)
    _run_loop(_serve(server, engine))


async def _serve(server: "_Server", engine: AsyncEngine) -> None:
    try:
        await server.serve()
    finally:
        server.cancel_drain()
        await engine.shutdown()
        log.info("stopped")


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
            print(f"specloop serve: listening on http://{host}:{port}, serving model "
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

