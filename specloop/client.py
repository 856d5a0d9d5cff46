"""`AsyncClient`: an asyncio client for a specloop server (or any OpenAI-compatible one).

    async with AsyncClient("http://127.0.0.1:8000") as client:
        done = await client.completions("def fib(n):", max_tokens=32, temperature=0)
        print(done.choices[0].text)
        stream = await client.chat([{"role": "user", "content": "hi"}], stream=True)
        async for chunk in stream:
            print(chunk.choices[0].delta.content or "", end="")

Calls return typed msgspec Structs (`specloop.protocol`). With `stream=True` the await sends
the request and checks its status (so a refusal raises there), then returns a `ChunkStream`
to iterate. A 503 (full queue, engine restarting) and a refused connection are retried with
exponential backoff, honouring `Retry-After`; other errors raise an `APIError` subclass that
carries the server's status, message, type, param and code.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

import httpx
import msgspec

from specloop.protocol import ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, ModelList

C = TypeVar("C")
T = TypeVar("T")


class APIError(Exception):
    """The server answered with an error (or the call failed on the way); fields as in the envelope."""

    def __init__(self, message: str, status: int | None = None, type: str | None = None,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code


class BadRequestError(APIError):
    """400 (or 415): the request was invalid; `param` names the field."""


class AuthenticationError(APIError):
    """401: the server needs an API key (`AsyncClient(api_key=...)`) and got none or a wrong one."""


class NotFoundError(APIError):
    """404: unknown model or route."""


class RequestTooLargeError(APIError):
    """413: the request body is larger than the server accepts (`--max-request-body-bytes`)."""


class ServiceUnavailableError(APIError):
    """503 after every retry: the queue stayed full or the engine is down."""


class ServerError(APIError):
    """Any other 5xx."""


class StreamError(APIError):
    """An error event inside a stream that had already begun."""


class APIConnectionError(APIError):
    """The server could not be reached."""


class APITimeoutError(APIError):
    """No answer within the timeout."""


class ChunkStream(Generic[C]):
    """The chunks of one streaming response; iterate once. Leaving early closes the connection,
    which aborts the request on the server."""

    def __init__(self, response: httpx.Response, chunk_type: type[C]) -> None:
        self._response = response
        self._decoder = msgspec.json.Decoder(chunk_type)

    async def __aiter__(self) -> AsyncIterator[C]:
        try:
            async for line in self._response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                if data.startswith('{"error"'):
                    raise _stream_error(data)
                yield self._decoder.decode(data)
        except httpx.TimeoutException as exc:
            raise APITimeoutError(f"the stream stalled: {exc}") from exc
        except httpx.TransportError as exc:
            raise APIConnectionError(f"the stream broke: {exc}") from exc
        finally:
            await self._response.aclose()

    async def aclose(self) -> None:
        await self._response.aclose()

    async def __aenter__(self) -> "ChunkStream[C]":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 timeout: float = 60.0, max_retries: int = 3, backoff: float = 0.5, max_backoff: float = 8.0,
                 http: httpx.AsyncClient | None = None) -> None:
        """`timeout` bounds connecting and each read (a stream's gap between chunks), in seconds.
        A 503 or a refused connection is tried again up to `max_retries` times, after
        `backoff * 2**attempt` seconds (capped at `max_backoff`) or the server's Retry-After."""
        base = base_url.rstrip("/")
        base = base[:-3] if base.endswith("/v1") else base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http or httpx.AsyncClient(base_url=base, timeout=timeout, headers=headers)
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff

    async def completions(self, prompt: str | list[int] | list[str] | list[list[int]], *, model: str | None = None,
                          stream: bool = False, **fields: Any) -> Completion | ChunkStream[CompletionChunk]:
        """POST /v1/completions; extra keyword fields (max_tokens, temperature, stop...) go as they are."""
        body = {"prompt": prompt, "model": model, "stream": stream, **fields}
        if stream:
            return await self._stream("/v1/completions", body, CompletionChunk)
        return await self._call("POST", "/v1/completions", Completion, body)

    async def chat(self, messages: list[dict[str, Any]], *, model: str | None = None, stream: bool = False,
                   **fields: Any) -> ChatCompletion | ChunkStream[ChatCompletionChunk]:
        """POST /v1/chat/completions; messages as OpenAI dicts ({"role", "content"})."""
        body = {"messages": messages, "model": model, "stream": stream, **fields}
        if stream:
            return await self._stream("/v1/chat/completions", body, ChatCompletionChunk)
        return await self._call("POST", "/v1/chat/completions", ChatCompletion, body)

    async def models(self) -> ModelList:
        return await self._call("GET", "/v1/models", ModelList)

    async def health(self) -> bool:
        """True when the server answers /health with 200 (no retries)."""
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx.TransportError:
            return False

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- plumbing -----------------------------------------------------------------------
    async def _call(self, method: str, path: str, kind: type[T], body: dict | None = None) -> T:
        response = await self._send(method, path, body, stream=False)
        return msgspec.json.decode(response.content, type=kind)

    async def _stream(self, path: str, body: dict, kind: type[C]) -> ChunkStream[C]:
        return ChunkStream(await self._send("POST", path, body, stream=True), kind)

    async def _send(self, method: str, path: str, body: dict | None, stream: bool) -> httpx.Response:
        content = msgspec.json.encode({k: v for k, v in body.items() if v is not None}) if body else None
        headers = {"Content-Type": "application/json"} if content else {}
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                request = self._http.build_request(method, path, content=content, headers=headers)
                response = await self._http.send(request, stream=stream)
            except httpx.ConnectError as exc:
                if last:
                    raise APIConnectionError(f"cannot reach {self._http.base_url}: {exc}") from exc
                await asyncio.sleep(self._delay(attempt, None))
                continue
            except httpx.TimeoutException as exc:
                raise APITimeoutError(f"{method} {path} timed out: {exc}") from exc
            if response.status_code == 200:
                return response
            await response.aread()
            await response.aclose()
            if response.status_code == 503 and not last:
                await asyncio.sleep(self._delay(attempt, response.headers.get("retry-after")))
                continue
            raise _http_error(response)
        raise AssertionError("unreachable")

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        delay = min(self.backoff * 2 ** attempt, self.max_backoff)
        try:
            return min(max(delay, float(retry_after)), self.max_backoff) if retry_after else delay
        except ValueError:  # an HTTP date: fall back to our own backoff
            return delay


_ERROR_TYPES = {400: BadRequestError, 415: BadRequestError, 401: AuthenticationError, 404: NotFoundError,
                413: RequestTooLargeError, 503: ServiceUnavailableError}


def _http_error(response: httpx.Response) -> APIError:
    kind = _ERROR_TYPES.get(response.status_code, ServerError if response.status_code >= 500 else APIError)
    fields = _error_fields(response.content)
    if fields is None:
        return kind(response.text or response.reason_phrase, response.status_code)
    return kind(status=response.status_code, **fields)


def _stream_error(data: str) -> StreamError:
    fields = _error_fields(data.encode()) or {"message": data}
    return StreamError(**fields)


def _error_fields(content: bytes) -> dict[str, Any] | None:
    try:
        error = msgspec.json.decode(content).get("error")
    except (msgspec.DecodeError, AttributeError):
        return None
    if not isinstance(error, dict):
        return None
    return {"message": str(error.get("message", "")), "type": error.get("type"), "param": error.get("param"),
            "code": error.get("code")}
