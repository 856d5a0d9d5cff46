"""The FastAPI app: OpenAI-compatible routes over one engine (`AsyncEngine`, or `DataParallelEngine`'s replicas).

    POST /v1/completions, POST /v1/chat/completions   (JSON, or server-sent events with stream)
    GET  /v1/models
    POST /tokenize, /detokenize                        (vLLM's shapes)
    GET  /health, /metrics, /version, /openapi.json, /docs

Bodies are decoded from the raw request with msgspec (no pydantic on the request path), so
every 400 names its field. Each request is one `Generation`; its first outputs are awaited
before the response starts, so refusals get their HTTP status, and a failure after the
stream began is sent as an error event followed by `data: [DONE]`.

In front of the routes, `server.frontdoor.FrontDoor` checks the API key and the body size
before anything is read, and turns any unhandled exception into a 500 in the envelope.
Chat templating and every encode or decode run in the engine's tokenizer pool, never on
the event loop.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

import specloop
from server.errors import APIError, bad_request, from_decode, from_engine, http_error_handler, too_deep
from server.formats import ChatFormat, CompletionFormat, ResponseFormat
from server.frontdoor import FrontDoor, is_protected
from server.generation import ClientGone, Generation, until_disconnect
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.openapi import RouteDoc, openapi_document, swagger_page
from server.params import Job, Limits, chat_job, check_chat, completion_jobs, content_chars, encode_chat
from server.schema import Bounds
from specloop.engine.data_parallel.engine import DataParallelEngine
from specloop.engine.serving import ServingEngine
from specloop.errors import SpecloopError
from specloop.protocol import (
    ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Completion, CompletionChunk, CompletionRequest,
    DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse, VersionInfo,
)

log = logging.getLogger(__name__)
S = TypeVar("S")
T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED = 499  # nginx's status for a client that left; nobody reads it
DEFAULT_MAX_BODY_BYTES = 4 << 20  # request bodies above this get 413 before they are parsed
TITLE = "specloop"


@dataclasses.dataclass
class ServerState:
    engine: ServingEngine
    model_name: str
    model_path: str  # for the start-up line only: never sent to clients
    limits: Limits
    metrics: ServerMetrics
    draining: bool = False  # set on shutdown: new requests get 503
    model_aliases: tuple[str, ...] = ()  # other names a request's `model` may give

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and name not in self.model_aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_admitting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if not self.engine.is_alive:
            raise APIError(503, "the engine has stopped", type="server_error", code="engine_dead")

    async def in_tokenizer_pool(self, fn: Callable[[Any], T]) -> T:
        """`fn(tokenizer)` off the event loop; a 503 (not a 500) when the engine stopped meanwhile."""
        self.check_admitting()
        try:
            return await self.engine.in_tokenizer_pool(fn)
        except RuntimeError:  # the pool was shut down with the engine
            self.check_admitting()
            raise


def engine_limits(engine: ServingEngine, chat_max_tokens: int | None = None) -> Limits:
    """Context length, the most tokens (prompt + max_tokens) the KV cache can ever hold, the
    most prompts one request may carry (the waiting queue's size), and a chat's default max_tokens."""
    return Limits(*engine.limits(), max_prompts=engine.config.max_waiting_requests, chat_max_tokens=chat_max_tokens)


class _Routes:
    """Registers each route with FastAPI and records its `RouteDoc` in the same call, so
    /openapi.json documents exactly the type each route decodes."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.docs: list[RouteDoc] = []

    def post(self, path: str, body: type[S], response: type, summary: str,
             stream: type | None = None) -> Callable[[Callable[[Request, S], Awaitable[Response]]], Any]:
        def register(handler: Callable[[Request, S], Awaitable[Response]]) -> Any:
            async def endpoint(request: Request) -> Response:
                request.state.arrival = time.perf_counter()
                return await handler(request, await _decode(request, body))

            self.app.add_api_route(path, endpoint, methods=["POST"], name=handler.__name__)
            self.docs.append(RouteDoc("POST", path, summary, body=body, response=response, stream=stream,
                                      protected=is_protected(path)))
            return handler

        return register

    def get(self, path: str, summary: str, response: type | None = None,
            media_type: str | None = None) -> Callable[[Callable[[], Awaitable[Response]]], Any]:
        def register(handler: Callable[[], Awaitable[Response]]) -> Any:
            # HEAD answers like GET without the body (probes and load balancers send it); the
            # document lists GET, which implies HEAD.
            self.app.add_api_route(path, handler, methods=["GET", "HEAD"])
            self.docs.append(RouteDoc("GET", path, summary, response=response, media_type=media_type,
                                      protected=is_protected(path)))
            return handler

        return register


def create_app(engine: ServingEngine, model_name: str, model_path: str | None = None, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, model_aliases: tuple[str, ...] = (),
               max_tokens_default: int | None = None) -> FastAPI:
    """The app serving `engine` as `model_name` (and `model_aliases`). `api_key` (empty: none)
    guards /v1/*, /tokenize and /detokenize; bodies over `max_body_bytes` get 413; a chat
    request without max_tokens generates up to `max_tokens_default` (None: all that fits)."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if max_tokens_default is not None and max_tokens_default < 1:
        raise ValueError(f"max_tokens_default must be positive, got {max_tokens_default}")
    aliases = tuple(alias for alias in model_aliases if alias != model_name)
    state = ServerState(engine, model_name, model_path or engine.config.model,
                        engine_limits(engine, max_tokens_default), ServerMetrics(engine, model_name),
                        model_aliases=aliases)
    app = FastAPI(title=TITLE, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    _add_error_handlers(app, state)
    routes = _Routes(app)
    _add_generation_routes(routes, state)
    _add_tokenizer_routes(routes, state)
    _add_info_routes(routes, state, max_body_bytes)

    @routes.get("/openapi.json", "This document (OpenAPI 3.1).", media_type="application/json")
    async def openapi() -> Response:
        return Response(document, media_type="application/json")

    @routes.get("/docs", "Swagger UI over /openapi.json.", media_type="text/html")
    async def docs() -> Response:
        return swagger_page(TITLE)

    document = msgspec.json.encode(openapi_document(routes.docs, title=TITLE, version=specloop.__version__,
                                                    api_key=bool(api_key), bounds=schema_bounds(state)))
    app.state.routes = tuple(routes.docs)
    app.add_middleware(FrontDoor, api_key=api_key or None, max_body_bytes=max_body_bytes,
                       count_error=state.metrics.count_error)
    return app


def schema_bounds(state: ServerState) -> Bounds:
    """The served engine's bounds /openapi.json states for each request field."""
    engine, config, limits = state.engine, state.engine.config, state.limits
    return Bounds(state.model_name, engine.vocab_size, limits.max_model_len, limits.max_request_tokens,
                  limits.max_prompts, config.max_stop_strings, config.max_stop_chars, engine.max_prompt_chars)


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every error response in the envelope, counted once in specloop_request_errors_total."""

    async def on_api_error(request: Request, exc: APIError) -> Response:
        state.metrics.count_error(exc.status)
        return exc.response()

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        state.metrics.count_error(exc.status_code)
        return await http_error_handler(request, exc)

    async def on_refusal(request: Request, exc: SpecloopError) -> Response:  # e.g. SamplingParams' checks
        return await on_api_error(request, from_engine(exc))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(SpecloopError, on_refusal)
    app.add_exception_handler(HTTPException, on_http_error)


def _add_generation_routes(routes: _Routes, state: ServerState) -> None:
    engine = state.engine

    @routes.post("/v1/completions", CompletionRequest, Completion, "Text completion (OpenAI).",
                 stream=CompletionChunk)
    async def completions(request: Request, req: CompletionRequest) -> Response:
        state.check_model(req.model)
        jobs = completion_jobs(req, state.limits)
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", state.model_name, engine.tokenizer,
                               req.logprobs is not None, req.return_token_ids)
        return await _respond(state, request, jobs, fmt, req.stream, _include_usage(req))

    @routes.post("/v1/chat/completions", ChatCompletionRequest, ChatCompletion, "Chat completion (OpenAI).",
                 stream=ChatCompletionChunk)
    async def chat_completions(request: Request, req: ChatCompletionRequest) -> Response:
        state.check_model(req.model)
        check_chat(req)
        engine.check_prompt_chars(content_chars(req.messages), "messages")  # before seconds of templating
        prompt_ids = await state.in_tokenizer_pool(
            lambda tok: encode_chat(tok, req.messages, req.add_generation_prompt))
        job = chat_job(req, prompt_ids, state.limits)
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", state.model_name, engine.tokenizer, req.logprobs,
                         req.return_token_ids)
        return await _respond(state, request, [job], fmt, req.stream, _include_usage(req))

    @routes.get("/v1/models", "The served model.", ModelList)
    async def models() -> Response:
        """Only the served name: an alias may be a local path (the checkpoint as given), never shown."""
        card = ModelCard(id=state.model_name, root=state.model_name, max_model_len=state.limits.max_model_len)
        return _json(ModelList([card]))


def _add_tokenizer_routes(routes: _Routes, state: ServerState) -> None:
    vocab_size = state.engine.vocab_size

    @routes.post("/tokenize", TokenizeRequest, TokenizeResponse,
                 "Token ids of a prompt, or of messages after the chat template (vLLM).")
    async def tokenize(request: Request, req: TokenizeRequest) -> Response:
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt" if req.messages is None else None)
        if req.messages is not None:
            messages = req.messages
            tokens = await state.in_tokenizer_pool(
                lambda tok: encode_chat(tok, messages, req.add_generation_prompt, req.add_special_tokens))
        else:
            text, special = req.prompt, req.add_special_tokens
            tokens = await state.in_tokenizer_pool(lambda tok: tok.encode(text, add_special_tokens=special))
        return _json(TokenizeResponse(len(tokens), state.limits.max_model_len, list(tokens)))

    @routes.post("/detokenize", DetokenizeRequest, DetokenizeResponse, "The text of token ids (vLLM).")
    async def detokenize(request: Request, req: DetokenizeRequest) -> Response:
        state.check_model(req.model)
        text = await state.in_tokenizer_pool(lambda tok: _decode_tokens(tok, req.tokens, vocab_size))
        return _json(DetokenizeResponse(text))


def _decode_tokens(tokenizer: Any, tokens: list[int], vocab_size: int) -> str:
    """Checked and decoded in the tokenizer pool: a long list is too much work for the event loop."""
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"tokens[{bad}] = {tokens[bad]} is outside the vocabulary [0, {vocab_size})", "tokens")
    return tokenizer.decode(tokens)


def _add_info_routes(routes: _Routes, state: ServerState, max_body_bytes: int) -> None:
    version = msgspec.json.encode(_version_info(state, max_body_bytes))

    @routes.get("/health", "200 while serving; 503 once the engine stopped or shutdown began. With data "
                "parallelism: 200 while a replica serves, the body saying how many do.")
    async def health() -> Response:
        state.check_admitting()
        if isinstance(state.engine, DataParallelEngine):
            return Response(msgspec.json.encode(_replica_health(state.engine)), media_type="application/json")
        return Response(status_code=200)

    @routes.get("/metrics", "Prometheus metrics (specloop_* and vLLM's vllm:* names).", media_type=CONTENT_TYPE)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @routes.get("/version", "specloop's version, the engine options as configured and as resolved at start-up.",
                VersionInfo)
    async def version_route() -> Response:
        return Response(version, media_type="application/json")


def _replica_health(engine: DataParallelEngine) -> dict[str, Any]:
    """`degraded` once a replica died: the server still serves, on fewer replicas."""
    alive = sum(replica.alive for replica in engine.replicas)
    return {"status": "ok" if alive == len(engine.replicas) else "degraded", "replicas": len(engine.replicas),
            "replicas_alive": alive}


def _version_info(state: ServerState, max_body_bytes: int) -> VersionInfo:
    """The engine options as configured (the served name in place of the checkpoint path: no local path
    leaks) and what start-up resolved them to."""
    engine = {**state.engine.config.summary(), "model": state.model_name}
    if isinstance(state.engine, DataParallelEngine):
        engine["data_parallel_size"] = len(state.engine.replicas)
    limits = {"max_model_len": state.limits.max_model_len, "max_request_tokens": state.limits.max_request_tokens,
              "max_prompts_per_request": state.limits.max_prompts, "max_body_bytes": max_body_bytes,
              "chat_max_tokens_default": state.limits.chat_max_tokens}
    return VersionInfo(specloop.__version__, state.model_name, engine, limits, state.engine.resolved.summary())


async def _decode(request: Request, kind: type[S]) -> S:
    ctype = request.headers.get("content-type")
    if ctype is not None and ctype.split(";")[0].strip().lower() != "application/json":
        raise APIError(415, f"send the body as JSON with Content-Type: application/json (got {ctype!r})",
                       code="unsupported_media_type")
    try:
        body = await request.body()
    except ClientDisconnect:
        raise APIError(CLIENT_CLOSED, "the client left while sending the body") from None
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.MsgspecError as exc:
        raise from_decode(exc) from None
    except RecursionError:
        raise too_deep() from None


def _include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


async def _respond(state: ServerState, request: Request, jobs: list[Job], fmt: ResponseFormat, stream: bool,
                   include_usage: bool) -> Response:
    state.check_admitting()
    gen = Generation(state.engine, jobs, fmt.request_id, state.metrics, arrival=request.state.arrival)
    try:
        items = await until_disconnect(request, _begin(gen, collect=not stream))
    except ClientGone:
        gen.close()
        state.metrics.count_error(CLIENT_CLOSED)
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
