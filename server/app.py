"""The FastAPI app: OpenAI-compatible routes over one AsyncEngine.

    POST /v1/completions, POST /v1/chat/completions   (JSON, or server-sent events with stream)
    GET  /v1/models, /health, /metrics

Bodies are decoded from the raw request with msgspec (no pydantic on the request path), so
every 400 names its field. Each request is one `Generation`; its first outputs are awaited
before the response starts, so refusals get their HTTP status, and a failure after the
stream began is sent as an error event followed by `data: [DONE]`.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from typing import TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from server.errors import APIError, from_decode, from_engine, http_error_handler
from server.formats import ChatFormat, CompletionFormat, ResponseFormat
from server.generation import ClientGone, Generation, until_disconnect
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.params import Job, Limits, chat_job, completion_jobs
from server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from specloop.engine.async_engine import AsyncEngine
from specloop.errors import SpecloopError

log = logging.getLogger(__name__)
S = TypeVar("S")
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED = 499  # nginx's status for a client that left; nobody reads it
DEFAULT_MAX_BODY_BYTES = 4 << 20  # request bodies above this get 413 before they are parsed


@dataclasses.dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    model_path: str
    limits: Limits
    metrics: ServerMetrics
    draining: bool = False  # set on shutdown: new requests get 503

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_admitting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if not self.engine.is_alive:
            raise APIError(503, "the engine has stopped", type="server_error", code="engine_dead")


def engine_limits(engine: AsyncEngine) -> Limits:
    """Context length and the most tokens (prompt + max_tokens) the KV cache can ever hold."""
    return Limits(*engine.limits())


def create_app(engine: AsyncEngine, model_name: str, model_path: str | None = None, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, model_aliases: tuple[str, ...] = ()) -> FastAPI:
    state = ServerState(engine, model_name, model_path or engine.config.model, engine_limits(engine),
                        ServerMetrics(engine))
    app = FastAPI(title="specloop", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    async def on_api_error(request: Request, exc: APIError) -> Response:
        state.metrics.errors.labels(str(exc.status)).inc()
        return exc.response()

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        state.metrics.errors.labels(str(exc.status_code)).inc()
        return await http_error_handler(request, exc)

    async def on_refusal(request: Request, exc: SpecloopError) -> Response:  # e.g. SamplingParams' checks
        return await on_api_error(request, from_engine(exc))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(SpecloopError, on_refusal)
    app.add_exception_handler(HTTPException, on_http_error)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _decode(request, CompletionRequest)
        state.check_model(req.model)
        jobs = completion_jobs(req)
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", state.model_name, engine.tokenizer,
                               req.logprobs is not None, req.return_token_ids)
        return await _respond(state, request, jobs, fmt, req.stream, _include_usage(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _decode(request, ChatCompletionRequest)
        state.check_model(req.model)
        job = chat_job(req, engine.tokenizer, state.limits)
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", state.model_name, engine.tokenizer, req.logprobs,
                         req.return_token_ids)
        return await _respond(state, request, [job], fmt, req.stream, _include_usage(req))

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=state.model_name, root=state.model_path, max_model_len=state.limits.max_model_len)
        return _json(ModelList([card]))

    @app.get("/health")
    async def health() -> Response:
        state.check_admitting()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _decode(request: Request, kind: type[S]) -> S:
    ctype = request.headers.get("content-type")
    if ctype is not None and ctype.split(";")[0].strip().lower() != "application/json":
        raise APIError(415, f"send the body as JSON with Content-Type: application/json (got {ctype!r})",
                       code="unsupported_media_type")
    try:
        return msgspec.json.decode(await request.body(), type=kind)
    except msgspec.MsgspecError as exc:
        raise from_decode(exc) from None


def _include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


async def _respond(state: ServerState, request: Request, jobs: list[Job], fmt: ResponseFormat, stream: bool,
                   include_usage: bool) -> Response:
    state.check_admitting()
    gen = Generation(state.engine, jobs, fmt.request_id, state.metrics)
    try:
        items = await until_disconnect(request, _begin(gen, collect=not stream))
    except ClientGone:
        gen.close()
        return Response(status_code=CLIENT_CLOSED)
    except SpecloopError as exc:
        gen.close()
        raise from_engine(exc) from None
    except BaseException:
        gen.close()
        raise
    if stream:
        return StreamingResponse(_events(gen, fmt, include_usage), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    return _json(fmt.response(fmt.fold(items, len(jobs)), gen.usage))


async def _begin(gen: Generation, collect: bool) -> list:
    await gen.start()
    return await gen.collect() if collect else []


async def _events(gen: Generation, fmt: ResponseFormat, include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events: chunks, the usage chunk on request, then [DONE] (after an error event
    when something failed mid-stream). Leaving early (client gone) closes the generation."""
    try:
        for chunk in fmt.preamble([job.index for job in gen.jobs]):
            yield _event(chunk)
        async for index, out in gen:
            chunk = fmt.chunk(index, out)
            if chunk is not None:
                yield _event(chunk)
        if include_usage:
            yield _event(fmt.usage_chunk(gen.usage))
    except Exception as exc:
        log.warning("request %s failed mid-stream: %s", fmt.request_id, exc)
        yield _event(from_engine(exc).envelope())
    finally:
        gen.close()
    yield DONE


def _event(payload: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def _json(payload: msgspec.Struct, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json")
